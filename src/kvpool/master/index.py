"""The object index: objects per tenant, puts, prefix lookups with read leases, removal, reclaim.

Rules:
- Pure logic: no I/O, no clock (every call takes `now_s`). The service, the simulator and the tests
  drive the same code.
- Object states: pending (space allocated, writer copying) -> complete (readable) -> gone (evicted,
  removed, revoked, reclaimed, or its last replica's segment died). A key that exists in either
  state answers PUT_EXISTS without new space; unknown keys are misses, never errors.
- Tenants are separate dicts: no call can reach another tenant's keys.
- Space is freed only when no reader can still hold it: a removed object that is leased keeps its
  space until the lease ends (`_zombies`); eviction never picks a leased object.
- One record per object, with __slots__, sharing what can be shared (a batch's `now_s` float, the
  interned size int), because the master must hold millions of small KV blocks. Its replicas are
  kept packed (24 bytes each, one bytes object): a leased lookup sends them as-is, joined.
- Leases: every leased lookup with hits gets a lease id and an entry in `_leases` (id -> tenant
  and the records it leased); each record counts the entries holding it (`lease_count`). A reader
  done with its reads releases its id: the entry goes, its records' counts drop, and a record at 0
  is unleased at once (evictable, or freed if it was removed). Another reader's lease on the same
  object keeps the count above 0, so a release never ends someone else's lease. Rejected: a bare
  per-key count released by key (a release arriving after its lease expired and another reader
  leased the object would end the new reader's lease; a duplicate release would too; and removed
  objects are no longer findable by key). The entry also makes a release cost O(its hits) with no
  key lookups, and a second release of the same id a no-op. Entries whose lease ended are purged
  by `expire_leases` (ids are granted in expiry order: one TTL for all); the lease_until_s check
  stays the authority, so an unreleased lease still ends at its TTL.
"""

from __future__ import annotations

from collections import deque

from kvpool.core.protocol import PUT_ALLOCATED, PUT_EXISTS, PUT_NO_SPACE, REPLICA_BYTES, Replica, pack_replicas
from kvpool.master.config import MasterConfig
from kvpool.master.eviction import COMPLETE, DEAD, DRAINING, IN_HEAP, PINNED, Evictor, ObjectRecord
from kvpool.master.placement import choose_segments
from kvpool.master.segments import SegmentTable

