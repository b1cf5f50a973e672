"""Same-host shared memory: a node's segment is a memfd that clients on the host map directly.

Rules:
- A segment is an anonymous memfd, never a named /dev/shm file: the kernel frees it once the node
  and every client that mapped it let go, even after SIGKILL, so nothing leaks and no restart has
  to clean up. Clients open it as /proc/<node pid>/fd/<fd> (same user, same PID namespace).
  Rejected: /dev/shm files (leak after SIGKILL), SCM_RIGHTS fd passing (needs a socket per node).
- The node asks for transparent huge pages (MADV_HUGEPAGE: used where the kernel allows them for
  shmem, /sys/kernel/mm/transparent_hugepage/shmem_enabled) and populates the whole segment from
  a background thread, 64 MiB per call (MADV_POPULATE_WRITE through ctypes, which releases the
  GIL): its RAM is taken seconds after start, not on the first put, yet the node mounts at once.
  A write that reaches a page before the thread does just faults it in. close() stops the thread
  first.
- A client maps once and keeps the mapping, but populates its page tables per 2 MiB chunk on the
  first copy that touches the chunk (MADV_POPULATE_READ: one call instead of a fault per 4 KiB
  page; read-populated shared pages are mapped writable, so writes do not fault again). Mapping a
  large segment whole (MAP_POPULATE) costs every client seconds and page tables before its first
  byte (docs/design/data-plane.md).
- A client's mapping outlives a killed node, but the master will drop that node's objects, so a
  mapping watches its node through a pidfd and a copy that ends after the node died is reported
  failed. The memfd name carries the segment's token (its NIXL agent name), checked on open, so a
  recycled pid or fd number can never map somebody else's memory.
- Only raw addresses cross this module (ctypes.memmove releases the GIL); no Python bytes. Large
  copies are split across helper threads where the process may use several CPUs (memcopy.py).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import select
import threading

import numpy as np

from kvpool.core.errors import TransferError
from kvpool.transfer.memcopy import copy_objects, copy_regions

_PROC_FD_PATH = re.compile(r"^/proc/(\d+)/fd/(\d+)$")
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)
_CHUNK = 2 << 20  # a client populates its mapping this much at a time
_NODE_CHUNK = 64 << 20  # the node's background thread, per call
_CHUNKS_VECTORIZED_FROM = 64  # ranges per copy from which the chunks they touch are found with numpy
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def _ask_huge_pages(mm: mmap.mmap) -> None:
    if _MADV_HUGEPAGE is not None:
        try:
            mm.madvise(_MADV_HUGEPAGE)
        except OSError:
            pass  # not offered for shmem here: 4 KiB pages


def _chunks_touched(offsets: list[int], sizes: list[int]):
    """The _CHUNK indices the ranges touch, each once where there are many ranges (a scatter-
    gather job's 1,024 regions: one numpy pass instead of a Python loop per region), else in order."""
    if len(offsets) < _CHUNKS_VECTORIZED_FROM:
        return [chunk for offset, size in zip(offsets, sizes)
                for chunk in range(offset // _CHUNK, (offset + max(size, 1) - 1) // _CHUNK + 1)]
    starts = np.asarray(offsets, dtype=np.int64)
    first = starts // _CHUNK
    spans = (starts + np.maximum(np.asarray(sizes, dtype=np.int64), 1) - 1) // _CHUNK - first + 1
    # range i's chunks first[i] .. first[i] + spans[i] - 1, all ranges' in one array
    return np.unique(np.repeat(first - np.cumsum(spans) + spans, spans) + np.arange(int(spans.sum()))).tolist()


def _memfd_name(token: str) -> str:
    return f"kvpool-{token}"


def _address_of(mm: mmap.mmap) -> int:
    view = np.frombuffer(mm, dtype=np.uint8, count=1)  # ctypes' from_buffer needs a writable mapping
    try:
        return view.ctypes.data
    finally:
        del view  # release the buffer export so the mapping can be closed later


class SharedSegmentFile:
    """Node side: `size_bytes` of shared memory at `base_addr`, reachable as `path`, populated by a
    background thread (`wait_populated`)."""

    def __init__(self, size_bytes: int, token: str) -> None:
        if size_bytes <= 0:
            raise ValueError(f"size_bytes must be > 0, got {size_bytes}")
        self.size_bytes = size_bytes
        self._fd = os.memfd_create(_memfd_name(token), os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, size_bytes)
            self._mmap = mmap.mmap(self._fd, size_bytes, flags=mmap.MAP_SHARED)
            _ask_huge_pages(self._mmap)  # before populating, so that huge pages (where allowed) back it
        except OSError:
            os.close(self._fd)
            raise
        self.base_addr = _address_of(self._mmap)
        self.path = f"/proc/{os.getpid()}/fd/{self._fd}"
        self._stop_populating = threading.Event()
        self._populator = threading.Thread(target=self._populate_all, name="kvpool-segment-populate", daemon=True)
        self._populator.start()

    def _populate_all(self) -> None:
        for start in range(0, self.size_bytes, _NODE_CHUNK):
            if self._stop_populating.is_set():
                return
            length = min(_NODE_CHUNK, self.size_bytes - start)
            if _libc.madvise(self.base_addr + start, length, _MADV_POPULATE_WRITE) != 0:
                return  # a kernel before 5.14 (EINVAL): writes fault the pages in instead

    def wait_populated(self, timeout_s: float | None = None) -> bool:
        """True once the background thread has populated the whole segment (or given up)."""
        self._populator.join(timeout_s)
        return not self._populator.is_alive()

    def close(self) -> None:
        if self._fd < 0:
            return
        self._stop_populating.set()
        self._populator.join()  # never madvise a range that munmap gave back (it could be reused)
        self._mmap.close()
        os.close(self._fd)
        self._fd = -1


class PeerMapping:
    """Client side: a node's segment mapped into this process. Raises OSError/ValueError when the
    path cannot be mapped (another host, another user, a dead node): the caller falls back to NIXL.

    Safe against a concurrent `close()`: copies hold the mapping; the unmap waits for the last one.
    """

    def __init__(self, path: str, size_bytes: int, token: str, writable: bool = True) -> None:
        """`writable=False`: opened O_RDONLY and mapped PROT_READ, so this process cannot write the
        node's memory through the mapping, whatever it does (a reader-only client)."""
        match = _PROC_FD_PATH.match(path)
        if match is None:
            raise ValueError(f"not a /proc/<pid>/fd/<fd> path: {path!r}")
        self.pid = int(match.group(1))
        self.size_bytes = size_bytes
        # pidfd first: if the pid was recycled after this, the name check below fails
        self._pidfd = os.pidfd_open(self.pid)
        try:
            fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
                if not target.startswith(f"/memfd:{_memfd_name(token)}"):
                    raise ValueError(f"{path} is {target!r}, not the segment of agent {token!r}")
                if os.fstat(fd).st_size < size_bytes:
                    raise ValueError(f"{path} is smaller than the segment's {size_bytes} bytes")
                self._mmap = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED,
                                       prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
            finally:
                os.close(fd)
        except BaseException:
            os.close(self._pidfd)
            raise
        _ask_huge_pages(self._mmap)
        self.base_addr = _address_of(self._mmap)
        self._unpopulated = bytearray(b"\x01") * ((size_bytes + _CHUNK - 1) // _CHUNK)  # 1: not mapped yet
        self._left = len(self._unpopulated)
        self._populate_lock = threading.Lock()
        self._exit_watch = select.poll()  # the pidfd turns readable when the node exits
        self._exit_watch.register(self._pidfd, select.POLLIN)
        self._watch_lock = threading.Lock()  # a poll object refuses two threads at once (RuntimeError)
        self._lock = threading.Lock()
        self._users = 0
        self._closing = False
        self._pinned_mapping = None  # cuda_copy.PinnedMapping, on the first GPU copy

    def node_alive(self) -> bool:
        with self._watch_lock:
            return not self._exit_watch.poll(0)

    def copy(self, op: str, local_addrs: list[int], remote_offsets: list[int], sizes: list[int],
             device: int | None = None, after_objects=None) -> None:  # fmt: skip
        """READ: segment -> local; WRITE: local -> segment. Bounds were checked by the caller.
        `device` N: the local regions are CUDA device N's memory, moved by its copy engines (the
        mapping is page-locked on first use and unlocked before it is unmapped). `after_objects`
        (counts, after): a host READ or WRITE calls after(n) once object n (the next counts[n]
        regions) is in place (memcopy.copy_objects); a copy that then turns out to have raced the node's exit
        still raises, so what `after` saw is discarded with the rest."""
        with self._lock:
            if self._closing:
                raise TransferError("segment mapping was dropped (forget_segment) during the transfer")
            self._users += 1
        try:
            if self._unpopulated is not None:
                self._populate(remote_offsets, sizes)
            if device is not None:
                self._pinned().copy(op, device, local_addrs, remote_offsets, sizes)
            elif op == "READ" and after_objects is not None:
                copy_objects(local_addrs, remote_offsets, sizes, *after_objects, src_base=self.base_addr)
            elif op == "READ":
                copy_regions(local_addrs, remote_offsets, sizes, src_base=self.base_addr)
            elif after_objects is not None:
                copy_objects(remote_offsets, local_addrs, sizes, *after_objects, dst_base=self.base_addr)
            else:
                copy_regions(remote_offsets, local_addrs, sizes, dst_base=self.base_addr)
        finally:
            with self._lock:
                self._users -= 1
                release = self._closing and self._users == 0
            if release:
                self._release()
        if not self.node_alive():
            raise TransferError(f"node process {self.pid} holding the segment has exited")

    def _populate(self, offsets: list[int], sizes: list[int]) -> None:
        """Map the chunks these ranges touch that no earlier copy touched (see the module rules)."""
        with self._populate_lock:
            todo = self._unpopulated
            if todo is None:
                return
            for chunk in _chunks_touched(offsets, sizes):
                if todo[chunk]:
                    start = chunk * _CHUNK
                    # an error (a kernel before 5.14) is no harm: page faults map the chunk instead
                    _libc.madvise(self.base_addr + start, min(_CHUNK, self.size_bytes - start), _MADV_POPULATE_READ)
                    todo[chunk] = 0
                    self._left -= 1
            if not self._left:
                self._unpopulated = None  # all mapped: copies skip this from now on

    def _pinned(self):
        with self._lock:
            if self._pinned_mapping is None:
                from kvpool.transfer.cuda_copy import PinnedMapping  # CUDA only where GPU memory moves

                self._pinned_mapping = PinnedMapping(self.base_addr, self.size_bytes)
            return self._pinned_mapping

    def close(self) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
            release = self._users == 0
        if release:
            self._release()

    def _release(self) -> None:
        if self._pinned_mapping is not None:
            self._pinned_mapping.close()
        self._mmap.close()
        os.close(self._pidfd)
