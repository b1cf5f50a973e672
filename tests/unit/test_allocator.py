"""The segment allocator: exact offsets, best fit, coalescing, fragmentation, and a property test."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.master.allocator import RangeAllocator


def test_sizes_round_up_to_alignment_and_offsets_are_exact():
    a = RangeAllocator(1024, alignment_bytes=64)
    assert a.allocate(100) == 0  # takes 128
    assert a.allocate(200) == 128  # takes 256
    assert a.allocate(64) == 384
    assert a.used_bytes == 448
    assert a.free_ranges() == [(448, 576)]


def test_best_fit_prefers_the_smallest_hole_that_fits():
    a = RangeAllocator(1024, alignment_bytes=64)
    offsets = [a.allocate(128) for _ in range(8)]  # fills the segment: 0, 128, ..., 896
    assert offsets == [i * 128 for i in range(8)]
    a.free(0, 128)
    a.free(128, 128)  # hole [0, 256)
    a.free(640, 128)  # hole [640, 768)
    assert a.free_ranges() == [(0, 256), (640, 128)]
    assert a.allocate(100) == 640  # the 128-byte hole, although the 256-byte one comes first
    assert a.allocate(200) == 0


def test_freeing_coalesces_with_both_neighbours():
    a = RangeAllocator(640, alignment_bytes=64)
    x, y, z = a.allocate(64), a.allocate(64), a.allocate(64)
    a.free(x, 64)
    a.free(z, 64)
    assert a.free_ranges() == [(0, 64), (128, 512)]
    a.free(y, 64)
    assert a.free_ranges() == [(0, 640)]
    assert a.num_free_ranges == 1 and a.free_bytes == 640


def test_fragmentation_is_one_minus_largest_over_total_free():
    a = RangeAllocator(1024, alignment_bytes=64)
    assert a.fragmentation() == 0.0
    offsets = [a.allocate(256) for _ in range(4)]
    assert a.fragmentation() == 0.0  # nothing free
    a.free(offsets[0], 256)
    a.free(offsets[2], 256)
    assert a.fragmentation() == pytest.approx(0.5)


def test_full_segment_and_bad_frees_are_refused():
    a = RangeAllocator(256, alignment_bytes=64)
    assert a.allocate(257) is None
    offset = a.allocate(256)
    assert a.allocate(1) is None
    a.free(offset, 256)
    with pytest.raises(ValueError, match="double free"):
        a.free(offset, 256)
    with pytest.raises(ValueError, match="not inside"):
        a.free(192, 128)
    with pytest.raises(ValueError, match="size_bytes"):
        a.allocate(0)
    with pytest.raises(ValueError, match="power of two"):
        RangeAllocator(1024, alignment_bytes=48)


def test_rebuild_leaves_exactly_the_gaps_between_used_ranges_free():
    a = RangeAllocator(1024, alignment_bytes=64)
    a.allocate(512)
    a.rebuild([(64, 100), (192, 64), (256, 64), (960, 64)])  # 100 takes 128; 192..320 is one run
    assert a.free_ranges() == [(0, 64), (320, 640)]
    assert (a.free_bytes, a.largest_free_bytes) == (704, 640)
    assert a.allocate(64) == 0 and a.allocate(640) == 320 and a.allocate(1) is None
    a.free(64, 100)
    assert a.free_ranges() == [(64, 128)]
    a.rebuild([])
    assert a.free_ranges() == [(0, 1024)]


@pytest.mark.parametrize("used", [[(0, 128), (64, 64)], [(32, 64)], [(960, 65)], [(64, 64), (0, 64)]])
def test_rebuild_refuses_overlapping_unaligned_outside_or_unsorted_ranges(used):
    with pytest.raises(ValueError, match="overlaps, is unaligned or outside"):
        RangeAllocator(1024, alignment_bytes=64).rebuild(used)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 300), st.integers(0, 1000)), max_size=120))
def test_random_alloc_free_never_overlaps_and_coalesces_back_to_one_range(ops):
    size = 4096
    a = RangeAllocator(size, alignment_bytes=16)
    live: dict[int, int] = {}  # offset -> requested size
    for is_alloc, nbytes, pick in ops:
        if is_alloc or not live:
            offset = a.allocate(nbytes)
            if offset is None:
                assert a.largest_free_bytes < a.aligned(nbytes)
                continue
            assert offset % 16 == 0 and offset + a.aligned(nbytes) <= size
            live[offset] = nbytes
        else:
            offset = sorted(live)[pick % len(live)]
            a.free(offset, live.pop(offset))
        spans = sorted((o, o + a.aligned(n)) for o, n in live.items())
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert end <= start, "allocated ranges overlap"
        free = a.free_ranges()
        for (o1, n1), (o2, _) in zip(free, free[1:]):
            assert o1 + n1 < o2, "adjacent free ranges were not coalesced"
        for o, n in free:
            assert all(e <= o or s >= o + n for s, e in spans), "a free range overlaps an allocation"
        assert a.free_bytes == size - sum(e - s for s, e in spans)
    for offset, nbytes in list(live.items()):
        a.free(offset, nbytes)
    assert a.free_ranges() == [(0, size)]
    assert a.fragmentation() == 0.0
