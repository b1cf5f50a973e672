"""The TCP channel: a plain TCP (or, on the master's host, Unix) request/reply channel to the
master, beside its ZMQ socket ("the lane").

Why: a ZMQ message crosses two threads on each side (the caller's and libzmq's I/O thread); this
channel is a plain socket, the caller's own thread doing the I/O on both sides, with the ZMQ
channel's request ids and epochs (frames.py). Measurements: docs/design/data-plane.md.

Rules:
- Served only without authentication: the channel has no CURVE, so a master with an auth dir
  offers port 0 and every client stays on ZMQ. Found through the ZMQ channel (LaneQuery ->
  LaneOffer), so a master without one (or authenticated) costs one round trip once, then nothing.
- Master side: `LaneServer` (tcp_server.py). It listens on TCP and on an abstract Unix socket with
  a random name, both offered in LaneOffer; a client tries the Unix socket first (it exists only in
  the master's network namespace, so only a client on its host reaches it) and TCP otherwise
  (TcpChannelConfig.unix_socket off: TCP always). Same frames; a Unix socket round trip costs less
  than loopback TCP.
- `send` (lease releases, quarantine ends: fire-and-forget) sends a one-way frame (request id 0):
  the master spends no send and the client no receive on a reply nobody reads.
- Lazy one-way frames (`send(request, lazy=True)`: lease releases) are written with the socket
  corked (TCP_CORK; a Unix socket has no cork: sent at once) and go out with the next frame, or
  after the kernel's 200 ms cork limit: a release costs its caller no transmit of its own. The
  master sees it no later than the caller's next request on this channel, in order, so "release,
  then ask" still holds.
- Client side (`LaneChannel`): wraps a MasterChannel and has its interface. A connection that
  breaks (reset, EOF: the master went away or restarted) is closed and the call is made again over
  ZMQ, which reconnects and fails over as before; a call that times out raises UnavailableError
  like a ZMQ one. After a failure the channel is looked for again at most every `_REDISCOVER_S`.
  (A live master closes a connection only for an oversized frame or a peer that does not read its
  replies; a request it had taken before that is then made twice, as a ZMQ retry would.)
- `begin` sends a call and returns at once, `finish` takes its reply (client/landing.py: a PutEnd
  that travels while the put's bytes are written). Replies on one connection come in order, so a
  call of another thread that reads a begun call's reply first keeps it for `finish` (`_parked`);
  a connection that closes in between fails the `finish` (UnavailableError: its outcome is
  unknown). Without the channel `begin` returns None and the caller makes its call the usual way.
- A call waits for its reply spinning first: non-blocking receives for up to `spin_s`
  (TcpChannelConfig), the CPU yielded between them (sched_yield: a thread or process beside it on
  that CPU runs), then a blocking receive: a reply arriving at an idle vCPU wakes it through the
  hypervisor. A call spins only while recent replies came within the spin (spin.py): where they
  come later (a busy master, more runnable processes than CPUs) each spin is lost CPU.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import msgspec

from kvpool.core import protocol
from kvpool.core.errors import ProtocolError, UnavailableError, error_from_reply
from kvpool.rpc.zmq_channel import BegunCall, MasterChannel, host_of
from kvpool.rpc.config import TcpChannelConfig
from kvpool.rpc.frames import DIRECT_BODY_BYTES, ONE_WAY_ID, RECV_CHUNK, REPLY_HEAD, REQUEST_HEAD
from kvpool.rpc.spin import SpinPolicy
from kvpool.rpc.timeouts import KernelTimeouts

log = logging.getLogger(__name__)

_REDISCOVER_S = 5.0
_TCP_CORK = getattr(socket, "TCP_CORK", None)  # Linux; elsewhere lazy frames go out at once
_AF_UNIX = getattr(socket, "AF_UNIX", None)


def _connect_unix(name: str, timeout_s: float) -> socket.socket | None:
    """The master's lane on its abstract Unix socket, reachable from its own network namespace
    only (the same host); None where it is not (another host: the caller uses TCP)."""
    if _AF_UNIX is None:
        return None
    sock = socket.socket(_AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect("\0" + name)
    except OSError:
        sock.close()
        return None
    return sock


class _LaneBroken(Exception):
    """The lane's connection is gone (reset, EOF): the call can go over ZMQ instead."""


