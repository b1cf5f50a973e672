"""Object records and eviction: LRU over chain tails, never a leased, pending or pinned object.

Rules:
- Candidates are complete, unpinned objects with no children (no object names them as parent):
  evicting only tails means a cached suffix is never left without its prefix. When a tail goes,
  its parent becomes a tail and a candidate, at its own (older) last access time.
- LRU among candidates: a heap of records ordered by the access time they had when pushed, with
  lazy invalidation. An access only writes `last_access_s` (O(1), no heap work on the lookup hot
  path); a popped record whose access time moved on is pushed back with the new time. This is exact
  LRU: a record popped fresh has an access time no later than any stale entry's true time.
- Each record is in the heap at most once (IN_HEAP), so the heap costs one pointer per object.
- Objects held only by segments still recovering are skipped: their space joins the allocator when
  the recovery ends, so evicting them would free nothing a put could use.
- Leased objects are skipped. One leased for longer than `max_lease_hold_s` without a break is
  marked DRAINING when eviction wants it: it takes no new lease, so it becomes evictable within one
  lease TTL. Rejected: capping every object's continuous lease (hot objects would turn into misses
  every cap period even with free memory); letting lookups renew leases unconditionally (the
  Mooncake complaint: eviction finds nothing and the pool stays full).
"""

from __future__ import annotations

from heapq import heapify, heappop, heappush
from typing import TYPE_CHECKING

from kvpool.core.protocol import REPLICA_BYTES, Replica, unpack_replicas

if TYPE_CHECKING:
    from kvpool.master.index import ObjectIndex

# record flags
COMPLETE = 1  # put_end arrived: readable
PINNED = 2  # never evicted (removed only explicitly)
IN_HEAP = 4  # has an entry in the eviction heap
DEAD = 8  # gone from the index; an old heap entry or a child may still point at it
DRAINING = 16  # eviction waits for its lease to end: no new lease

NO_CHECKSUM = bytes(8)


class ObjectRecord:
    __slots__ = (
        "space",  # the tenant's dict that holds this record
        "key",
        "locations",  # bytes: its replicas packed (protocol.pack_replicas), sent as-is by leased lookups
        "flags",
        "parent",  # ObjectRecord | None
        "num_children",
        "last_access_s",
        "heap_access_s",  # last_access_s when pushed onto the eviction heap
        "lease_until_s",  # float | None
        "lease_since_s",  # start of the current unbroken lease, float | None
        "lease_count",  # leased lookups holding it and not yet released nor expired (index._leases)
        "token",  # the write token of its allocation (PutStart): PutEnd / PutRevoke must name it
        "checksum",  # bytes: the writer's checksum, little-endian uint64 (all zeros: none)
    )

    def __init__(self, space: dict, key: str, locations: bytes, flags: int, now_s: float, token: int = 0) -> None:
        self.space = space
        self.key = key
        self.locations = locations
        self.flags = flags
        self.parent: ObjectRecord | None = None
        self.num_children = 0
        self.last_access_s = now_s
        self.heap_access_s = now_s
        self.lease_until_s: float | None = None
        self.lease_since_s: float | None = None
        self.lease_count = 0
        self.token = token
        self.checksum = NO_CHECKSUM

    def __lt__(self, other: "ObjectRecord") -> bool:
        return self.heap_access_s < other.heap_access_s

    @property
    def replicas(self) -> list[Replica]:
        """Unpacked (cold paths: freeing space, dropping a segment, tests)."""
        return unpack_replicas(self.locations)

    @property
    def size_bytes(self) -> int:
        loc = self.locations
        return int.from_bytes(loc[16:REPLICA_BYTES], "little") if loc else 0


class Evictor:
    def __init__(self, index: "ObjectIndex") -> None:
        self.index = index
        self.heap: list[ObjectRecord] = []
        self.evictions = 0
        self.evicted_bytes = 0

    def push(self, rec: ObjectRecord) -> None:
        rec.flags |= IN_HEAP
        rec.heap_access_s = rec.last_access_s
        heappush(self.heap, rec)

    def maybe_evict(self, now_s: float) -> int:
        """Above the high watermark: evict down to the low watermark."""
        segments = self.index.segments
        capacity = segments.capacity_bytes
        used = segments.used_bytes
        if capacity == 0 or used <= capacity * self.index.config.high_watermark:
            return 0
        return self.evict(now_s, used - int(capacity * self.index.config.low_watermark))

    def evict_for(self, size_bytes: int, now_s: float) -> bool:
        """An allocation failed: evict down to the low watermark, then on until some segment has a
        free range for `size_bytes` (LRU frees space anywhere; a fit needs it in one range)."""
        segments = self.index.segments
        capacity = segments.capacity_bytes
        freed = self.evict(now_s, max(0, segments.used_bytes - int(capacity * self.index.config.low_watermark)))
        step = max(size_bytes, capacity // 100)
        while not any(not s.recovering and s.allocator.can_allocate(size_bytes) for s in segments.by_id.values()):
            more = self.evict(now_s, step)
            if more == 0:
                break
            freed += more
        return freed > 0

    def evict(self, now_s: float, bytes_to_free: int) -> int:
        """Evict LRU candidates until `bytes_to_free` bytes are free; returns the bytes freed."""
        index = self.index
        heap = self.heap
        max_hold_s = index.config.max_lease_hold_s
        freed = 0
        set_aside: list[ObjectRecord] = []
        while freed < bytes_to_free and heap:
            rec = heappop(heap)
            flags = rec.flags & ~IN_HEAP
            rec.flags = flags
            if flags & (DEAD | PINNED) or not flags & COMPLETE or rec.num_children:
                continue  # a parent comes back when its last child goes
            if rec.last_access_s != rec.heap_access_s:
                self.push(rec)  # used since it was pushed: take its place by the new time
                continue
            lease_until = rec.lease_until_s
            if lease_until is not None:
                if lease_until > now_s:
                    if now_s - rec.lease_since_s >= max_hold_s:
                        rec.flags = flags | DRAINING
                    set_aside.append(rec)
                    continue
                rec.lease_until_s = rec.lease_since_s = None
                index.lease_expiries += 1
            frees = 0
            on_recovering = False
            for replica in unpack_replicas(rec.locations):
                segment = index.segments.by_id.get(replica.segment_id)
                if segment is not None:
                    if segment.recovering:
                        on_recovering = True
                    else:
                        frees += segment.allocator.aligned(replica.size)
            if on_recovering and not frees:
                set_aside.append(rec)  # its space is not the allocator's yet: evicting it frees nothing now
                continue
            freed += frees
            self.evicted_bytes += rec.size_bytes
            self.evictions += 1
            index.evict(rec)  # to its disk tier when it has a copy there (tiers.py), else dropped
        for rec in set_aside:
            self.push(rec)
        return freed

    def compact(self) -> None:
        """Drop dead records from the heap (removed objects leave their entries behind)."""
        live = [rec for rec in self.heap if not rec.flags & DEAD]
        if len(live) < len(self.heap):
            heapify(live)
            self.heap = live
