"""Fresh memory for the values a plain `get` returns, with its pages faulted in one system call.

Why: a `get` of a 1 MiB value returns a new bytes object, and new memory of that size comes from
the kernel page by page (256 page faults, each costing more than the copy of its page).
`madvise(MADV_POPULATE_WRITE)` (Linux 5.14) faults the whole range in one call, about halving the
cost of a fresh 1 MiB value (docs/design/client.md).

Rules:
- `new_bytes(size)` makes an uninitialised bytes object (CPython's own
  `PyBytes_FromStringAndSize(NULL, size)`, as C extensions do) and hands out the address of its
  buffer so the caller fills it before anyone else sees the object (nothing hashes or shares it
  until it is returned). Where the buffer's offset cannot be confirmed at import (another
  interpreter), `available()` is False and callers copy into a new object instead.
- `prefault(addr, size)` populates the page-aligned interior of a range of at least
  `PREFAULT_FROM_BYTES`; a kernel without MADV_POPULATE_WRITE turns it off for the process (the
  pages then fault on first write). It never changes the range's contents.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import sys

PREFAULT_FROM_BYTES = 256 << 10  # smaller values: a few faults, not worth a system call
_MADV_POPULATE_WRITE = 23  # linux/mman.h (5.14)
_PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(None, use_errno=True)
_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_madvise.restype = ctypes.c_int
_populate_works = sys.platform.startswith("linux")

_from_string_and_size = ctypes.pythonapi.PyBytes_FromStringAndSize
_from_string_and_size.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
_from_string_and_size.restype = ctypes.py_object
_DATA_OFFSET = bytes.__basicsize__ - 1  # PyBytesObject: header, then ob_sval[]


def _offset_confirmed() -> bool:
    probe = b"kvpool-fresh-bytes"
    try:
        return sys.implementation.name == "cpython" and ctypes.string_at(id(probe) + _DATA_OFFSET, len(probe)) == probe
    except (OSError, ValueError):
        return False


_BYTES_OK = _offset_confirmed()


def available() -> bool:
    """Whether `new_bytes` can be used in this interpreter."""
    return _BYTES_OK


def new_bytes(size_bytes: int) -> tuple[bytes, int]:
    """(an uninitialised bytes object of `size_bytes`, the address of its buffer). The caller
    must write every byte before the object is seen by anyone else."""
    if not _BYTES_OK:
        raise RuntimeError("uninitialised bytes objects are not available in this interpreter")
    if size_bytes <= 0:
        raise ValueError(f"size_bytes must be > 0, got {size_bytes}")
    out = _from_string_and_size(None, size_bytes)
    return out, id(out) + _DATA_OFFSET


def prefault(addr: int, size_bytes: int) -> bool:
    """Fault in the whole pages of [addr, addr + size_bytes) for writing; True if it was done."""
    global _populate_works
    if not _populate_works or size_bytes < PREFAULT_FROM_BYTES:
        return False
    start = (addr + _PAGE - 1) & ~(_PAGE - 1)
    end = (addr + size_bytes) & ~(_PAGE - 1)
    if end <= start:
        return False
    if _madvise(start, end - start, _MADV_POPULATE_WRITE) != 0:
        if ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS):  # a kernel before 5.14
            _populate_works = False
        return False
    return True
