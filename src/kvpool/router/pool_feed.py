"""Follow the master's pool events into the router's `PoolIndex` (`--master`).

Rules:
- Start: subscribe to the PUB address a PoolEventsQuery names, then ask for the snapshot, then
  apply the batches after it (the order that misses nothing: protocol/events.py). A batch the index
  refuses (a gap: PUB drops what a slow subscriber cannot take; another epoch) means a new snapshot.
- A master that restarted publishes elsewhere under a new epoch: when no batch came for
  `probe_interval_s`, a keyless query checks the epoch, the address and the sequence; any change
  (or a master that does not answer) starts over. Until the first snapshot the index holds
  nothing, so the router routes as if the pool were empty, never on stale keys of another epoch.
- Only this module talks to the master for the router; the index it feeds is pure. Master calls
  run on a worker thread (the control channel is blocking); events arrive on an asyncio SUB socket.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from kvpool.core import protocol as p
from kvpool.core.errors import KVPoolError
from kvpool.router.pool_state import PoolIndex
from kvpool.rpc.zmq_channel import MasterChannel, host_of

log = logging.getLogger("kvpool.router")

_ANY_HOST = ("0.0.0.0", "*", "::", "")


@dataclass
class FeedStats:
    snapshots: int = 0  # taken: the first, and one per resync
    resyncs: dict[str, int] = field(default_factory=dict)  # by why: gap, epoch, restart, unavailable
    batches: int = 0
    bad_messages: int = 0
    confirmed_s: float | None = None  # monotonic: when the view was last known current (batch, snapshot, probe)
    connected: bool = False

    def resynced(self, why: str) -> None:
        self.resyncs[why] = self.resyncs.get(why, 0) + 1


def events_endpoint(published: str, master_address: str) -> str:
    """The PUB address as this router reaches it: a master bound to every interface names its
    own host (0.0.0.0), which is the host of the address the router calls it on."""
    host = host_of(published)
    if host not in _ANY_HOST:
        return published
    port = published.rsplit(":", 1)[1]
    master_host = host_of(master_address.split(",")[0].strip())
    return f"tcp://{f'[{master_host}]' if ':' in master_host else master_host}:{port}"


class PoolFeed:
    def __init__(self, master_address: str, index: PoolIndex, namespace: str = "", probe_interval_s: float = 2.0,
                 timeout_s: float = 5.0) -> None:  # fmt: skip
        self.master_address = master_address
        self.index = index
        self.namespace = namespace
        self.probe_interval_s = probe_interval_s
        self.stats = FeedStats()
        self._channel = MasterChannel(master_address, timeout_s=timeout_s)
        self._ctx = zmq.asyncio.Context.instance()
        self._decode = msgspec.msgpack.Decoder(p.PoolEventBatch).decode
        self._task: asyncio.Task | None = None
        self.ready = asyncio.Event()  # set once a snapshot is in the index

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"pool events {self.master_address}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self._channel.close()

    async def _query(self, with_keys: bool) -> p.PoolEventsOffer:
        request = p.PoolEventsQuery(self.namespace, with_keys)
        reply = await asyncio.to_thread(self._channel.call, request, 60.0 if with_keys else None)
        if not isinstance(reply, p.PoolEventsOffer):
            raise KVPoolError(f"the master answered a PoolEventsQuery with {type(reply).__name__}")
        return reply

    async def _run(self) -> None:
        backoff_s = 0.2
        while True:
            try:
                await self._follow()
            except asyncio.CancelledError:
                raise
            except (KVPoolError, OSError, zmq.ZMQError) as e:
                self.stats.connected = False
                self.stats.resynced("unavailable")
                log.warning("pool events from %s: %s; retrying in %.1f s", self.master_address, e, backoff_s)
                await asyncio.sleep(backoff_s)
                backoff_s = min(5.0, 2 * backoff_s)
                continue
            backoff_s = 0.2

    async def _follow(self) -> None:
        """Follow one incarnation's stream; returns when the master changed (start over)."""
        probe = await self._query(with_keys=False)
        if not probe.address:
            raise KVPoolError("the master publishes no pool events (authentication is on); routing on the "
                              "estimate of what the backends stored")  # fmt: skip
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.SUBSCRIBE, p.POOL_EVENTS_TOPIC)
        sock.connect(events_endpoint(probe.address, self.master_address))
        try:
            await asyncio.sleep(0.05)  # let the subscription reach the master; a miss is a gap, then a resync
            await self._snapshot()
            self.stats.connected = True
            while True:
                try:
                    frames = await asyncio.wait_for(sock.recv_multipart(), self.probe_interval_s)
                except TimeoutError:
                    now = await self._query(with_keys=False)
                    if now.epoch != probe.epoch or now.address != probe.address:
                        self.stats.resynced("restart")
                        log.warning("master %s restarted (new epoch): following its new stream", self.master_address)
                        self.index.clear()  # nothing of the old incarnation is trusted
                        return
                    if now.seq > self.index.seq:  # the last batches were lost
                        self.stats.resynced("gap")
                        await self._snapshot()
                    else:
                        self.stats.confirmed_s = time.monotonic()
                    continue
                refused = self._apply(frames)
                if refused is not None:
                    self.stats.resynced(refused)
                    if refused == "epoch":  # another incarnation publishes here now
                        self.index.clear()
                        return
                    await self._snapshot()
        finally:
            sock.close()

    def _apply(self, frames: list[bytes]) -> str | None:
        """Apply one message; why the index refused it ("gap", "epoch"), or None."""
        if len(frames) != 2:
            self.stats.bad_messages += 1
            return None
        try:
            batch = self._decode(frames[1])
        except msgspec.DecodeError:
            self.stats.bad_messages += 1
            return None
        if not self.index.apply(batch):
            return "epoch" if batch.epoch != self.index.epoch else "gap"
        self.stats.batches += 1
        self.stats.confirmed_s = time.monotonic()
        return None

    async def _snapshot(self) -> None:
        offer = await self._query(with_keys=True)
        self.index.reset(offer)
        self.stats.snapshots += 1
        self.stats.confirmed_s = time.monotonic()
        self.ready.set()
