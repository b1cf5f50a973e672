"""Which objects of a job are wholly in place while its bytes land in order (a lane READ).

A job's regions are objects of `counts[n]` consecutive regions each (the caller's after_objects,
plane.py). A stream that fills the job's bytes [start, end) in order reports how many of them are
in; `after(n)` is then called, once, for each object lying wholly inside [start, end) as soon as
its last byte is in, so a reader checksums it while it is still in the CPU's caches and while the
rest of the job is still on the wire. An object cut by `start` or `end` (a job run as two halves
on two connections) is never reported: the caller checks it after the job, as it does any object
`after` did not see."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence


def object_spans(counts: Sequence[int], sizes: Sequence[int]) -> list[tuple[int, int]]:
    """(first byte, end byte) of each object within the job."""
    starts = list(itertools.accumulate(counts, initial=0))
    if starts[-1] != len(sizes) or min(counts, default=1) < 1:
        raise ValueError(f"{len(counts)} objects of {starts[-1]} regions in all, but {len(sizes)} regions")
    ends = list(itertools.accumulate(sizes, initial=0))
    return [(ends[starts[n]], ends[starts[n + 1]]) for n in range(len(counts))]


def progress_watcher(spans: Sequence[tuple[int, int]], after: Callable[[int], None], start: int,
                     end: int) -> Callable[[int], None]:
    """A callable(bytes in place since `start`) that calls after(n) for the objects within
    [start, end) whose bytes are all in, in order, each once."""
    inside = [(n, stop - start) for n, (first, stop) in enumerate(spans) if first >= start and stop <= end]
    next_one = 0

    def landed(num_bytes: int) -> None:
        nonlocal next_one
        while next_one < len(inside) and inside[next_one][1] <= num_bytes:
            after(inside[next_one][0])
            next_one += 1

    return landed
