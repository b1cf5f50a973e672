"""Memory helpers: which objects become which (addr, size) regions; registered-range bookkeeping."""

import ctypes

import numpy as np
import pytest
import torch

from kvpool.client.memory import RegisteredRanges, StagingBuffer, copy_bytes, region_of
from kvpool.core.errors import UsageError


def test_numpy_region_is_the_array_buffer():
    a = np.arange(100, dtype=np.float32)
    r = region_of(a, writable=True)
    assert (r.addr, r.size_bytes) == (a.ctypes.data, 400)


def test_torch_region_is_the_tensor_storage():
    t = torch.arange(10, dtype=torch.float16)
    r = region_of(t, writable=True)
    assert (r.addr, r.size_bytes) == (t.data_ptr(), 20)


def test_bytes_are_a_source_but_not_a_destination():
    b = b"hello world"
    r = region_of(b, writable=False)
    assert r.size_bytes == 11
    assert ctypes.string_at(r.addr, r.size_bytes) == b
    with pytest.raises(UsageError, match="immutable"):
        region_of(b, writable=True)


def test_bytearray_is_writable():
    b = bytearray(8)
    r = region_of(b, writable=True)
    copy_bytes(r.addr, region_of(b"abcdefgh", writable=False).addr, 8)
    assert bytes(b) == b"abcdefgh"


@pytest.mark.parametrize(
    "bad, match",
    [
        (np.arange(10)[::2], "C-contiguous"),
        (torch.arange(12).reshape(3, 4).t(), "contiguous"),
        ((1, 2, 3, 4), "pair"),
        ((4096, 64, -1), "device >= 0"),
        ((0, 10), "addr > 0"),
        ("a string", "unsupported memory type"),
        ([1, 2, 3], "unsupported memory type"),
    ],
)
def test_bad_memory_is_a_usage_error(bad, match):
    with pytest.raises(UsageError, match=match):
        region_of(bad, writable=False)


def test_read_only_array_refused_as_destination():
    a = np.zeros(4)
    a.flags.writeable = False
    region_of(a, writable=False)
    with pytest.raises(UsageError, match="read-only"):
        region_of(a, writable=True)


def test_registered_ranges_merge_and_contain():
    r = RegisteredRanges()
    r.add(1000, 100)  # [1000, 1100)
    r.add(2000, 100)  # [2000, 2100)
    assert len(r) == 2
    assert r.contains(1000, 100) and r.contains(1050, 50) and r.contains(2099, 1)
    assert not r.contains(1050, 51)  # runs past the end
    assert not r.contains(999, 2)  # starts before
    assert not r.contains(1100, 1)  # the gap
    r.add(1100, 900)  # fills the gap exactly: everything merges
    assert len(r) == 1
    assert r.contains(1000, 1100)
    r.add(500, 10)
    r.add(3000, 10)
    assert len(r) == 3
    r.add(400, 3000)  # swallows all
    assert len(r) == 1 and r.contains(400, 3000) and not r.contains(399, 1)


def test_staging_buffer_grows_by_doubling_and_registers_each_buffer():
    registered = []
    s = StagingBuffer(lambda addr, size: registered.append(size), 4096)
    assert registered == [4096]
    s.ensure(4096)
    assert registered == [4096]
    s.ensure(5000)
    assert registered == [4096, 8192] and s.array.nbytes == 8192
    s.ensure(40000)
    assert registered == [4096, 8192, 65536]


def test_first_outside_names_the_first_unregistered_region():
    r = RegisteredRanges()
    r.add(1000, 100)
    r.add(5000, 100)
    assert r.first_outside([[1000, 1050], [5000]], [[50, 50], [100]]) is None
    assert r.first_outside([[1000], [5000, 5090]], [[10], [10, 20]]) == (1, 5090, 20)
    assert r.first_outside([[1095]], [[10]]) == (0, 1095, 10)
    assert r.first_outside([[10]], [[1]]) == (0, 10, 1)
