"""Where a new object's replicas go: free-ratio first, one replica per node.

Rules:
- Pure: takes segments, returns segments; allocation itself is the index's job.
- Among segments that can hold the object, the one with the largest free ratio wins (ties: the
  lower segment id, so placement is deterministic and tests can assert it). This spreads load and
  memory pressure across nodes. Rejected: random placement (Mooncake's default) hides imbalance and
  makes tests nondeterministic; local-first needs the caller's host, which the wire does not carry.
- A segment still recovering (its node is announcing what it holds) takes nothing new.
- Which segments a tenant may use is the segment table's answer (SegmentTable.placeable: its
  dedicated segments, else the shared ones); `why_nowhere` says why none of them can take an
  object before any eviction is tried.
- Replicas go to distinct nodes (two segments of one node share its fate). When fewer nodes have
  room than replicas were asked for, the object gets as many as there are (at least one).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvpool.master.segments import Segment, SegmentTable


def choose_segments(segments: Iterable[Segment], size_bytes: int, num_replicas: int) -> list[Segment]:
    fitting = [s for s in segments if not s.recovering and s.allocator.can_allocate(size_bytes)]
    if not fitting:
        return []
    fitting.sort(key=lambda s: (-s.free_ratio(), s.segment_id))
    chosen: list[Segment] = []
    nodes: set[str] = set()
    for segment in fitting:
        if segment.node_id in nodes:
            continue
        chosen.append(segment)
        nodes.add(segment.node_id)
        if len(chosen) == num_replicas:
            break
    return chosen


def why_nowhere(segments: SegmentTable, placeable: dict[int, Segment], tenant: str, dedicated: bool, size: int) -> str:
    """Why no eviction can make room for a `size`-byte object of `tenant` ("" if one may)."""
    if not segments.by_id:
        return "no segment is mounted: start a `kvpool node` (or embed one)"
    if not placeable:
        if dedicated:
            return (f"tenant {tenant!r} places only on segments dedicated to it and none is mounted now: "
                    f"start a `kvpool node --tenant {tenant}`")
        return f"every mounted segment is dedicated to a tenant: start a `kvpool node` without --tenant for tenant {tenant!r}'s objects"
    if all(s.recovering for s in placeable.values()):
        return ("no segment can take it yet: every segment is recovering (its node is announcing what it "
                "holds to this master); retry in a moment")
    largest = max(s.capacity_bytes for s in placeable.values())
    if next(iter(placeable.values())).allocator.aligned(size) > largest:
        return (f"an object of {size} bytes is larger than the largest segment ({largest} bytes): "
                "use smaller objects or mount larger segments")
    return ""
