"""Checksums of objects as region lists: boundaries don't matter, bytes do, 0 is never returned."""

import ctypes
import random

import numpy as np
import pytest
import xxhash

from kvpool.client import checksum as cs
from kvpool.client.checksum import ALGORITHM, checksum_bytes, checksum_objects, checksum_regions
from kvpool.core.errors import UsageError

DATA = random.Random(7).randbytes(16384)  # no repeats: swapped halves differ


@pytest.fixture
def buf() -> np.ndarray:
    return np.frombuffer(DATA, dtype=np.uint8).copy()


def split(array: np.ndarray, cuts: list[int]) -> tuple[list[int], list[int]]:
    """The regions of `array` between consecutive `cuts` (offsets, 0 and len implied)."""
    edges = [0, *cuts, array.nbytes]
    base = array.ctypes.data
    return [base + lo for lo in edges[:-1]], [hi - lo for lo, hi in zip(edges, edges[1:])]


def test_algorithm_is_xxh3_64_of_the_concatenated_bytes(buf):
    assert ALGORITHM == "xxh3_64"
    assert checksum_regions(*split(buf, [])) == xxhash.xxh3_64_intdigest(DATA)
    assert checksum_regions(*split(buf, [1, 4096, 9000])) == xxhash.xxh3_64_intdigest(DATA)


@pytest.mark.parametrize(
    "cuts",
    [[], [1], [8192], [1, 2, 3], [4096, 8192, 12288], [100, 5000, 5001, 16383], list(range(512, 16384, 512))],
)
def test_region_boundaries_do_not_change_the_checksum(buf, cuts):
    assert checksum_regions(*split(buf, cuts)) == checksum_bytes(DATA)


def test_regions_need_not_be_adjacent_or_ascending(buf):
    # the object is regions [8192, 16384) then [0, 8192): the bytes in that order
    base = buf.ctypes.data
    swapped = DATA[8192:] + DATA[:8192]
    assert checksum_regions([base + 8192, base], [8192, 8192]) == checksum_bytes(swapped)
    assert checksum_regions([base + 8192, base], [8192, 8192]) != checksum_bytes(DATA)


@pytest.mark.parametrize("bit", [0, 7, 8 * 4096, 8 * 16384 - 1])
def test_one_flipped_bit_changes_the_checksum(buf, bit):
    regions = split(buf, [4096, 8192, 12288])
    before = checksum_regions(*regions)
    buf[bit // 8] ^= 1 << (bit % 8)
    after = checksum_regions(*regions)
    assert after != before
    assert after == checksum_bytes(buf.tobytes())


def test_numpy_array_regions():
    # a paged KV cache: per layer one array [num_blocks, block_bytes]; object j = block j of every layer
    layers = [np.arange(4 * 512, dtype=np.float16).reshape(4, 512) + layer for layer in range(6)]
    for j in range(4):
        addrs = [int(layer[j].ctypes.data) for layer in layers]
        sizes = [layer[j].nbytes for layer in layers]
        expected = checksum_bytes(b"".join(layer[j].tobytes() for layer in layers))
        assert checksum_regions(addrs, sizes) == expected
    assert checksum_bytes(layers[0]) == checksum_bytes(layers[0].tobytes())


def test_numpy_integer_sizes_are_accepted(buf):
    addrs, sizes = split(buf, [4096, 8192])
    assert checksum_regions(addrs, [np.int64(s) for s in sizes]) == checksum_bytes(DATA)
    assert checksum_regions(np.array(addrs).tolist(), np.array(sizes).tolist()) == checksum_bytes(DATA)


def test_mixed_region_sizes_take_the_general_path(buf):
    addrs, sizes = split(buf, [10, 4096, 4200])
    assert len(set(sizes)) == 4
    assert checksum_regions(addrs, sizes) == checksum_bytes(DATA)


def test_batch_equals_one_by_one(buf):
    a1, s1 = split(buf, [4096])
    a2, s2 = split(buf[:100], [])
    a3, s3 = split(buf, [1, 2, 3, 4])
    assert checksum_objects([a1, a2, a3], [s1, s2, s3]) == [
        checksum_regions(a1, s1),
        checksum_bytes(DATA[:100]),
        checksum_bytes(DATA),
    ]
    assert checksum_objects([], []) == []


def test_bytes_version_equals_regions_version_for_every_bytes_like(buf):
    expected = checksum_regions(*split(buf, [777]))
    for value in (DATA, bytearray(DATA), memoryview(DATA), buf, ctypes.create_string_buffer(DATA, len(DATA))):
        assert checksum_bytes(value) == expected


@pytest.mark.parametrize("sizes", [[0], [4, 0], [4, -1], [0, 0], [4, 4, 0], [4, 4.5], ["4"]])
def test_zero_length_or_bad_sizes_raise(buf, sizes):
    addrs = [buf.ctypes.data] * len(sizes)
    with pytest.raises(ValueError, match="int size_bytes > 0"):
        checksum_regions(addrs, sizes)
    with pytest.raises(UsageError):
        checksum_objects([addrs], [sizes])


def test_empty_objects_and_mismatched_lists_raise(buf):
    with pytest.raises(ValueError, match="at least one region"):
        checksum_regions([], [])
    with pytest.raises(ValueError, match="one size per address"):
        checksum_regions([buf.ctypes.data, buf.ctypes.data], [4])
    with pytest.raises(ValueError, match="one size list per object"):
        checksum_objects([[buf.ctypes.data]], [])
    with pytest.raises(ValueError, match="empty value"):
        checksum_bytes(b"")


def test_non_contiguous_bytes_like_raises():
    a = np.arange(16, dtype=np.uint8)[::2]
    with pytest.raises(ValueError, match="not C-contiguous"):
        checksum_bytes(memoryview(a))


def test_zero_is_never_returned(monkeypatch, buf):
    # no input with xxh3_64 == 0 is known, so make the hash return 0 and check the mapping to 1
    monkeypatch.setattr(cs, "_digest", lambda _view: 0)
    zero_hasher = type("ZeroHasher", (), {"update": lambda self, _b: None, "intdigest": lambda self: 0})
    monkeypatch.setattr(cs, "_new_hasher", zero_hasher)
    assert checksum_bytes(DATA) == 1
    assert checksum_regions(*split(buf, [])) == 1
    assert checksum_regions(*split(buf, [4096])) == 1
    assert checksum_regions(*split(buf, [10, 4096])) == 1
    assert checksum_objects([split(buf, [])[0]], [split(buf, [])[1]]) == [1]


def test_size_cache_is_bounded(monkeypatch, buf):
    monkeypatch.setattr(cs, "_MAX_CACHED_SIZES", 8)
    for n in range(1, 40):
        assert checksum_regions([buf.ctypes.data], [n]) == checksum_bytes(DATA[:n])
    assert len(cs._buffer_at) <= 8
