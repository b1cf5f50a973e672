"""Which objects of a job are wholly in place as its bytes land in order (transfer/object_progress.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.transfer.object_progress import object_spans, progress_watcher


def test_spans_follow_the_objects_regions():
    assert object_spans([1, 2, 1], [10, 5, 5, 7]) == [(0, 10), (10, 20), (20, 27)]
    with pytest.raises(ValueError, match="regions"):
        object_spans([2, 2], [1, 1, 1])
    with pytest.raises(ValueError, match="regions"):
        object_spans([0, 3], [1, 1, 1])


@given(st.lists(st.tuples(st.integers(1, 3), st.integers(1, 50)), min_size=1, max_size=10),
       st.floats(0, 1), st.lists(st.integers(0, 40), max_size=30))
def test_each_object_within_the_range_is_reported_once_in_order_after_its_last_byte(objects, where, steps):
    counts = [c for c, _ in objects]
    sizes = [size for c, size in objects for _ in range(c)]
    spans = object_spans(counts, sizes)
    total = spans[-1][1]
    cut = int(total * where)
    for start, end in ((0, cut), (cut, total)):
        seen: list[int] = []
        landed = progress_watcher(spans, seen.append, start, end)
        in_place = 0
        for step in [*steps, end - start]:  # the stream ends with all its bytes in
            in_place = min(end - start, in_place + step)
            landed(in_place)
            # reported exactly: the objects inside [start, end) whose last byte is in
            assert seen == [n for n, (a, b) in enumerate(spans) if a >= start and b <= end and b - start <= in_place]
    # an object cut by `cut` is reported by neither half; every other object by exactly one
    both = [n for start, end in ((0, cut), (cut, total)) for n, (a, b) in enumerate(spans) if a >= start and b <= end]
    assert sorted(both) == [n for n, (a, b) in enumerate(spans) if b <= cut or a >= cut]
