"""Rounds of transfers, one job per segment, shared by a put's writes and a get's reads.

Rules:
- A round asks the segment cache for every segment it touches, groups the objects by segment
  (plan.group_by_segment) and hands all jobs to the data plane at once; an object whose segment
  the master no longer knows fails without a transfer.
- A segment whose job failed is asked about again (segments.py), so a dead node's segment is
  forgotten as soon as the master has dropped it.
- No round waits longer than the client's `timeout_s`.
"""

from __future__ import annotations

from kvpool.client import plan
from kvpool.client.checksum import checksum_after
from kvpool.client.memory import RegisteredRanges
from kvpool.client.metrics import TenantMetrics
from kvpool.client.segments import SegmentCache
from kvpool.core.errors import KVPoolError
from kvpool.core.protocol import Replica

# a same-host read or put this large checksums each object right after its copy (memcopy.copy_objects)
CHECKSUM_DURING_COPY_BYTES = 8 << 20


def fence(in_flight: dict) -> None:
    """A read that missed its deadline may still write into the caller's memory: return only once
    every such transfer is over (the data plane ends it at its peer's death at the latest)."""
    for transfer in {id(t): t for t in in_flight.values()}.values():
        transfer.wait()


class Transfers:
    def __init__(self, plane, segments: SegmentCache, device_memory: RegisteredRanges, timeout_s: float,
                 metrics: TenantMetrics) -> None:
        self._plane = plane
        self._segments = segments
        self._device_memory = device_memory  # read only: memory.Registrations adds to it
        self._timeout_s = timeout_s
        self._metrics = metrics

    def on_host(self, addrs: list[list[int]]) -> list[int]:
        """Indices of the objects whose regions are host memory (one transfer's regions lie in one
        memory, so the first region tells)."""
        if not len(self._device_memory):
            return list(range(len(addrs)))
        return [i for i, a in enumerate(addrs) if a and not self._device_memory.contains(a[0], 1)]

    def carried_unregistered(self, op: str, choices: list[tuple[int, Replica]], totals: list[int]) -> bool:
        """Whether every chosen replica's route carries memory that is not registered (plane.py)."""
        infos = self._segments.get({r.segment_id for _, r in choices})
        return all(r.segment_id in infos and self._plane.carries_unregistered(op, infos[r.segment_id], totals[i])
                   for i, r in choices)

    def copies_locally(self, choices: list[tuple[int, Replica]]) -> bool:
        """Whether every chosen replica is written by a same-host copy (the shared-memory path)."""
        try:
            infos = self._segments.get({r.segment_id for _, r in choices})
            return all(r.segment_id in infos and self._plane.path_for(infos[r.segment_id]) == "shm" for _, r in choices)
        except KVPoolError:
            return False

    def run_round(
        self, op: str, choices: list[tuple[int, Replica]], addrs, sizes, timeout_s: float | None = None,
        checksum_into: tuple[dict, list[int]] | None = None, *, unregistered: bool = False, before_landing=None,
        sent=None, tags: list | None = None,
    ) -> tuple[set[int], dict]:
        """One round of transfers, one job per segment; returns (the object indices that failed,
        object index -> the data plane's StuckTransfer for failed ones whose transfer may still land).
        `checksum_into` (digests, expected): a shared-memory READ or WRITE of CHECKSUM_DURING_COPY_BYTES or
        more checksums each object with a non-zero expected checksum right after its copy, into
        digests[object index] (a smaller job is still in the CPU's last-level cache after its copy:
        checksummed after it in one call, without a call per object). `sent`: the data plane's
        hook, called once a WRITE's bytes are on their way (it must not raise). `tags[object
        index]`: a WRITE's lane tag for that object (transfer/tcp_path_tags.py), sent where its job holds it alone."""
        in_flight: dict = {}
        if not choices:
            return set(), in_flight
        infos = self._segments.get({r.segment_id for _, r in choices})
        failed = {i for i, r in choices if r.segment_id not in infos}
        jobs = plan.group_by_segment([(i, r) for i, r in choices if r.segment_id in infos], addrs, sizes)
        if not jobs:
            return failed, in_flight
        errors = self._plane.transfer_many(
            op,
            [(infos[j.segment_id], j.local_addrs, j.remote_offsets, j.sizes) for j in jobs],
            self._timeout_s if timeout_s is None else min(timeout_s, self._timeout_s),
            [checksum_after(j.object_indices, addrs, sizes, *checksum_into)
             if sum(j.sizes) >= CHECKSUM_DURING_COPY_BYTES else None for j in jobs] if checksum_into else None,
            unregistered=unregistered, before_landing=before_landing, sent=sent,
            tags=[tags[j.object_indices[0]] if len(j.object_indices) == 1 else None for j in jobs] if tags else None,
        )
        broken_segments = []
        for job, error in zip(jobs, errors):
            if error is not None:
                failed.update(job.object_indices)
                broken_segments.append(job.segment_id)
                if error.in_flight is not None:
                    in_flight.update(dict.fromkeys(job.object_indices, error.in_flight))
        if broken_segments:
            self._metrics.transfer_failures[op].inc(len(broken_segments))
            self._segments.recheck(broken_segments)
        return failed, in_flight
