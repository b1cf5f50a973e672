"""Timeouts a blocking socket's sends and receives get from the kernel (SO_SNDTIMEO / SO_RCVTIMEO).

Why: `socket.settimeout` makes CPython poll() before every send and receive, and setting it costs
two fcntl() calls; the kernel's timeouts cost nothing per call (docs/design/data-plane.md).
Rules:
- A send or receive that waits past them raises BlockingIOError (EAGAIN), which callers treat as
  their timeout.
- They bound each send and receive, not a whole message (as settimeout bounds `sendall`): a peer
  taking a few bytes at a time would keep a sender going, so loops call `before(deadline)`
  between calls.
"""

from __future__ import annotations

import socket
import struct
import time

_TIMEVAL = struct.Struct("@ll")  # struct timeval: seconds, microseconds


class KernelTimeouts:
    """Makes `sock` blocking and sets its kernel timeouts on demand (`arm`)."""

    __slots__ = ("_sock", "_armed_s")

    def __init__(self, sock: socket.socket) -> None:
        sock.settimeout(None)
        self._sock = sock
        self._armed_s: float | None = None

    def before(self, deadline_s: float) -> None:
        """Arm for what is left until `deadline_s` (monotonic); TimeoutError when nothing is."""
        left = deadline_s - time.monotonic()
        if left <= 0:
            raise TimeoutError
        self.arm(left)

    def send_all(self, data, deadline_s: float) -> None:
        """`sock.sendall(data)`, ended by TimeoutError / BlockingIOError at `deadline_s`."""
        view = memoryview(data)
        while view:
            self.before(deadline_s)
            view = view[self._sock.send(view):]

    def arm(self, seconds: float) -> None:
        """Let each send and receive wait about `seconds` (at least 1 ms). Set again only when
        `seconds` moves by more than a tenth: a caller with a deadline retries a receive that ended
        early, and one that ends late does so by a tenth of its timeout at most."""
        seconds = max(1e-3, seconds)
        armed = self._armed_s
        if armed is not None and abs(seconds - armed) <= 0.1 * armed:
            return
        value = _TIMEVAL.pack(int(seconds), int(seconds % 1 * 1e6))
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
        self._armed_s = seconds

    def disarm(self) -> None:
        """Let sends and receives wait as long as they need (no kernel timeout)."""
        value = _TIMEVAL.pack(0, 0)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
        self._armed_s = None
