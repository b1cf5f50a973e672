"""The caller's memory as (address, size_bytes) regions, and the bookkeeping of registered memory.

Rules:
- Only contiguous memory is accepted: C-contiguous numpy arrays, contiguous torch tensors (CPU,
  or CUDA: then the region names its device), bytes-like objects (bytes, bytearray, memoryview),
  an explicit `(addr, size_bytes)` pair or an `(addr, size_bytes, cuda_device)` triple.
  Anything else is a UsageError that says what to change; nothing here copies silently.
- torch is never imported here: a tensor is recognised by its type's module, so the client stays
  importable (and cheap) without torch.
- `RegisteredRanges` answers "does [addr, addr + size) lie inside memory registered with the data
  plane?" so an unregistered buffer is refused before any transfer starts, not deep inside NIXL.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

import numpy as np

from kvpool.core.errors import UsageError
from kvpool.transfer.memcopy import copy_one


@dataclass(frozen=True)
class Region:
    addr: int
    size_bytes: int
    device: int | None = None  # None: host memory; N: CUDA device N


def _is_torch_tensor(value: object) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "data_ptr")


def region_of(memory: object, *, writable: bool) -> Region:
    """The contiguous bytes behind `memory`. `writable` demands memory a read may land in."""
    if isinstance(memory, tuple):
        if len(memory) not in (2, 3) or not all(isinstance(v, int) and not isinstance(v, bool) for v in memory):
            raise UsageError(f"a raw memory region is an (addr, size_bytes) pair or an (addr, size_bytes, "
                             f"cuda_device) triple of ints, got {memory!r}")  # fmt: skip
        addr, size_bytes, device = (*memory, None) if len(memory) == 2 else memory
        if addr <= 0 or size_bytes <= 0 or (device is not None and device < 0):
            raise UsageError(f"raw region needs addr > 0, size_bytes > 0 and device >= 0, got {memory!r}")
        return Region(addr, size_bytes, device)
    if _is_torch_tensor(memory):
        if memory.device.type not in ("cpu", "cuda"):
            raise UsageError(f"only CPU and CUDA tensors are supported, got a tensor on {memory.device}")
        if not memory.is_contiguous():
            raise UsageError("the tensor is not contiguous: pass tensor.contiguous()")
        device = None if memory.device.type == "cpu" else (memory.device.index or 0)
        return Region(int(memory.data_ptr()), int(memory.numel() * memory.element_size()), device)
    if isinstance(memory, np.ndarray):
        if not memory.flags.c_contiguous:
            raise UsageError("the numpy array is not C-contiguous: pass np.ascontiguousarray(array)")
        if writable and not memory.flags.writeable:
            raise UsageError("the numpy array is read-only; a get needs writable memory")
        return Region(int(memory.ctypes.data), int(memory.nbytes))
    if isinstance(memory, (bytes, bytearray, memoryview)):
        if isinstance(memory, memoryview) and not memory.c_contiguous:
            raise UsageError("the memoryview is not contiguous")
        if writable and (isinstance(memory, bytes) or (isinstance(memory, memoryview) and memory.readonly)):
            raise UsageError("bytes are immutable; a get needs a bytearray, numpy array or tensor")
        view = np.frombuffer(memory, dtype=np.uint8)
        return Region(int(view.ctypes.data) if view.size else 0, int(view.nbytes))
    raise UsageError(
        f"unsupported memory type {type(memory).__name__}: pass bytes, a numpy array, a CPU torch "
        f"tensor or an (addr, size_bytes) pair"
    )


def copy_bytes(dst_addr: int, src_addr: int, size_bytes: int) -> None:
    copy_one(dst_addr, src_addr, size_bytes)


class RegisteredRanges:
    """Non-overlapping [start, end) ranges; adjacent or overlapping additions are merged."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._lock = threading.Lock()

    def add(self, addr: int, size_bytes: int) -> None:
        start, end = addr, addr + size_bytes
        with self._lock:
            i = bisect.bisect_left(self._ends, start)  # first range that ends at or after start
            j = bisect.bisect_right(self._starts, end)  # ranges [i, j) touch [start, end)
            if i < j:
                start = min(start, self._starts[i])
                end = max(end, self._ends[j - 1])
            self._starts[i:j] = [start]
            self._ends[i:j] = [end]

    def contains(self, addr: int, size_bytes: int) -> bool:
        with self._lock:
            i = bisect.bisect_right(self._starts, addr) - 1
            return i >= 0 and addr + size_bytes <= self._ends[i]

    def first_outside(self, addrs: list[list[int]], sizes: list[list[int]]) -> tuple[int, int, int] | None:
        """(object index, addr, size) of the first region not inside a registered range, or None.
        Consecutive regions usually share a range, so the last one found is tried first."""
        with self._lock:
            starts, ends = self._starts, self._ends
            lo = hi = 0
            for i, (a_list, s_list) in enumerate(zip(addrs, sizes)):
                for addr, size in zip(a_list, s_list):
                    if lo <= addr and addr + size <= hi:
                        continue
                    k = bisect.bisect_right(starts, addr) - 1
                    if k < 0 or addr + size > ends[k]:
                        return i, addr, size
                    lo, hi = starts[k], ends[k]
        return None

    def __len__(self) -> int:
        return len(self._starts)


