"""Placement kept in order: the segment table's placement groups and running used total, checked
against the rule they replace (sort every placeable segment per object) under random traffic."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core import protocol as p
from kvpool.master.ids import IdSource
from kvpool.master.segments import Segment, SegmentTable


def sorted_choice(segments, size_bytes: int, num_replicas: int) -> list[int]:
    """The rule as it was written before the heap: every fitting segment sorted by free ratio."""
    fitting = [s for s in segments if not s.recovering and s.allocator.can_allocate(size_bytes)]
    fitting.sort(key=lambda s: (-s.free_ratio(), s.segment_id))
    chosen, nodes = [], set()
    for segment in fitting:
        if segment.node_id not in nodes and len(chosen) < num_replicas:
            chosen.append(segment.segment_id)
            nodes.add(segment.node_id)
    return chosen


def mount(table: SegmentTable, node: str, size: int, tenant: str = "", recovering: bool = False) -> Segment:
    msg = p.MountSegment(node, "host", size, 0, f"agent-{node}", b"", recovering=recovering, tenant=tenant)
    return table.mount(msg, 0.0)[0]


OPS = st.lists(
    st.tuples(st.sampled_from(["mount", "alloc", "alloc", "alloc", "free", "free", "unmount", "recover", "choose"]),
              st.integers(0, 7), st.integers(1, 5000), st.integers(1, 3)),
    max_size=150,
)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_kept_order_chooses_what_sorting_every_segment_chose(ops):
    table = SegmentTable(64, 1.0, 10.0, IdSource(1 << 32))
    held: list[tuple[Segment, int, int]] = []  # (segment, offset, size) allocated
    for op, pick, size, replicas in ops:
        segments = list(table.by_id.values())
        if op == "mount" or not segments:
            # a node that mounts again replaces its segment; some mount recovering
            mount(table, f"n{pick}", 1024 * (1 + pick), recovering=pick == 5)
        elif op == "alloc":
            segment = segments[pick % len(segments)]
            offset = segment.allocator.allocate(size)
            if offset is not None:
                held.append((segment, offset, size))
        elif op == "free" and held:
            segment, offset, size = held.pop(pick % len(held))
            if segment.segment_id in table.by_id:
                segment.allocator.free(offset, size)
        elif op == "unmount":
            table.unmount(segments[pick % len(segments)].segment_id)
        elif op == "recover":  # recovery ends: the allocator is rebuilt from what the node announced
            segment = segments[pick % len(segments)]
            mine = sorted((o, s) for seg, o, s in held if seg is segment)
            segment.recovering = False
            segment.allocator.rebuild(mine)
        group = table.placeable("")
        assert [s.segment_id for s in group.choose(size, replicas)] == sorted_choice(
            group.segments.values(), size, replicas)
        assert table.used_bytes == sum(s.used_bytes for s in table.by_id.values())


def test_dedicated_groups_are_kept_apart_and_an_emptied_one_goes():
    table = SegmentTable(64, 1.0, 10.0, IdSource(1 << 32))
    shared = mount(table, "n1", 4096)
    mine = mount(table, "n2", 1024, tenant="acme")
    assert [s.segment_id for s in table.placeable("acme").choose(64, 1)] == [mine.segment_id]
    assert [s.segment_id for s in table.placeable("other").choose(64, 1)] == [shared.segment_id]
    mine.allocator.allocate(512)
    assert table.used_bytes == 512
    table.unmount(mine.segment_id)
    assert table.used_bytes == 0 and "acme" not in table.by_tenant
    assert table.placeable("acme").choose(64, 1) == []  # sticky: never spilled onto shared memory
    mine.allocator.free(0, 512)  # a segment that is gone no longer counts in the pool's total
    assert table.used_bytes == 0


def test_the_heap_stays_bounded_under_churn():
    table = SegmentTable(64, 1.0, 10.0, IdSource(1 << 32))
    segments = [mount(table, f"n{i}", 1 << 20) for i in range(3)]
    group = table.placeable("")
    for n in range(10_000):
        segment = segments[n % 3]
        segment.allocator.free(segment.allocator.allocate(4096), 4096)
        group.choose(4096, 1)  # pushes what moved
        assert len(group._heap) <= 2 * len(segments) + 32 + 1
    assert [s.segment_id for s in group.choose(4096, 3)] == [s.segment_id for s in segments]


def test_an_unmounted_segment_leaves_no_entry_behind():
    """Stale entries would keep a gone segment (its directory log, its allocator) alive; in a group
    left with one segment they would never surface to be dropped."""
    table = SegmentTable(64, 1.0, 10.0, IdSource(1 << 32))
    kept, gone = mount(table, "n1", 4096), mount(table, "n2", 8192)
    group = table.placeable("")
    assert [s.segment_id for s in group.choose(64, 2)] == [kept.segment_id, gone.segment_id]
    gone.allocator.allocate(64)
    table.unmount(gone.segment_id)
    assert all(entry[3] is not gone for entry in group._heap)
    assert [s.segment_id for s in group.choose(64, 2)] == [kept.segment_id]
