"""Fresh memory for plain gets (client/fresh_memory.py): uninitialised bytes objects filled in
place are ordinary bytes, prefaulting never changes a range's contents, and `get`/`get_array`
return exactly the stored bytes through it."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kvpool.client import fresh_memory
from kvpool.client.plain_values import _bytes_of


@pytest.mark.skipif(not fresh_memory.available(), reason="not CPython")
@pytest.mark.parametrize("size", [1, 4095, 4096, 256 << 10, (1 << 20) + 7])
def test_a_new_bytes_object_filled_in_place_is_ordinary_bytes(size):
    payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    out, addr = fresh_memory.new_bytes(size)
    assert type(out) is bytes and len(out) == size
    fresh_memory.prefault(addr, size)
    ctypes.memmove(addr, payload.ctypes.data, size)
    assert out == payload.tobytes()
    assert hash(out) == hash(payload.tobytes())  # hashed after filling: like any bytes
    assert {out: 1}[payload.tobytes()] == 1


def test_prefault_keeps_the_contents_and_skips_small_or_unaligned_ranges():
    buf = np.random.default_rng(1).integers(0, 256, 3 << 20, dtype=np.uint8)
    before = buf.copy()
    base = int(buf.ctypes.data)
    done = fresh_memory.prefault(base + 1, (2 << 20) + 3)
    assert done or not fresh_memory._populate_works  # a kernel before 5.14 turns it off
    assert np.array_equal(buf, before)
    assert fresh_memory.prefault(base, fresh_memory.PREFAULT_FROM_BYTES - 1) is False
    assert fresh_memory.prefault(base + 1, 100) is False


def test_a_staged_value_becomes_bytes_equal_to_it_at_every_size():
    for size in (3, 64 << 10, fresh_memory.PREFAULT_FROM_BYTES, (3 << 20) + 5):
        staged = np.random.default_rng(size).integers(0, 256, size + 64, dtype=np.uint8)[5:5 + size]
        out = _bytes_of(staged)
        assert type(out) is bytes and out == staged.tobytes()


def test_new_bytes_refuses_an_empty_size():
    if not fresh_memory.available():
        pytest.skip("not CPython")
    with pytest.raises(ValueError):
        fresh_memory.new_bytes(0)