class LaneChannel:
    """A MasterChannel (same interface) whose calls go over the lane when the master offers one."""

    lands_puts = True  # a put's PutEnd may travel before its write, PutLanded after (client/landing.py)

    def __init__(self, channel: MasterChannel, spin_s: float | None = None,
                 config: TcpChannelConfig | None = None) -> None:
        """`config`: the channel's settings (None: TcpChannelConfig.from_env(), read once now).
        `spin_s`: how long a call spins for its reply before blocking, over the config's (0:
        never), while replies come that quickly (spin.py)."""
        self.channel = channel
        self.config = TcpChannelConfig.from_env() if config is None else config
        self.spin = SpinPolicy(self.config.spin_s if spin_s is None else spin_s)
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
                    if lazy and _TCP_CORK is not None and not self._corked and self._sock.family != _AF_UNIX:
                        self._sock.setsockopt(socket.IPPROTO_TCP, _TCP_CORK, 1)
                        self._corked = True
                    self._timeouts.send_all(REQUEST_HEAD.pack(len(payload), ONE_WAY_ID) + payload,
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
        use_unix = offer.unix and self.config.unix_socket
        sock = _connect_unix(offer.unix, min(timeout_s, 2.0)) if use_unix else None
        if sock is None:
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
        frame = bytearray(REQUEST_HEAD.size)  # the payload is encoded behind the head: no copy to join them
        protocol.request_encoder.encode_into(request, frame, REQUEST_HEAD.size)
        REQUEST_HEAD.pack_into(frame, 0, len(frame) - REQUEST_HEAD.size, request_id)
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
            if len(inbox) >= REPLY_HEAD.size:
                length, reply_id, epoch = REPLY_HEAD.unpack_from(inbox)
                end = REPLY_HEAD.size + length
                if len(inbox) >= end:
                    body = bytes(inbox[REPLY_HEAD.size : end])
                    del inbox[:end]
                    return reply_id, epoch, body
                if length >= DIRECT_BODY_BYTES:  # a large reply (a value): the rest straight into its body
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
                    data = sock.recv(RECV_CHUNK)  # a reply under way here is < DIRECT_BODY_BYTES: it fits
            except (TimeoutError, BlockingIOError, InterruptedError):
                continue
            except OSError as e:
                raise _LaneBroken(e) from None
            if not data:
                raise _LaneBroken("connection closed by the master")
            if waiting_since is not None and sample:
                self.spin.record(time.perf_counter() - waiting_since)
                waiting_since = None
            if not inbox and len(data) >= REPLY_HEAD.size:  # the usual case: one whole reply, no copies
                length, reply_id, epoch = REPLY_HEAD.unpack_from(data)
                if len(data) == REPLY_HEAD.size + length:
                    return reply_id, epoch, memoryview(data)[REPLY_HEAD.size :]
                if len(data) < REPLY_HEAD.size + length and length >= DIRECT_BODY_BYTES:
                    # the first part of a large reply: into its body at once, not through the inbox
                    # (appending 64 KiB to an empty bytearray cost ~45 us here: it grows, and faults)
                    return reply_id, epoch, self._read_body(sock, length, deadline_s, request, data)
            inbox += data

    def _spin(self, sock: socket.socket) -> bytes | None:
        """What a non-blocking receive finds within spin_s (yielding the CPU between tries), or None."""
        end = time.perf_counter() + self.spin_s
        while True:
            try:
                return sock.recv(RECV_CHUNK, socket.MSG_DONTWAIT)
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
            have = len(inbox) - REPLY_HEAD.size
            body[:have] = memoryview(inbox)[REPLY_HEAD.size :]
            inbox.clear()
        else:
            have = len(first) - REPLY_HEAD.size
            body[:have] = memoryview(first)[REPLY_HEAD.size :]
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

