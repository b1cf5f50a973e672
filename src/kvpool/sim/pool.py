"""The simulated pool: the master's real logic (MasterCore: index, allocator, tail-LRU eviction,
leases) on the simulator's clock, fed protocol messages like the service feeds it.

Rules:
- Nothing here decides what to keep: puts, lookups and evictions are the master's. This module
  only turns block keys into protocol requests and mounts one segment per pool node.
- Keys are chain keys (str of the simulator's int key): a chained prefix, so PutStart names each
  block's parent and the master's tail-first eviction sees the chains.
- The master's timed work (`tick`: watermark eviction, lease expiry) runs at most every
  `tick_interval_s` of simulated time, as the service's loop would; its idle work (eviction down
  to the low watermark, in slices) runs to its end before each request, as a master with spare
  time does between requests.
"""

from __future__ import annotations

from typing import Sequence

from kvpool.core import protocol as p
from kvpool.master.config import MasterConfig
from kvpool.master.core import MAX_POOL_BYTES, MAX_SEGMENT_BYTES, MasterCore
from kvpool.sim.config import PoolConfig

TENANT = "sim"


class PoolModel:
    def __init__(self, config: PoolConfig, object_bytes: int, master: MasterConfig | None = None) -> None:
        self.config = config
        self.object_bytes = int(object_bytes)
        self.master_config = master or MasterConfig(node_ttl_s=1e12, heartbeat_interval_s=1e11, put_timeout_s=1e12)
        self.core = MasterCore(self.master_config, epoch=1 << 40)
        if config.capacity_bytes == float("inf"):
            per_node = min(MAX_SEGMENT_BYTES, MAX_POOL_BYTES // config.num_nodes)  # the master's limits
        else:
            per_node = int(config.capacity_bytes // config.num_nodes)
        if per_node < self.object_bytes:
            raise ValueError(f"pool: each node's {per_node} bytes cannot hold one {self.object_bytes}-byte block")
        for i in range(config.num_nodes):
            reply = self.core.handle(p.MountSegment(f"pool{i}", f"host{i}", per_node, 0, f"agent{i}", b""), 0.0)
            if isinstance(reply, p.ErrorReply):  # e.g. a pool larger than the master's limits
                raise ValueError(f"pool: node {i} of {per_node} bytes cannot be mounted: {reply.message}")
        self._last_tick_s = 0.0
        self.puts = 0
        self.refused = 0

    def _tick(self, now_s: float) -> None:
        """Before each request: the timed work when due, and the idle work to its end (the service's
        loop does it between requests: a master with spare time)."""
        if now_s - self._last_tick_s >= self.master_config.tick_interval_s:
            self._last_tick_s = now_s
            self.core.tick(now_s)
        while self.core.has_idle_work:
            self.core.idle_work(now_s)

    def lookup(self, keys: Sequence[int], now_s: float, lease: bool) -> tuple[int, int]:
        """(leading keys in the pool, lease id to release after the load or 0)."""
        if not keys:
            return 0, 0
        self._tick(now_s)
        reply = self.core.handle(p.LookupPrefix(TENANT, [str(k) for k in keys], lease), now_s)
        if not isinstance(reply, p.LookupReply):
            raise RuntimeError(f"pool lookup refused: {reply}")
        return reply.num_hit, reply.lease_id

    def release(self, lease_id: int, now_s: float) -> None:
        if lease_id:
            self.core.handle(p.ReleaseLeases(TENANT, [lease_id]), now_s)

    def session_event(self, session: str, request: str, kind: int, now_s: float) -> None:
        """A session hint, as a connector sends it (core/protocol/sessions.py)."""
        self._tick(now_s)
        self.core.handle(p.SessionEvents(TENANT, [p.SessionEvent(session, request, kind)]), now_s)

    def put(self, keys: Sequence[int], parent: int | None, now_s: float, session: str = "") -> int:
        """Write a chain's blocks (`parent`: the key before keys[0]); returns how many were new."""
        if not keys:
            return 0
        self._tick(now_s)
        names = [str(k) for k in keys]
        parents = [str(parent) if parent is not None else None] + names[:-1]
        reply = self.core.handle(p.PutStart(TENANT, names, [self.object_bytes] * len(names), parents, 1, False,
                                            session), now_s)
        if not isinstance(reply, p.PutStartReply):
            raise RuntimeError(f"pool put refused: {reply}")
        ended = [(n, t) for n, s, t in zip(names, reply.statuses, reply.tokens) if s == p.PUT_ALLOCATED]
        self.refused += sum(1 for s in reply.statuses if s == p.PUT_NO_SPACE)
        if ended:
            self.core.handle(p.PutEnd(TENANT, [n for n, _ in ended], [t for _, t in ended], [0] * len(ended)), now_s)
        self.puts += len(ended)
        return len(ended)

    @property
    def evictions(self) -> int:
        return self.core.index.evictor.evictions

    @property
    def used_bytes(self) -> int:
        return self.core.segments.used_bytes
