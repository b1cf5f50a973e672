"""The lane: a plain TCP request/reply channel to the master, beside its ZMQ socket (issue 14).

Why: a ZMQ message crosses two threads on each side (the caller's and libzmq's I/O thread), so
one round trip is six thread wake-ups instead of two. On the 2-core VM this was measured on, a
Python ZMQ echo took ~125 us P50 across hosts and a plain TCP echo ~26 us; the lane is that
plain socket, with the caller's own thread doing the I/O on both sides.

Wire format (little endian), one frame per request and per reply, in order on one connection:
    request: u32 payload length | u64 request id | msgpack Request
    reply:   u32 payload length | u64 request id | u64 master epoch | msgpack Reply
Same request ids and epochs as the ZMQ channel (control.py), so the same rules hold: a reply whose
id is not the call's is a late one and is dropped; a new epoch empties the caller's caches first.
Request id 0 (which the channel's ids never take) is one-way: the master answers nothing to it, not
even an error. `send` (lease releases, quarantine ends: fire-and-forget) uses it, so the master
spends no send and the client no receive on a reply nobody reads (benchmarks/results/peers/
fixes.md: no change a single client feels; it takes one reply per read off the master's loop).

Rules:
- Served only without authentication: the lane has no CURVE, so a master with an auth dir offers
  port 0 and every client stays on ZMQ. Found through the ZMQ channel (LaneQuery -> LaneOffer), so
  a master without a lane (older, or authenticated) costs one round trip once, then nothing.
- Master side (`LaneServer`): non-blocking sockets polled by the master's own loop (zmq.Poller
  takes plain fds); a frame announcing more than `max_frame_bytes` closes that connection (as
  ZMQ's MAXMSGSIZE does), and so does a peer whose unsent replies pass `max_pending_bytes`.
- Lazy one-way frames (`send(request, lazy=True)`: lease releases) are written with the socket
  corked (TCP_CORK) and go out with the next frame, or after the kernel's 200 ms cork limit: a
  release no longer costs its caller a transmit of its own. The master sees it no later than the
  caller's next request on this channel, in order, so "release, then ask" still holds.
- Client side (`LaneChannel`): wraps a MasterChannel and has its interface. A lane that breaks
  (reset, EOF: the master went away or restarted) is closed and the call is made again over ZMQ,
  which reconnects and fails over as before; a lane call that times out raises UnavailableError
  like a ZMQ one. After a failure the lane is looked for again at most every `_REDISCOVER_S`.
  (A live master closes a lane only for an oversized frame or a peer that does not read its
  replies; a request it had taken before that is then made twice, as a ZMQ retry would.)
- `begin` sends a call and returns at once, `finish` takes its reply (client/landing.py: a PutEnd
  that travels while the put's bytes are written). Replies on one connection come in order, so a
  call of another thread that reads a begun call's reply first keeps it for `finish` (`_parked`);
  a lane that closes in between fails the `finish` (UnavailableError: its outcome is unknown).
  Without a lane `begin` returns None and the caller makes its call the usual way.
- A call waits for its reply spinning first: non-blocking receives for up to `spin_s`
  ($KVPOOL_LANE_SPIN_US, default 100 us; 0: never), the CPU yielded between them
  (sched_yield: a thread or process beside it on that CPU runs), then a blocking receive. A
  blocked caller's CPU goes idle, and a reply arriving at an idle vCPU wakes it through the
  hypervisor: ~30 us each way on the 2-core VM (benchmarks/results/peers/echo_placement.md).
  Pinned like two machines, a lookup took 86-91 us blocking and 33 us spinning; the 4-client agent
  loop's throughput held (651 vs 659 loops/s) with the yield and fell 10 % without it (fixes.md 27).
  A call spins only while recent replies came within the spin (spin.py): where they come later (a
  busy master, more runnable processes than CPUs) each spin is lost CPU and the tail grows.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass

import msgspec
import zmq

from kvpool.core import protocol
from kvpool.core.errors import ProtocolError, UnavailableError, error_from_reply
from kvpool.transfer.control import MasterChannel, host_of
from kvpool.transfer.spin import SpinPolicy, spin_from_env
from kvpool.transfer.timeouts import KernelTimeouts

log = logging.getLogger(__name__)

_REQUEST_HEAD = struct.Struct("<IQ")
_REPLY_HEAD = struct.Struct("<IQQ")
_REDISCOVER_S = 5.0
ONE_WAY_ID = 0  # a request with this id gets no reply (ids of calls start at 1)
ONE_WAY_BYTES = ONE_WAY_ID.to_bytes(8, "little")  # the same id as it travels in a frame
_RECV_CHUNK = 1 << 16
_TCP_CORK = getattr(socket, "TCP_CORK", None)  # Linux; elsewhere lazy frames go out at once
_DIRECT_BODY_BYTES = 16 << 10  # a reply this large is received into its own buffer (LaneChannel._read_body)
# the master receives a request in place only up to this size: its body is allocated (and zeroed,
# so resident) when the head arrives, and an unauthenticated peer must not make it commit more than
# this per connection by announcing a large frame; larger requests grow with the bytes that came
_IN_PLACE_MAX_BYTES = 1 << 20
# plain ints: every test of a zmq.PollEvent flag runs Python code (~1 us, several per request)
_POLLIN, _POLLOUT, _POLLERR = int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.POLLERR)


# ---- master side ----------------------------------------------------------------------------------


REPLY_HEAD_BYTES = _REPLY_HEAD.size  # room a reply frame leaves for its head (LaneServer.reply_frame)


class _Connection:
    __slots__ = ("sock", "fd", "key", "inbox", "outbox", "body", "body_have", "body_id")

    def __init__(self, sock: socket.socket, key: bytes) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.key = key  # the peer's identity for the master (rate limits): unique per connection
        self.inbox = bytearray()
        self.outbox = bytearray()
        self.body: bytearray | None = None  # a large request being received straight into its body
        self.body_have = 0
        self.body_id = b""


class LaneServer:
    """The lane's listener and connections; the master's loop polls them with `poller`."""

    def __init__(self, host: str, poller: zmq.Poller, max_frame_bytes: int, max_pending_bytes: int = 256 << 20) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, 0))
        self._listener.listen(512)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._poller = poller
        self._max_frame = max_frame_bytes
        self._max_pending = max_pending_bytes
        self._connections: dict[int, _Connection] = {}  # by fd
        self._by_key: dict[bytes, _Connection] = {}
        self._serial = itertools.count(1)
        poller.register(self._listener.fileno(), _POLLIN)

    def owns(self, fd) -> bool:
        return fd == self._listener.fileno() or fd in self._connections

    def handle(self, fd: int, events: int) -> list[tuple[bytes, bytes, bytes | bytearray | memoryview]]:
        """Accept, read or flush for `fd`; the complete requests read: (connection key, id, payload)."""
        if fd == self._listener.fileno():
            self._accept()
            return []
        conn = self._connections.get(fd)
        if conn is None:
            return []
        if events & _POLLOUT:
            self._flush(conn)
        if not events & (_POLLIN | _POLLERR) or conn.fd not in self._connections:
            return []
        if conn.body is not None:
            return self._fill_body(conn)
        try:
            data = conn.sock.recv(_RECV_CHUNK)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return []
        inbox = conn.inbox
        if not inbox and len(data) >= _REQUEST_HEAD.size:  # the usual case: one whole request, no copies
            length = _REQUEST_HEAD.unpack_from(data)[0]
            if len(data) == _REQUEST_HEAD.size + length and length <= self._max_frame:
                return [(conn.key, data[4:12], memoryview(data)[_REQUEST_HEAD.size :])]
            if len(data) < _REQUEST_HEAD.size + length and _DIRECT_BODY_BYTES <= length <= min(
                    self._max_frame, _IN_PLACE_MAX_BYTES):
                # the first part of a large request (a value): into its own body, received on in
                # place; through the inbox it was copied three times (append, slice, bytes)
                conn.body = bytearray(length)
                conn.body_have = len(data) - _REQUEST_HEAD.size
                conn.body[: conn.body_have] = memoryview(data)[_REQUEST_HEAD.size :]
                conn.body_id = data[4:12]
                return self._fill_body(conn)
        inbox += data
        self._read_more(conn)  # a large request: what has arrived of it now, not at the next poll
        out = []
        start, end = 0, len(inbox)
        while end - start >= _REQUEST_HEAD.size:
            length = _REQUEST_HEAD.unpack_from(inbox, start)[0]
            if length > self._max_frame:
                log.warning("lane peer sent a %d-byte frame (limit %d): connection closed", length, self._max_frame)
                self._drop(conn)
                return out
            frame_end = start + _REQUEST_HEAD.size + length
            if frame_end > end:
                break
            out.append((conn.key, bytes(inbox[start + 4 : start + 12]), bytes(inbox[start + _REQUEST_HEAD.size : frame_end])))
            start = frame_end
        if start:
            del inbox[:start]
        return out

    def _fill_body(self, conn: _Connection) -> list[tuple[bytes, bytes, bytearray]]:
        """Receive what has arrived of the large request under way; the request once complete."""
        body, view = conn.body, memoryview(conn.body)
        while conn.body_have < len(body):
            try:
                received = conn.sock.recv_into(view[conn.body_have :])
            except (BlockingIOError, InterruptedError):
                return []  # the rest at a later poll
            except OSError:
                received = 0
            if not received:
                self._drop(conn)
                return []
            conn.body_have += received
        view.release()
        conn.body = None
        return [(conn.key, conn.body_id, body)]

    def _read_more(self, conn: _Connection) -> None:
        """Read on while the first frame in the inbox is incomplete and its bytes are there, each
        read as large as what is missing (a broken connection is found at the next poll)."""
        inbox, sock = conn.inbox, conn.sock
        while len(inbox) >= _REQUEST_HEAD.size:
            length = _REQUEST_HEAD.unpack_from(inbox)[0]
            missing = _REQUEST_HEAD.size + length - len(inbox)
            if missing <= 0 or length > self._max_frame:
                return
            try:
                data = sock.recv(max(missing, _RECV_CHUNK))
            except OSError:  # nothing more yet (or broken: found at the next poll)
                return
            if not data:
                return
            inbox += data

    def reply_frame(self, key: bytes, request_id: bytes, epoch: int, frame: bytearray) -> None:
        """Send a reply whose payload is in `frame` behind REPLY_HEAD_BYTES of room for its head
        (the master encodes it there: a large value is not copied again to join the two)."""
        if request_id == ONE_WAY_BYTES:
            return  # the peer asked for no reply
        conn = self._by_key.get(key)
        if conn is None:
            return  # the peer went away while we worked on its request
        _REPLY_HEAD.pack_into(frame, 0, len(frame) - REPLY_HEAD_BYTES, int.from_bytes(request_id, "little"), epoch)
        if conn.outbox:
            conn.outbox += frame
        else:
            try:
                sent = conn.sock.send(frame)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._drop(conn)
                return
            if sent == len(frame):
                return
            conn.outbox += frame[sent:]
            self._poller.modify(conn.fd, _POLLIN | _POLLOUT)
        if len(conn.outbox) > self._max_pending:
            log.warning("lane peer does not read its replies (%d bytes pending): connection closed", len(conn.outbox))
            self._drop(conn)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # e.g. out of file descriptors: keep serving the others
                if e.errno not in (errno.ECONNABORTED, errno.EPROTO):
                    log.warning("lane accept failed: %s", e)
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Connection(sock, b"lane-%d" % next(self._serial))
            self._connections[conn.fd] = conn
            self._by_key[conn.key] = conn
            self._poller.register(conn.fd, _POLLIN)

    def _flush(self, conn: _Connection) -> None:
        try:
            sent = conn.sock.send(conn.outbox)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        del conn.outbox[:sent]
        if not conn.outbox:
            self._poller.modify(conn.fd, _POLLIN)

    def _drop(self, conn: _Connection) -> None:
        if self._connections.pop(conn.fd, None) is not None:
            del self._by_key[conn.key]
            self._poller.unregister(conn.fd)
            conn.sock.close()

    def close(self) -> None:
        for conn in list(self._connections.values()):
            self._drop(conn)
        self._poller.unregister(self._listener.fileno())
        self._listener.close()


# ---- client side ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class BegunCall:
    """A call LaneChannel.begin sent; its reply is LaneChannel.finish's."""

    request: protocol.Request
    request_id: int
    deadline_s: float  # monotonic
    generation: int  # the lane connection it went on


