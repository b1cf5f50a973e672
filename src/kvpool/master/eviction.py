"""DRAM eviction candidates: LRU over chain tails, never a pending or pinned object (pure).

Rules:
- This module only chooses. It owns the eviction heaps and their entries (a record's IN_HEAP bit
  and `heap_access_s`) and nothing else: it frees no space, drops no record and holds no reference
  to the index. `Evictor.select` hands out candidates in order; the caller (pressure.py) decides
  whether each may go (leases, recovering segments), keeps the ones it passes over, and evicts the
  others through the index.
- Candidates are complete, unpinned objects with no children (no object names them as parent):
  evicting only tails means a cached suffix is never left without its prefix. When a tail goes,
  its parent becomes a tail and is pushed again (by the index), at its own (older) access time,
  so it can be chosen within the same selection.
- LRU among candidates: a heap of records ordered by the access time they had when pushed, with
  lazy invalidation. An access only writes `last_access_s` (O(1), no heap work on the lookup hot
  path); a popped record whose access time moved on is pushed back with the new time. This is exact
  LRU: a record popped fresh has an access time no later than any stale entry's true time.
- Each record is in the heap at most once (IN_HEAP), so the heap costs one pointer per object.
- Opt-in `SessionAwareOrder` (session_order.py) replaces LRU among the tails by predicted session
  return, from session hints; the default stays LRU.
- A candidate under a TTL (`retention`, retention.py) is passed over like a leased one; due
  retentions are released when a selection starts.
- Tenants (quotas.py): a tenant with a quota or dedicated segments keeps its candidates in its
  own heap (`TenantAccount.heap`, over all its namespaces); the others share `heap`. Each record is
  in one heap, and the global order pops the oldest top among all heaps (O(heaps) per pop, heaps =
  such tenants + 1), so watermark eviction is the same LRU as with one heap. A selection scoped to
  one tenant pops that tenant's heap only; `shared_only` never pops dedicated tenants' heaps (their
  objects are not where the room is needed).
"""

from __future__ import annotations

from heapq import heapify, heappop, heappush
from typing import TYPE_CHECKING

from kvpool.core.protocol import REPLICA_BYTES
from kvpool.master.records import COMPLETE, GONE, IN_HEAP, PINNED, ObjectRecord
from kvpool.master.session_order import SessionAwareOrder

if TYPE_CHECKING:
    from kvpool.master.retention import Retention
    from kvpool.master.quotas import TenantAccount

__all__ = ["EVICTION_SLICE_BYTES", "EVICTION_SLICE_OBJECTS", "PUT_EVICTION_FACTOR", "Evictor", "Selection",
           "SessionAwareOrder"]

PUT_EVICTION_FACTOR = 2  # a put above the high watermark evicts at most this many times its bytes beyond it
EVICTION_SLICE_BYTES = 1 << 20  # one slice of eviction towards the low watermark (~4 objects of 256 KiB)
EVICTION_SLICE_OBJECTS = 32  # ... and at most this many evictions (small objects: ~10 us each here)


