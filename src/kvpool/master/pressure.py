"""Memory pressure: when to evict and how much, applying the evictor's choices through the index.

Rules:
- The evictor (eviction.py) chooses, the lease table (leases.py) says whether a lease holds a
  candidate, the segment space says what evicting it frees, and the index (`ObjectIndex.evict`)
  evicts it: to its disk tier when it has a copy there, else gone. Nothing below calls back here.
- Objects held only by segments still recovering are passed over: their space joins the allocator
  when the recovery ends, so evicting them would free nothing a put could use.
- Watermarks: once the pool is above the high watermark, eviction works down to the low one in
  slices of `EVICTION_SLICE_BYTES` (at most `EVICTION_SLICE_OBJECTS` evictions): one whenever the
  master has no request waiting (`MasterCore.idle_work`) and one per tick; a put that finds the
  pool above the high watermark evicts back under it and at most twice its own bytes more
  (`PUT_EVICTION_FACTOR`). So watermark eviction never holds the master's one thread for a batch,
  and a master with spare time evicts in it. (An allocation that does not fit at all still
  evicts on demand, `evict_for`: down to the low watermark, then on until a range fits. With
  the pool kept under the high watermark that takes fragmentation or a burst larger than 1 %.)
  Measured (`benchmarks/results/master_tail/`): when a put evicted 1 % of a 1 GiB pool of 256 KiB
  objects at once, put_start took 0.7 ms at P99 against 37 us at P50.
- Scoped eviction: a tenant at its quota (`evict_for_quota`) or placing on its dedicated segments
  evicts its own objects and never another tenant's; placement on shared segments does not take
  dedicated tenants' objects.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from kvpool.core.protocol import unpack_replicas
from kvpool.master.config import MasterConfig
from kvpool.master.eviction import EVICTION_SLICE_OBJECTS, Evictor
from kvpool.master.index import ObjectIndex
from kvpool.master.leases import LeaseTable
from kvpool.master.space import SegmentSpace

if TYPE_CHECKING:
    from kvpool.master.quotas import TenantAccount
    from kvpool.master.segments import Segment


class Pressure:
    def __init__(self, config: MasterConfig, space: SegmentSpace, evictor: Evictor, leases: LeaseTable,
                 index: ObjectIndex) -> None:
        self.config = config
        self.space = space
        self.evictor = evictor
        self.leases = leases
        self.index = index
        # the pool went above the high watermark and eviction has not yet reached the low one (or
        # found nothing more it could evict: then it stops until the pool is above the high one again)
        self.descending = False

    def _watermarks(self) -> tuple[int, int, int]:
        """(used, high, low) in bytes; past the high watermark, eviction goes on down to the low one."""
        capacity, used = self.space.capacity_bytes, self.space.used_bytes
        high = int(capacity * self.config.high_watermark)
        if used > high:
            self.descending = True
        return used, high, int(capacity * self.config.low_watermark)

    def evict_over_high(self, now_s: float, extra_bytes: int) -> int:
        """A put's share: above the high watermark, evict back under it and `extra_bytes` more (never
        past the low one); the rest of the way is left to `evict_slice`. Returns the bytes freed."""
        used, high, low = self._watermarks()
        if used <= high:
            return 0
        return self._descend(now_s, used, low, min(used - low, used - high + extra_bytes))

    def evict_slice(self, now_s: float, slice_bytes: int, max_objects: int = EVICTION_SLICE_OBJECTS) -> int:
        """One slice of the way down to the low watermark, once the pool went above the high one:
        `slice_bytes` or `max_objects` evictions, whichever comes first. Returns the bytes freed."""
        used, _, low = self._watermarks()
        if not self.descending:
            return 0
        return self._descend(now_s, used, low, min(used - low, slice_bytes), max_objects)

    def _descend(self, now_s: float, used: int, low: int, to_free: int, max_objects: int | None = None) -> int:
        evictor = self.evictor
        stop_at = None if max_objects is None else evictor.evictions + max_objects
        freed = self._evict(now_s, lambda freed: freed >= to_free or (stop_at is not None and evictor.evictions >= stop_at))
        counted_out = stop_at is not None and evictor.evictions >= stop_at  # the count ended it: the next slice goes on
        if freed >= used - low or (freed < to_free and not counted_out):
            self.descending = False  # there, or nothing more can go now (leased, pending): the next put above
        return freed                  # the high watermark starts again

    def evict_for(self, size_bytes: int, now_s: float, eligible: Iterable[Segment] | None = None,
                  account: TenantAccount | None = None) -> bool:
        """An allocation failed: evict down to the low watermark, then on until some segment has a
        free range for `size_bytes` (LRU frees space anywhere; a fit needs it in one range).
        `eligible`: the segments the object may go to (None: all); `account`: evict only this tenant's
        objects (it places on its dedicated segments, or is at its quota), and only until it fits."""
        segments = self.space.segments
        candidates = list(segments.by_id.values() if eligible is None else eligible)
        capacity = sum(s.capacity_bytes for s in candidates)
        used = sum(s.used_bytes for s in candidates)
        shared_only = eligible is not None and account is None and bool(segments.dedicated_tenants)
        # only records with a replica where the room is needed (when that is not everywhere)
        on_segments = {s.segment_id for s in candidates} if account is not None or shared_only else None
        freed = 0
        if account is None:
            freed = self._evict(now_s, _at_least(max(0, used - int(capacity * self.config.low_watermark))),
                                None, shared_only, on_segments)
        step = max(size_bytes, capacity // 100)
        while not any(not s.recovering and s.allocator.can_allocate(size_bytes) for s in candidates):
            more = self._evict(now_s, _at_least(step), account, shared_only, on_segments)
            if more == 0:
                break
            freed += more
        return freed > 0

    def evict_for_quota(self, account: TenantAccount, size_bytes: int, num_replicas: int, now_s: float) -> bool:
        """The tenant is at its quota: evict its own LRU candidates until one more object of
        `size_bytes` x `num_replicas` fits (quotas.py). False: it still does not."""
        evictions = self.evictor.evictions
        self._evict(now_s, lambda _freed: account.fits(size_bytes, num_replicas), account)
        account.quota_evictions += self.evictor.evictions - evictions
        return account.fits(size_bytes, num_replicas)

    def make_room_on(self, segment: Segment, size_bytes: int, account: TenantAccount, now_s: float) -> None:
        """A promotion found no range on `segment`: evict for one (on a dedicated segment, only its
        tenant's objects there)."""
        aligned = segment.allocator.aligned(size_bytes)
        if segment.tenant:
            self.evict(now_s, aligned, account, on_segments={segment.segment_id})
        else:
            self.evict(now_s, aligned)

    def evict(self, now_s: float, bytes_to_free: int, account: TenantAccount | None = None,
              shared_only: bool = False, on_segments: set[int] | None = None) -> int:
        """Evict LRU candidates until `bytes_to_free` bytes are free; returns the bytes freed.
        `account`: only that tenant's objects; `shared_only`: none of tenants with dedicated segments;
        `on_segments`: only objects with a replica on one of these segments."""
        return self._evict(now_s, _at_least(bytes_to_free), account, shared_only, on_segments)

    def _evict(self, now_s: float, enough: Callable[[int], bool], account: TenantAccount | None = None,
               shared_only: bool = False, on_segments: set[int] | None = None) -> int:
        max_hold_s = self.config.max_lease_hold_s
        evictable = self.leases.evictable
        eviction_frees = self.space.eviction_frees
        evict = self.index.evict
        selection = self.evictor.select(now_s, account, shared_only, on_segments)
        freed = 0
        while not enough(freed):
            rec = selection.next()
            if rec is None:
                break
            if rec.lease_until_s is not None and not evictable(rec, now_s, max_hold_s):
                selection.keep(rec)
                continue
            frees, on_recovering = eviction_frees(unpack_replicas(rec.locations))
            if on_recovering and not frees:
                selection.keep(rec)  # its space is not the allocator's yet: evicting it frees nothing now
                continue
            freed += frees
            selection.taken(rec)
            evict(rec)
        selection.close()
        return freed


def _at_least(bytes_to_free: int) -> Callable[[int], bool]:
    return lambda freed: freed >= bytes_to_free
