"""Copies of the master's inline values on nodes, so that a restart or a failover keeps them.

Rules:
- Every inline value stored (inline.py) is copied to one node: a DIR_VALUE op in the directory log
  of one mounted segment that is not recovering and may hold the value's tenant's data (shared, or
  that tenant's own), picked by the key's hash. The PutValue reply waits for the node to have it
  like any commit (durability.py). Every value dropped (removed, evicted, replaced) is dropped on
  the segment that holds its copy (`kept_on`), so a copy never outlives its value.
- A value stored while no segment can take it, or whose segment went (unmounted, dead), has no
  copy: a restart loses it (a miss, recomputed), never anything else.
- On recovery a node announces its copies (AnnounceObjects.values). One the master holds no value
  or object under is taken back as an inline value held on that segment; any other is dropped
  from that node: two copies of one key, or a copy of a key put again since, must never come back.
- Pure: the core calls it with the changes InlineValues recorded; the segment space writes the logs.
"""

from __future__ import annotations

from kvpool.core.protocol import PUT_ALLOCATED, VALUE_PINNED, DirEntry
from kvpool.master.inline import InlineValues
from kvpool.master.segments import Segment
from kvpool.master.space import SegmentSpace

_Key = tuple[str, str]  # (namespace, key)


class InlineCopies:
    def __init__(self, space: SegmentSpace, inline: InlineValues, owner_of) -> None:
        self.space = space
        self.inline = inline
        self.owner_of = owner_of  # namespace -> the tenant that owns it (access.namespace_owner)
        self.kept_on: dict[_Key, Segment] = {}
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
            held = self.kept_on.pop(entry_key, None)
            if held is not None and by_id.get(held.segment_id) is held:
                self.space.log_value(held, entry_key[0], entry_key[1], b"", False)
            if value is None:
                continue
            if entry_key == adopted:
                self.kept_on[entry_key] = on
                continue
            segment = self._choose(entry_key, by_id)
            if segment is None:
                self.uncopied += 1
                continue
            self.space.log_value(segment, entry_key[0], entry_key[1], value.data, value.pinned)
            self.kept_on[entry_key] = segment
            self.copied += 1

    def _choose(self, entry_key: _Key, by_id: dict) -> Segment | None:
        owner = self.owner_of(entry_key[0])
        fit = [s for s in by_id.values() if not s.recovering and s.tenant in ("", owner)]
        if not fit:
            return None
        return fit[hash(entry_key) % len(fit)]

    def announced(self, segment: Segment, values: list[DirEntry], holds, quota_of) -> int:
        """Take back the copies a recovering node announced; returns how many. `holds(tenant,
        key)`: whether the index holds that key; `quota_of(owner)`: its byte quota or None."""
        self.apply()  # what was recorded before: never mixed with what is taken back
        inline, taken = self.inline, 0
        for entry in values:
            if entry.size <= 0 or len(entry.value) != entry.size or not entry.tenant or not entry.key:
                continue
            entry_key = (entry.tenant, entry.key)
            if (inline.contains(entry.tenant, entry.key) or holds(entry.tenant, entry.key)
                    or not inline.accepts(entry.size)):
                self.space.log_value(segment, entry.tenant, entry.key, b"", False)
                continue
            owner = self.owner_of(entry.tenant)
            status, _ = inline.put(entry.tenant, owner, entry.key, entry.value, bool(entry.offset & VALUE_PINNED),
                                   quota_of(owner))
            self._send(inline.take_changes(), entry_key, segment)  # values it evicted lose their copies
            if status != PUT_ALLOCATED:  # no room: the copy goes
                self.space.log_value(segment, entry.tenant, entry.key, b"", False)
                continue
            taken += 1
        self.taken_back += taken
        return taken