class Evictor:
    def __init__(self) -> None:
        self.heap: list[ObjectRecord] = []
        self.evictions = 0
        self.evicted_bytes = 0
        self.order: SessionAwareOrder | None = None  # None: LRU over tails (the default)
        self.own: list[TenantAccount] = []  # tenants with their own heap (a quota, or dedicated segments)
        self.retention: Retention | None = None  # TTL hints (master/hints.py); None: none kept

    def forget(self, rec: ObjectRecord) -> None:
        """`rec` left the pool (the index dropped it): its retention and session ownership go."""
        if self.retention is not None and self.retention.until:
            self.retention.release(rec)
        if self.order is not None:
            self.order.forget(rec.space.name, rec.key)

    def set_order(self, order: SessionAwareOrder | None) -> None:
        """Choose among tails by another order (the records now in the heap move over)."""
        waiting = []
        if self.order is None:
            for heap in [self.heap, *(account.heap for account in self.own)]:
                waiting += [rec for rec in heap if rec.state != GONE]
                heap.clear()
        self.order = order
        self.heap = []
        for rec in waiting:
            self.push(rec)

    def give_own_heap(self, account: TenantAccount) -> None:
        """From now on keep this tenant's candidates apart (its shared-heap entries move over, once)."""
        if account.heap is not None:
            return
        mine = [rec for rec in self.heap if rec.space.account is account]
        if mine:
            self.heap = [rec for rec in self.heap if rec.space.account is not account]
            heapify(self.heap)
            heapify(mine)
        account.heap = mine
        self.own.append(account)

    def push(self, rec: ObjectRecord) -> None:
        rec.heaps |= IN_HEAP
        if self.order is not None:
            self.order.push(rec)
            return
        rec.heap_access_s = rec.last_access_s
        heap = rec.space.account.heap
        if heap is None:
            heappush(self.heap, rec)
            return
        heappush(heap, rec)
        if len(heap) > 2 * rec.space.account.num_objects + 1024:
            live = [r for r in heap if r.state != GONE]
            heapify(live)
            heap[:] = live

    def select(self, now_s: float, account: TenantAccount | None = None, shared_only: bool = False,
               on_segments: set[int] | None = None) -> Selection:
        """Candidates in eviction order. `account`: only that tenant's objects; `shared_only`: none
        of tenants with dedicated segments; `on_segments`: only objects with a replica there."""
        if self.retention is not None and self.retention.until:
            self.retention.expire(now_s)
        return Selection(self, now_s, account, shared_only, on_segments)

    def _pop(self, now_s: float, account: TenantAccount | None, shared_only: bool) -> ObjectRecord | None:
        """The next entry: of `account` only when given (its own heap), else the oldest top of all
        heaps (with `shared_only`, not those of tenants with dedicated segments)."""
        if self.order is not None:
            return self.order.pop(now_s)
        if account is not None and account.heap is not None:
            return heappop(account.heap) if account.heap else None
        best = self.heap if self.heap else None
        for other in self.own:
            heap = other.heap
            if heap and (best is None or heap[0] < best[0]) and not (shared_only and other.dedicated):
                best = heap
        return heappop(best) if best is not None else None

    def _moved(self, rec: ObjectRecord, now_s: float) -> bool:
        """Whether a popped candidate should now go later than its heap entry said."""
        if self.order is not None:
            return self.order.moved(rec, now_s)
        return rec.last_access_s != rec.heap_access_s

    @property
    def num_entries(self) -> int:
        return len(self.heap)

    def compact(self) -> None:
        """Drop gone records from the heaps (removed objects leave their entries behind)."""
        if self.order is not None:
            self.order.compact()
            return
        for heap in [self.heap, *(account.heap for account in self.own)]:
            live = [rec for rec in heap if rec.state != GONE]
            if len(live) < len(heap):
                heapify(live)
                heap[:] = live


class Selection:
    """One pass of candidates: `next()` until None or the caller has freed enough; `keep` what it
    passes over and `taken` what it evicts; `close` puts the kept ones back."""

    __slots__ = ("_evictor", "_now_s", "_account", "_shared_only", "_on_segments", "_kept")

    def __init__(self, evictor: Evictor, now_s: float, account: TenantAccount | None, shared_only: bool,
                 on_segments: set[int] | None) -> None:
        self._evictor = evictor
        self._now_s = now_s
        self._account = account
        self._shared_only = shared_only
        self._on_segments = on_segments
        self._kept: list[ObjectRecord] = []

    def next(self) -> ObjectRecord | None:
        evictor, now_s, account = self._evictor, self._now_s, self._account
        on_segments = self._on_segments
        while True:
            rec = evictor._pop(now_s, account, self._shared_only)
            if rec is None:
                return None
            rec.heaps &= ~IN_HEAP
            if rec.state != COMPLETE or rec.flags & PINNED or rec.num_children:
                continue  # a parent comes back when its last child goes
            retention = evictor.retention
            if retention is not None and retention.until and retention.holds(rec, now_s):
                self._kept.append(rec)  # a TTL keeps it: back in the heap when the selection closes
                continue
            if evictor._moved(rec, now_s):
                evictor.push(rec)  # used since it was pushed: take its place by the new time
                continue
            owner = rec.space.account
            if ((account is not None and owner is not account) or (self._shared_only and owner.dedicated)
                    or (on_segments is not None and not _on_any(rec.locations, on_segments))):
                self._kept.append(rec)  # another tenant's (only under the session order), or not where room is needed
                continue
            return rec

    def keep(self, rec: ObjectRecord) -> None:
        self._kept.append(rec)

    def taken(self, rec: ObjectRecord) -> None:
        """The caller evicts `rec` (counted before it changes: its size is its DRAM size)."""
        self._evictor.evictions += 1
        self._evictor.evicted_bytes += rec.size_bytes

    def close(self) -> None:
        push = self._evictor.push
        for rec in self._kept:
            push(rec)
        self._kept = []


def _on_any(locations: bytes, segment_ids: set[int]) -> bool:
    for start in range(0, len(locations), REPLICA_BYTES):
        if int.from_bytes(locations[start : start + 8], "little", signed=True) in segment_ids:
            return True
    return False
