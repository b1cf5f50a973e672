"""A node's directory: the committed objects its segment holds, as the master reported them.

Rules:
- Fed only by the master's DirectoryDelta ops (heartbeat replies), applied in sequence order:
  an op already applied is skipped, a gap (ops lost) or a `reset` empties the directory first,
  so the directory never lists an object the master has not committed there. It may list fewer.
- Self-describing: each entry holds key, tenant, size, offset, parent and checksum, everything a
  new master needs to rebuild its record (AnnounceObjects), plus when it was committed here, which
  gives the new master its LRU order. Readers verify the checksum, so an entry whose bytes were
  overwritten since (the directory lags the master by up to one heartbeat) is a miss, never wrong
  data.
- It lives in the node process, beside the segment it describes: both outlive any master and end
  together (a restarted node has new, empty memory and nothing to announce).
- Ops that ask for disk-tier work (DIR_PROMOTE, DIR_DISK_DROP; core/protocol/records.py) are handed to
  `on_ops` too and leave the directory as it is: a DIR_DISK_DROP names no DRAM range, and a
  promotion is recorded (`record`) only once it landed and the master was told, so a new master
  is never announced a range whose bytes never came.
- It also keeps the copies of the master's inline values the master sends (DIR_VALUE ops), by
  (tenant, key), and announces them back (master/inline_copies.py); an op of size 0 drops one.
- Pure: no I/O, times passed in.
"""

from __future__ import annotations

from kvpool.core.protocol import DIR_COMMIT, DIR_VALUE, DirEntry, DirectoryDelta


class NodeDirectory:
    def __init__(self) -> None:
        self._entries: dict[int, tuple[DirEntry, float]] = {}  # offset -> (entry, committed at); commit order
        self.applied_seq = 0  # last op applied from the current mount's log
        self.values: dict[tuple[str, str], DirEntry] = {}  # (tenant, key) -> the DIR_VALUE op keeping its copy
        self.resets = 0

    def __len__(self) -> int:
        return len(self._entries)

    def new_mount(self) -> None:
        """The segment was mounted again: the master's log for it starts over at 1."""
        self.applied_seq = 0

    def apply(self, delta: DirectoryDelta, now_s: float, on_ops=None) -> int:
        """Apply a delta's ops in order; returns how many were new. `on_ops(segment_id, ops)` gets
        the new ones (the disk tier's feed)."""
        skip = 0
        if delta.reset or delta.first_seq > self.applied_seq + 1:
            self._entries.clear()
            self.values.clear()
            self.resets += 1
        else:
            skip = self.applied_seq + 1 - delta.first_seq
        entries = self._entries
        fresh = delta.ops[skip:] if skip > 0 else delta.ops
        for op in fresh:
            if op.op == DIR_VALUE:
                if op.size > 0:
                    self.values[(op.tenant, op.key)] = op
                else:
                    self.values.pop((op.tenant, op.key), None)
                continue
            if op.op != DIR_COMMIT:
                continue
            entries.pop(op.offset, None)
            if op.size > 0:
                entries[op.offset] = (op, now_s)
        if on_ops is not None and fresh:
            on_ops(delta.segment_id, fresh)
        new = max(0, len(delta.ops) - skip)
        self.applied_seq = max(self.applied_seq, delta.first_seq + len(delta.ops) - 1)
        return new

    def record(self, op: DirEntry, now_s: float) -> None:
        """A promotion into `op.offset` landed and the master knows: the range holds the object."""
        self._entries.pop(op.offset, None)
        self._entries[op.offset] = (op, now_s)

    def forget(self, offsets: list[int]) -> None:
        for offset in offsets:
            self._entries.pop(offset, None)

    def oldest_first(self, now_s: float) -> tuple[list[DirEntry], list[float]]:
        """Every entry, oldest commit first, with its age in seconds."""
        entries, ages = [], []
        for entry, committed_s in self._entries.values():
            entries.append(entry)
            ages.append(max(0.0, now_s - committed_s))
        return entries, ages
