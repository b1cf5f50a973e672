"""Recovery: a remounted node announces what its segment holds and a (new) master takes it back.

Rules:
- Only while the segment is recovering: its allocator is built from the announced ranges when the
  announcement ends (`finish`), so no new object is placed over an announced one meanwhile.
- Announced entries that conflict with what the index already holds (another checksum or size under
  the key, a pending put of it, overlapping ranges, no checksum) are rejected; a record rebuilt
  from its entry takes the LRU place its age says, and joins the eviction heap only at `finish`.
- Chains are relinked as entries arrive in any order: a child whose parent was not seen yet waits
  in `orphans` until its parent comes or no segment is recovering any more.
- Recovered objects count in their tenant's usage (quotas.py) like any other, quota or not: a
  tenant above its quota after a restart evicts its own objects at its next put.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpool.core.protocol import MAX_REPLICAS, REPLICA_BYTES, DirEntry, Replica, pack_replicas
from kvpool.master.chains import Orphans
from kvpool.master.records import COMPLETE, GONE, IN_HEAP, PINNED, ObjectRecord
from kvpool.master.replicas import on_segment, pack_replica
from kvpool.master.segments import Segment

if TYPE_CHECKING:
    from kvpool.master.index import ObjectIndex


class Recovery:
    def __init__(self, index: "ObjectIndex") -> None:
        self.index = index
        self.orphans = Orphans()  # recovered, parent not (yet) seen

    def announce(
        self, segment: Segment, entries: list[DirEntry], ages_s: list[float], now_s: float
    ) -> tuple[int, list[int]]:
        """Take objects a remounted segment's node says it holds committed; returns (accepted,
        rejected offsets). Only while the segment is recovering (its allocator is built at the end)."""
        index = self.index
        accepted = 0
        rejected: list[int] = []
        segment_id = segment.segment_id
        allocator = segment.allocator
        recovered = segment.recovered
        for i, entry in enumerate(entries):
            offset, size, tenant, key = entry.offset, entry.size, entry.tenant, entry.key
            # no checksum: its bytes cannot be told from what overwrote them since (the directory lags
            # the master by a heartbeat), so it is not served again
            if (size <= 0 or offset < 0 or offset % allocator.alignment_bytes
                    or offset + allocator.aligned(size) > allocator.size_bytes or not tenant or not key
                    or offset in recovered or not 0 < entry.checksum < (1 << 64)):
                rejected.append(offset)
                continue
            space = index.space_of(tenant)
            checksum = entry.checksum.to_bytes(8, "little")
            packed = pack_replica(segment_id, offset, size)
            rec = space.get(key)
            if rec is not None:
                # another node's replica of it, or a put since the restart: take it only if it is the same object
                if (rec.state != COMPLETE or rec.size_bytes != size or rec.checksum != checksum
                        or on_segment(rec.locations, segment_id)
                        or len(rec.locations) >= REPLICA_BYTES * MAX_REPLICAS):
                    rejected.append(offset)
                    continue
                space.account.charge(rec, -1)
                rec.locations += packed
                space.account.charge(rec, 1)
            else:
                last_access_s = now_s - (ages_s[i] if i < len(ages_s) and ages_s[i] > 0 else 0.0)
                rec = ObjectRecord(space, key, packed, COMPLETE, 0, last_access_s)
                rec.checksum = checksum
                space[key] = rec
                space.account.charge(rec, 1)
                index.num_complete += 1
                self.orphans.link(rec, tenant, entry.parent)  # it joins the eviction heap in finish_recovery
            recovered[offset] = (size, rec)
            segment.num_objects += 1
            accepted += 1
        index.recovered_objects += accepted
        index.rejected_announcements += len(rejected)
        return accepted, rejected

    def finish(self, segment: Segment) -> int:
        """Build the segment's allocator from the announced ranges and let it take new objects;
        objects whose ranges overlap an earlier one lose this replica. Returns how many did."""
        index = self.index
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
                index.space.log_removal([Replica(segment_id, offset, 0)])
            else:
                index.drop(rec, free_space=False)  # logs the removal
        segment.allocator.rebuild(used)
        push = index.evictor.push
        for _, rec in segment.recovered.values():
            # not before: evicting it while its segment recovered would have freed nothing
            if not rec.num_children and not rec.heaps & IN_HEAP and rec.state != GONE and not rec.flags & PINNED:
                push(rec)
        segment.recovered = {}
        segment.recovering = False
        self.forget_orphans_unless_recovering()
        index.rejected_announcements += len(overlapping)
        index.recovered_objects -= len(overlapping)
        return len(overlapping)

    def forget_orphans_unless_recovering(self) -> None:
        if not any(s.recovering for s in self.index.segments.by_id.values()):
            self.orphans.clear()
