"""A transfer that missed its deadline and may still move bytes: the handle that fences it.

Nothing in NIXL cancels a one-sided transfer in flight (measured with NIXL 1.5.1 / UCX; see
nixlio.py and docs/design/data-plane.md). Releasing its handle only frees the handle, and
the bytes still land when a stopped peer resumes, into the remote range (WRITE) or into our
memory (READ); a WRITE may even read our source buffer after the release. Only the request's own
end (done, or an error such as the peer's death) says no byte can move any more.

Rules:
- The data plane never releases such a request: it hands it to a reaper that polls it until it
  ends, and returns a TransferError whose `in_flight` is this object. Whoever owns the memory on
  either side waits for it (`wait`) or is called back (`add_done_callback`) before reusing it.
- Callbacks run once, on the reaper's thread (or at once, if it is over already); they must be
  short and must not wait for other transfers.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class StuckTransfer:
    def __init__(self, description: str) -> None:
        self.description = description
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[StuckTransfer], None]] = []
        self.outcome: str | None = None  # "done" or the error that ended it

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the transfer is over (True) or `timeout_s` passed (False)."""
        return self._done.wait(timeout_s)

    def add_done_callback(self, fn: Callable[["StuckTransfer"], None]) -> None:
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def finish(self, outcome: str) -> None:
        """Called by the reaper once the request has ended."""
        with self._lock:
            if self._done.is_set():
                return
            self.outcome = outcome
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # one owner's bug must not keep the others waiting
                log.exception("callback of a settled transfer (%s) failed", self.description)


def all_of(transfers: list) -> "StuckTransfer":
    """One handle for several in-flight transfers: the one itself, else a StuckTransfer that is
    done once every one of them is."""
    if len(transfers) == 1:
        return transfers[0]
    combined = StuckTransfer(" + ".join(t.description for t in transfers))
    left = [len(transfers)]
    lock = threading.Lock()

    def one_done(_transfer) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        combined.finish("done")

    for t in transfers:
        t.add_done_callback(one_done)
    return combined
