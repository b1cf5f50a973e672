"""A segment's directory log: the ops its node has not acknowledged yet (pure).

Rules:
- The master appends one op per change to what the segment holds committed: an add when a put
  ends, a removal (size 0) when a committed object goes (evicted, removed, rejected on recovery).
  Ops are numbered from 1 in append order; the node applies them in order and acknowledges the
  last one it applied in its next heartbeat, which drops them here.
- A heartbeat reply carries at most `max_ops_per_reply` ops, and copies of inline values (DIR_VALUE)
  of at most MAX_VALUE_BYTES_PER_REPLY together (one op at least); the node asks again at once when
  the reply was full.
- The log is bounded (`max_ops`): a node that stops acknowledging (stuck, partitioned) would grow
  it without end. Past the bound the log is dropped and the next delta says `reset`: the node
  forgets its directory and starts again from the ops after it. That node then cannot bring those
  objects back after a master restart (they are recomputed); nothing is ever served wrong.
"""

from __future__ import annotations

import itertools
from collections import deque

from kvpool.core.protocol import DirEntry, DirectoryDelta


MAX_VALUE_BYTES_PER_REPLY = 8 << 20


class DirectoryLog:
    __slots__ = ("ops", "first_seq", "reset", "max_ops", "value_bytes")

    def __init__(self, max_ops: int) -> None:
        self.ops: deque[DirEntry] = deque()
        self.first_seq = 1  # sequence number of ops[0]
        self.reset = False
        self.max_ops = max_ops
        self.value_bytes = 0  # of the inline value copies among `ops`

    @property
    def last_seq(self) -> int:
        return self.first_seq + len(self.ops) - 1

    def append(self, op: DirEntry) -> None:
        if len(self.ops) >= self.max_ops:
            self.first_seq += len(self.ops)
            self.ops.clear()
            self.value_bytes = 0
            self.reset = True
        self.ops.append(op)
        self.value_bytes += len(op.value)

    def ack(self, seq: int) -> None:
        """The node has applied every op up to `seq`. After a reset, only an acknowledgement at or
        past the reset point counts (it comes from a node that applied the reset, or one that had
        applied every op the reset dropped, whose directory is therefore whole)."""
        if self.reset:
            if seq < self.first_seq - 1:
                return
            self.reset = False
        ops = self.ops
        drop = min(seq - self.first_seq + 1, len(ops))
        if self.value_bytes:
            for _ in range(drop):
                self.value_bytes -= len(ops.popleft().value)
        else:
            for _ in range(drop):
                ops.popleft()
        if drop > 0:
            self.first_seq += drop

    def delta(self, segment_id: int, max_ops_per_reply: int) -> DirectoryDelta | None:
        if not self.ops and not self.reset:
            return None
        n = min(len(self.ops), max_ops_per_reply)
        if self.value_bytes > MAX_VALUE_BYTES_PER_REPLY:  # a backlog of value copies: cut it by bytes too
            size = 0
            for i, op in enumerate(itertools.islice(self.ops, n)):
                size += len(op.value)
                if size > MAX_VALUE_BYTES_PER_REPLY and i > 0:
                    n = i
                    break
        ops = [self.ops[i] for i in range(n)] if n < len(self.ops) else list(self.ops)
        return DirectoryDelta(segment_id, self.first_seq, ops, self.reset, more=n < len(self.ops))
