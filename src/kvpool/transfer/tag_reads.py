"""Reading a value by its tag from the nodes that may hold it (tcp_path_tags.py): the data plane's side.

Rules:
- Every given segment whose route has a TCP path (not shared memory) and a connection free
  right now is asked at once (READ_TAG sent on each), then the answers are taken in order: the
  first node that knows the tag is read into `make(size)`'s output. After that, another answer is
  read only if it is "not known" (9 bytes); one that would send bytes too (a replica) has its
  connection closed rather than drained, so a cold get never moves a value twice.
- A connection goes back to its lane only once its answer was read whole; one whose answer was
  not read (an error in `make` or `before_landing`, an interrupt, a later ask that failed, a
  replica's bytes) is closed first, so no later job on it reads a stale answer (a READ that took
  a tag's reply as its own would return shifted bytes; a WRITE that took it as a refusal would
  leave its bytes landing unfenced).
- An ask connects within ASK_CONNECT_S at most (a node that died and drops packets would hold
  every cold get for the full connect timeout), and a segment whose ask or answer failed is not
  asked again for SKIP_FAILED_S: the client also asks the master whether it still exists.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from kvpool.core.errors import TransferError
from kvpool.core.protocol import SegmentInfo

ASK_CONNECT_S = 0.5
SKIP_FAILED_S = 5.0


class _Unwanted(Exception):
    """A second node's answer carries the bytes too: its connection is closed, not drained."""


def _unwanted(size: int):
    raise _Unwanted


class TagReader:
    """The data plane's tag reads; `lane_of(segment)`: its route's TcpPath, or None."""

    def __init__(self, lane_of: Callable[[SegmentInfo], object]) -> None:
        self._lane_of = lane_of
        self._lock = threading.Lock()
        self._failed_until: dict[int, float] = {}  # segment id -> monotonic time to ask again from

    def read(self, segments: Sequence[SegmentInfo], tag: bytes, make, timeout_s: float, before_landing=None):
        """(segment, offset, size, output, address) from the first node that knows `tag`; None
        when none knows it or none could be asked; TransferError (with `segment_ids`, the segments
        that failed) when none knew it and an ask or answer failed."""
        now = time.monotonic()
        deadline = now + timeout_s
        asked: list[list] = []  # [segment, lane, connection, answer read whole]
        found = failure = None
        failed: list[int] = []
        try:
            for segment in self._askable(segments, now):
                try:
                    lane = self._lane_of(segment)
                except TransferError as e:
                    failure = e
                    failed.append(segment.segment_id)
                    continue
                conn = lane.try_acquire() if lane is not None else None
                if conn is None:
                    continue
                entry = [segment, lane, conn, False]
                asked.append(entry)
                try:
                    conn.ask_tag(tag, min(deadline, now + ASK_CONNECT_S))
                except TransferError as e:
                    entry[3] = True  # closed by the failure: nothing to read
                    failure = e
                    failed.append(segment.segment_id)
            for entry in asked:
                segment, lane, conn, done = entry
                if done:
                    continue
                first = found is None
                try:
                    got = conn.take_tagged(make if first else _unwanted, deadline,
                                           before_landing if first else None, lane.spin if first else None)
                except _Unwanted:
                    entry[3] = True  # closed by take_tagged
                    continue
                except TransferError as e:
                    entry[3] = True
                    failure = e
                    failed.append(segment.segment_id)
                    continue
                entry[3] = True
                if got is not None and first:
                    found = (segment, *got)
        finally:
            for _, lane, conn, done in asked:
                if not done:
                    conn.close()  # its answer may still come: never read by another job
                lane.release(conn)
            if failed:
                self._skip(failed)
        if found is None and failure is not None:
            error = TransferError(str(failure))
            error.segment_ids = failed
            raise error
        return found

    def _askable(self, segments: Sequence[SegmentInfo], now: float) -> list[SegmentInfo]:
        with self._lock:
            if not self._failed_until:
                return list(segments)
            self._failed_until = {s: t for s, t in self._failed_until.items() if t > now}
            return [s for s in segments if s.segment_id not in self._failed_until]

    def _skip(self, segment_ids: list[int]) -> None:
        until = time.monotonic() + SKIP_FAILED_S
        with self._lock:
            for segment_id in segment_ids:
                self._failed_until[segment_id] = until
