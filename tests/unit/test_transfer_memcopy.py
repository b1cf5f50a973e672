"""Host copies split across helper threads (transfer/memcopy.py): every byte lands once, in place."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.transfer import memcopy

MiB = 1 << 20


@given(st.lists(st.integers(1, 2000), min_size=1, max_size=20), st.integers(1, 6))
@settings(max_examples=100, deadline=None)
def test_split_covers_every_byte_once_in_about_equal_parts(sizes, num_parts):
    pairs, offset = [], 0
    for size in sizes:
        pairs.append((10_000_000 + offset, 50_000_000 + offset, size))
        offset += size + 7  # gaps between regions: parts must not bridge them
    parts = memcopy.split(pairs, num_parts)
    assert 1 <= len(parts) <= num_parts
    copied = [(d, s, n) for part in parts for d, s, n in part]
    # the same bytes, in order, with dst and src moving together
    flat_in = [(d + i, s + i) for d, s, n in pairs for i in range(n)]
    flat_out = [(d + i, s + i) for d, s, n in copied for i in range(n)]
    assert flat_out == flat_in
    total = sum(sizes)
    target = -(-total // num_parts)
    assert all(sum(n for _, _, n in part) <= target for part in parts)


def test_a_large_job_is_copied_exactly_whatever_the_split(monkeypatch):
    monkeypatch.setattr(memcopy, "_num_cpus", 4)  # 4 parts of 10 MiB: the 24 MiB region is cut
    submitted = []
    real_executor = memcopy._executor

    def counting_executor():
        submitted.append(1)
        return real_executor()

    monkeypatch.setattr(memcopy, "_executor", counting_executor)
    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, 40 * MiB, dtype=np.uint8)
    dst = np.zeros_like(src)
    base_s, base_d = src.ctypes.data, dst.ctypes.data
    # one 24 MiB region, then 16 regions of 1 MiB written in reverse order of their sources
    pairs = [(base_d, base_s, 24 * MiB)]
    pairs += [(base_d + (24 + i) * MiB, base_s + (39 - i) * MiB, MiB) for i in range(16)]
    memcopy.copy_regions(*map(list, zip(*pairs)))
    assert len(submitted) == 3  # three helpers took a part each, the caller the fourth
    assert np.array_equal(dst[: 24 * MiB], src[: 24 * MiB])
    for i in range(16):
        assert np.array_equal(dst[(24 + i) * MiB : (25 + i) * MiB], src[(39 - i) * MiB : (40 - i) * MiB])


def test_small_jobs_and_single_cpu_processes_copy_on_the_callers_thread(monkeypatch):
    used = []
    monkeypatch.setattr(memcopy, "_executor", lambda: used.append(1))  # would fail if called
    src = np.arange(1 * MiB, dtype=np.uint8)
    dst = np.zeros_like(src)
    memcopy.copy_regions([dst.ctypes.data], [src.ctypes.data], [src.nbytes])  # below SPLIT_MIN_BYTES
    assert np.array_equal(src, dst) and not used
    monkeypatch.setattr(memcopy, "_num_cpus", 1)
    big = np.ones(16 * MiB, dtype=np.uint8)
    out = np.zeros_like(big)
    # through the bases, as a segment's copies pass them
    memcopy.copy_regions([0], [0], [big.nbytes], dst_base=out.ctypes.data, src_base=big.ctypes.data)
    assert np.array_equal(big, out) and not used


@given(st.lists(st.tuples(st.integers(0, 63), st.integers(0, 63),
                          st.sampled_from([1, 100, 4095, 16 << 10, (16 << 10) + 5, 200_000, (512 << 10) - 1, 512 << 10])),
                min_size=1, max_size=6),
       st.booleans())
@settings(max_examples=60, deadline=None)
def test_regions_at_any_alignment_land_exactly(regions, split):
    """Mutually misaligned regions of 16-512 KiB go through numpy's loop, the others through
    memmove: either way every byte lands in place and nothing around it changes."""
    room = sum(size + 128 for _, _, size in regions)
    src = np.random.default_rng(len(regions)).integers(0, 256, room, dtype=np.uint8)
    dst = np.zeros(room + 64, dtype=np.uint8)
    dsts, srcs, sizes, expected, at = [], [], [], np.zeros_like(dst), 0
    for dst_shift, src_shift, size in regions:
        dsts.append(at + dst_shift)
        srcs.append(at + src_shift)
        sizes.append(size)
        expected[at + dst_shift : at + dst_shift + size] = src[at + src_shift : at + src_shift + size]
        at += size + 128
    old = memcopy.SPLIT_MIN_BYTES, memcopy.PART_MIN_BYTES, memcopy._num_cpus
    if split:  # parts on helper threads, regions cut between them: the same routes
        memcopy.SPLIT_MIN_BYTES, memcopy.PART_MIN_BYTES, memcopy._num_cpus = 1, 1, 3
    try:
        memcopy.copy_regions(dsts, srcs, sizes, dst_base=dst.ctypes.data, src_base=src.ctypes.data)
    finally:
        memcopy.SPLIT_MIN_BYTES, memcopy.PART_MIN_BYTES, memcopy._num_cpus = old
    assert np.array_equal(dst, expected)


def test_misaligned_regions_take_numpys_loop_and_aligned_ones_memmove(monkeypatch):
    routes = []
    real_copyto = np.copyto
    monkeypatch.setattr(memcopy.np, "copyto", lambda *a, **k: (routes.append("numpy"), real_copyto(*a, **k)))
    src = np.arange(1 * MiB, dtype=np.uint8)
    dst = np.zeros(1 * MiB + 64, dtype=np.uint8)
    d, s = dst.ctypes.data, src.ctypes.data
    shift = (s - d + 16) % 64  # dst lands 16 bytes past src, modulo 64: rep movsb's slow case
    memcopy.copy_one(d + shift, s, 64 << 10)
    assert routes == ["numpy"]
    assert np.array_equal(dst[shift : shift + (64 << 10)], src[: 64 << 10])
    shift = (s - d) % 64  # mutually aligned: memmove
    memcopy.copy_one(d + shift, s + 64, 64 << 10)
    shift = (s - d + 48) % 64  # 48 past: memmove is fast there
    memcopy.copy_one(d + shift, s, 64 << 10)
    memcopy.copy_one(d + (s - d + 16) % 64, s, 1 << 20)  # from 512 KiB glibc uses vector moves
    assert routes == ["numpy"]


@given(st.lists(st.lists(st.integers(1, 300_000), min_size=1, max_size=4), min_size=1, max_size=12),
       st.sampled_from([1, 2, 4]))
@settings(max_examples=40, deadline=None)
def test_copy_objects_calls_after_once_per_object_with_its_bytes_in_place(objects, cpus):
    """Every object's regions are in place when after(n) runs (it checks them then), each n once,
    in order within a thread's run; whether the job runs on one thread, in runs of whole objects
    on helper threads, or (fewer objects than parts) object by object split."""
    sizes = [size for regions in objects for size in regions]
    counts = [len(regions) for regions in objects]
    src = np.random.default_rng(len(sizes)).integers(0, 256, sum(sizes), dtype=np.uint8)
    dst = np.zeros(sum(sizes) + 64 * len(sizes), dtype=np.uint8)
    offsets = np.cumsum([0, *sizes])[:-1].tolist()
    dsts = [o + 64 * i + 16 for i, o in enumerate(offsets)]  # gaps, and 16 bytes past the source
    starts = np.cumsum([0, *counts]).tolist()
    seen: list[int] = []

    def after(n: int) -> None:
        for r in range(starts[n], starts[n + 1]):
            assert np.array_equal(dst[dsts[r] : dsts[r] + sizes[r]], src[offsets[r] : offsets[r] + sizes[r]])
        seen.append(n)

    old = memcopy.SPLIT_MIN_BYTES, memcopy.PART_MIN_BYTES, memcopy._num_cpus
    memcopy.SPLIT_MIN_BYTES, memcopy.PART_MIN_BYTES, memcopy._num_cpus = 1, 100_000, cpus
    try:
        memcopy.copy_objects(dsts, offsets, sizes, counts, after, dst.ctypes.data, src.ctypes.data)
    finally:
        memcopy.SPLIT_MIN_BYTES, memcopy.PART_MIN_BYTES, memcopy._num_cpus = old
    assert sorted(seen) == list(range(len(objects)))


def test_copy_objects_refuses_counts_that_do_not_cover_the_regions_and_passes_after_errors_on():
    src, dst = np.ones(4096, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
    regions = ([dst.ctypes.data, dst.ctypes.data + 100], [src.ctypes.data, src.ctypes.data + 100], [100, 100])
    for counts in ([1], [1, 2], [2, 0]):
        with pytest.raises(ValueError):
            memcopy.copy_objects(*regions, counts, lambda n: None)

    def after(n: int) -> None:
        raise RuntimeError(f"object {n}")

    with pytest.raises(RuntimeError, match="object 0"):
        memcopy.copy_objects(*regions, [2], after)
