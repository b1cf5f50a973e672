"""The TCP path: transfers to a node's segment over one plain TCP round trip per request.

Why: across hosts without RDMA, NIXL runs on UCX's TCP transport, which emulates a one-sided read
with active messages in several round trips; this path is one request and one reply, the caller's
own thread doing the I/O, bytes received straight into the caller's memory and sent straight from
the segment (no staging copy). Which jobs take it, and the measurements: docs/design/data-plane.md.

Wire format (little endian), one request and one reply at a time per connection:
    request: b"KVSL" | u8 op (1 READ, 2 WRITE) | u32 regions | regions x (u64 offset, u64 size)
             | WRITE only: the regions' bytes, in order
    reply:   u8 status (0 ok, 1 refused) | u64 length | READ ok: the bytes | refused: a UTF-8 reason
    ops 3 TAG and 4 READ_TAG: where values were last written, by a digest of their name (tcp_path_tags.py)
Rules:
- Served by the segment's owner (SegmentMemory with `lane_host`, tcp_path_server.py) only where
  nothing is authenticated: it has no encryption or keys, like the master's TCP channel
  (rpc/tcp_channel.py). It exposes what NIXL's UCX listener exposes (any byte of the segment to
  whoever reaches the port), no more.
- Every region is checked against the segment before a byte moves; a request over the limits (or
  malformed) is refused with its reason and the connection closed (a WRITE's bytes are then never
  read). One thread per connection, at most 256 connections (more are closed on accept: a client
  that opens many cannot exhaust the node's threads); close() shuts every connection and joins its
  thread before the memory goes away, so no thread touches an unmapped segment.
- Client side (`TcpPath`): up to 4 connections per segment route, each used by one thread at a
  time (`try_acquire`: with all in use the job goes to NIXL instead of queueing; a job from
  unregistered memory waits for one instead). A large job runs as two halves on two connections
  at once when a second is free (tcp_path_halves.py). A failure closes that connection (the next
  job reconnects) and is a TransferError for that job, never a hang.
- A WRITE that failed midway carries `in_flight` (fence.py): bytes already in the node's socket
  still land when its thread reads them (a stopped node: when it resumes), so the handle is done
  only once the node has closed its end of that connection; until then the range is quarantined.
- A job run whole on the caller's thread (not in halves) spins: its sends and receives are
  non-blocking (the CPU yielded between tries) until 1 ns per byte plus `spin_s` have passed since
  it began, not counting its connect and callbacks (a read's page faulting, a write's hash), then
  block: a blocked call pays a vCPU's wake-up, several per MiB. As on the master's TCP channel
  (rpc/spin.py), it spins only while most recent jobs ended within their spin: where they do not
  (more runnable processes than CPUs) every spin would be lost CPU. Halves never spin: two threads
  spinning for one GIL.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence

from kvpool.core.errors import TransferError
from kvpool.rpc.spin import SpinPolicy
from kvpool.rpc.timeouts import KernelTimeouts
from kvpool.transfer import tcp_path_tags
from kvpool.transfer.config import DEFAULT_TCP_SPIN_US
from kvpool.transfer.fence import StuckTransfer
from kvpool.transfer.tcp_path_tags import READ_TAG
from kvpool.transfer.tcp_path_wire import (
    HEAD, MAGIC, MAX_REQUEST_BYTES, READ, REGION, REPLY, WRITE, recv_all, requests, send_all, tag_request, view,
)


_SPIN_S_PER_BYTE = 1e-9  # a job's spin also covers its bytes at 1 GB/s
_OPS = {"READ": READ, "WRITE": WRITE}


def reachable_address(peer_host: str) -> str:
    """The local IP address that packets to `peer_host` leave from (what a peer there can reach)."""
    family = socket.AF_INET6 if ":" in peer_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((peer_host, 9))  # UDP: no packet is sent
        return probe.getsockname()[0]


# ---- the client's side ----------------------------------------------------------------------------


class TcpPath:
    """A client's connections to one segment's TCP path: up to `max_connections`, each used by one
    thread at a time and connected on first use."""

    def __init__(self, address: str, max_connections: int = 4, spin_s: float = DEFAULT_TCP_SPIN_US * 1e-6) -> None:
        """`spin_s`: how long beyond 1 ns per byte a whole job spins (0: never; DataPlane passes
        its config's tcp_spin_s). The policy is shared by the route's connections:
        two threads recording at once may lose a sample, which only delays its verdict."""
        self.address = address
        self.spin = SpinPolicy(spin_s)
        self._max = max_connections
        self._open = 0  # connections made and not closed, idle or in use
        self._idle: list[TcpPathConnection] = []
        self._freed = threading.Condition()
        self._closed = False

    def try_acquire(self) -> TcpPathConnection | None:
        """An idle connection, or a new one while fewer than the maximum are open; else None."""
        with self._freed:
            return self._take()

    def acquire(self) -> TcpPathConnection:
        """A connection, waiting for one to be released if all are in use."""
        with self._freed:
            while (conn := self._take()) is None:
                self._freed.wait()
            return conn

    def _take(self) -> TcpPathConnection | None:
        if self._idle:
            return self._idle.pop()
        if self._open < self._max:
            self._open += 1
            return TcpPathConnection(self.address)
        return None

    def release(self, conn: TcpPathConnection) -> None:
        with self._freed:
            if self._closed:
                conn.close()
                self._open -= 1
            else:
                self._idle.append(conn)
            self._freed.notify()

    def close(self) -> None:
        """Closes the idle connections now and those in use when they are released."""
        with self._freed:
            self._closed = True
            for conn in self._idle:
                conn.close()
            self._open -= len(self._idle)
            self._idle.clear()


class TcpPathConnection:
    """One connection to a segment's TCP path (connected on first use, again after a failure)."""

    def __init__(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        self.host = host[1:-1] if host.startswith("[") else host
        self.port = int(port)
        self.address = address
        self._sock: socket.socket | None = None
        self._timeouts: KernelTimeouts | None = None  # the socket's (rpc/timeouts.py: no poll() per receive)

    def transfer(self, op: str, local_addrs: Sequence[int], remote_offsets: Sequence[int], sizes: Sequence[int],
                 deadline_s: float, before_landing=None, sent=None, spin: SpinPolicy | None = None,
                 tag: tuple[bytes, int, int] | None = None) -> None:
        """One job, in as many requests as the limits need; TransferError if it did not complete
        (the connection is then closed, and made again by the next job). `before_landing(addr,
        size)`: called for each local region of a READ request once it is sent (plane.py).
        `sent()`: called once a WRITE request's bytes are all handed to the kernel, before its
        reply is awaited (it must not raise: the request is then still unanswered). `spin`: the
        route's policy, for a job that may spin (see the module rules). `tag` (tag, offset, size):
        a TAG request recording it goes just before the WRITE's first request (tcp_path_tags.py)."""
        began = time.monotonic()
        spin_s = spin.spin_s if spin is not None and spin.spins else None
        aside = 0.0  # seconds of the job spent connecting and in the callbacks, not moving bytes
        tag_frame = tag_request(*tag) if tag is not None and op == "WRITE" else None
        try:
            for n, (addrs, offsets, lengths) in enumerate(requests(local_addrs, remote_offsets, sizes)):
                aside += self._transfer(_OPS[op], addrs, offsets, lengths, deadline_s, before_landing, sent, spin_s,
                                        tag_frame if n == 0 else None)
        except TransferError:  # refused, or a wrong answer: the node has stopped reading this request
            self._close()
            raise
        except (TimeoutError, BlockingIOError):  # BlockingIOError: a send or receive waited past its timeout
            raise TransferError(f"TCP path {self.address}: {op} timed out",
                                in_flight=self._give_up(op)) from None
        except OSError as e:
            raise TransferError(f"TCP path {self.address}: {op} failed: {e}", in_flight=self._give_up(op)) from None
        if spin is not None:  # how long beyond its bytes' share the job's I/O took, spinning or blocked
            spin.record(time.monotonic() - began - aside - sum(sizes) * _SPIN_S_PER_BYTE)

    def _give_up(self, op: str) -> StuckTransfer | None:
        """Drop the connection after a failed job. A READ lands only through our own receives, so
        nothing more can arrive once we stop; but bytes of a WRITE that reached the node's socket
        are still copied into the segment when its thread reads them (a stopped node: when it
        resumes). So a WRITE's socket is shut for sending and handed to a thread that waits for
        the node to close its end (it does at the end of a cut request, or by dying): the returned
        handle is done then, and the written range must not be reused before (fence.py)."""
        sock, self._sock = self._sock, None
        if sock is None:
            return None
        if op != "WRITE":
            sock.close()
            return None
        stuck = StuckTransfer(f"TCP path WRITE to {self.address}")
        threading.Thread(target=_wait_for_close, args=(sock, self._timeouts, stuck), name="kvpool-lane-fence",
                         daemon=True).start()
        return stuck

    def _connected(self, deadline_s: float) -> tuple[socket.socket, KernelTimeouts]:
        """The connection (made now if there is none) and its timeouts; TimeoutError past `deadline_s`."""
        remaining = deadline_s - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        if self._sock is None:
            sock = socket.create_connection((self.host, self.port), timeout=min(remaining, 2.0))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._timeouts = KernelTimeouts(sock)
            self._sock = sock
        return self._sock, self._timeouts

    def _transfer(self, op: int, local_addrs, remote_offsets, sizes, deadline_s: float, before_landing=None,
                  sent=None, spin_s: float | None = None, tag_frame: bytes | None = None) -> float:
        """One request; returns the seconds it spent connecting and in `sent` / `before_landing`.
        `spin_s`: its sends and receives spin for that plus 1 ns per byte, not counting those.
        `tag_frame`: a WRITE's TAG, sent in the same send just before it (no reply)."""
        started = time.monotonic()
        sock, timeouts = self._connected(deadline_s)
        now = time.monotonic()
        aside = now - started
        timeouts.arm(deadline_s - now)
        spin_until = min(deadline_s, now + spin_s + sum(sizes) * _SPIN_S_PER_BYTE) if spin_s is not None else 0.0
        count = len(sizes)
        request = bytearray(HEAD.size + count * REGION.size)
        HEAD.pack_into(request, 0, MAGIC, op, count)
        for i, (offset, size) in enumerate(zip(remote_offsets, sizes)):
            REGION.pack_into(request, HEAD.size + i * REGION.size, offset, size)
        views = [view(a, s) for a, s in zip(local_addrs, sizes)]
        reply = bytearray(REPLY.size)
        if op == WRITE:
            head = [memoryview(tag_frame)] if tag_frame is not None else []
            send_all(sock, head + [memoryview(request)] + views, timeouts, deadline_s, spin_until)
            if sent is not None:  # while the node receives
                took, spin_until = _aside(spin_until, deadline_s, sent)
                aside += took
            recv_all(sock, [memoryview(reply)], 0, timeouts=timeouts, deadline_s=deadline_s, spin_until=spin_until)
        else:
            send_all(sock, [memoryview(request)], timeouts, deadline_s, spin_until)
            if before_landing is not None:  # while the node sends
                took, spin_until = _aside(spin_until, deadline_s, _prepare, before_landing, local_addrs, sizes)
                aside += took
            # the reply's head and bytes in as few receives as the kernel allows (one, when small); on
            # a refusal the reason lands in the caller's memory, which a failed read leaves undefined
            received = recv_all(sock, [memoryview(reply), *views], REPLY.size, timeouts=timeouts,
                                 deadline_s=deadline_s, spin_until=spin_until)
        status, length = REPLY.unpack(reply)
        if status != 0:
            if op == WRITE:
                reason = bytearray(min(length, 4096))
                recv_all(sock, [memoryview(reason)], 0, timeouts=timeouts, deadline_s=deadline_s)
            else:
                reason = views[0][: max(0, min(length, received - REPLY.size))].tobytes()
            raise TransferError(f"TCP path {self.address} refused the {('', 'READ', 'WRITE')[op]}: "
                                f"{reason.decode(errors='replace')}")
        expected = sum(sizes) if op == READ else 0
        if length != expected:
            raise TransferError(f"TCP path {self.address} answered {length} bytes, expected {expected}")
        return aside

    def ask_tag(self, tag: bytes, deadline_s: float) -> None:
        """Send a READ_TAG for `tag`; take_tagged receives its answer. TransferError (the
        connection closed) if it could not be sent."""
        self._guarded("READ_TAG", self._ask_tag, tag, deadline_s)

    def take_tagged(self, make, deadline_s: float, before_landing=None,
                    spin: SpinPolicy | None = None) -> tuple[int, int, object, int] | None:
        """The answer to ask_tag: (offset, size, output, its address) with the bytes the node
        holds where the tag was last written, read into `make(size)`'s (output, address); None
        if the node knows no such tag. `before_landing(addr, size)`: called once the size is
        known, while the node sends. TransferError (the connection closed) if it failed."""
        return self._guarded("READ_TAG", self._take_tagged, make, deadline_s, before_landing, spin)

    def _guarded(self, op: str, fn, *args):
        """fn(*args); any failure closes the connection (an answer may still be on its way) and
        is a TransferError, but for errors not of I/O (e.g. `make`'s), raised as they are."""
        try:
            return fn(*args)
        except TransferError:
            self._close()
            raise
        except (TimeoutError, BlockingIOError):
            self._close()
            raise TransferError(f"TCP path {self.address}: {op} timed out") from None
        except OSError as e:
            self._close()
            raise TransferError(f"TCP path {self.address}: {op} failed: {e}") from None
        except BaseException:
            self._close()
            raise

    def _ask_tag(self, tag: bytes, deadline_s: float) -> None:
        sock, timeouts = self._connected(deadline_s)
        timeouts.arm(deadline_s - time.monotonic())
        send_all(sock, [memoryview(HEAD.pack(MAGIC, READ_TAG, 1) + tag)], timeouts, deadline_s)

    def _take_tagged(self, make, deadline_s: float, before_landing, spin: SpinPolicy | None):
        began = time.monotonic()
        sock, timeouts = self._sock, self._timeouts
        if sock is None:
            raise TransferError(f"TCP path {self.address}: no READ_TAG was asked on this connection")
        timeouts.arm(deadline_s - began)
        spin_s = spin.spin_s if spin is not None and spin.spins else None
        spin_until = min(deadline_s, began + spin_s) if spin_s is not None else 0.0
        head = bytearray(REPLY.size + tcp_path_tags.OFFSET.size)
        got = recv_all(sock, [memoryview(head)], REPLY.size, timeouts=timeouts, deadline_s=deadline_s,
                        spin_until=spin_until)
        status, size = REPLY.unpack_from(head)
        if status == tcp_path_tags.NOT_KNOWN and size == 0 and got == REPLY.size:
            return None
        if status != tcp_path_tags.KNOWN:
            reason = bytes(head[REPLY.size : got])
            raise TransferError(f"TCP path {self.address} refused the READ_TAG: "
                                f"{reason.decode(errors='replace')}...")
        if not 0 < size <= MAX_REQUEST_BYTES:
            raise TransferError(f"TCP path {self.address} answered a tag of {size} bytes")
        (offset,) = tcp_path_tags.OFFSET.unpack_from(head, REPLY.size)
        out, addr = make(size)
        aside = 0.0
        if before_landing is not None:  # while the node sends
            aside, spin_until = _aside(spin_until, deadline_s, before_landing, addr, size)
        if spin_until:
            spin_until = min(deadline_s, spin_until + size * _SPIN_S_PER_BYTE)
        recv_all(sock, [view(addr, size)], 0, timeouts=timeouts, deadline_s=deadline_s, spin_until=spin_until)
        if spin is not None:
            spin.record(time.monotonic() - began - aside - size * _SPIN_S_PER_BYTE)
        return offset, size, out, addr

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    close = _close


def _wait_for_close(sock: socket.socket, timeouts: KernelTimeouts, stuck: StuckTransfer) -> None:
    """Until the node closes its end of a WRITE we gave up on (EOF, or a reset: its thread has
    read all it ever will), then `stuck` is done."""
    outcome = "closed by the node"
    try:
        sock.shutdown(socket.SHUT_WR)  # the node's receive of the cut request ends at EOF
        timeouts.disarm()  # wait as long as the node takes
        while sock.recv(1 << 16):
            pass  # a late reply to the write
    except OSError as e:
        outcome = f"connection ended: {e}"
    finally:
        sock.close()
        stuck.finish(outcome)


def _aside(spin_until: float, deadline_s: float, fn, *args) -> tuple[float, float]:
    """Run `fn(*args)`, work beside the job's I/O: (seconds it took, the spin's end moved that much later)."""
    started = time.monotonic()
    fn(*args)
    took = time.monotonic() - started
    return took, (min(deadline_s, spin_until + took) if spin_until else 0.0)


def _prepare(before_landing, local_addrs, sizes) -> None:
    for addr, size in zip(local_addrs, sizes):
        before_landing(addr, size)


