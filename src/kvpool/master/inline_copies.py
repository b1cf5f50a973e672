"""Copies of the master's inline values on nodes, so that a restart or a failover keeps them.

Rules:
- Every inline value stored (inline.py) is copied to one node: a DIR_VALUE op in the directory log
  of one segment where the value's tenant places new objects (placement's rule: its dedicated
  segments, else the shared ones) that is not recovering, picked by the key's hash, stamped with this master's epoch. Every value
  dropped (removed, evicted, replaced) is dropped on the segment that holds its copy (`kept_on`).
  Copies and drops both count as commits (space.py): the reply to the request that made them waits
  until the node has them (durability.py), so a value removed or replaced never comes back as the
  old one after a crash.
- A value stored while no segment can take it, or whose segment went (unmounted, dead), has no
  copy: a restart loses it (a miss, recomputed), never anything else.
- On recovery a node announces its copies (AnnounceObjects.values). A copy is taken back as an
  inline value kept on that segment only when it was made by an earlier master (this one knows
  its own values: a copy of its own it does not hold was dropped while the node was away), the
  master holds nothing under its key, the node may hold that tenant's data, and it fits; any other
  copy is dropped from that node.
- Pure: the core calls it with the changes InlineValues recorded; the segment space writes the logs.
"""

from __future__ import annotations

from kvpool.core.protocol import PUT_ALLOCATED, VALUE_PINNED, DirEntry
from kvpool.master.inline import InlineValues
from kvpool.master.segments import Segment
from kvpool.master.space import SegmentSpace

_Key = tuple[str, str]  # (namespace, key)


class InlineCopies:
    def __init__(self, space: SegmentSpace, inline: InlineValues, owner_of, epoch: int) -> None:
        self.space = space
        self.inline = inline
        self.owner_of = owner_of  # namespace -> the tenant that owns it (access.namespace_owner)
        self.epoch = epoch
        self.kept_on: dict[_Key, int] = {}  # the segment id holding each value's copy
        self.copied = 0
        self.uncopied = 0  # values stored while no segment could keep a copy
        self.taken_back = 0
        inline.changes = []

    def apply(self) -> None:
        """Send what InlineValues recorded since the last call to the nodes."""
        self._send(self.inline.take_changes(), None, None)

    def _send(self, changes: list, adopted: _Key | None, on: Segment | None) -> None:
        """Copy stored values, drop the copies of dropped ones; `adopted`, stored from a copy on
        `on`, is kept there as it is."""
        by_id = self.space.segments.by_id
        for entry_key, value in changes:
            held = by_id.get(self.kept_on.pop(entry_key, 0))
            if held is not None:
                self._drop(held, entry_key)
            if value is None:
                continue
            if entry_key == adopted:
                self.kept_on[entry_key] = on.segment_id
                continue
            segment = self._choose(entry_key)
            if segment is None:
                self.uncopied += 1
                continue
            self.space.log_value(segment, entry_key[0], entry_key[1], value.data, value.pinned, self.epoch)
            self.kept_on[entry_key] = segment.segment_id
            self.copied += 1

    def _drop(self, segment: Segment, entry_key: _Key) -> None:
        self.space.log_value(segment, entry_key[0], entry_key[1], b"", False, self.epoch)

    def _may_hold(self, segment: Segment, namespace: str) -> bool:
        return segment.tenant in ("", self.owner_of(namespace))

    def _choose(self, entry_key: _Key) -> Segment | None:
        """Where the value's tenant places new objects (segments.placeable), not recovering."""
        group = self.space.placeable(self.owner_of(entry_key[0])).segments
        fit = [s for s in group.values() if not s.recovering]
        if not fit:
            return None
        return fit[hash(entry_key) % len(fit)]

    def announced(self, segment: Segment, values: list[DirEntry], holds, quota_of) -> int:
        """Take back the copies a recovering node announced; returns how many. `holds(tenant,
        key)`: whether the index holds that key; `quota_of(owner)`: its byte quota or None."""
        self.apply()  # what was recorded before: never mixed with what is taken back
        inline, taken = self.inline, 0
        for entry in values:
            if entry.size <= 0 or not entry.tenant or not entry.key:
                continue
            entry_key = (entry.tenant, entry.key)
            if (len(entry.value) != entry.size or entry.checksum == self.epoch
                    or not self._may_hold(segment, entry.tenant) or inline.contains(entry.tenant, entry.key)
                    or holds(entry.tenant, entry.key) or not inline.accepts(entry.size)):
                self._drop(segment, entry_key)
                continue
            owner = self.owner_of(entry.tenant)
            status, _ = inline.put(entry.tenant, owner, entry.key, entry.value, bool(entry.offset & VALUE_PINNED),
                                   quota_of(owner))
            self._send(inline.take_changes(), entry_key, segment)  # values it evicted lose their copies
            if status != PUT_ALLOCATED:  # no room: the copy goes
                self._drop(segment, entry_key)
                continue
            taken += 1
        self.taken_back += taken
        return taken

    def refused(self, segment: Segment, values: list[DirEntry]) -> None:
        """Copies announced too late (the segment's recovery had ended): the node drops them."""
        for entry in values:
            if entry.tenant and entry.key:
                self._drop(segment, (entry.tenant, entry.key))
