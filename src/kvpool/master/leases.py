"""Read leases: which leased lookups hold which records, until when, and removed objects they hold.

Rules:
- This module is the only writer of a record's lease fields (`lease_until_s`, `lease_since_s`,
  `lease_count`) and of its DRAINING flag.
- Every leased lookup with hits gets a lease id and an entry here (id -> tenant and the records it
  leased); each record counts the entries holding it (`lease_count`). A reader done with its reads
  releases its id: the entry goes, its records' counts drop, and a record at 0 is unleased at once
  (evictable, or freed if it was removed). Another reader's lease on the same object keeps the
  count above 0, so a release never ends someone else's lease. Rejected: a bare per-key count
  released by key (a release arriving after its lease expired and another reader leased the object
  would end the new reader's lease; a duplicate release would too; and removed objects are no
  longer findable by key). The entry also makes a release cost O(its hits) with no key lookups,
  and a second release of the same id a no-op. Entries whose lease ended are purged by `expire`
  (ids are granted in expiry order: one TTL for all); the lease_until_s check stays the authority,
  so an unreleased lease still ends at its TTL.
- Space is freed only when no reader can still hold it: a removed object that is leased keeps its
  ranges here (`hold_removed`) until its lease ends; then they go back to the segment space.
- Eviction never takes a leased object (`evictable`). One leased for longer than
  `max_lease_hold_s` without a break is marked DRAINING when eviction wants it: it takes no new
  lease, so it becomes evictable within one lease TTL. Rejected: capping every object's continuous
  lease (hot objects would turn into misses every cap period even with free memory); letting
  lookups renew leases unconditionally (eviction finds nothing and the pool stays full).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from kvpool.core.types import SegmentId
from kvpool.master.records import COMPLETE, DRAINING, ObjectRecord
from kvpool.master.replicas import keep_other_replicas, on_segment
from kvpool.master.space import SegmentSpace


class LeaseTable:
    def __init__(self, space: SegmentSpace) -> None:
        self._space = space
        self.entries: dict[int, tuple[str, list[ObjectRecord]]] = {}  # lease id -> (tenant, records)
        self._order: deque[tuple[float, int]] = deque()  # (until_s, lease id), in grant order
        self._removed: set[ObjectRecord] = set()  # removed while leased: ranges freed when the lease ends
        self.grants = 0
        self.expiries = 0
        self.releases = 0

    def lease_run(self, get: Callable[[str], ObjectRecord | None], keys: list[str], now_s: float,
                  ttl_s: float) -> tuple[list[ObjectRecord], int]:
        """Lease the complete records of the leading keys; returns (them, index of the first key that
        is disk-only, or -1). A draining object takes no new lease, unless its lease ended a TTL ago
        (eviction had its window and did not need it)."""
        until_s = now_s + ttl_s
        reopen_s = now_s - ttl_s
        hits: list[ObjectRecord] = []
        append = hits.append
        disk_only_at = -1
        for key in keys:
            rec = get(key)
            if rec is None:
                break
            if not rec.locations:  # disk-only
                disk_only_at = len(hits)
                break
            if rec.state != COMPLETE:
                break
            flags = rec.flags
            if flags & DRAINING:
                if (rec.lease_until_s or 0.0) > reopen_s:
                    break
                rec.flags = flags & ~DRAINING
            lease_until = rec.lease_until_s
            if lease_until is None or lease_until <= now_s:
                if lease_until is not None:
                    self.expiries += 1
                rec.lease_since_s = now_s
                self.grants += 1
            rec.lease_until_s = until_s
            rec.last_access_s = now_s
            rec.lease_count += 1
            append(rec)
        return hits, disk_only_at

    def grant(self, lease_id: int, tenant: str, hits: list[ObjectRecord], until_s: float) -> None:
        self.entries[lease_id] = (tenant, hits)
        self._order.append((until_s, lease_id))

    def release(self, tenant: str, lease_ids: list[int]) -> int:
        """End these leased lookups' leases; returns how many were live."""
        entries = self.entries
        released = 0
        for lease_id in lease_ids:
            entry = entries.get(lease_id)
            if entry is None or entry[0] != tenant:
                continue  # unknown, expired, released already, or another tenant's
            del entries[lease_id]
            released += 1
            self._unhold(entry[1])
        self.releases += released
        return released

    def expire(self, now_s: float) -> None:
        """Drop entries whose TTL has passed (their records' lease_until_s already says so)."""
        order = self._order
        entries = self.entries
        while order and order[0][0] <= now_s:
            entry = entries.pop(order.popleft()[1], None)
            if entry is not None:
                self._unhold(entry[1])

    def _unhold(self, records: list[ObjectRecord]) -> None:
        removed = self._removed
        for rec in records:
            left = rec.lease_count - 1
            rec.lease_count = left
            if left == 0 and rec.lease_until_s is not None:
                rec.lease_until_s = rec.lease_since_s = None  # no reader holds it any more
                if rec in removed:
                    removed.discard(rec)
                    self._space.free(rec.replicas)

    def is_leased(self, rec: ObjectRecord, now_s: float) -> bool:
        return rec.lease_until_s is not None and rec.lease_until_s > now_s

    def hold_removed(self, rec: ObjectRecord) -> None:
        """`rec` left the index while leased: its ranges stay allocated until its lease ends."""
        self._removed.add(rec)

    def free_removed(self, now_s: float) -> None:
        """Free removed objects whose lease ran out unreleased (released ones are freed at once)."""
        done = [rec for rec in self._removed if rec.lease_until_s is None or rec.lease_until_s <= now_s]
        for rec in done:
            self._removed.discard(rec)
            self._space.free(rec.replicas)

    def forget_segment(self, segment_id: SegmentId) -> None:
        """The segment is gone: removed objects held only there have nothing left to free."""
        for rec in [r for r in self._removed if on_segment(r.locations, segment_id)]:
            if not keep_other_replicas(rec, segment_id, charged=False):
                self._removed.discard(rec)

    def evictable(self, rec: ObjectRecord, now_s: float, max_hold_s: float) -> bool:
        """Whether no lease holds `rec` (an expired one is cleared); one held without a break for
        `max_hold_s` or more is marked DRAINING."""
        lease_until = rec.lease_until_s
        if lease_until is not None:
            if lease_until > now_s:
                if now_s - rec.lease_since_s >= max_hold_s:
                    rec.flags |= DRAINING
                return False
            rec.lease_until_s = rec.lease_since_s = None
            self.expiries += 1
        return True
