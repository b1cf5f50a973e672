"""A TCP-path job run as two halves on two connections of the same route (plane.py's TCP-path jobs).

Why: two TCP streams carry more than one (the kernel's work for each on its own core); the
thresholds and their measurements: docs/design/data-plane.md.

Rules:
- A job of `split_bytes` or more (0: never) is cut at its middle byte (a region across it is cut
  in two) when a second connection of the route is free right now; else it runs whole.
- The second half runs on one of a few kept threads (started lazily, remade in a forked child),
  so a split costs no thread start; the first runs on the caller's thread and alone calls
  `sent` (DataPlane.transfer_many's hook).
- The call returns only when both halves have ended (the other half lands in the caller's
  memory). One failed half is its TransferError; two failed halves are one TransferError whose
  `in_flight` is done when every half that may still land is (a WRITE given up on).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent import futures

from kvpool.core.errors import TransferError
from kvpool.transfer.fence import all_of

_MAX_HALF_RUNNERS = 4  # threads that run second halves, per process (lazily started, kept)
_half_pool: futures.ThreadPoolExecutor | None = None
_half_pool_lock = threading.Lock()


def _half_runner() -> futures.ThreadPoolExecutor:
    """The threads that run split jobs' second halves: kept, so a split costs no thread start."""
    global _half_pool
    with _half_pool_lock:
        if _half_pool is None:
            _half_pool = futures.ThreadPoolExecutor(_MAX_HALF_RUNNERS, thread_name_prefix="kvpool-lane-half")
        return _half_pool


def _forget_half_runner_after_fork() -> None:
    global _half_pool
    _half_pool = None  # the parent's threads do not exist in a forked child


os.register_at_fork(after_in_child=_forget_half_runner_after_fork)


def run_on_lane(op: str, lane, conn, local_addrs: Sequence[int], remote_offsets: Sequence[int], sizes: Sequence[int],
                split_bytes: int, deadline: float, before_landing=None, sent=None, tag=None) -> None:
    """The job on `conn` (a connection of `lane`, tcp_path.py), in two halves when the rules
    above allow; TransferError if it did not complete. `tag`: a WRITE's (tag, offset, size), sent
    just before the first half (tcp_path_tags.py)."""
    total = sum(sizes) if split_bytes else 0
    second = lane.try_acquire() if split_bytes and total >= split_bytes else None
    if second is None:  # whole on this thread: it may spin (tcp_path.py)
        conn.transfer(op, local_addrs, remote_offsets, sizes, deadline, before_landing, sent, lane.spin, tag)
        return
    first_half, second_half = halves(local_addrs, remote_offsets, sizes, total // 2)
    try:
        other = _half_runner().submit(second.transfer, op, *second_half, deadline, before_landing)
    except BaseException:
        lane.release(second)
        raise
    first_error = None
    try:
        conn.transfer(op, *first_half, deadline, before_landing, sent, tag=tag)
    except TransferError as e:
        first_error = e
    finally:
        # the other half lands in the caller's memory: never return before it ends
        futures.wait([other])
        lane.release(second)
    errors = [e for e in (first_error, other.exception()) if e is not None]
    for error in errors:
        if not isinstance(error, TransferError):
            raise error
    if len(errors) == 2:  # both failed: whichever WRITE half may still land keeps the range fenced
        stuck = [e.in_flight for e in errors if e.in_flight is not None]
        raise TransferError(f"{errors[0]}; {errors[1]}", in_flight=all_of(stuck) if stuck else None)
    if errors:
        raise errors[0]


def halves(addrs, offsets, sizes, at: int):
    """The regions cut at byte `at` (a region across it is cut in two): two (addrs, offsets, sizes)."""
    cut_halves: tuple[tuple[list, list, list], ...] = (([], [], []), ([], [], []))
    done = 0
    for addr, offset, size in zip(addrs, offsets, sizes):
        addr, offset, size = int(addr), int(offset), int(size)
        cut = min(max(at - done, 0), size)  # bytes of this region in the first half
        for half, start, length in ((cut_halves[0], 0, cut), (cut_halves[1], cut, size - cut)):
            if length:
                half[0].append(addr + start)
                half[1].append(offset + start)
                half[2].append(length)
        done += size
    return cut_halves
