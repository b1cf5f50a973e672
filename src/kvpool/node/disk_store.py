"""A node's disk tier on a local file system: one file per object, O_DIRECT, checksummed.

Rules:
- One file per object, named by a hash of (tenant, key), in 256 subdirectories. Layout: a 4 KiB
  header block (magic, version, sizes, the object's xxh3_64 checksum, tenant, key, parent, and the
  header's own xxh3_64 in its last 8 bytes), then the payload padded to 4 KiB, so every read and
  write is one large aligned O_DIRECT transfer through a page-aligned bounce buffer (an anonymous
  mmap). Rejected: a log-structured file (needs compaction, which is most of its code, for a
  workload of objects of >= 1 MiB where a file per object costs one open and one rename each).
- Commit: written under a temporary name, renamed into place when complete. A file is served only
  when its header checksum, its length and (on every read) its payload checksum agree, so a file
  cut short or corrupted (a crash between the rename and the data reaching the disk, a bad sector,
  a truncation) is detected, deleted and reported lost; it is never copied into DRAM as good. No
  fsync per object: after a power loss the newest objects may be lost, never served wrong.
- Capacity: `capacity_bytes` bounds the files' total size (header + padded payload). A write that
  would pass it, or that the file system refuses (ENOSPC), raises DiskFull and leaves nothing
  behind; other OS errors raise DiskError. Both say what to change.
- O_DIRECT where the file system takes it (ext4, xfs; tmpfs since Linux 6.6); otherwise buffered
  I/O, said once in the log (`direct` tells which).
- Last use is the file's mtime (set when written or read), the new master's LRU order after a
  restart.
- Thread-safety: one caller at a time (the node's tier worker thread).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import xxhash

log = logging.getLogger(__name__)

BLOCK = 4096
MAGIC = b"KVPD"
VERSION = 1
_HEADER = struct.Struct("<4sHHQQHHH")  # magic, version, flags, size, checksum, len(tenant), len(key), len(parent)+1 (0: none)
_CHUNK = 64 << 20  # one read/write call at most (Linux moves < 2 GiB per call)


class DiskError(OSError):
    """The disk tier could not do an I/O (the object stays uncached on disk)."""


class DiskFull(DiskError):
    """No room left within --disk-size or on the file system."""


@dataclass(frozen=True)
class StoredObject:
    tenant: str
    key: str
    size: int
    checksum: int
    parent: str | None
    file_bytes: int
    path: Path
    last_use_s: float  # wall clock (mtime)


def checksum_of(view: memoryview) -> int:
    """xxh3_64, 0 mapped to 1 (kvpool.client.checksum's rule: 0 means "none")."""
    return xxhash.xxh3_64_intdigest(view) or 1


def file_bytes_for(size: int) -> int:
    return BLOCK + (size + BLOCK - 1) // BLOCK * BLOCK


class DiskStore:
    def __init__(self, root: Path, capacity_bytes: int, direct: bool = True) -> None:
        if capacity_bytes < 2 * BLOCK:
            raise ValueError(f"disk capacity must be at least {2 * BLOCK} bytes, got {capacity_bytes}")
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self.objects: dict[tuple[str, str], StoredObject] = {}
        self.used_bytes = 0
        self.direct = direct and hasattr(os, "O_DIRECT")
        self._buffer: mmap.mmap | None = None
        self._buffer_addr = 0

    # ---- opening -------------------------------------------------------------------------------

    def open(self) -> list[StoredObject]:
        """Create the directory, or scan it: unfinished temporary files and files whose header or
        length is wrong are deleted. Returns the objects found (oldest use first)."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / ".probe"
            if self.direct:
                try:
                    fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644)
                    os.close(fd)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    self.direct = False
                    log.warning("%s does not take O_DIRECT: the disk tier uses buffered I/O", self.root)
                finally:
                    probe.unlink(missing_ok=True)
        except OSError as e:
            raise DiskError(e.errno, f"cannot use {self.root} as the disk tier: {e.strerror}") from None
        found: list[StoredObject] = []
        dropped = 0
        for sub in sorted(self.root.iterdir()):
            if not sub.is_dir():
                continue
            for path in sub.iterdir():
                if path.suffix != ".kv":
                    path.unlink(missing_ok=True)  # an unfinished write
                    continue
                obj = self._read_header(path)
                if obj is None:
                    path.unlink(missing_ok=True)
                    dropped += 1
                    continue
                found.append(obj)
        found.sort(key=lambda o: o.last_use_s)
        for obj in found:
            old = self.objects.get((obj.tenant, obj.key))
            if old is not None:  # two files for one key cannot both be named by its hash; kept for safety
                continue
            self.objects[(obj.tenant, obj.key)] = obj
            self.used_bytes += obj.file_bytes
        if dropped:
            log.warning("disk tier %s: %d files with a bad header or length deleted", self.root, dropped)
        return list(self.objects.values())

    def _read_header(self, path: Path) -> StoredObject | None:
        try:
            st = path.stat()
            with open(path, "rb") as f:
                block = f.read(BLOCK)
        except OSError:
            return None
        if len(block) < BLOCK or xxhash.xxh3_64_intdigest(block[: BLOCK - 8]) != int.from_bytes(block[-8:], "little"):
            return None
        magic, version, _flags, size, checksum, lt, lk, lp = _HEADER.unpack_from(block)
        if magic != MAGIC or version != VERSION or size <= 0 or st.st_size != file_bytes_for(size):
            return None
        pos = _HEADER.size
        try:
            tenant = block[pos : pos + lt].decode()
            key = block[pos + lt : pos + lt + lk].decode()
            parent = block[pos + lt + lk : pos + lt + lk + lp - 1].decode() if lp else None
        except UnicodeDecodeError:
            return None
        if path != self.path_of(tenant, key):
            return None
        return StoredObject(tenant, key, size, checksum, parent, st.st_size, path, st.st_mtime)

    # ---- naming and buffers --------------------------------------------------------------------

    def path_of(self, tenant: str, key: str) -> Path:
        name = xxhash.xxh3_128_hexdigest(f"{tenant}\0{key}".encode())
        return self.root / name[:2] / f"{name}.kv"

    def _bounce(self, nbytes: int) -> memoryview:
        if self._buffer is None or len(self._buffer) < nbytes:
            if self._buffer is not None:
                self._buffer.close()
            self._buffer = mmap.mmap(-1, max(nbytes, 8 << 20))
            self._buffer_addr = ctypes.addressof(ctypes.c_char.from_buffer(self._buffer))
        return memoryview(self._buffer)[:nbytes]

    def close(self) -> None:
        if self._buffer is not None:
            self._buffer_addr = 0
            try:
                self._buffer.close()
            except BufferError:
                pass
            self._buffer = None

    # ---- write and read ------------------------------------------------------------------------

    def write_from(self, tenant: str, key: str, parent: str | None, checksum: int, addr: int, size: int) -> bool:
        """Copy `size` bytes at `addr` (the node's own segment) to disk as (tenant, key). False when
        the copied bytes do not have `checksum` (they were overwritten since: nothing is written).
        Raises DiskFull / DiskError."""
        nbytes = file_bytes_for(size)
        old = self.objects.get((tenant, key))
        if old is not None and old.checksum == checksum:
            return True
        if self.used_bytes + nbytes - (old.file_bytes if old else 0) > self.capacity_bytes:
            raise DiskFull(errno.ENOSPC, f"disk tier {self.root} full ({self.used_bytes} of {self.capacity_bytes} "
                           "bytes used): give it a larger --disk-size or more room")
        buf = self._bounce(nbytes)
        ctypes.memmove(self._buffer_addr + BLOCK, addr, size)
        if checksum_of(buf[BLOCK : BLOCK + size]) != checksum:
            return False
        buf[BLOCK + size : nbytes] = bytes(nbytes - BLOCK - size)
        t, k, p = tenant.encode(), key.encode(), parent.encode() if parent is not None else None
        header = _HEADER.pack(MAGIC, VERSION, 0, size, checksum, len(t), len(k), len(p) + 1 if p is not None else 0)
        header += t + k + (p or b"")
        if len(header) > BLOCK - 8:
            raise DiskError(errno.ENAMETOOLONG, f"tenant, key and parent of {key!r} do not fit a disk header")
        block = header + bytes(BLOCK - 8 - len(header))
        buf[: BLOCK - 8] = block
        buf[BLOCK - 8 : BLOCK] = xxhash.xxh3_64_intdigest(block).to_bytes(8, "little")
        path = self.path_of(tenant, key)
        tmp = path.with_suffix(".tmp")
        try:
            path.parent.mkdir(exist_ok=True)
            self._write_file(tmp, buf)
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFull(e.errno, f"file system under {self.root} is full: {e.strerror}") from None
            raise DiskError(e.errno, f"writing {path}: {e.strerror}") from None
        if old is not None:
            self.used_bytes -= old.file_bytes
        self.objects[(tenant, key)] = StoredObject(tenant, key, size, checksum, parent, nbytes, path, time.time())
        self.used_bytes += nbytes
        return True

    def _write_file(self, path: Path, buf: memoryview) -> None:
        flags = os.O_CREAT | os.O_WRONLY | os.O_TRUNC | (os.O_DIRECT if self.direct else 0)
        fd = os.open(path, flags, 0o644)
        try:
            done = 0
            while done < len(buf):
                done += os.pwrite(fd, buf[done : done + _CHUNK], done)
        finally:
            os.close(fd)

    def read_into(self, tenant: str, key: str, checksum: int, addr: int) -> bool:
        """Copy the object's payload to `addr` once its checksum is verified. False when the store
        does not hold that object (or another version of it). A corrupt or cut file raises
        DiskError and is deleted (forget() done)."""
        obj = self.objects.get((tenant, key))
        if obj is None or obj.checksum != checksum:
            return False
        buf = self._bounce(obj.file_bytes)
        try:
            fd = os.open(obj.path, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
            try:
                done = 0
                while done < obj.file_bytes:
                    n = os.preadv(fd, [buf[done : done + _CHUNK]], done)
                    if n == 0:
                        break
                    done += n
            finally:
                os.close(fd)
        except OSError as e:
            self.forget(tenant, key, delete=True)
            raise DiskError(e.errno, f"reading {obj.path}: {e.strerror}; the file is dropped") from None
        if done != obj.file_bytes or checksum_of(buf[BLOCK : BLOCK + obj.size]) != checksum:
            self.forget(tenant, key, delete=True)
            raise DiskError(errno.EIO, f"{obj.path} is cut short or corrupted (checksum mismatch); the file is dropped")
        ctypes.memmove(addr, self._buffer_addr + BLOCK, obj.size)
        try:
            os.utime(obj.path)
        except OSError:
            pass
        return True

    def forget(self, tenant: str, key: str, checksum: int | None = None, delete: bool = True) -> bool:
        """Drop (tenant, key) (only that version when `checksum` is given); True when it was held."""
        obj = self.objects.get((tenant, key))
        if obj is None or (checksum is not None and obj.checksum != checksum):
            return False
        del self.objects[(tenant, key)]
        self.used_bytes -= obj.file_bytes
        if delete:
            obj.path.unlink(missing_ok=True)
        return True
