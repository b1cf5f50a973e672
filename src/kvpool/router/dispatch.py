"""Late binding: requests wait at the router, not in one backend's queue, until a backend has room.

Why: a request sent at once joins one server's queue, and stays there if that queue turns out
slow (a prefix it expected cached is recomputed, KV memory fills); a request sent later can go to
whichever server frees up first. On the long e2e trace the slowest tenth of requests all sat in
one server's queue (benchmarks/results/e2e_peers/2026-12-02-2cpu-epyc-quiet-long-wm/tails.md). With a shared pool,
the server that frees up loads the prefix from the pool, so choosing late costs little.

Rules:
- Off by default (`max_waiting` 0: every request is sent as soon as it arrives).
- With `max_waiting` N, a backend "has room" while fewer than N requests sent to it are still
  without a first byte (`Backend.waiting_since`). A request waits while no healthy backend has
  room, in arrival order (FIFO: nobody waits behind later arrivals for ever), and is then routed
  by the policy among the backends with room, so the choice is made with the state of that
  moment.
- Only streamed completions go through the gate (`/v1/` paths but /v1/models, `"stream": true`):
  a non-streamed one sends its first byte when it ends, so holding it would cap the requests
  running on a backend, not those queued there. Retries after a failure do not wait again.
- A backend's room is re-checked whenever a request gets its first byte, fails or ends, and at
  least every `recheck_s` by each held request (that is when a health change, or a held client
  that hung up, is seen).
- If every backend is unhealthy the waiter is let through, and routing fails as it would without
  the gate (503), instead of holding the client.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Sequence

from kvpool.router.backends import Backend


class ClientLeft(Exception):
    """The client of a held request hung up: it is dropped, never sent to a backend."""


def has_room(backend: Backend, max_waiting: int) -> bool:
    return backend.healthy and len(backend.waiting_since) < max_waiting


class DispatchGate:
    def __init__(self, backends: Sequence[Backend], max_waiting: int, recheck_s: float = 0.5) -> None:
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 (0: off), got {max_waiting}")
        self.backends = backends
        self.max_waiting = max_waiting
        self.recheck_s = recheck_s
        self._waiters: deque[asyncio.Future] = deque()
        self._handing_over = False  # a request was let through and has not taken its room yet

    @property
    def enabled(self) -> bool:
        return self.max_waiting > 0

    @property
    def waiting(self) -> int:
        """Requests held at the router now."""
        return len(self._waiters)

    def rooms(self) -> list[bool]:
        """Per backend, whether a request may be sent there now (all True when the gate is off)."""
        if not self.enabled:
            return [True] * len(self.backends)
        return [has_room(b, self.max_waiting) for b in self.backends]

    def _open(self) -> bool:
        return any(self.rooms()) or not any(b.healthy for b in self.backends)

    @contextlib.asynccontextmanager
    async def turn(self, gone: Callable[[], bool] | None = None, *, front: bool = False):
        """`async with gate.turn(): <route the request>`: enters once this request may be routed
        (at once when nobody waits and a backend has room); the block must take the room (make the
        request's Load) without awaiting. `gone()` says whether its client has hung up (checked
        while held: ClientLeft). `front`: a request that had its turn but found the room taken
        meanwhile (by a retry, which skips the gate) waits again at the head, not behind later ones."""
        if not self.enabled:
            yield
            return
        if self._waiters or self._handing_over or not self._open():
            await self._wait(gone or (lambda: False), front)
        self._handing_over = True
        try:
            yield
        finally:
            self._handing_over = False
            self.notify()

    async def _wait(self, gone: Callable[[], bool], front: bool) -> None:
        future = asyncio.get_running_loop().create_future()
        if front:
            self._waiters.appendleft(future)
        else:
            self._waiters.append(future)
        try:
            while not future.done():
                try:
                    await asyncio.wait_for(asyncio.shield(future), self.recheck_s)
                except asyncio.TimeoutError:
                    if gone():
                        raise ClientLeft from None
                    self.notify()
            if gone():
                raise ClientLeft
        except BaseException:  # cancelled (the client left): give up the place, or the turn given
            if future.done() and not future.cancelled():
                self._handing_over = False
            else:
                future.cancel()
                if future in self._waiters:
                    self._waiters.remove(future)
            self.notify()
            raise

    def notify(self) -> None:
        """Something changed (a first byte, an end, a routed request): let the head waiter through
        if a backend has room. One at a time: the next is let through once this one has taken its
        room (the end of its turn notifies again)."""
        if self._handing_over:
            return
        while self._waiters and self._waiters[0].done():
            self._waiters.popleft()
        if self._waiters and self._open():
            self._handing_over = True
            self._waiters.popleft().set_result(None)
