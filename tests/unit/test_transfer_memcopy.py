"""Host copies split across helper threads (transfer/memcopy.py): every byte lands once, in place."""

from __future__ import annotations

import numpy as np
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
