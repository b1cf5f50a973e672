"""Subscribe to vLLM's KV events (`--kv-events-config` with the zmq publisher) and feed them to
each backend's `BackendCache`, and what was stored to the pool's views (the ledger, or the pool
index learning which engine hash is which router hash).

Rules:
- vLLM publishes multipart messages (topic, 8-byte big-endian sequence number, msgpack of a
  KVEventBatch `[ts, events, data_parallel_rank?]`); we connect a SUB socket to each backend's
  endpoint. A gap in the sequence numbers means events were lost (publisher high-water mark, or
  the router started late): counted, and the blocks that then lack a parent stay unplaced.
- A message that does not decode is counted and dropped; it never stops the subscriber.
- Only this module touches zmq; the index it feeds is pure.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from kvpool.router.prefix_index import BackendCache, RouterHash, StoredBlocks, decode_event

log = logging.getLogger("kvpool.router")


@dataclass
class EventStream:
    endpoint: str
    cache: BackendCache
    last_seq: int | None = None
    lost_batches: int = 0
    bad_messages: int = 0


OnStored = Callable[[list[Hashable], list[RouterHash]], None]  # (engine hashes, the router hashes they are)


def apply_message(stream: EventStream, frames: list[bytes], on_stored: OnStored) -> int:
    """Apply one published message; returns the number of events applied."""
    if len(frames) != 3:
        stream.bad_messages += 1
        return 0
    _topic, seq_bytes, payload = frames
    seq = int.from_bytes(seq_bytes, "big")
    if stream.last_seq is not None and seq > stream.last_seq + 1:
        stream.lost_batches += seq - stream.last_seq - 1
    stream.last_seq = seq
    try:
        batch = msgspec.msgpack.decode(payload)
        raw_events = batch[1] if isinstance(batch, (list, tuple)) else batch.get("events", [])
    except (msgspec.DecodeError, IndexError, AttributeError, TypeError):
        stream.bad_messages += 1
        return 0
    applied = 0
    for raw in raw_events or []:
        try:
            event = decode_event(raw)
        except (TypeError, ValueError):
            event = None
        if event is None:
            continue
        stored = stream.cache.apply(event)
        if stored and isinstance(event, StoredBlocks):
            on_stored(event.block_hashes, stored)
        applied += 1
    return applied


class EventSubscriber:
    def __init__(self, streams: list[EventStream], on_stored: OnStored) -> None:
        self.streams = streams
        self.on_stored = on_stored
        self._ctx = zmq.asyncio.Context.instance()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        for stream in self.streams:
            self._tasks.append(asyncio.create_task(self._run(stream), name=f"kv-events {stream.endpoint}"))

    async def _run(self, stream: EventStream) -> None:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(stream.endpoint)
        try:
            while True:
                frames = await sock.recv_multipart()
                apply_message(stream, frames, self.on_stored)
        except asyncio.CancelledError:
            pass
        finally:
            sock.close()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._tasks.clear()
