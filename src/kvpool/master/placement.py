"""Where a new object's replicas go: free-ratio first, one replica per node.

Rules:
- Pure: segments in, segments out; allocation itself is the index's job.
- Among segments that can hold the object, the one with the largest free ratio wins (ties: the
  lower segment id, so placement is deterministic and tests can assert it). This spreads load and
  memory pressure across nodes. Rejected: random placement (Mooncake's default) hides imbalance and
  makes tests nondeterministic; local-first needs the caller's host, which the wire does not carry.
- A segment still recovering (its node is announcing what it holds) takes nothing new.
- Which segments a tenant may use is one `PlacementGroup` (SegmentTable.placeable: its dedicated
  segments, else the shared ones); `why_nowhere` says why none of them can take an object before
  any eviction is tried.
- Replicas go to distinct nodes (two segments of one node share its fate). When fewer nodes have
  room than replicas were asked for, the object gets as many as there are (at least one).
- The order is kept, not recomputed: a group holds its segments in a heap by free ratio. A
  segment whose allocator's usage changed (`changed`, called by the segment table for every
  allocation, free and rebuild) is only marked; the next `choose` pushes each marked segment once
  (an eviction slice frees dozens of objects of one segment: one push). Older entries of a segment
  are stale and skipped when they surface (lazy deletion); the heap is rebuilt once stale entries
  outnumber live ones. A put then looks at the few segments at the top, O(log n), where sorting every
  segment per object cost O(n log n): 110 us per PutStart of two objects with 64 segments, against
  34 us with one (benchmarks/master_tail_bench.py --segments).
"""

from __future__ import annotations

from heapq import heapify, heappop, heappush
from itertools import count
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpool.master.segments import Segment, SegmentTable

_REBUILD_SLACK = 32  # stale entries tolerated beyond the live ones before a rebuild


class PlacementGroup:
    """The segments one set of tenants places on, largest free ratio first."""

    __slots__ = ("segments", "_heap", "_current", "_pushes", "_moved")

    def __init__(self) -> None:
        self.segments: dict[int, Segment] = {}  # by id
        self._heap: list[tuple[float, int, int, Segment]] = []  # (-free ratio, segment id, push count, segment)
        self._current: dict[int, tuple[float, int, int, Segment]] = {}  # segment id -> its live entry
        self._pushes = count()  # unique per entry: ties between entries never compare segments
        self._moved: set[Segment] = set()  # changed since their last push

    def __len__(self) -> int:
        return len(self.segments)

    def add(self, segment: Segment) -> None:
        self.segments[segment.segment_id] = segment
        self._moved.add(segment)

    def remove(self, segment: Segment) -> None:
        del self.segments[segment.segment_id]
        self._moved.discard(segment)
        self._current.pop(segment.segment_id, None)
        # its entries would keep the gone segment (its directory log, its allocator) alive until they
        # surfaced, which in a group left with one segment is never: rebuilt now (unmounts are rare)
        self._rebuild()

    def changed(self, segment: Segment) -> None:
        """`segment`'s free ratio may have changed: its place in the order follows (at the next choose)."""
        self._moved.add(segment)

    def _push_moved(self) -> None:
        heap, current, pushes = self._heap, self._current, self._pushes
        for segment in self._moved:
            entry = (-segment.free_ratio(), segment.segment_id, next(pushes), segment)
            current[segment.segment_id] = entry
            heappush(heap, entry)
        self._moved.clear()
        if len(heap) > 2 * len(current) + _REBUILD_SLACK:
            self._rebuild()

    def _rebuild(self) -> None:
        """The heap with the live entries only."""
        self._heap[:] = self._current.values()
        heapify(self._heap)

    def choose(self, size_bytes: int, num_replicas: int) -> list[Segment]:
        """Up to `num_replicas` segments on distinct nodes that can hold `size_bytes` now, largest
        free ratio first; [] when none can."""
        segments = self.segments
        if len(segments) == 1:  # nothing to order (what moved is pushed once there are more)
            for segment in segments.values():
                if not segment.recovering and segment.allocator.can_allocate(size_bytes):
                    return [segment]
            return []
        if self._moved:
            self._push_moved()
        heap, current = self._heap, self._current
        if num_replicas == 1 and heap:  # the usual case: the top entry, when it is live and fits
            entry = heap[0]
            segment = entry[3]
            if current.get(entry[1]) is entry and not segment.recovering and segment.allocator.can_allocate(size_bytes):
                return [segment]
        chosen: list[Segment] = []
        nodes: set[str] = set()
        looked_at = []
        while heap and len(chosen) < num_replicas:
            entry = heappop(heap)
            segment = entry[3]
            if current.get(entry[1]) is not entry:
                continue  # stale: the segment moved since, or is gone
            looked_at.append(entry)
            if segment.recovering or segment.node_id in nodes or not segment.allocator.can_allocate(size_bytes):
                continue
            chosen.append(segment)
            nodes.add(segment.node_id)
        for entry in looked_at:
            heappush(heap, entry)
        return chosen


def why_nowhere(segments: SegmentTable, placeable: PlacementGroup, tenant: str, dedicated: bool, size: int) -> str:
    """Why no eviction can make room for a `size`-byte object of `tenant` ("" if one may)."""
    if not segments.by_id:
        return "no segment is mounted: start a `kvpool node` (or embed one)"
    group = placeable.segments
    if not group:
        if dedicated:
            return (f"tenant {tenant!r} places only on segments dedicated to it and none is mounted now: "
                    f"start a `kvpool node --tenant {tenant}`")
        return f"every mounted segment is dedicated to a tenant: start a `kvpool node` without --tenant for tenant {tenant!r}'s objects"
    if all(s.recovering for s in group.values()):
        return ("no segment can take it yet: every segment is recovering (its node is announcing what it "
                "holds to this master); retry in a moment")
    largest = max(s.capacity_bytes for s in group.values())
    if next(iter(group.values())).allocator.aligned(size) > largest:
        return (f"an object of {size} bytes is larger than the largest segment ({largest} bytes): "
                "use smaller objects or mount larger segments")
    return ""
