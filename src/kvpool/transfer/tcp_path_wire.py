"""The TCP path's wire format and socket loops, shared by its client (tcp_path.py) and server
(tcp_path_server.py). The format itself is described in tcp_path.py's header.

Rules:
- No state: helpers over a socket and the caller's buffers (memoryviews of raw addresses).
- Scatter-gather I/O (sendmsg / recvmsg_into, at most 512 buffers per call): a job's regions go
  out and come in without being joined into one buffer.
- With `timeouts`, a loop ends with TimeoutError at its deadline however the bytes trickle in; a
  spin (non-blocking calls, the CPU yielded between them) lasts until its monotonic `spin_until`.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import time
from collections.abc import Sequence

from kvpool.rpc.timeouts import KernelTimeouts
from kvpool.transfer.tcp_path_tags import TAG, TAG_BYTES

MAGIC = b"KVSL"
READ, WRITE = 1, 2
HEAD = struct.Struct("<4sBI")
REGION = struct.Struct("<QQ")
REPLY = struct.Struct("<BQ")
MAX_REGIONS = 1 << 16
MAX_REQUEST_BYTES = 64 << 20


def view(addr: int, size: int) -> memoryview:
    return memoryview((ctypes.c_char * size).from_address(addr)).cast("B")


def tag_request(tag: bytes, offset: int, size: int) -> bytes:
    """A TAG request (tcp_path_tags.py): `tag` names the `size` bytes at `offset`."""
    if len(tag) != TAG_BYTES:
        raise ValueError(f"a tag is {TAG_BYTES} bytes, not {len(tag)}")
    return HEAD.pack(MAGIC, TAG, 1) + REGION.pack(offset, size) + tag


def requests(local_addrs: Sequence[int], remote_offsets: Sequence[int], sizes: Sequence[int],
              max_bytes: int | None = None, max_regions: int | None = None):
    """The job cut into requests within the server's limits (a region larger than one request is
    cut into parts): yields (local addrs, remote offsets, sizes) per request."""
    max_bytes = MAX_REQUEST_BYTES if max_bytes is None else max_bytes
    max_regions = MAX_REGIONS if max_regions is None else max_regions
    if len(sizes) <= max_regions and sum(sizes) <= max_bytes:
        yield local_addrs, remote_offsets, sizes  # the usual case: one request
        return
    addrs: list[int] = []
    offsets: list[int] = []
    lengths: list[int] = []
    total = 0
    for addr, offset, size in zip(local_addrs, remote_offsets, sizes):
        done = 0
        while done < size:
            part = min(size - done, max_bytes - total)
            addrs.append(addr + done)
            offsets.append(offset + done)
            lengths.append(part)
            total += part
            done += part
            if total == max_bytes or len(lengths) == max_regions:
                yield addrs, offsets, lengths
                addrs, offsets, lengths, total = [], [], [], 0
    if lengths:
        yield addrs, offsets, lengths


def recv_all(sock: socket.socket, buffers: list[memoryview], at_least: int, total: int | None = None,
              timeouts: KernelTimeouts | None = None, deadline_s: float = 0.0, spin_until: float = 0.0) -> int:
    """Scatter received bytes over `buffers` (recvmsg_into, at most 512 at a time) until `total`
    bytes (default: all the buffers hold) or, once the first `at_least` bytes are in and their first
    byte is not 0 (a refusal: only its reason follows), at once. Returns the bytes received.
    With `timeouts`: TimeoutError at `deadline_s`, however the bytes trickle in. Non-blocking
    receives (the CPU yielded between them) until the monotonic `spin_until`, if given."""
    total = sum(len(b) for b in buffers) if total is None else total
    got, i, offset = 0, 0, 0  # bytes so far; the buffer being filled and how far
    while got < total:
        flags, spin_until = spin_flags(spin_until, timeouts, deadline_s)
        try:
            n = sock.recvmsg_into([buffers[i][offset:], *buffers[i + 1 : i + 512]], 0, flags)[0]
        except (BlockingIOError, InterruptedError):
            if not flags:
                raise  # a blocking receive past its kernel timeout
            os.sched_yield()
            continue
        if n == 0:
            raise ConnectionError("connection closed mid-message")
        if at_least and got < at_least <= got + n and buffers[0][0] != 0:
            return got + n
        got += n
        while n:
            left = len(buffers[i]) - offset
            if n < left:
                offset += n
                break
            n -= left
            i, offset = i + 1, 0
    return got


def send_all(sock: socket.socket, buffers: list[memoryview], timeouts: KernelTimeouts | None = None,
              deadline_s: float = 0.0, spin_until: float = 0.0) -> None:
    """sendmsg until every buffer is sent (the kernel may take part of them per call, and at most
    IOV_MAX = 1024 buffers per call). With `timeouts`: TimeoutError at `deadline_s`. Non-blocking
    sends (the CPU yielded between them) until the monotonic `spin_until`, if given."""
    i = 0
    while i < len(buffers):
        flags, spin_until = spin_flags(spin_until, timeouts, deadline_s)
        try:
            sent = sock.sendmsg(buffers[i : i + 512], (), flags)
        except (BlockingIOError, InterruptedError):
            if not flags:
                raise  # a blocking send past its kernel timeout
            os.sched_yield()
            continue
        while i < len(buffers) and sent >= len(buffers[i]):
            sent -= len(buffers[i])
            i += 1
        if sent:
            buffers[i] = buffers[i][sent:]


def spin_flags(spin_until: float, timeouts: KernelTimeouts | None, deadline_s: float) -> tuple[int, float]:
    """The next send's or receive's flags and what is left of the spin: (MSG_DONTWAIT, spin_until)
    while the spin lasts, then (0, 0.0), a blocking call whose kernel timeout ends at `deadline_s`."""
    if spin_until and time.monotonic() < spin_until:
        return socket.MSG_DONTWAIT, spin_until
    if timeouts is not None:
        timeouts.before(deadline_s)
    return 0, 0.0
