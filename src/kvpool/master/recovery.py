"""Recovery: a remounted node announces what its segment holds and a (new) master takes it back.

Rules:
- Only while the segment is recovering: its allocator is built from the announced ranges when the
  announcement ends (`finish`), so no new object is placed over an announced one meanwhile.
- Announced entries that conflict with what the index already holds (another checksum or size under
  the key, a pending put of it, overlapping ranges, no checksum) are rejected; a record rebuilt
  from its entry takes the LRU place its age says, and joins the eviction heap only at `finish`.
- Chains are relinked as entries arrive in any order: a child whose parent was not seen yet waits
  in `orphans` until its parent comes or no segment is recovering any more.
- This module checks announced entries, keeps the announced ranges of a recovering segment and
  builds its allocator at the end; it holds no reference to the index. The index puts the records
  it rebuilds into their namespaces (`ObjectIndex.announce`) and drops the ones `finish` yields.
- Recovered objects count in their tenant's usage (quotas.py) like any other, quota or not: a
  tenant above its quota after a restart evicts its own objects at its next put.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvpool.core.protocol import MAX_REPLICAS, REPLICA_BYTES, DirEntry, DiskEntry, Replica, pack_replicas
from kvpool.master.chains import Orphans
from kvpool.master.eviction import Evictor
from kvpool.master.records import COMPLETE, GONE, IN_HEAP, PINNED, ObjectRecord
from kvpool.master.replicas import on_segment, pack_replica
from kvpool.master.segments import Segment
from kvpool.master.space import SegmentSpace


class Recovery:
    def __init__(self, space: SegmentSpace, evictor: Evictor) -> None:
        self.space = space
        self.evictor = evictor
        self.orphans = Orphans()  # recovered, parent not (yet) seen
        self.recovered_objects = 0
        self.rejected_announcements = 0

    def acceptable(self, segment: Segment, entry: DirEntry) -> bool:
        """Whether an announced entry can be taken at all: a whole aligned range inside the segment,
        not announced before, with a checksum (without one its bytes cannot be told from what
        overwrote them since: the directory lags the master by a heartbeat, so it is not served)."""
        allocator = segment.allocator
        offset, size = entry.offset, entry.size
        return not (size <= 0 or offset < 0 or offset % allocator.alignment_bytes
                    or offset + allocator.aligned(size) > allocator.size_bytes or not entry.tenant or not entry.key
                    or offset in segment.recovered or not 0 < entry.checksum < (1 << 64))

    def add_replica(self, segment: Segment, entry: DirEntry, rec: ObjectRecord) -> bool:
        """Another node's replica of an object the index holds, or a put since the restart: taken
        only if it is the same object (complete, same size and checksum, no replica here yet)."""
        segment_id = segment.segment_id
        if (rec.state != COMPLETE or rec.size_bytes != entry.size
                or rec.checksum != entry.checksum.to_bytes(8, "little")
                or on_segment(rec.locations, segment_id)
                or len(rec.locations) >= REPLICA_BYTES * MAX_REPLICAS):
            return False
        account = rec.space.account
        account.charge(rec, -1)
        rec.locations += pack_replica(segment_id, entry.offset, entry.size)
        account.charge(rec, 1)
        return True

    def rebuild(self, segment: Segment, entry: DirEntry, space: dict, last_access_s: float) -> ObjectRecord:
        """A record for an announced object the index does not hold (the caller puts it in)."""
        rec = ObjectRecord(space, entry.key, pack_replica(segment.segment_id, entry.offset, entry.size), COMPLETE, 0,
                           last_access_s)
        rec.checksum = entry.checksum.to_bytes(8, "little")
        return rec

    def rebuild_disk_only(self, entry: DiskEntry, space: dict, now_s: float) -> ObjectRecord:
        """A record for an object announced on a node's disk only (the caller puts it in)."""
        rec = ObjectRecord(space, entry.key, b"", COMPLETE, 0, now_s - max(0.0, entry.age_s))
        rec.checksum = entry.checksum.to_bytes(8, "little")
        return rec

    def taken(self, segment: Segment, entry: DirEntry, rec: ObjectRecord) -> None:
        """`rec` holds the announced range: it joins the allocator when the recovery ends."""
        segment.recovered[entry.offset] = (entry.size, rec)
        segment.num_objects += 1

    def counted(self, accepted: int, rejected: int) -> None:
        self.recovered_objects += accepted
        self.rejected_announcements += rejected

    def finish(self, segment: Segment) -> Iterator[ObjectRecord]:
        """Build the segment's allocator from the announced ranges and let it take new objects.
        Objects whose ranges overlap an earlier one lose this replica; yields those left without
        any (the caller drops each, keeping its space: it was never the allocator's)."""
        alignment = segment.allocator.alignment_bytes
        used: list[tuple[int, int]] = []
        overlapping: list[tuple[int, ObjectRecord]] = []
        position = 0
        for offset in sorted(segment.recovered):
            size, rec = segment.recovered[offset]
            if offset < position or offset % alignment:
                overlapping.append((offset, rec))
                continue
            used.append((offset, size))
            position = offset + segment.allocator.aligned(size)
        segment_id = segment.segment_id
        for offset, rec in overlapping:
            del segment.recovered[offset]
            segment.num_objects -= 1
            rest = [r for r in rec.replicas if not (r.segment_id == segment_id and r.offset == offset)]
            if rest:
                rec.space.account.charge(rec, -1)
                rec.locations = pack_replicas(rest)
                rec.space.account.charge(rec, 1)
                self.space.log_removal([Replica(segment_id, offset, 0)])
            else:
                yield rec  # its removal is logged as it is dropped
        segment.allocator.rebuild(used)
        push = self.evictor.push
        for _, rec in segment.recovered.values():
            # not before: evicting it while its segment recovered would have freed nothing
            if not rec.num_children and not rec.heaps & IN_HEAP and rec.state != GONE and not rec.flags & PINNED:
                push(rec)
        segment.recovered = {}
        segment.recovering = False
        self.forget_orphans_unless_recovering()
        self.rejected_announcements += len(overlapping)
        self.recovered_objects -= len(overlapping)

    def forget_orphans_unless_recovering(self) -> None:
        if not any(s.recovering for s in self.space.segments.by_id.values()):
            self.orphans.clear()