class StagingBuffer:
    """A registered bounce buffer for put/get of values the caller did not register. Grows by
    doubling; outgrown buffers stay alive because the data plane may still hold their registration
    (there is no unregister in the contract), so the memory kept is under twice the largest value."""

    def __init__(self, register, initial_bytes: int) -> None:
        self._register = register
        self._buffers: list[np.ndarray] = []
        self.lock = threading.Lock()  # held by the caller for the whole copy + transfer
        self.array = self._grow(initial_bytes)

    def _grow(self, size_bytes: int) -> np.ndarray:
        array = np.zeros(size_bytes, dtype=np.uint8)  # zeros: touch the pages now, not mid-transfer
        self._register(int(array.ctypes.data), size_bytes)
        self._buffers.append(array)
        self.array = array
        return array

    def ensure(self, size_bytes: int) -> np.ndarray:
        if size_bytes > self.array.nbytes:
            new_size = self.array.nbytes
            while new_size < size_bytes:
                new_size *= 2
            self._grow(new_size)
        return self.array

    @property
    def addr(self) -> int:
        return int(self.array.ctypes.data)


class Registrations:
    """The memory this client registered with the data plane (only this class registers): the
    ranges, the GPU part of them, and the objects they belong to, kept alive as long as the client."""

    def __init__(self, plane) -> None:
        self._plane = plane
        self.ranges = RegisteredRanges()
        self.device = RegisteredRanges()  # the GPU part of `ranges`
        self._kept_alive: list[object] = []  # registered objects must outlive their registration
        self._lock = threading.Lock()

    def register(self, memory) -> None:
        """Register `memory` (anything region_of takes) and keep the object alive."""
        region = region_of(memory, writable=False)
        if region.size_bytes <= 0:
            raise UsageError("cannot register empty memory")
        self.register_region(region.addr, region.size_bytes, region.device)
        if not isinstance(memory, tuple):
            self._kept_alive.append(memory)

    def register_region(self, addr: int, size_bytes: int, device: int | None = None) -> None:
        with self._lock:
            if self.ranges.contains(addr, size_bytes):
                return
            self._plane.register(addr, size_bytes, device)
            self.ranges.add(addr, size_bytes)
            if device is not None:
                self.device.add(addr, size_bytes)

    def contains(self, addr: int, size_bytes: int) -> bool:
        return self.ranges.contains(addr, size_bytes)

    def check(self, addrs: list[list[int]], sizes: list[list[int]]) -> None:
        """A UsageError naming the first object with a region outside registered memory (the data
        plane checks too, but per job)."""
        outside = self.ranges.first_outside(addrs, sizes)
        if outside is not None:
            i, addr, size = outside
            raise UsageError(
                f"object {i}: region at 0x{addr:x} ({size} bytes) is not inside registered "
                f"memory; call client.register(buffer) first"
            )
