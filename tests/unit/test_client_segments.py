"""The client's segment cache: one GetSegments per miss, gone segments forgotten by the plane.
The master is a recorded function here: the cache's rules, not the wire, are under test."""

from kvpool.client.segments import SegmentCache
from kvpool.core import protocol
from kvpool.core.protocol import SegmentInfo


def _info(segment_id: int, host: str = "h1") -> SegmentInfo:
    return SegmentInfo(segment_id, f"node{segment_id}", host, 1 << 20, 4096, f"agent{segment_id}", b"md")


class _Master:
    def __init__(self, known: dict[int, SegmentInfo]) -> None:
        self.known = known
        self.asked: list[list[int]] = []

    def __call__(self, request, reply_type):
        assert isinstance(request, protocol.GetSegments) and reply_type is protocol.SegmentsReply
        self.asked.append(list(request.segment_ids))
        return protocol.SegmentsReply([self.known[s] for s in request.segment_ids if s in self.known])


class _Plane:
    def __init__(self) -> None:
        self.forgotten: list[int] = []

    def forget_segment(self, segment_id: int) -> None:
        self.forgotten.append(segment_id)


def test_fetches_only_what_is_missing_and_forgets_unknown_ids():
    master, plane = _Master({1: _info(1), 2: _info(2, "h2")}), _Plane()
    cache = SegmentCache(master, plane, "h1")
    assert set(cache.get({1, 3})) == {1}
    assert master.asked == [[1, 3]] and plane.forgotten == [3]
    assert set(cache.get({1, 2})) == {1, 2}
    assert master.asked == [[1, 3], [2]]  # 1 came from the cache
    assert cache.local_ids() == {1}  # 2 lives on another host


def test_recheck_forgets_segments_the_master_dropped():
    master, plane = _Master({1: _info(1), 2: _info(2)}), _Plane()
    cache = SegmentCache(master, plane, "h1")
    cache.get({1, 2})
    del master.known[2]  # node 2 died and the master noticed
    cache.recheck([1, 2])
    assert plane.forgotten == [2]
    assert cache.local_ids() == {1}
    cache.recheck([1])  # still alive: kept
    assert plane.forgotten == [2] and cache.local_ids() == {1}