class _LaneBroken(Exception):
    """The lane's connection is gone (reset, EOF): the call can go over ZMQ instead."""


class LaneChannel:
    """A MasterChannel (same interface) whose calls go over the lane when the master offers one."""

    def __init__(self, channel: MasterChannel, spin_s: float | None = None) -> None:
        """`spin_s`: how long a call spins for its reply before blocking (None: $KVPOOL_LANE_SPIN_US
        microseconds, default 100; 0: never), while replies come that quickly (spin.py)."""
        self.channel = channel
        self.spin = SpinPolicy(spin_from_env() if spin_s is None else spin_s)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._next_look_s = 0.0  # monotonic time of the next LaneQuery
        self._inbox = bytearray()
        self._timeouts: KernelTimeouts | None = None  # the lane socket's (timeouts.py)
        self._corked = False  # lazy frames wait in the socket (TCP_CORK) for the next frame
        self._generation = 0  # counts lane connections: a begun call's reply comes on its own
        self._awaited: set[int] = set()  # ids of begun calls not yet finished
        self._parked: dict[int, tuple[int, bytes]] = {}  # their replies read by other calls: (epoch, body)

    @property
    def spin_s(self) -> float:
        return self.spin.spin_s

    @spin_s.setter
    def spin_s(self, value: float) -> None:
        self.spin = SpinPolicy(value)

    # the MasterChannel interface
    @property
    def address(self) -> str:
        return self.channel.address

    @property
    def epoch(self) -> int | None:
        return self.channel.epoch

    @property
    def timeout_s(self) -> float:
        return self.channel.timeout_s

    @property
    def on_lane(self) -> bool:
        return self._sock is not None

    def add_epoch_listener(self, listener) -> None:
        self.channel.add_epoch_listener(listener)

    def call(self, request: protocol.Request, timeout_s: float | None = None, meanwhile=None) -> protocol.Reply:
        """`meanwhile()`: run once the request is sent, before its reply is awaited (the
        caller's own work while the master answers; it must not raise)."""
        timeout = self.channel.timeout_s if timeout_s is None else timeout_s
        started = time.monotonic()
        with self._lock:
            sock = self._lane(timeout)
            if sock is not None:
                try:
                    return self._lane_call(sock, request, started + timeout, meanwhile)
                except _LaneBroken as e:
                    log.info("lane to master %s broke (%s): going over ZMQ", self.address, e)
                    self._close_lane()
        return self.channel.call(request, max(1e-3, started + timeout - time.monotonic()), meanwhile)

    def begin(self, request: protocol.Request, timeout_s: float | None = None) -> "BegunCall | None":
        """Send a call over the lane and return without its reply (take it with `finish`, or
        `abandon` it); None, having sent nothing, when there is no lane."""
        timeout = self.channel.timeout_s if timeout_s is None else timeout_s
        deadline_s = time.monotonic() + timeout
        with self._lock:
            sock = self._lane(timeout)
            if sock is None:
                return None
            request_id = self.channel.next_request_id()
            try:
                self._send_call(request, request_id, deadline_s)
            except _LaneBroken as e:
                log.info("lane to master %s broke (%s): going over ZMQ", self.address, e)
                self._close_lane()
                return None
            self._awaited.add(request_id)
            return BegunCall(request, request_id, deadline_s, self._generation)

    def finish(self, call: "BegunCall") -> protocol.Reply:
        """The reply to a call `begin` sent, or UnavailableError (the lane closed meanwhile, or the
        master did not answer in time: whether it took the call is unknown) / the error it answered."""
        with self._lock:
            try:
                if call.generation != self._generation or self._sock is None:
                    raise UnavailableError(f"the lane to master {self.address} closed before it answered "
                                           f"{type(call.request).__name__}")
                got = self._parked.pop(call.request_id, None)
                if got is None:
                    got = self._reply_to(self._sock, call.request_id, call.deadline_s, call.request, sample=False)
            except _LaneBroken as e:
                self._close_lane()
                raise UnavailableError(f"the lane to master {self.address} broke before it answered "
                                       f"{type(call.request).__name__} ({e})") from None
            finally:
                self._awaited.discard(call.request_id)
            epoch, body = got
            self.channel.see_epoch(epoch)
        return self._decoded(body)

    def abandon(self, call: "BegunCall") -> None:
        """Give up on a begun call's reply (dropped whenever it comes)."""
        with self._lock:
            self._awaited.discard(call.request_id)
            self._parked.pop(call.request_id, None)

    def send(self, request: protocol.Request, *, lazy: bool = False) -> None:
        """One way: the master answers nothing. `lazy`: the frame may wait in our socket until the
        next frame goes out behind it, at most the kernel's cork limit (200 ms), so a lease release
        costs the caller no transmit of its own (~50 us across hosts here) and rides with the next
        request; over ZMQ it is sent at once."""
        with self._lock:
            if self._sock is not None:
                payload = protocol.request_encoder.encode(request)
                try:
                    if lazy and _TCP_CORK is not None and not self._corked:
                        self._sock.setsockopt(socket.IPPROTO_TCP, _TCP_CORK, 1)
                        self._corked = True
                    self._timeouts.send_all(_REQUEST_HEAD.pack(len(payload), ONE_WAY_ID) + payload,
                                            time.monotonic() + self.channel.timeout_s)
                    if not lazy:
                        self._uncork()
                    return
                except OSError:  # TimeoutError and BlockingIOError too
                    self._close_lane()
        self.channel.send(request)

    def close(self) -> None:
        with self._lock:
            self._close_lane()
        self.channel.close()

    # internals (the caller holds self._lock)
    def _lane(self, timeout_s: float) -> socket.socket | None:
        if self._sock is not None or time.monotonic() < self._next_look_s:
            return self._sock
        self._next_look_s = time.monotonic() + _REDISCOVER_S
        try:
            offer = self.channel.call(protocol.LaneQuery(), timeout_s)
        except ProtocolError:  # a master without the lane (older): never ask it again
            self._next_look_s = float("inf")
            return None
        except UnavailableError:
            return None  # the ZMQ call that follows will say so too
        if not isinstance(offer, protocol.LaneOffer) or not offer.port:
            return None
        host = host_of(self.channel.address)
        try:
            sock = socket.create_connection((host, offer.port), timeout=min(timeout_s, 2.0))
        except OSError as e:
            log.info("master %s offers a lane on port %d but it cannot be reached (%s): using ZMQ", self.address,
                     offer.port, e)
            return None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._timeouts = KernelTimeouts(sock)
        self._sock = sock
        self._inbox = bytearray()
        return sock

    def _close_lane(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self._generation += 1
        self._inbox = bytearray()
        self._corked = False
        self._awaited.clear()
        self._parked.clear()

    def _uncork(self) -> None:
        """Send what lazy frames left corked, with whatever was written behind them."""
        if self._corked:
            self._corked = False
            self._sock.setsockopt(socket.IPPROTO_TCP, _TCP_CORK, 0)

    def _lane_call(self, sock: socket.socket, request: protocol.Request, deadline_s: float,
                   meanwhile=None) -> protocol.Reply:
        request_id = self.channel.next_request_id()
        self._send_call(request, request_id, deadline_s)
        if meanwhile is not None:
            meanwhile()
        epoch, body = self._reply_to(sock, request_id, deadline_s, request)
        self.channel.see_epoch(epoch)
        return self._decoded(body)

    def _send_call(self, request: protocol.Request, request_id: int, deadline_s: float) -> None:
        frame = bytearray(_REQUEST_HEAD.size)  # the payload is encoded behind the head: no copy to join them
        protocol.request_encoder.encode_into(request, frame, _REQUEST_HEAD.size)
        _REQUEST_HEAD.pack_into(frame, 0, len(frame) - _REQUEST_HEAD.size, request_id)
        try:
            self._timeouts.send_all(frame, deadline_s)
            self._uncork()
        except (TimeoutError, BlockingIOError):
            self._close_lane()
            raise UnavailableError(f"master {self.address} does not take requests (lane send timed out)") from None
        except OSError as e:
            raise _LaneBroken(e) from None

    def _reply_to(self, sock: socket.socket, request_id: int, deadline_s: float, request,
                  sample: bool = True) -> tuple[int, bytes]:
        """(epoch, body) of the reply to `request_id`; a begun call's reply read on the way is
        parked for its `finish`, any other (a `send`'s, a call that gave up) dropped."""
        while True:
            reply_id, epoch, body = self._read_frame(sock, deadline_s, request, sample)
            if reply_id == request_id:
                return epoch, body
            if reply_id in self._awaited:
                self._parked[reply_id] = (epoch, body)

    def _decoded(self, body) -> protocol.Reply:
        try:
            reply = protocol.reply_decoder.decode(body)
        except msgspec.DecodeError as e:
            raise ProtocolError(f"undecodable reply from master {self.address}: {e}") from None
        if type(reply) is protocol.ErrorReply:
            raise error_from_reply(reply.kind, reply.message)
        return reply

    def _read_frame(self, sock: socket.socket, deadline_s: float, request,
                    sample: bool = True) -> tuple[int, int, bytes]:
        """The next reply frame: (request id, master epoch, body). `sample`: the wait counts for
        the spin policy (not for a begun call's reply, usually there before it is asked for)."""
        inbox = self._inbox
        first = True
        waiting_since = None  # perf_counter() when the first receive began (the spin policy's sample)
        while True:
            if len(inbox) >= _REPLY_HEAD.size:
                length, reply_id, epoch = _REPLY_HEAD.unpack_from(inbox)
                end = _REPLY_HEAD.size + length
                if len(inbox) >= end:
                    body = bytes(inbox[_REPLY_HEAD.size : end])
                    del inbox[:end]
                    return reply_id, epoch, body
                if length >= _DIRECT_BODY_BYTES:  # a large reply (a value): the rest straight into its body
                    return reply_id, epoch, self._read_body(sock, length, deadline_s, request)
            try:
                data = None
                if first:
                    waiting_since = time.perf_counter()
                    if self.spin.spins:
                        data = self._spin(sock)
                else:
                    self._arm_until(deadline_s, request)
                first = False
                if data is None:
                    data = sock.recv(_RECV_CHUNK)  # a reply under way here is < _DIRECT_BODY_BYTES: it fits
            except (TimeoutError, BlockingIOError, InterruptedError):
                continue
            except OSError as e:
                raise _LaneBroken(e) from None
            if not data:
                raise _LaneBroken("connection closed by the master")
            if waiting_since is not None and sample:
                self.spin.record(time.perf_counter() - waiting_since)
                waiting_since = None
            if not inbox and len(data) >= _REPLY_HEAD.size:  # the usual case: one whole reply, no copies
                length, reply_id, epoch = _REPLY_HEAD.unpack_from(data)
                if len(data) == _REPLY_HEAD.size + length:
                    return reply_id, epoch, memoryview(data)[_REPLY_HEAD.size :]
                if len(data) < _REPLY_HEAD.size + length and length >= _DIRECT_BODY_BYTES:
                    # the first part of a large reply: into its body at once, not through the inbox
                    # (appending 64 KiB to an empty bytearray cost ~45 us here: it grows, and faults)
                    return reply_id, epoch, self._read_body(sock, length, deadline_s, request, data)
            inbox += data

    def _spin(self, sock: socket.socket) -> bytes | None:
        """What a non-blocking receive finds within spin_s (yielding the CPU between tries), or None."""
        end = time.perf_counter() + self.spin_s
        while True:
            try:
                return sock.recv(_RECV_CHUNK, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                if time.perf_counter() >= end:
                    return None
                os.sched_yield()

    def _arm_until(self, deadline_s: float, request) -> None:
        """Bound the next receive by what is left of the call; past its deadline the lane is closed
        (a reply may be half read: the connection cannot carry another) and the call unavailable."""
        remaining = deadline_s - time.monotonic()
        if remaining <= 0:
            self._close_lane()
            raise UnavailableError(f"master {self.address} did not answer {type(request).__name__} in time (lane)")
        self._timeouts.arm(remaining)

    def _read_body(self, sock: socket.socket, length: int, deadline_s: float, request,
                   first: bytes | None = None) -> bytearray:
        """The body of the reply whose head (and maybe a first part) is in `first` (a receive that
        held no other frame) or else in the inbox, the rest received straight into it: one copy of
        the bytes instead of three (inbox, slice, bytes)."""
        body = bytearray(length)
        if first is None:
            inbox = self._inbox
            have = len(inbox) - _REPLY_HEAD.size
            body[:have] = memoryview(inbox)[_REPLY_HEAD.size :]
            inbox.clear()
        else:
            have = len(first) - _REPLY_HEAD.size
            body[:have] = memoryview(first)[_REPLY_HEAD.size :]
        view = memoryview(body)
        while have < length:
            self._arm_until(deadline_s, request)
            try:
                received = sock.recv_into(view[have:])
            except (TimeoutError, BlockingIOError, InterruptedError):
                continue
            except OSError as e:
                raise _LaneBroken(e) from None
            if not received:
                raise _LaneBroken("connection closed by the master")
            have += received
        return body

