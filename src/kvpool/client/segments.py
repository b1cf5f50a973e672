"""The client's cache of segment descriptions (what the data plane needs to reach a segment).

Rules:
- Entries are keyed by segment id and never go stale in place: a remount gets a new id, and ids
  are unique across master incarnations, so an id either describes the same segment or is gone.
- A new master incarnation empties the cache and drops the data plane's routes (`on_new_epoch`,
  called by the channel before the new incarnation's reply is used).
- Unknown ids are fetched in one GetSegments round trip per call; ids the master leaves out are
  gone, and the data plane forgets them (drops its mapping or remote agent).
- After a failed transfer the failing ids are asked about again, so a dead node's segment is
  forgotten as soon as the master has dropped it (until then the data plane fails fast on it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from kvpool.core import protocol
from kvpool.core.protocol import SegmentInfo


class SegmentCache:
    def __init__(self, call: Callable, plane, host_id: str) -> None:
        self._call = call  # call(request, reply_type) -> reply
        self._plane = plane
        self._host_id = host_id
        self._by_id: dict[int, SegmentInfo] = {}
        self._lock = threading.Lock()

    def get(self, segment_ids: Iterable[int]) -> dict[int, SegmentInfo]:
        """The known ones among `segment_ids` (fetching what is not cached)."""
        segment_ids = set(segment_ids)
        with self._lock:
            known = {s: self._by_id[s] for s in segment_ids if s in self._by_id}
        missing = sorted(segment_ids - known.keys())
        if missing:
            reply = self._call(protocol.GetSegments(missing), protocol.SegmentsReply)
            with self._lock:
                for info in reply.segments:
                    self._by_id[info.segment_id] = info
                    known[info.segment_id] = info
            for segment_id in missing:
                if segment_id not in known:  # unmounted since the reply that named it
                    self._plane.forget_segment(segment_id)
        return known

    def recheck(self, segment_ids: Iterable[int]) -> None:
        """Forget the segments among `segment_ids` that the master no longer knows."""
        segment_ids = sorted(set(segment_ids))
        reply = self._call(protocol.GetSegments(segment_ids), protocol.SegmentsReply)
        alive = {info.segment_id for info in reply.segments}
        for segment_id in segment_ids:
            if segment_id not in alive:
                with self._lock:
                    self._by_id.pop(segment_id, None)
                self._plane.forget_segment(segment_id)

    def on_new_epoch(self, old_epoch: int | None, new_epoch: int) -> None:
        if old_epoch is None:
            return
        with self._lock:
            dropped, self._by_id = list(self._by_id), {}
        for segment_id in dropped:
            self._plane.forget_segment(segment_id)

    def local_ids(self) -> set[int]:
        """Cached segments on this host (reachable through the shared-memory path)."""
        with self._lock:
            return {s for s, info in self._by_id.items() if info.host_id == self._host_id}

    def lane_segments(self, include_local: bool = False) -> list[SegmentInfo]:
        """Cached segments that serve a segment lane, by id: those on other hosts, or all with
        `include_local` (a client whose path is "lane"); a tag read's candidates."""
        with self._lock:
            return [info for _, info in sorted(self._by_id.items())
                    if info.lane_address and (include_local or info.host_id != self._host_id)]
