"""Prefix chains: which record names which as its parent, and how many children hold each.

Rules:
- This module is the only writer of a record's chain fields: `parent`, `num_children` (children
  holding DRAM, or pending) and `disk_children` (children held on disk only).
- A record with children is never evicted from DRAM (a cached suffix never outlives its prefix in
  the pool); a disk-only record leaves the pool only once it has no children at all.
- Every function returns the parent that has just become a tail (no DRAM child any more, and for a
  disk-only parent no disk child either), or None: the caller puts it back among eviction
  candidates. Nothing here knows about heaps, tiers or the index.
- Recovery relinks chains as entries arrive in any order: a child whose parent was not announced
  yet waits in `Orphans` until its parent comes or no segment is recovering any more.
"""

from __future__ import annotations

from kvpool.master.records import COMPLETE, GONE, ObjectRecord




def hold_parent(parent: ObjectRecord) -> None:
    """A put names `parent` (before it is placed: eviction for the put must spare its prefix)."""
    parent.num_children += 1


def release_parent(parent: ObjectRecord) -> ObjectRecord | None:
    """A child holding DRAM (or pending) left `parent`, or a put that held it was refused."""
    parent.num_children -= 1
    return parent if not parent.num_children else None


def attach(child: ObjectRecord, parent: ObjectRecord | None) -> None:
    """`child` was placed and names `parent` (already counted by hold_parent)."""
    child.parent = parent


def detach(rec: ObjectRecord) -> ObjectRecord | None:
    """`rec` leaves the index: out of its parent's counts."""
    parent = rec.parent
    if parent is None:
        return None
    rec.parent = None
    if not rec.locations:
        parent.disk_children -= 1
        return parent if not parent.disk_children and not parent.num_children else None
    return release_parent(parent)


def to_disk(rec: ObjectRecord) -> ObjectRecord | None:
    """`rec` lost its DRAM copy and lives on disk only (demotion)."""
    parent = rec.parent
    if parent is None:
        return None
    parent.num_children -= 1
    parent.disk_children += 1
    return parent if not parent.num_children else None


def to_dram(rec: ObjectRecord) -> None:
    """A disk-only `rec` holds DRAM again (promotion done)."""
    parent = rec.parent
    if parent is not None:
        parent.disk_children -= 1
        parent.num_children += 1


def _link(child: ObjectRecord, parent: ObjectRecord) -> None:
    child.parent = parent
    if child.locations:
        parent.num_children += 1
    else:
        parent.disk_children += 1


class Orphans:
    """Recovered records whose parent has not been announced yet, by (tenant, parent key)."""

    def __init__(self) -> None:
        self.waiting: dict[tuple[str, str], list[ObjectRecord]] = {}

    def link(self, rec: ObjectRecord, tenant: str, parent_key: str | None) -> None:
        """Join a recovered record to its parent (and its waiting children to it) once both are known."""
        waiting = self.waiting.pop((tenant, rec.key), None)
        if waiting:
            for child in waiting:
                if child.state != GONE and child.parent is None:
                    _link(child, rec)
        if parent_key is None:
            return
        parent = rec.space.get(parent_key)
        if parent is not None and parent.state == COMPLETE:
            _link(rec, parent)
        else:
            self.waiting.setdefault((tenant, parent_key), []).append(rec)

    def clear(self) -> None:
        self.waiting.clear()

    def __len__(self) -> int:
        return len(self.waiting)
