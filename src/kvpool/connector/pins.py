"""Blocks held in vLLM's block pool for saves in flight.

Rules:
- A save's source blocks get a reference in vLLM's block pool (`touch`) when the save is planned,
  and lose it (`free_blocks`, tail first, so vLLM evicts a prefix's end before its start) once
  every worker has reported the save's job: a finished or preempted request's blocks are not
  reused while a write reads them.
- At most `max_fraction` of vLLM's blocks are held at once (`room_blocks`): the scheduler defers
  or drops saves past it, so saves never starve admission.
- Only this class takes or drops those references; job ids are its own, counted from 0.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class SavePins:
    def __init__(self, num_workers: int, max_fraction: float) -> None:
        self._num_workers = num_workers
        self._max_fraction = max_fraction
        self._block_pool = None
        self._jobs: dict[int, tuple[list[int], int]] = {}  # job id -> (block ids, workers yet to report)
        self._num_blocks = 0
        self._next_job_id = 0

    def bind(self, block_pool) -> None:
        self._block_pool = block_pool

    @property
    def bound(self) -> bool:
        return self._block_pool is not None

    def room_blocks(self) -> int:
        """How many more blocks may be held for saves now (negative past the limit)."""
        return int(self._max_fraction * self._block_pool.num_gpu_blocks) - self._num_blocks

    def pin(self, block_ids: list[int]) -> int:
        """Hold these blocks for a new save job; returns the job's id."""
        job_id, self._next_job_id = self._next_job_id, self._next_job_id + 1
        self._block_pool.touch([self._block_pool.blocks[b] for b in block_ids])
        self._jobs[job_id] = (block_ids, self._num_workers)
        self._num_blocks += len(block_ids)
        return job_id

    def reported(self, job_id: int, num_workers: int) -> None:
        """`num_workers` workers reported the job; the blocks go back once all of them have."""
        pinned = self._jobs.get(job_id)
        if pinned is None:
            log.warning("kvpool: a worker reported unknown save job %d", job_id)
            return
        block_ids, remaining = pinned[0], pinned[1] - num_workers
        if remaining > 0:
            self._jobs[job_id] = (block_ids, remaining)
            return
        del self._jobs[job_id]
        self._num_blocks -= len(block_ids)
        self._block_pool.free_blocks(self._block_pool.blocks[b] for b in reversed(block_ids))

    def has_pending(self) -> bool:
        return bool(self._jobs)
