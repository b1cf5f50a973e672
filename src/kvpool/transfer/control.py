"""The control channel to the master: one request, one reply, with a deadline.

Rules:
- A DEALER socket with an 8-byte request id per call: a reply that arrives after its caller gave
  up is recognised by id and dropped, so a late reply can never answer the next call.
- Thread-safe by a lock: calls are short; batching, not concurrency, is how callers go fast.
- A call that gets no reply within `timeout_s` raises UnavailableError and never hangs; an
  ErrorReply is raised as the matching KVPoolError class.
- `send` is fire-and-forget (a request whose answer nobody needs, e.g. ReleaseLeases): its reply
  arrives later and the next `call` drops it like any stale reply.
"""

from __future__ import annotations

import itertools
import threading
import time

import msgspec
import zmq

from kvpool.core import protocol
from kvpool.core.errors import ProtocolError, UnavailableError, error_from_reply


class MasterChannel:
    def __init__(self, address: str, timeout_s: float = 5.0, context: zmq.Context | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.address = address
        self.timeout_s = timeout_s
        self._context = context or zmq.Context.instance()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._socket: zmq.Socket | None = None

    def _connect(self) -> zmq.Socket:
        if self._socket is None:
            sock = self._context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 1000)
            sock.connect(self.address)
            self._socket = sock
        return self._socket

    def call(self, request: protocol.Request, timeout_s: float | None = None) -> protocol.Reply:
        timeout_ms = int(1000 * (self.timeout_s if timeout_s is None else timeout_s))
        payload = protocol.request_encoder.encode(request)
        with self._lock:
            sock = self._connect()
            request_id = next(self._ids).to_bytes(8, "little")
            try:
                sock.send_multipart([request_id, payload], flags=zmq.NOBLOCK)
            except zmq.Again:
                raise UnavailableError(f"master {self.address} is not accepting requests") from None
            deadline = time.monotonic() + timeout_ms / 1000
            while True:
                remaining_ms = max(0, int(1000 * (deadline - time.monotonic())))
                if not sock.poll(remaining_ms, zmq.POLLIN):
                    raise UnavailableError(
                        f"master {self.address} did not answer {type(request).__name__} within "
                        f"{timeout_ms / 1000:.1f} s (is `kvpool master` running there?)"
                    )
                frames = sock.recv_multipart()
                if len(frames) == 2 and frames[0] == request_id:
                    break
                # otherwise a stale reply to a call that timed out earlier: drop it, keep waiting
        try:
            reply = protocol.reply_decoder.decode(frames[1])
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
