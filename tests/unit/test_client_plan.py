"""Client planning: scatter-gather offsets, one job per segment, replica order, lease counting."""

import pytest

from kvpool.client import plan
from kvpool.core.protocol import Replica


def test_regions_of_an_object_are_concatenated_into_its_replica():
    addrs = [[100, 500, 900], [2000]]
    sizes = [[10, 20, 30], [64]]
    jobs = plan.group_by_segment([(0, Replica(7, 4096, 60)), (1, Replica(7, 8192, 64))], addrs, sizes)
    assert len(jobs) == 1
    job = jobs[0]
    assert job.segment_id == 7
    assert job.local_addrs == [100, 500, 900, 2000]
    assert job.remote_offsets == [4096, 4106, 4126, 8192]
    assert job.sizes == [10, 20, 30, 64]
    assert job.object_indices == [0, 1]


def test_one_job_per_segment_in_first_seen_order():
    addrs, sizes = [[1], [2], [3]], [[8], [8], [8]]
    choices = [(0, Replica(5, 0, 8)), (1, Replica(3, 0, 8)), (2, Replica(5, 8, 8))]
    jobs = plan.group_by_segment(choices, addrs, sizes)
    assert [j.segment_id for j in jobs] == [5, 3]
    assert jobs[0].object_indices == [0, 2] and jobs[0].remote_offsets == [0, 8]
    assert jobs[1].object_indices == [1]


def test_same_host_replicas_come_first_otherwise_order_kept():
    replicas = [Replica(1, 0, 8), Replica(2, 0, 8), Replica(3, 0, 8)]
    assert [r.segment_id for r in plan.order_replicas(replicas, {3})] == [3, 1, 2]
    assert [r.segment_id for r in plan.order_replicas(replicas, set())] == [1, 2, 3]


def test_leading_count_stops_at_first_failure_or_late_read():
    assert plan.leading_within_lease([1.0, 2.0, 3.0], deadline=5.0) == 3
    assert plan.leading_within_lease([1.0, None, 3.0], deadline=5.0) == 1
    assert plan.leading_within_lease([1.0, 6.0, 3.0], deadline=5.0) == 1
    assert plan.leading_within_lease([5.0], deadline=5.0) == 1  # at the deadline still counts
    assert plan.leading_within_lease([], deadline=5.0) == 0


def test_normalize_accepts_bare_ints_for_single_regions():
    addrs, sizes = plan.normalize_regions(2, [10, [20, 30]], [5, [6, 7]])
    assert addrs == [[10], [20, 30]] and sizes == [[5], [6, 7]]


@pytest.mark.parametrize(
    "n, addrs, sizes, match",
    [
        (2, [[1]], [[1]], "2 keys but 1 addrs"),
        (1, [[1, 2]], [[1]], "2 addrs but 1 sizes"),
        (1, [[]], [[]], "no regions"),
        (1, [[0]], [[8]], "addr > 0"),
        (1, [[8]], [[0]], "size > 0"),
        (1, [["x"]], [[8]], "must be ints"),
        (1, [[1.5]], [[8]], "must be ints"),
        (1, [[True]], [[8]], "must be ints"),
    ],
)
def test_normalize_rejects_bad_shapes(n, addrs, sizes, match):
    with pytest.raises(ValueError, match=match):
        plan.normalize_regions(n, addrs, sizes)
