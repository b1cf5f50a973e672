"""The control channel to the master: one request, one reply, with a deadline.

Rules:
- A DEALER socket with an 8-byte request id per call: a reply that arrives after its caller gave
  up is recognised by id and dropped, so a late reply can never answer the next call.
- Every reply names the master's incarnation (its epoch frame). When it changes, the channel calls
  its epoch listeners BEFORE the reply is handed to the caller, so whoever cached ids of the old
  incarnation (segment descriptions, routes, leases) drops them before using anything of the new
  one. Listeners run under the channel's lock: they must not call the channel.
- Several master addresses (a list, or one string with commas) name one master and its standbys,
  started with the same config and never two at a time: a call that gets no reply moves the next
  call to the next address. A standby is a new incarnation, so the rule above applies.
- Thread-safe by a lock: calls are short; batching, not concurrency, is how callers go fast.
- A call that gets no reply within `timeout_s` raises UnavailableError and never hangs; an
  ErrorReply is raised as the matching KVPoolError class.
- `send` is fire-and-forget (a request whose answer nobody needs, e.g. ReleaseLeases): its reply
  arrives later and the next `call` drops it like any stale reply.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from kvpool.core import protocol
from kvpool.core.errors import ProtocolError, UnavailableError, error_from_reply

log = logging.getLogger(__name__)

EpochListener = Callable[[int | None, int], None]  # (old epoch or None, new epoch)


def parse_addresses(address: str | list[str] | tuple[str, ...]) -> list[str]:
    """'tcp://a:1,tcp://b:2' or a list of addresses -> the list; ValueError when empty or malformed."""
    items = address.split(",") if isinstance(address, str) else list(address)
    addresses = [a.strip() for a in items if a and a.strip()]
    if not addresses:
        raise ValueError("no master address given")
    for a in addresses:
        if not a.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"master address must be a ZMQ endpoint like tcp://HOST:PORT, got {a!r}")
    return addresses


class MasterChannel:
    def __init__(
        self, address: str | list[str], timeout_s: float = 5.0, context: zmq.Context | None = None
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.addresses = parse_addresses(address)
        self.timeout_s = timeout_s
        self.epoch: int | None = None  # the incarnation that answered last
        self._current = 0  # index into addresses
        self._context = context or zmq.Context.instance()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._socket: zmq.Socket | None = None
        self._listeners: list[EpochListener] = []

    @property
    def address(self) -> str:
        return self.addresses[self._current]

    def add_epoch_listener(self, listener: EpochListener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def _connect(self) -> zmq.Socket:
        if self._socket is None:
            sock = self._context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 1000)
            sock.connect(self.address)
            self._socket = sock
        return self._socket

    def _fail_over(self) -> None:
        """No reply: the next call goes to the next address (with one address: a fresh socket)."""
        if len(self.addresses) > 1:
            if self._socket is not None:
                self._socket.close(linger=0)
                self._socket = None
            self._current = (self._current + 1) % len(self.addresses)
            log.warning("master did not answer; trying %s next", self.address)

    def _see_epoch(self, frame: bytes) -> None:
        epoch = int.from_bytes(frame, "little")
        if epoch == self.epoch:
            return
        old, self.epoch = self.epoch, epoch
        if old is not None:
            log.warning("master %s is a new incarnation (epoch %016x, was %016x): dropping what was cached",
                        self.address, epoch, old)
        for listener in self._listeners:
            listener(old, epoch)

    def call(self, request: protocol.Request, timeout_s: float | None = None) -> protocol.Reply:
        timeout_ms = int(1000 * (self.timeout_s if timeout_s is None else timeout_s))
        payload = protocol.request_encoder.encode(request)
        with self._lock:
            sock = self._connect()
            request_id = next(self._ids).to_bytes(8, "little")
            try:
                sock.send_multipart([request_id, payload], flags=zmq.NOBLOCK)
            except zmq.Again:
                self._fail_over()
                raise UnavailableError(f"master {self.address} is not accepting requests") from None
            deadline = time.monotonic() + timeout_ms / 1000
            while True:
                remaining_ms = max(0, int(1000 * (deadline - time.monotonic())))
                if not sock.poll(remaining_ms, zmq.POLLIN):
                    address = self.address
                    self._fail_over()
                    raise UnavailableError(
                        f"master {address} did not answer {type(request).__name__} within "
                        f"{timeout_ms / 1000:.1f} s (is `kvpool master` running there?)"
                    )
                frames = sock.recv_multipart()
                if len(frames) == 3 and frames[0] == request_id:
                    break
                # otherwise a stale reply to a call that timed out earlier: drop it, keep waiting
            self._see_epoch(frames[1])
        try:
            reply = protocol.reply_decoder.decode(frames[2])
        except msgspec.DecodeError as e:
            raise ProtocolError(f"undecodable reply from master {self.address}: {e}") from None
        if isinstance(reply, protocol.ErrorReply):
            raise error_from_reply(reply.kind, reply.message)
        return reply

    def send(self, request: protocol.Request) -> None:
        """Send without waiting for the reply; raises UnavailableError if the send queue is full."""
        payload = protocol.request_encoder.encode(request)
        with self._lock:
            sock = self._connect()
            try:
                sock.send_multipart([next(self._ids).to_bytes(8, "little"), payload], flags=zmq.NOBLOCK)
            except zmq.Again:
                raise UnavailableError(f"master {self.address} is not accepting requests") from None

    def close(self) -> None:
        with self._lock:
            if self._socket is not None:
                self._socket.close(linger=0)
                self._socket = None