_NO_REPLICAS: tuple = ()
# byte length of a hit's packed replicas -> its replica count (protocol.MAX_REPLICAS fit in a byte)
_COUNT_OF_LENGTH = bytes(n // REPLICA_BYTES if n % REPLICA_BYTES == 0 else 0 for n in range(256))


class ObjectIndex:
    def __init__(self, config: MasterConfig, segments: SegmentTable) -> None:
        self.config = config
        self.segments = segments
        self.tenants: dict[str, dict[str, ObjectRecord]] = {}
        self.evictor = Evictor(self)
        # pending records in put order; a pending record's last_access_s is its put_start time
        self._pending: deque[ObjectRecord] = deque()
        self._zombies: set[ObjectRecord] = set()  # removed while leased: space freed when the lease ends
        self._leases: dict[int, tuple[str, list[ObjectRecord]]] = {}  # lease id -> (tenant, records)
        self._lease_order: deque[tuple[float, int]] = deque()  # (until_s, lease id), in grant order
        self._next_lease_id = 1
        self.lease_releases = 0
        self._sizes: dict[int, int] = {}  # interned size ints: KV blocks mostly share a few sizes
        self.num_complete = 0
        self.num_pending = 0
        self.puts = 0
        self.gets = 0
        self.lookups = 0
        self.hit_keys = 0
        self.miss_keys = 0
        self.lease_grants = 0
        self.lease_expiries = 0
        self.reclaimed = 0
        self.dropped = 0

    # ---- put -----------------------------------------------------------------------------------

    def put_start(
        self,
        tenant: str,
        keys: list[str],
        sizes: list[int],
        parents: list[str | None],
        num_replicas: int,
        pinned: bool,
        now_s: float,
    ) -> tuple[list[int], list[tuple[Replica, ...]], str]:
        space = self.tenants.get(tenant)
        if space is None:
            space = self.tenants[tenant] = {}
        statuses: list[int] = []
        replicas: list[tuple[Replica, ...]] = []
        message = ""
        base_flags = PINNED if pinned else 0
        for i, key in enumerate(keys):
            rec = space.get(key)
            if rec is not None:
                if rec.flags & COMPLETE:
                    rec.last_access_s = now_s
                statuses.append(PUT_EXISTS)
                replicas.append(_NO_REPLICAS)
                continue
            size = self._sizes.setdefault(sizes[i], sizes[i])
            parent_key = parents[i] if parents else None
            parent = space.get(parent_key) if parent_key is not None else None
            if parent is not None:
                parent.num_children += 1  # before placing: eviction for this put must spare its prefix
            placed, why = self._place(size, num_replicas, now_s)
            if not placed:
                if parent is not None:
                    self._release_child(parent)
                statuses.append(PUT_NO_SPACE)
                replicas.append(_NO_REPLICAS)
                message = message or why
                continue
            rec = ObjectRecord(space, key, pack_replicas(placed), base_flags, now_s)
            rec.parent = parent
            space[key] = rec
            self.num_pending += 1
            self._pending.append(rec)
            statuses.append(PUT_ALLOCATED)
            replicas.append(placed)
        self.evictor.maybe_evict(now_s)
        return statuses, replicas, message

    def _place(self, size: int, num_replicas: int, now_s: float) -> tuple[tuple[Replica, ...], str]:
        segments = self.segments
        chosen = choose_segments(segments.by_id.values(), size, num_replicas)
        if not chosen:
            largest = segments.largest_segment_bytes
            if largest == 0:
                return _NO_REPLICAS, "no segment is mounted: start a `kvpool node` (or embed one)"
            if segments.by_id[next(iter(segments.by_id))].allocator.aligned(size) > largest:
                return _NO_REPLICAS, (
                    f"an object of {size} bytes is larger than the largest segment ({largest} bytes): "
                    "use smaller objects or mount larger segments"
                )
            if self.evictor.evict_for(size, now_s):
                chosen = choose_segments(segments.by_id.values(), size, num_replicas)
            if not chosen:
                return _NO_REPLICAS, (
                    f"pool full: no segment has a free range of {size} bytes even after eviction "
                    f"(used {segments.used_bytes} of {segments.capacity_bytes} bytes; the rest is leased, "
                    "pending or pinned, or fragmented); retry later or add nodes"
                )
        placed = []
        for segment in chosen:
            offset = segment.allocator.allocate(size)
            segment.num_objects += 1
            placed.append(Replica(segment.segment_id, offset, size))
        return tuple(placed), ""

    def put_end(self, tenant: str, keys: list[str], now_s: float) -> int:
        """Make pending objects readable; returns how many were pending (others are ignored)."""
        space = self.tenants.get(tenant)
        if space is None:
            return 0
        ended = 0
        push = self.evictor.push
        for key in keys:
            rec = space.get(key)
            if rec is None or rec.flags & COMPLETE:
                continue
            rec.flags |= COMPLETE
            rec.last_access_s = now_s
            ended += 1
            if not rec.num_children and not rec.flags & PINNED:
                push(rec)
        self.num_pending -= ended
        self.num_complete += ended
        self.puts += ended
        return ended

    def put_revoke(self, tenant: str, keys: list[str]) -> int:
        space = self.tenants.get(tenant)
        if space is None:
            return 0
        revoked = 0
        for key in keys:
            rec = space.get(key)
            if rec is not None and not rec.flags & COMPLETE:
                self.drop(rec)
                revoked += 1
        return revoked

    def reclaim_pending(self, now_s: float) -> int:
        """Free pending objects whose put never ended within put_timeout_s (their writer died)."""
        pending = self._pending
        started_before_s = now_s - self.config.put_timeout_s
        reclaimed = 0
        while pending:
            rec = pending[0]
            if not rec.flags & (COMPLETE | DEAD):
                if rec.last_access_s > started_before_s:
                    break  # put order: every later entry started later
                self.drop(rec)
                reclaimed += 1
            pending.popleft()
        self.reclaimed += reclaimed
        return reclaimed

    # ---- get -----------------------------------------------------------------------------------

    def lookup_prefix(
        self, tenant: str, keys: list[str], lease: bool, now_s: float
    ) -> tuple[int, int, bytes, bytes]:
        """How many leading keys are complete; with `lease`, lease them and return (num_hit,
        lease_id, packed replica locations, per-hit replica counts or b"" when all are 1).

        A draining object (eviction is waiting for its lease to end) takes no new lease, so a
        leased lookup stops there; a counting lookup (lease=False) still sees it.
        """
        self.lookups += 1
        space = self.tenants.get(tenant)
        hits: list[ObjectRecord] = []
        num_hit = 0
        lease_id = 0
        locations = counts = b""
        if space is not None:
            get = space.get
            if lease:
                self.gets += 1
                until_s = now_s + self.config.lease_ttl_s
                reopen_s = now_s - self.config.lease_ttl_s  # a draining object is leasable again after
                append = hits.append
                for key in keys:
                    rec = get(key)
                    if rec is None:
                        break
                    flags = rec.flags
                    if flags & (COMPLETE | DRAINING) != COMPLETE:
                        if not flags & COMPLETE or (rec.lease_until_s or 0.0) > reopen_s:
                            break
                        rec.flags = flags & ~DRAINING  # eviction had its window and did not need it
                    lease_until = rec.lease_until_s
                    if lease_until is None or lease_until <= now_s:
                        if lease_until is not None:
                            self.lease_expiries += 1
                        rec.lease_since_s = now_s
                        self.lease_grants += 1
                    rec.lease_until_s = until_s
                    rec.last_access_s = now_s
                    rec.lease_count += 1
                    append(rec)
                num_hit = len(hits)
                if num_hit:
                    lease_id = self._next_lease_id
                    self._next_lease_id = lease_id + 1
                    self._leases[lease_id] = (tenant, hits)
                    self._lease_order.append((until_s, lease_id))
                    parts = [rec.locations for rec in hits]
                    locations = b"".join(parts)
                    if len(locations) != REPLICA_BYTES * num_hit:
                        counts = bytes(map(len, parts)).translate(_COUNT_OF_LENGTH)
            else:
                for key in keys:
                    rec = get(key)
                    if rec is None or not rec.flags & COMPLETE:
                        break
                    rec.last_access_s = now_s
                    num_hit += 1
        self.hit_keys += num_hit
        self.miss_keys += len(keys) - num_hit
        return num_hit, lease_id, locations, counts

    def release_leases(self, tenant: str, lease_ids: list[int], now_s: float) -> int:
        """End these leased lookups' leases (see the module rules); returns how many were live."""
        leases = self._leases
        released = 0
        for lease_id in lease_ids:
            entry = leases.get(lease_id)
            if entry is None or entry[0] != tenant:
                continue  # unknown, expired, released already, or another tenant's
            del leases[lease_id]
            released += 1
            self._unhold(entry[1], now_s)
        self.lease_releases += released
        return released

    def expire_leases(self, now_s: float) -> None:
        """Drop lease entries whose TTL has passed (their records' lease_until_s already says so)."""
        order = self._lease_order
        leases = self._leases
        while order and order[0][0] <= now_s:
            entry = leases.pop(order.popleft()[1], None)
            if entry is not None:
                self._unhold(entry[1], now_s)

    def _unhold(self, records: list[ObjectRecord], now_s: float) -> None:
        zombies = self._zombies
        for rec in records:
            left = rec.lease_count - 1
            rec.lease_count = left
            if left == 0 and rec.lease_until_s is not None:
                rec.lease_until_s = rec.lease_since_s = None  # no reader holds it any more
                if rec in zombies:
                    zombies.discard(rec)
                    self._free_replicas(rec.replicas)

    def exists(self, tenant: str, keys: list[str]) -> list[bool]:
        """Complete or not, per key. Never leases and never touches recency: a probe is not a use."""
        space = self.tenants.get(tenant)
        if space is None:
            return [False] * len(keys)
        get = space.get
        return [(rec := get(key)) is not None and bool(rec.flags & COMPLETE) for key in keys]

    # ---- removal -------------------------------------------------------------------------------

    def remove(self, tenant: str, keys: list[str], now_s: float) -> int:
        """Remove complete objects (pending ones belong to their writer: put_revoke). A leased one
        vanishes from the namespace at once but keeps its space until its lease ends."""
        space = self.tenants.get(tenant)
        if space is None:
            return 0
        removed = 0
        for key in keys:
            rec = space.get(key)
            if rec is None or not rec.flags & COMPLETE:
                continue
            removed += 1
            if rec.lease_until_s is not None and rec.lease_until_s > now_s:
                self.drop(rec, free_space=False)
                self._zombies.add(rec)
            else:
                self.drop(rec)
        return removed

    def free_zombies(self, now_s: float) -> None:
        """Free removed objects whose lease ran out unreleased (released ones are freed at once)."""
        done = [rec for rec in self._zombies if rec.lease_until_s is None or rec.lease_until_s <= now_s]
        for rec in done:
            self._zombies.discard(rec)
            self._free_replicas(rec.replicas)

    def drop(self, rec: ObjectRecord, free_space: bool = True) -> None:
        """Forget an object: out of its namespace, out of its parent's child count, space freed."""
        flags = rec.flags
        if flags & DEAD:
            return
        rec.flags = flags | DEAD
        del rec.space[rec.key]
        if flags & COMPLETE:
            self.num_complete -= 1
        else:
            self.num_pending -= 1
        parent = rec.parent
        if parent is not None:
            rec.parent = None
            self._release_child(parent)
        if free_space:
            self._free_replicas(rec.replicas)

    def _release_child(self, parent: ObjectRecord) -> None:
        parent.num_children -= 1
        if not parent.num_children and parent.flags & (COMPLETE | PINNED | DEAD | IN_HEAP) == COMPLETE:
            self.evictor.push(parent)  # a tail again: an eviction candidate at its own access time

    def _free_replicas(self, replicas: list[Replica]) -> None:
        by_id = self.segments.by_id
        for replica in replicas:
            segment = by_id.get(replica.segment_id)
            if segment is not None:  # an unmounted segment's space is gone with it
                segment.allocator.free(replica.offset, replica.size)
                segment.num_objects -= 1

    def drop_segment(self, segment_id: int) -> int:
        """The segment is gone: drop its replicas; objects left without any replica disappear."""
        lost = 0
        for space in list(self.tenants.values()):
            hit = [rec for rec in space.values() if _on_segment(rec.locations, segment_id)]
            for rec in hit:
                rest = [r for r in rec.replicas if r.segment_id != segment_id]
                if rest:
                    rec.locations = pack_replicas(rest)
                else:
                    self.drop(rec)
                    lost += 1
        for rec in [z for z in self._zombies if _on_segment(z.locations, segment_id)]:
            rest = [r for r in rec.replicas if r.segment_id != segment_id]
            if rest:
                rec.locations = pack_replicas(rest)
            else:
                self._zombies.discard(rec)
        self.dropped += lost
        return lost


def _on_segment(locations: bytes, segment_id: int) -> bool:
    """Whether packed replicas include one on `segment_id` (checked without unpacking them all)."""
    for start in range(0, len(locations), REPLICA_BYTES):
        if int.from_bytes(locations[start : start + 8], "little", signed=True) == segment_id:
            return True
    return False
