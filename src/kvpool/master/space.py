"""The segment space: mounted segments, their allocators, their directory logs and quarantined ranges.

Rules:
- This is the only code that allocates or frees a replica's range, and the only code that appends
  to a segment's directory log (directory.py). Everything else asks it.
- A replica on a segment that is no longer mounted frees nothing: its memory went with the segment,
  and segment ids are never reused (segments.py), so no later range can be mistaken for it.
- A segment still recovering has no allocator yet (it is built from the announced ranges when the
  recovery ends): freeing one of its ranges forgets the announced range instead.
- A write revoked while its bytes may still land (`quarantine`) keeps its ranges until its writer
  says the transfer ended (`end_quarantine`), its segment goes, or `quarantine_max_s` passed. Only
  ranges are kept, never the record: the record left the index when it was revoked.
- Every append is noted: `grown` holds the segments whose logs grew and `commits` the (segment,
  sequence number) of each commit, removal and inline value copy or drop since the shell last took them (durability.py wakes parked
  heartbeats with the first and holds replies on the second).
- No clock: every time is passed in as `now_s`.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvpool.core.protocol import DIR_DISK_DROP, DIR_PROMOTE, DIR_VALUE, VALUE_PINNED, DirEntry, Replica
from kvpool.core.types import SegmentId
from kvpool.master.placement import PlacementGroup, why_nowhere
from kvpool.master.segments import Segment, SegmentTable


class _Quarantined:
    __slots__ = ("owner", "replicas", "until_s")

    def __init__(self, owner: object, replicas: list[Replica], until_s: float) -> None:
        self.owner = owner  # the tenant space of the revoked write: only its tenant may end it
        self.replicas = replicas
        self.until_s = until_s


class SegmentSpace:
    def __init__(self, segments: SegmentTable) -> None:
        self.segments = segments
        self._quarantine: dict[int, _Quarantined] = {}  # write token -> its ranges
        self.quarantine_expiries = 0
        self.grown: set[Segment] = set()  # segments whose directory logs grew since the shell took them
        self.commits: list[tuple[Segment, int]] = []  # (segment, op sequence number) of each commit since

    def take_commits(self) -> list[tuple[Segment, int]]:
        commits = self.commits
        if commits:
            self.commits = []
        return commits

    def take_grown(self) -> set[Segment]:
        grown = self.grown
        if grown:
            self.grown = set()
        return grown

    def _append(self, segment: Segment, op: DirEntry) -> None:
        segment.log.append(op)
        self.grown.add(segment)

    # ---- capacity ------------------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self.segments.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self.segments.used_bytes

    def segment(self, segment_id: SegmentId) -> Segment | None:
        return self.segments.by_id.get(segment_id)

    # ---- placement and allocation --------------------------------------------------------------

    def placeable(self, tenant: str) -> PlacementGroup:
        return self.segments.placeable(tenant)

    def why_nowhere(self, placeable: PlacementGroup, tenant: str, dedicated: bool, size: int) -> str:
        """Why no segment the tenant may use can take `size` bytes whatever is evicted ("" if some can)."""
        return why_nowhere(self.segments, placeable, tenant, dedicated, size)

    def allocate(self, chosen: Iterable[Segment], size: int) -> tuple[Replica, ...]:
        """One range of `size` bytes on each chosen segment (placement.choose found room on each)."""
        placed = []
        for segment in chosen:
            offset = segment.allocator.allocate(size)
            segment.num_objects += 1
            placed.append(Replica(segment.segment_id, offset, size))
        return tuple(placed)

    def allocate_on(self, segment: Segment, size: int) -> int | None:
        """A range on this segment (a promotion's), or None when none is free."""
        offset = segment.allocator.allocate(size)
        if offset is not None:
            segment.num_objects += 1
        return offset

    def free(self, replicas: Iterable[Replica]) -> None:
        by_id = self.segments.by_id
        for replica in replicas:
            segment = by_id.get(replica.segment_id)
            if segment is None:
                continue  # an unmounted segment's space is gone with it
            if segment.recovering:
                segment.recovered.pop(replica.offset, None)  # the allocator is built when recovery ends
            else:
                segment.allocator.free(replica.offset, replica.size)
            segment.num_objects -= 1

    def free_range(self, segment: Segment, offset: int, size: int) -> None:
        """Free one range the node was asked to fill and did not (a failed or unwanted promotion)."""
        segment.allocator.free(offset, size)
        segment.num_objects -= 1
        self._append(segment, DirEntry(offset, 0))

    def eviction_frees(self, replicas: Iterable[Replica]) -> tuple[int, bool]:
        """(bytes that freeing these replicas gives the allocators, whether one is on a recovering
        segment, whose space is not the allocator's yet)."""
        frees = 0
        on_recovering = False
        by_id = self.segments.by_id
        for replica in replicas:
            segment = by_id.get(replica.segment_id)
            if segment is not None:
                if segment.recovering:
                    on_recovering = True
                else:
                    frees += segment.allocator.aligned(replica.size)
        return frees, on_recovering

    # ---- directory logs ------------------------------------------------------------------------

    def log_commit(self, replicas: Iterable[Replica], tenant: str, key: str, parent_key: str | None,
                   checksum: int) -> None:
        by_id = self.segments.by_id
        for replica in replicas:
            segment = by_id.get(replica.segment_id)
            if segment is not None:
                self._append(segment, DirEntry(replica.offset, replica.size, tenant, key, parent_key, checksum))
                self.commits.append((segment, segment.log.last_seq))

    def log_removal(self, replicas: Iterable[Replica]) -> None:
        """Counted in `commits` too: a reply to a removal waits for it like one to a put, so a key
        removed and put again never comes back as its old object after a crash."""
        by_id = self.segments.by_id
        for replica in replicas:
            segment = by_id.get(replica.segment_id)
            if segment is not None:
                self._append(segment, DirEntry(replica.offset, 0))
                self.commits.append((segment, segment.log.last_seq))

    def log_disk_drop(self, segment_id: SegmentId, tenant: str, key: str, checksum: int) -> None:
        """Tell the node to delete its disk copy of this object."""
        segment = self.segments.by_id.get(segment_id)
        if segment is not None:
            self._append(segment, DirEntry(0, 0, tenant, key, None, checksum, DIR_DISK_DROP))

    def log_promote(self, segment: Segment, offset: int, size: int, tenant: str, key: str,
                    parent_key: str | None, checksum: int) -> None:
        """Ask the node to read its disk copy into the range at `offset`."""
        self._append(segment, DirEntry(offset, size, tenant, key, parent_key, checksum, DIR_PROMOTE))

    def log_value(self, segment: Segment, tenant: str, key: str, value: bytes, pinned: bool, epoch: int) -> None:
        """Ask the node to keep a copy of an inline value made by the master of `epoch` (an empty
        `value`: to drop its copy). A drop counts in `commits` like a copy (see log_removal)."""
        self._append(segment, DirEntry(VALUE_PINNED if pinned else 0, len(value), tenant, key, None, epoch, DIR_VALUE,
                                       value))
        self.commits.append((segment, segment.log.last_seq))

    # ---- quarantine ----------------------------------------------------------------------------

    def quarantine(self, token: int, owner: object, replicas: list[Replica], until_s: float) -> None:
        self._quarantine[token] = _Quarantined(owner, replicas, until_s)

    def end_quarantine(self, owner: object, tokens: list[int]) -> int:
        """Free quarantined ranges of these tokens (only `owner`'s: tokens of another are ignored)."""
        freed = 0
        for token in tokens:
            held = self._quarantine.get(token)
            if held is not None and held.owner is owner:
                del self._quarantine[token]
                self.free(held.replicas)
                freed += 1
        return freed

    def expire_quarantine(self, now_s: float) -> int:
        """Free quarantines past their limit: a writer silent that long is taken to be gone."""
        done = [token for token, held in self._quarantine.items() if held.until_s <= now_s]
        for token in done:
            self.free(self._quarantine.pop(token).replicas)
        self.quarantine_expiries += len(done)
        return len(done)

    @property
    def num_quarantined(self) -> int:
        return len(self._quarantine)

    def forget_segment(self, segment_id: SegmentId) -> None:
        """The segment is gone: quarantined ranges there go with it (the transfer's target is gone,
        and so is the risk); a quarantine left with no range ends."""
        for token, held in list(self._quarantine.items()):
            rest = [r for r in held.replicas if r.segment_id != segment_id]
            if not rest:
                del self._quarantine[token]
            elif len(rest) != len(held.replicas):
                held.replicas = rest
