"""The local memory a DataPlane may move bytes from and into, and the checks of a job against it.

Rules:
- Only this class changes the set of registered regions and its index; the DataPlane calls it
  under its own lock (and adds NIXL's registration to a region, where an agent runs).
- Every region of a job is checked before any byte moves: local regions must lie inside one
  registered region, remote ones inside the segment; one job's local regions lie in one kind of
  memory (host, or one GPU). A bad list is the caller's bug: UsageError, naming the region.
- A few regions are checked by a Python loop, many (past `_VECTORIZE_FROM`) with numpy: each is
  faster in its range.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvpool.core.errors import UsageError
from kvpool.core.protocol import SegmentInfo

if TYPE_CHECKING:
    from kvpool.transfer.plane import Route

_VECTORIZE_FROM = 64  # regions per job from which numpy checks them faster than a Python loop


@dataclass
class Region:
    size_bytes: int
    device: int | None  # None: host memory; N: CUDA device N
    registration: object | None = None  # NIXL's, once the agent runs


@dataclass
class CheckedJob:
    route: Route | None
    segment: SegmentInfo
    local_addrs: list[int]
    remote_offsets: list[int]
    sizes: list[int]
    device: int | None = None  # where the local regions are (None: host memory)


def validate_region(addr: int, size_bytes: int, device: int | None) -> None:
    """UsageError unless `addr`, `size_bytes` and `device` can name registered memory."""
    if not isinstance(addr, int) or addr <= 0:
        raise UsageError(f"addr must be a positive int address, got {addr!r}")
    if not isinstance(size_bytes, int) or size_bytes <= 0:
        raise UsageError(f"size_bytes must be a positive int, got {size_bytes!r}")
    if device is not None and (not isinstance(device, int) or isinstance(device, bool) or device < 0):
        raise UsageError(f"device must be None (host memory) or a CUDA device index >= 0, got {device!r}")


class RegisteredMemory:
    """Registered regions by start address, with a sorted index for the checks (not thread-safe:
    the caller holds its lock while changing it; checks read an index replaced whole)."""

    def __init__(self) -> None:
        self.regions: dict[int, Region] = {}  # by start addr
        self._starts = np.zeros(0, dtype=np.int64)
        self._ends = np.zeros(0, dtype=np.int64)
        self._starts_list: list[int] = []
        self._ends_list: list[int] = []
        self._devices_list: list[int | None] = []  # parallel to _starts_list: an index, rebuilt from regions
        self._has_gpu_memory = False

    def is_new(self, addr: int, size_bytes: int, device: int | None) -> bool:
        """False if exactly this memory is registered already; UsageError if it overlaps other
        registered memory (or is not valid memory to register); else True."""
        validate_region(addr, size_bytes, device)
        known = self.regions.get(addr)
        if known is not None and (known.size_bytes, known.device) == (size_bytes, device):
            return False
        end = addr + size_bytes
        for start, region in self.regions.items():
            if start < end and addr < start + region.size_bytes:
                raise UsageError(f"memory {addr:#x}+{size_bytes} overlaps registered "
                                 f"{start:#x}+{region.size_bytes}; unregister it first")  # fmt: skip
        return True

    def add(self, addr: int, region: Region) -> None:
        self.regions[addr] = region
        self._rebuild_index()

    def remove(self, addr: int) -> Region:
        """The region that started at `addr`, no longer registered; UsageError if there is none."""
        region = self.regions.pop(addr, None)
        if region is None:
            raise UsageError(f"no registered memory starts at {addr:#x}")
        self._rebuild_index()
        return region

    def _rebuild_index(self) -> None:
        self._starts_list = sorted(self.regions)
        self._ends_list = [s + self.regions[s].size_bytes for s in self._starts_list]
        self._devices_list = [self.regions[s].device for s in self._starts_list]
        self._has_gpu_memory = any(d is not None for d in self._devices_list)
        self._starts = np.array(self._starts_list, dtype=np.int64)
        self._ends = np.array(self._ends_list, dtype=np.int64)

    def check(
        self, segment: SegmentInfo, local_addrs: Sequence[int], remote_offsets: Sequence[int], sizes: Sequence[int],
        unregistered: bool = False,
    ) -> CheckedJob:
        """The job with its regions checked (UsageError naming the first bad one, nothing moved):
        remote regions inside the segment, local ones inside registered memory, unless
        `unregistered` (then the caller's own host memory: only the segment's bounds are checked)."""
        if not isinstance(segment, SegmentInfo):
            raise UsageError(f"segment must be a SegmentInfo, got {type(segment).__name__}")
        if not len(local_addrs) == len(remote_offsets) == len(sizes):
            raise UsageError(
                f"local_addrs, remote_offsets and sizes differ in length: "
                f"{len(local_addrs)}, {len(remote_offsets)}, {len(sizes)}"
            )
        try:
            local = list(map(operator.index, local_addrs))
            remote = list(map(operator.index, remote_offsets))
            size = list(map(operator.index, sizes))
        except TypeError as e:
            raise UsageError(f"addresses, offsets and sizes must be integers: {e}") from None
        if unregistered:  # host memory of the caller's own: only the segment's bounds to check
            for i, (offset, num_bytes) in enumerate(zip(remote, size)):
                if num_bytes <= 0 or offset < 0 or offset + num_bytes > segment.size_bytes:
                    self._outside_segment(segment, i, offset, num_bytes)
            return CheckedJob(None, segment, local, remote, size, None)
        if len(size) > _VECTORIZE_FROM:
            self._check_vectorized(segment, local, remote, size)
            return CheckedJob(None, segment, local, remote, size, self._job_device(local))
        # a Python loop beats numpy's per-call overhead for the few regions of a typical object
        segment_bytes, starts, ends = segment.size_bytes, self._starts_list, self._ends_list
        for i, (addr, offset, num_bytes) in enumerate(zip(local, remote, size)):
            if num_bytes <= 0 or offset < 0 or offset + num_bytes > segment_bytes:
                self._outside_segment(segment, i, offset, num_bytes)
            slot = bisect.bisect_right(starts, addr) - 1
            if slot < 0 or addr + num_bytes > ends[slot]:
                self._not_registered(i, addr, num_bytes)
        return CheckedJob(None, segment, local, remote, size, self._job_device(local))

    def _job_device(self, local: list[int]) -> int | None:
        """The one memory a checked job's local regions lie in (None: host). Free while no GPU
        memory is registered (the host-only hot path)."""
        if not self._has_gpu_memory:
            return None
        starts, slot_devices = self._starts_list, self._devices_list
        devices = {slot_devices[bisect.bisect_right(starts, addr) - 1] for addr in local}
        if len(devices) > 1:
            where = ", ".join("host" if d is None else f"cuda:{d}" for d in sorted(devices, key=lambda d: -1 if d is None else d))
            raise UsageError(f"one transfer's local regions lie in different memories ({where}): split it per device")
        return next(iter(devices), None)

    def _check_vectorized(self, segment: SegmentInfo, local: list[int], remote: list[int], size: list[int]) -> None:
        try:
            addr = np.array(local, dtype=np.int64)
            offset = np.array(remote, dtype=np.int64)
            num_bytes = np.array(size, dtype=np.int64)
        except OverflowError as e:
            raise UsageError(f"addresses, offsets and sizes must fit in 64 bits: {e}") from None
        outside = (num_bytes <= 0) | (offset < 0) | (offset + num_bytes > segment.size_bytes)
        if outside.any():
            i = int(np.argmax(outside))
            self._outside_segment(segment, i, remote[i], size[i])
        starts, ends = self._starts, self._ends
        slot = np.searchsorted(starts, addr, side="right") - 1
        inside = (slot >= 0) & (addr + num_bytes <= (ends[np.maximum(slot, 0)] if len(ends) else -1))
        if not inside.all():
            i = int(np.argmin(inside))
            self._not_registered(i, local[i], size[i])

    @staticmethod
    def _outside_segment(segment: SegmentInfo, i: int, offset: int, num_bytes: int) -> None:
        raise UsageError(
            f"region {i} (offset {offset}, {num_bytes} bytes) is outside segment "
            f"{segment.segment_id} of {segment.size_bytes} bytes"
        )

    @staticmethod
    def _not_registered(i: int, addr: int, num_bytes: int) -> None:
        raise UsageError(
            f"local region {i} ({addr:#x}+{num_bytes}) is not inside memory registered with DataPlane.register()"
        )
