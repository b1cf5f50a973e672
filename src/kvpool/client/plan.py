"""Pure planning for the client's transfers: no I/O, so the rules are unit-tested exactly.

Rules:
- Object i is the concatenation, in order, of its scatter-gather regions (addrs[i], sizes[i]);
  region k of object i lands at replica.offset + sum(sizes[i][:k]) inside the replica's segment.
- One data-plane job per segment per round: every region bound for (or read from) a segment goes
  into one descriptor list, so the data plane can post it as one batch.
- A get counts only LEADING keys read completely and before the lease deadline; a key read after
  its deadline is treated as failed, because its space may already hold another object.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.core.protocol import Replica


@dataclass
class SegmentJob:
    """The regions of one round that go to (or come from) one segment."""

    segment_id: int
    local_addrs: list[int] = field(default_factory=list)
    remote_offsets: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    object_indices: list[int] = field(default_factory=list)  # objects with regions in this job

    def add_object(self, index: int, replica: Replica, addrs: list[int], sizes: list[int]) -> None:
        offset = replica.offset
        for addr, size in zip(addrs, sizes):
            self.local_addrs.append(addr)
            self.remote_offsets.append(offset)
            self.sizes.append(size)
            offset += size
        self.object_indices.append(index)


def group_by_segment(
    choices: list[tuple[int, Replica]], addrs: list[list[int]], sizes: list[list[int]]
) -> list[SegmentJob]:
    """`choices`: (object index, the replica to use). Jobs come out in first-seen segment order."""
    jobs: dict[int, SegmentJob] = {}
    for index, replica in choices:
        job = jobs.get(replica.segment_id)
        if job is None:
            job = jobs[replica.segment_id] = SegmentJob(replica.segment_id)
        job.add_object(index, replica, addrs[index], sizes[index])
    return list(jobs.values())


def order_replicas(replicas: list[Replica], local_segment_ids: set[int]) -> list[Replica]:
    """Replicas on this host first (the shared-memory path is ~3x faster), otherwise as given."""
    return sorted(replicas, key=lambda r: r.segment_id not in local_segment_ids)


def leading_within_lease(completed_at: list[float | None], deadline: float) -> int:
    """How many leading objects completed (not None) no later than `deadline`."""
    count = 0
    for t in completed_at:
        if t is None or t > deadline:
            break
        count += 1
    return count


def normalize_regions(
    num_keys: int, addrs: list, sizes: list
) -> tuple[list[list[int]], list[list[int]]]:
    """Accept per-object region lists (or a bare int for a one-region object); validate shapes.
    Raises ValueError with the object index; the client turns it into a UsageError.
    Lists of plain ints are passed through uncopied (this runs per region on the hot path)."""
    if len(addrs) != num_keys or len(sizes) != num_keys:
        raise ValueError(f"got {num_keys} keys but {len(addrs)} addrs and {len(sizes)} sizes entries")
    out_addrs: list[list[int]] = []
    out_sizes: list[list[int]] = []
    for i, (a, s) in enumerate(zip(addrs, sizes)):
        a_list, s_list = _int_list(a, i), _int_list(s, i)
        if len(a_list) != len(s_list):
            raise ValueError(f"object {i}: {len(a_list)} addrs but {len(s_list)} sizes")
        if not a_list:
            raise ValueError(f"object {i}: no regions")
        if min(a_list) <= 0 or min(s_list) <= 0:
            raise ValueError(f"object {i}: need addr > 0 and size > 0, got addrs={a_list} sizes={s_list}")
        out_addrs.append(a_list)
        out_sizes.append(s_list)
    return out_addrs, out_sizes


def _int_list(value: object, index: int) -> list[int]:
    if type(value) is int:
        return [value]
    if type(value) is list and all(type(x) is int for x in value):
        return value
    if _is_int(value):
        return [int(value)]
    try:
        items = list(value)
    except TypeError:
        raise ValueError(f"object {index}: addrs and sizes must be ints or lists of ints, got {value!r}") from None
    for x in items:
        if not _is_int(x):
            raise ValueError(f"object {index}: addrs and sizes must be ints, got {x!r}")
    return [int(x) for x in items]


def _is_int(value: object) -> bool:
    # numpy integers count; bools do not
    return hasattr(value, "__index__") and not isinstance(value, bool) and not hasattr(value, "__len__")
