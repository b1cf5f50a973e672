"""Host memory copies for the same-host path: large jobs split across helper threads.

Rules:
- `copy_regions(dsts, srcs, sizes, dst_base, src_base)` copies region i from `src_base + srcs[i]`
  to `dst_base + dsts[i]` with memmove (a segment's offsets go in with its base: no list is built
  for a job that is not split); the job is the caller's whole list. ctypes.memmove releases the
  GIL, so helper threads copy at once with the caller.
- A job is split only when it is large (>= `SPLIT_MIN_BYTES`) and this process may run on more
  than one CPU (its affinity mask, read once per process): a vLLM worker pinned to one core copies
  on its own thread as before, since a second thread there would only take turns with it. Parts
  are >= `PART_MIN_BYTES`; one part runs on the caller's thread, the others on at most
  `MAX_HELPERS` daemon threads of one pool per process (remade in a forked child, where the
  parent's threads do not exist).
- Parts split the byte range, not the list: one 64 MiB region is cut in pieces as well as 64
  regions of 1 MiB. Every byte is copied exactly once; the call returns when all parts are done.
  Regions of one job must not overlap each other (they never do: distinct objects and buffers).
- Pure memory work: no I/O, no locks held while copying.
"""

from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor

SPLIT_MIN_BYTES = 8 << 20
PART_MIN_BYTES = 4 << 20
MAX_HELPERS = 3

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_num_cpus: int | None = None


def _helpers() -> int:
    global _num_cpus
    if _num_cpus is None:
        try:
            _num_cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            _num_cpus = 1
    return min(MAX_HELPERS, _num_cpus - 1)


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(MAX_HELPERS, thread_name_prefix="kvpool-memcopy")
        return _pool


def _forget_after_fork() -> None:
    global _pool, _num_cpus
    _pool, _num_cpus = None, None


os.register_at_fork(after_in_child=_forget_after_fork)


def split(pairs: list[tuple[int, int, int]], num_parts: int) -> list[list[tuple[int, int, int]]]:
    """`pairs` cut into `num_parts` runs of about equal bytes (regions cut where a run ends)."""
    total = sum(size for _, _, size in pairs)
    target = -(-total // num_parts)
    parts: list[list[tuple[int, int, int]]] = [[]]
    room = target
    for dst, src, size in pairs:
        while size:
            take = min(size, room)
            parts[-1].append((dst, src, take))
            dst, src, size, room = dst + take, src + take, size - take, room - take
            if not room and len(parts) < num_parts:
                parts.append([])
                room = target
    return [p for p in parts if p]


def _copy(pairs: list[tuple[int, int, int]]) -> None:
    memmove = ctypes.memmove
    for dst, src, size in pairs:
        memmove(dst, src, size)


def copy_regions(dsts: list[int], srcs: list[int], sizes: list[int], dst_base: int = 0, src_base: int = 0) -> None:
    total = sum(sizes)
    helpers = _helpers() if total >= SPLIT_MIN_BYTES else 0
    num_parts = min(helpers + 1, total // PART_MIN_BYTES)
    if num_parts < 2:
        memmove = ctypes.memmove
        for dst, src, size in zip(dsts, srcs, sizes):
            memmove(dst_base + dst, src_base + src, size)
        return
    pairs = [(dst_base + dst, src_base + src, size) for dst, src, size in zip(dsts, srcs, sizes)]
    first, *rest = split(pairs, num_parts)
    futures = [_executor().submit(_copy, part) for part in rest]
    try:
        _copy(first)
    finally:
        for future in futures:
            future.result()
