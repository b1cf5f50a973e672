"""The TCP channel's master side: its listener and connections, polled by the master's own loop.

Rules (the frames: frames.py; the client side: tcp_channel.py):
- Non-blocking sockets polled by the master's loop (zmq.Poller takes plain fds); a frame
  announcing more than `max_frame_bytes` closes that connection (as ZMQ's MAXMSGSIZE does), and so
  does a peer whose unsent replies pass `max_pending_bytes`.
- A request frame arriving whole in one receive is handed on without a copy; a large one is
  received in place into its own body (up to _IN_PLACE_MAX_BYTES, allocated when its head comes).
- A reply to a one-way request (ONE_WAY_BYTES) is never sent.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import secrets
import socket
import sys

import zmq

from kvpool.rpc.frames import DIRECT_BODY_BYTES, ONE_WAY_BYTES, RECV_CHUNK, REPLY_HEAD, REPLY_HEAD_BYTES, REQUEST_HEAD

log = logging.getLogger(__name__)

# the master receives a request in place only up to this size: its body is allocated (and zeroed,
# so resident) when the head arrives, and an unauthenticated peer must not make it commit more than
# this per connection by announcing a large frame; larger requests grow with the bytes that came
_IN_PLACE_MAX_BYTES = 1 << 20
# plain ints: every test of a zmq.PollEvent flag runs Python code (~1 us, several per request)
_POLLIN, _POLLOUT, _POLLERR = int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.POLLERR)



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
        # the same lane on a Unix socket, for clients in this host's network namespace (an abstract
        # name: nothing on disk, gone with the process; random, so only those told it find it)
        self.unix_name = ""
        self._unix_listener: socket.socket | None = None
        if hasattr(socket, "AF_UNIX") and sys.platform.startswith("linux"):
            name = f"kvpool-lane-{os.getpid()}-{secrets.token_hex(8)}"
            unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                unix.bind("\0" + name)
                unix.listen(512)
                unix.setblocking(False)
            except OSError as e:
                log.info("no Unix-socket lane (%s): same-host clients use TCP", e)
                unix.close()
            else:
                self._unix_listener, self.unix_name = unix, name
        self._listeners = {lst.fileno(): lst for lst in (self._listener, self._unix_listener) if lst is not None}
        self._poller = poller
        self._max_frame = max_frame_bytes
        self._max_pending = max_pending_bytes
        self._connections: dict[int, _Connection] = {}  # by fd
        self._by_key: dict[bytes, _Connection] = {}
        self._serial = itertools.count(1)
        for fd in self._listeners:
            poller.register(fd, _POLLIN)

    def owns(self, fd) -> bool:
        return fd in self._listeners or fd in self._connections

    def handle(self, fd: int, events: int) -> list[tuple[bytes, bytes, bytes | bytearray | memoryview]]:
        """Accept, read or flush for `fd`; the complete requests read: (connection key, id, payload)."""
        listener = self._listeners.get(fd)
        if listener is not None:
            self._accept(listener)
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
            data = conn.sock.recv(RECV_CHUNK)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return []
        inbox = conn.inbox
        if not inbox and len(data) >= REQUEST_HEAD.size:  # the usual case: one whole request, no copies
            length = REQUEST_HEAD.unpack_from(data)[0]
            if len(data) == REQUEST_HEAD.size + length and length <= self._max_frame:
                return [(conn.key, data[4:12], memoryview(data)[REQUEST_HEAD.size :])]
            if len(data) < REQUEST_HEAD.size + length and DIRECT_BODY_BYTES <= length <= min(
                    self._max_frame, _IN_PLACE_MAX_BYTES):
                # the first part of a large request (a value): into its own body, received on in
                # place; through the inbox it was copied three times (append, slice, bytes)
                conn.body = bytearray(length)
                conn.body_have = len(data) - REQUEST_HEAD.size
                conn.body[: conn.body_have] = memoryview(data)[REQUEST_HEAD.size :]
                conn.body_id = data[4:12]
                return self._fill_body(conn)
        inbox += data
        self._read_more(conn)  # a large request: what has arrived of it now, not at the next poll
        out = []
        start, end = 0, len(inbox)
        while end - start >= REQUEST_HEAD.size:
            length = REQUEST_HEAD.unpack_from(inbox, start)[0]
            if length > self._max_frame:
                log.warning("lane peer sent a %d-byte frame (limit %d): connection closed", length, self._max_frame)
                self._drop(conn)
                return out
            frame_end = start + REQUEST_HEAD.size + length
            if frame_end > end:
                break
            out.append((conn.key, bytes(inbox[start + 4 : start + 12]), bytes(inbox[start + REQUEST_HEAD.size : frame_end])))
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
        while len(inbox) >= REQUEST_HEAD.size:
            length = REQUEST_HEAD.unpack_from(inbox)[0]
            missing = REQUEST_HEAD.size + length - len(inbox)
            if missing <= 0 or length > self._max_frame:
                return
            try:
                data = sock.recv(max(missing, RECV_CHUNK))
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
        REPLY_HEAD.pack_into(frame, 0, len(frame) - REPLY_HEAD_BYTES, int.from_bytes(request_id, "little"), epoch)
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

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # e.g. out of file descriptors: keep serving the others
                if e.errno not in (errno.ECONNABORTED, errno.EPROTO):
                    log.warning("lane accept failed: %s", e)
                return
            sock.setblocking(False)
            if sock.family != getattr(socket, "AF_UNIX", None):
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
        for fd, listener in self._listeners.items():
            self._poller.unregister(fd)
            listener.close()
