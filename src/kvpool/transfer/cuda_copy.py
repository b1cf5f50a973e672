"""Same-host copies between a mapped pool segment and GPU memory, on the GPU's copy engines.

Rules:
- The segment's mapping is page-locked once per route (`cudaHostRegister`, portable), so the DMA
  engines read and write it directly: no bounce buffer, no SMs, no CPU copy.
- One job's regions go to the GPU in ONE call where the runtime has `cudaMemcpyBatchAsync`
  (CUDA >= 12.8; its signature lost `failIdx` in 13.0, both are handled), else one
  `cudaMemcpyAsync` per region. They run on a non-blocking stream of this module's per device,
  never the default stream, and the call returns once that stream has finished them (a stream
  sync, never a device-wide one): the bytes are in place when `copy` returns, like memmove.
- Only this module talks to the CUDA runtime, through ctypes on the libcudart the process already
  loaded (torch's), so nothing is compiled and no CUDA Python package is needed. Without CUDA,
  `available()` is False and any copy is a TransferError that says so.
- The alternatives benchmarks/gpu_check.py measures against this: per-region cudaMemcpyAsync, a
  gather kernel over the mapped host memory, NIXL on the same host (docs/design/data-plane.md).
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading
from collections.abc import Sequence

from kvpool.core.errors import TransferError

_HOST_REGISTER_PORTABLE = 0x01
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the pointers (UVA)
_STREAM_NON_BLOCKING = 0x01
_SRC_ACCESS_ORDER_STREAM = 1


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation), ("dstLocHint", _MemLocation),
                ("flags", ctypes.c_uint)]  # fmt: skip


def _load_cudart():
    if "torch" in sys.modules:  # torch loaded its libcudart: the soname finds that one
        names = ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    else:
        names = ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
    for site in sys.path:
        names += sorted(glob.glob(os.path.join(site, "nvidia", "**", "libcudart.so.*"), recursive=True))
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


class CudaRuntime:
    """The few CUDA runtime calls the copy path needs, each checked."""

    def __init__(self, lib) -> None:
        self._lib = lib
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        version = ctypes.c_int()
        self._check(lib.cudaRuntimeGetVersion(ctypes.byref(version)), "cudaRuntimeGetVersion")
        self.version = version.value  # e.g. 13000
        self._batch = getattr(lib, "cudaMemcpyBatchAsync", None) if self.version >= 12080 else None
        self._streams: dict[int, ctypes.c_void_p] = {}
        self._lock = threading.Lock()

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            raise TransferError(f"CUDA {what} failed: {self._lib.cudaGetErrorString(code).decode()} ({code})")

    @property
    def batched(self) -> bool:
        return self._batch is not None

    def pin(self, addr: int, size_bytes: int) -> None:
        self._check(self._lib.cudaHostRegister(ctypes.c_void_p(addr), ctypes.c_size_t(size_bytes),
                                               ctypes.c_uint(_HOST_REGISTER_PORTABLE)), "cudaHostRegister")  # fmt: skip

    def unpin(self, addr: int) -> None:
        self._check(self._lib.cudaHostUnregister(ctypes.c_void_p(addr)), "cudaHostUnregister")

    def _stream(self, device: int) -> ctypes.c_void_p:
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                self._check(self._lib.cudaSetDevice(device), "cudaSetDevice")
                stream = ctypes.c_void_p()
                self._check(self._lib.cudaStreamCreateWithFlags(ctypes.byref(stream), _STREAM_NON_BLOCKING),
                            "cudaStreamCreateWithFlags")  # fmt: skip
                self._streams[device] = stream
            return stream

    def copy(self, device: int, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int], batched: bool | None = None) -> None:
        """Copy every (dst, src, size) and return when all are done."""
        if not sizes:
            return
        stream = self._stream(device)
        self._check(self._lib.cudaSetDevice(device), "cudaSetDevice")
        if (self.batched if batched is None else batched) and self._batch is not None:
            self._copy_batched(dsts, srcs, sizes, stream)
        else:
            memcpy = self._lib.cudaMemcpyAsync
            for dst, src, size in zip(dsts, srcs, sizes):
                self._check(memcpy(ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(size),
                                   _MEMCPY_DEFAULT, stream), "cudaMemcpyAsync")  # fmt: skip
        self._check(self._lib.cudaStreamSynchronize(stream), "cudaStreamSynchronize")

    def _copy_batched(self, dsts, srcs, sizes, stream) -> None:
        n = len(sizes)
        dst_arr = (ctypes.c_void_p * n)(*dsts)
        src_arr = (ctypes.c_void_p * n)(*srcs)
        size_arr = (ctypes.c_size_t * n)(*sizes)
        attrs = _MemcpyAttributes(_SRC_ACCESS_ORDER_STREAM, _MemLocation(0, 0), _MemLocation(0, 0), 0)
        attr_idx = (ctypes.c_size_t * 1)(0)
        args = [dst_arr, src_arr, size_arr, ctypes.c_size_t(n), ctypes.byref(attrs), attr_idx, ctypes.c_size_t(1)]
        if self.version < 13000:  # 12.8/12.9 report the failing copy's index
            fail = ctypes.c_size_t(0)
            args.append(ctypes.byref(fail))
        self._check(self._batch(*args, stream), "cudaMemcpyBatchAsync")


_RUNTIME: CudaRuntime | None = None
_RUNTIME_LOCK = threading.Lock()


def runtime() -> CudaRuntime:
    """The process's CudaRuntime; TransferError where this machine has no CUDA."""
    global _RUNTIME
    with _RUNTIME_LOCK:
        if _RUNTIME is None:
            lib = _load_cudart()
            if lib is None:
                raise TransferError("GPU memory was registered but no CUDA runtime (libcudart) can be loaded here")
            _RUNTIME = CudaRuntime(lib)
        return _RUNTIME


def available() -> bool:
    try:
        runtime()
        return True
    except TransferError:
        return False


class PinnedMapping:
    """A segment mapping page-locked for the copy engines; `copy` moves one job's regions."""

    def __init__(self, base_addr: int, size_bytes: int) -> None:
        self.base_addr = base_addr
        self._cuda = runtime()
        self._cuda.pin(base_addr, size_bytes)
        self._pinned = True

    def copy(self, op: str, device: int, local_addrs: Sequence[int], remote_offsets: Sequence[int],
             sizes: Sequence[int]) -> None:  # fmt: skip
        remote = [self.base_addr + off for off in remote_offsets]
        if op == "READ":  # segment -> GPU
            self._cuda.copy(device, local_addrs, remote, sizes)
        else:
            self._cuda.copy(device, remote, local_addrs, sizes)

    def close(self) -> None:
        if self._pinned:
            self._pinned = False
            try:
                self._cuda.unpin(self.base_addr)
            except TransferError:
                pass  # the mapping goes next anyway
