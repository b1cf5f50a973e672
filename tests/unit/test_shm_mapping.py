"""A node segment (transfer/shm.py) is populated by the node in the background; a client's mapping
is populated per chunk on first use, not whole at map time, and copies across chunk borders read
and write the right bytes."""

from __future__ import annotations

import ctypes

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.transfer import shm

MiB = 1 << 20


def mapped_kib(addr: int) -> int:
    """Rss of the mapping that starts at `addr` in this process (its page tables' share)."""
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] == f"{addr:x}":
            for follow in lines[i + 1 :]:
                if follow.startswith("Rss:"):
                    return int(follow.split()[1])
    raise AssertionError(f"no mapping at {addr:#x}")


def test_client_mapping_is_populated_per_chunk_on_first_use():
    size = 4 * shm._CHUNK
    segment = shm.SharedSegmentFile(size, "lazytest")
    try:
        assert segment.wait_populated(30.0)
        assert mapped_kib(segment.base_addr) >= size // 1024 * 0.99  # the node's side: all of it, at start
        pattern = np.random.default_rng(3).integers(0, 256, 2 * MiB, dtype=np.uint8)
        border = 2 * shm._CHUNK - MiB  # straddles chunks 1 and 2
        ctypes.memmove(segment.base_addr + border, pattern.ctypes.data, pattern.nbytes)
        mapping = shm.PeerMapping(segment.path, size, "lazytest")
        try:
            assert mapped_kib(mapping.base_addr) < 1024  # nothing mapped before the first copy
            out = np.zeros_like(pattern)
            mapping.copy("READ", [out.ctypes.data], [border], [out.nbytes])
            assert np.array_equal(out, pattern)
            touched = mapped_kib(mapping.base_addr)
            # chunks 1 and 2 only (plus at most the kernel's read fault-around window, 64 KiB, past an edge)
            assert 2 * shm._CHUNK // 1024 <= touched <= 2 * shm._CHUNK // 1024 + 128
            mapping.copy("WRITE", [pattern.ctypes.data], [0], [MiB])  # chunk 0: mapped now, written through
            back = np.frombuffer(ctypes.string_at(segment.base_addr, MiB), dtype=np.uint8)
            assert np.array_equal(back, pattern[:MiB])
            mapping.copy("READ", [out.ctypes.data], [size - 4096], [4096])  # the last chunk
            assert mapping._unpopulated is None  # every chunk mapped: later copies skip the bookkeeping
            assert np.array_equal(out[:4096], np.frombuffer(ctypes.string_at(segment.base_addr + size - 4096, 4096),
                                                            dtype=np.uint8))  # fmt: skip
        finally:
            mapping.close()
    finally:
        segment.close()


_RANGE = st.tuples(st.integers(0, 40 * shm._CHUNK),
                   st.one_of(st.integers(0, 5 * shm._CHUNK), st.sampled_from([1, shm._CHUNK - 1, shm._CHUNK, shm._CHUNK + 1])))


def _each_chunk_of_each_range(ranges) -> set[int]:
    return {chunk for o, s in ranges for chunk in range(o // shm._CHUNK, (o + max(s, 1) - 1) // shm._CHUNK + 1)}


@settings(max_examples=200, deadline=None)
@given(st.lists(_RANGE, min_size=1, max_size=shm._CHUNKS_VECTORIZED_FROM - 1))
def test_the_chunks_a_few_ranges_touch_are_each_chunk_of_each_range(ranges):
    found = shm._chunks_touched([o for o, _ in ranges], [s for _, s in ranges])
    assert set(found) == _each_chunk_of_each_range(ranges)


@settings(max_examples=200, deadline=None)
@given(st.lists(_RANGE, min_size=shm._CHUNKS_VECTORIZED_FROM, max_size=300),
       st.booleans())
def test_the_chunks_many_ranges_touch_are_found_in_one_numpy_pass_each_once(ranges, within_a_chunk):
    if within_a_chunk:  # ranges of at most a chunk (a scatter-gather job's regions)
        ranges = [(o, min(s, shm._CHUNK)) for o, s in ranges]
    found = shm._chunks_touched([o for o, _ in ranges], [s for _, s in ranges])
    assert sorted(found) == sorted(_each_chunk_of_each_range(ranges))  # every chunk, each named once


def test_a_many_region_copy_maps_only_the_chunks_its_regions_touch():
    size = 8 * shm._CHUNK
    segment = shm.SharedSegmentFile(size, "manyregions")
    try:
        assert segment.wait_populated(30.0)
        region = 4096
        # 128 regions (the numpy pass) in chunks 1, 3 and 6; one straddles chunks 3 and 4
        offsets = ([shm._CHUNK + i * 2 * region for i in range(60)] + [3 * shm._CHUNK + i * region for i in range(60)]
                   + [6 * shm._CHUNK + i * region for i in range(7)] + [4 * shm._CHUNK - region // 2])
        assert len(offsets) >= shm._CHUNKS_VECTORIZED_FROM
        data = np.random.default_rng(5).integers(0, 256, len(offsets) * region, dtype=np.uint8)
        mapping = shm.PeerMapping(segment.path, size, "manyregions")
        try:
            base = int(data.ctypes.data)
            mapping.copy("WRITE", [base + i * region for i in range(len(offsets))], offsets, [region] * len(offsets))
            assert [i for i, flag in enumerate(mapping._unpopulated) if not flag] == [1, 3, 4, 6]
            for i, offset in enumerate(offsets):
                assert ctypes.string_at(segment.base_addr + offset, region) == data[i * region:(i + 1) * region].tobytes()
        finally:
            mapping.close()
    finally:
        segment.close()
