"""End-to-end checksums of pool objects: xxh3_64 over an object's regions, in order.

Rules:
- An object is the concatenation, in order, of its regions `(addr, size_bytes)`. Its checksum is
  a function of those bytes alone, never of where the region boundaries fall, so a writer with 32
  scatter-gather KV regions and a reader with one staging buffer agree on the same bytes.
- The writer checksums its source regions before writing; a reader checksums its destination
  regions after reading and compares. This module only computes; it never compares or decides.
- 0 means "no checksum" wherever a checksum is stored, so it is never returned: an object whose
  xxh3_64 is 0 is given 1 (odds 2**-64; the price is that such an object collides with one whose
  hash is 1).
- Pure: reads the memory it is given and nothing else. Addresses are trusted, as in the transfer
  that moves the same bytes: the caller passes regions it already resolved (memory.region_of,
  RegisteredRanges), and an address outside the process's memory crashes it. Sizes are checked:
  every region holds >= 1 byte, every object >= 1 region, else a UsageError (a ValueError).
- Zero copy: a region becomes a buffer through a ctypes array type of its size, made once per
  size and kept (bounded) with its bound `from_address`: ~110 ns a region. numpy.ctypeslib.as_array
  costs ~30x that, a copy 10x, and slices of one memoryview over the address space are slower in
  the hash loop (+40 ns a region).
- Thread-safe: the size cache is the only state, and its races are harmless (two threads may both
  make one size's type).

Why xxh3_64: faster than crc32c on large and on scattered regions, it lets other threads run
while it hashes large buffers, and 64 bits let a random corruption through with odds 2**-64
(measurements and the rejected alternatives: docs/design/client.md).
"""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Callable

import xxhash

from kvpool.core.errors import UsageError

ALGORITHM = "xxh3_64"
NO_CHECKSUM = 0  # what a stored checksum field holds when there is none; never returned here

_MAX_CACHED_SIZES = 4096  # distinct region sizes; a KV cache has a handful, so this is a leak guard

_new_hasher = xxhash.xxh3_64
_digest = xxhash.xxh3_64_intdigest
# size_bytes -> (ctypes.c_char * size_bytes).from_address: a buffer over [addr, addr + size)
_buffer_at: dict[int, Callable[[int], ctypes.Array]] = {}


def _new_buffer_at(size_bytes: int) -> Callable[[int], ctypes.Array]:
    """Only reached on a cache miss, so the sizes seen before are not checked again."""
    try:
        size_bytes = operator.index(size_bytes)  # numpy integers too
    except TypeError:
        raise UsageError(f"every region needs an int size_bytes > 0, got {size_bytes!r}") from None
    if size_bytes <= 0:
        raise UsageError(f"every region needs an int size_bytes > 0, got {size_bytes}")
    if len(_buffer_at) >= _MAX_CACHED_SIZES:
        _buffer_at.clear()
    buffer_at = (ctypes.c_char * size_bytes).from_address
    _buffer_at[size_bytes] = buffer_at
    return buffer_at


def _checksum(addrs: list[int], sizes: list[int]) -> int:
    num_regions = len(addrs)
    if num_regions != len(sizes):
        raise UsageError(f"an object needs one size per address, got {num_regions} addrs and {len(sizes)} sizes")
    if num_regions == 1:
        size = sizes[0]
        value = _digest((_buffer_at.get(size) or _new_buffer_at(size))(addrs[0]))
        return value or 1
    if num_regions == 0:
        raise UsageError("an object needs at least one region, got none")
    hasher = _new_hasher()
    update = hasher.update
    first = sizes[0]
    if sizes.count(first) == num_regions:  # the common KV-cache case: all regions one size
        buffer_at = _buffer_at.get(first) or _new_buffer_at(first)
        for addr in addrs:
            update(buffer_at(addr))
    else:
        get = _buffer_at.get
        for addr, size in zip(addrs, sizes):
            update((get(size) or _new_buffer_at(size))(addr))
    return hasher.intdigest() or 1


def checksum_regions(addrs: list[int], sizes: list[int]) -> int:
    """The checksum (unsigned 64-bit, never 0) of one object: its regions' bytes, in order."""
    return _checksum(addrs, sizes)


def checksum_objects(addrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
    """One checksum per object, `addrs[i]`/`sizes[i]` being object i's regions (the hot path)."""
    if len(addrs) != len(sizes):
        raise UsageError(f"one size list per object, got {len(addrs)} addr lists and {len(sizes)} size lists")
    return [_checksum(a, s) for a, s in zip(addrs, sizes)]


def checksum_after(indices: list[int], addrs, sizes, digests: dict[int, int], expected: list[int]):
    """(counts, after) for DataPlane.transfer_many: object n of a job is object indices[n] of the
    call; after(n) checksums it into digests[indices[n]] (when its writer left a checksum) while
    its bytes are still in the CPU's caches."""

    def after(n: int) -> None:
        i = indices[n]
        if expected[i]:
            digests[i] = _checksum(addrs[i], sizes[i])

    return [len(sizes[i]) for i in indices], after


def checksum_bytes(data: bytes | bytearray | memoryview) -> int:
    """The checksum of a plain bytes-like value (any C-contiguous buffer, numpy arrays included);
    equal to `checksum_regions` over the same bytes."""
    view = memoryview(data)
    if view.nbytes == 0:
        raise UsageError("cannot checksum an empty value: a pool object holds >= 1 byte")
    if not view.c_contiguous:
        raise UsageError("the value is not C-contiguous: pass a contiguous copy")
    return _digest(view) or 1
