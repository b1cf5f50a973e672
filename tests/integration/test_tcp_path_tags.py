"""Tags on the TCP path (transfer/tcp_path_tags.py): a WRITE that carries a tag has the node record
where it wrote, and READ_TAG returns the bytes there now with their offset; an unknown tag is a
short "not known"; bad tag requests are refused and the lane keeps serving; the index forgets the
least recently used tag first."""

from __future__ import annotations

import socket
import struct

import numpy as np
import pytest

from kvpool.core.errors import TransferError
from kvpool.transfer import tcp_path_tags
from kvpool.transfer import tcp_path_wire as wire
from kvpool.transfer.tcp_path_tags import TagIndex, tag_of

import test_tcp_path
from test_tcp_path import _plane

segment, info = test_tcp_path.segment, test_tcp_path.info  # the fixtures, shared


def _new_array(size: int):
    array = np.empty(size, dtype=np.uint8)
    return array, int(array.ctypes.data)


def test_a_tag_is_a_16_byte_digest_of_tenant_and_key():
    assert len(tag_of("t", "k")) == 16
    assert tag_of("t", "k") == tag_of("t", "k")
    assert len({tag_of("t", "k"), tag_of("t", "k2"), tag_of("t2", "k"), tag_of("t\0k", "")}) == 4
    assert len(tag_of("t", "x" * 1024)) == 16


def test_the_index_keeps_the_last_place_and_forgets_the_least_recently_used():
    index = TagIndex(max_tags=3)
    for n in range(3):
        index.note(bytes([n]) * 16, n * 100, 10)
    index.note(bytes([0]) * 16, 555, 20)  # rewritten: the last place wins, and it is the newest
    assert index.find(bytes([1]) * 16) == (100, 10)  # read: now newer than tag 2
    index.note(bytes([3]) * 16, 300, 10)
    assert index.find(bytes([2]) * 16) is None  # the least recently used went
    assert index.find(bytes([0]) * 16) == (555, 20)
    assert len(index) == 3


@pytest.mark.parametrize("size", [4096, 3 << 20])  # whole, and written in two halves (>= 2 MiB)
def test_a_tagged_write_is_read_back_by_tag_from_another_client(info, size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    tag = tag_of("tenant", f"value-{size}")
    offset = 12288
    with _plane(data, path="lane") as writer, _plane(path="lane") as reader:
        assert writer.transfer_many("WRITE", [(info, [data.ctypes.data], [offset], [size])], 5.0,
                                    tags=[tag]) == [None]
        got = reader.read_tagged([info], tag, _new_array, 5.0)
        assert got is not None
        where, at, length, out, addr = got
        assert where is info and (at, length) == (offset, size) and addr == out.ctypes.data
        assert np.array_equal(out, data)
        assert reader.read_tagged([info], tag_of("tenant", "never-written"), _new_array, 5.0) is None
        # the same connection serves a plain READ after both answers
        back = np.zeros(size, dtype=np.uint8)
        reader.register(back.ctypes.data, size)
        reader.transfer("READ", info, [back.ctypes.data], [offset], [size], 5.0)
        assert np.array_equal(back, data)


def test_a_write_without_a_tag_or_of_several_regions_records_none(info):
    data = np.arange(8192, dtype=np.uint8)
    tag = tag_of("tenant", "scattered")
    with _plane(data, path="lane") as plane:
        plane.transfer_many("WRITE", [(info, [data.ctypes.data, data.ctypes.data + 4096], [0, 65536],
                                       [4096, 4096])], 5.0, tags=[tag])
        assert plane.read_tagged([info], tag, _new_array, 5.0) is None


def test_the_bytes_read_by_tag_are_whatever_is_there_now(info):
    """A tag says where, not what: a later untagged write over the range is what READ_TAG returns
    (the client checks it against the master's answer, known_places.py)."""
    first, second = np.full(4096, 1, dtype=np.uint8), np.full(4096, 2, dtype=np.uint8)
    tag = tag_of("tenant", "overwritten")
    with _plane(first, second, path="lane") as plane:
        plane.transfer_many("WRITE", [(info, [first.ctypes.data], [40960], [4096])], 5.0, tags=[tag])
        plane.transfer("WRITE", info, [second.ctypes.data], [40960], [4096], 5.0)
        _, _, _, out, _ = plane.read_tagged([info], tag, _new_array, 5.0)
        assert np.array_equal(out, second)


def _raw(segment, request: bytes) -> bytes:
    host, _, port = segment.lane_address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize("request_bytes, reason", [
    (wire.HEAD.pack(wire.MAGIC, tcp_path_tags.TAG, 2) + b"\0" * 16, b"one tag"),
    (wire.HEAD.pack(wire.MAGIC, tcp_path_tags.READ_TAG, 0), b"one tag"),
])
def test_bad_tag_requests_are_refused_and_the_lane_keeps_serving(segment, info, request_bytes, reason):
    with test_tcp_path._raw(segment) as sock:
        sock.sendall(request_bytes)
        status, body = test_tcp_path._reply(sock)
        assert status == 1 and reason in body
        assert sock.recv(1) == b""  # closed after the refusal
    data = np.arange(4096, dtype=np.uint8)
    tag = tag_of("tenant", "after-a-refusal")
    with _plane(data, path="lane") as plane:
        plane.transfer_many("WRITE", [(info, [data.ctypes.data], [0], [4096])], 5.0, tags=[tag])
        assert np.array_equal(plane.read_tagged([info], tag, _new_array, 5.0)[3], data)


@pytest.mark.parametrize("offset, size", [(test_tcp_path.SEGMENT_BYTES - 10, 4096), (0, 0), (2**64 - 1, 1)])
def test_a_tag_outside_the_segment_is_not_recorded_nor_answered_and_the_connection_goes_on(segment, offset, size):
    tag = b"o" * 16
    answer = _raw(segment, wire.HEAD.pack(wire.MAGIC, tcp_path_tags.TAG, 1) + struct.pack("<QQ", offset, size) + tag
                  + wire.HEAD.pack(wire.MAGIC, tcp_path_tags.READ_TAG, 1) + tag)
    assert answer == wire.REPLY.pack(tcp_path_tags.NOT_KNOWN, 0)  # only the READ_TAG's answer


def test_a_tagged_write_of_more_than_one_request_is_tagged_and_read_back_the_usual_way(segment, info, monkeypatch):
    """A value over one request's bytes: its tag is recorded, the write's answer is the only one
    the writer reads, and a READ_TAG answers "not known" (one reply is at most a request's bytes)."""
    monkeypatch.setattr(wire, "MAX_REQUEST_BYTES", 64 << 10)  # the client cuts the job into requests of 64 KiB
    monkeypatch.setattr(segment._lane, "_max_bytes", 64 << 10)  # and the node takes no more per request
    data = np.random.default_rng(3).integers(0, 256, 200 << 10, dtype=np.uint8)
    tag = tag_of("tenant", "large")
    with _plane(data, path="lane") as plane:
        for _ in range(2):  # the second write on the same connection: no stray answer in between
            assert plane.transfer_many("WRITE", [(info, [data.ctypes.data], [0], [data.nbytes])], 5.0,
                                       tags=[tag]) == [None]
        assert segment._lane.tags.find(tag) == (0, data.nbytes)
        assert plane.read_tagged([info], tag, _new_array, 5.0) is None


def test_a_tag_request_alone_records_and_read_tag_answers_not_known_in_one_short_reply(segment):
    tag = b"r" * 16
    assert _raw(segment, wire.HEAD.pack(wire.MAGIC, tcp_path_tags.READ_TAG, 1) + tag) == \
        wire.REPLY.pack(tcp_path_tags.NOT_KNOWN, 0)
    answer = _raw(segment, wire.HEAD.pack(wire.MAGIC, tcp_path_tags.TAG, 1) + struct.pack("<QQ", 8192, 100) + tag
                  + wire.HEAD.pack(wire.MAGIC, tcp_path_tags.READ_TAG, 1) + tag)
    status, length = wire.REPLY.unpack_from(answer)
    assert (status, length) == (tcp_path_tags.KNOWN, 100)
    assert tcp_path_tags.OFFSET.unpack_from(answer, wire.REPLY.size) == (8192,)
    assert len(answer) == wire.REPLY.size + 8 + 100


def test_several_segments_are_asked_at_once_and_the_one_that_knows_is_read(info):
    """Two segments (two nodes' lanes): the tag is known by the second only, then by both (a
    replica): the first that knows is read, the other's answer drained, and the connections
    serve the next job."""
    from kvpool.transfer import SegmentMemory
    import msgspec

    data = np.random.default_rng(7).integers(0, 256, 1 << 16, dtype=np.uint8)
    tag = tag_of("tenant", "on-the-second")
    with SegmentMemory(1 << 20, name="lane-unit-2", lane_host="127.0.0.1") as other:
        second = msgspec.structs.replace(other.segment_info(segment_id=2, node_id="n2"), host_id="another-host")
        with _plane(data, path="lane") as plane:
            plane.transfer_many("WRITE", [(second, [data.ctypes.data], [4096], [data.nbytes])], 5.0, tags=[tag])
            where, offset, size, out, _ = plane.read_tagged([info, second], tag, _new_array, 5.0)
            assert where is second and (offset, size) == (4096, data.nbytes) and np.array_equal(out, data)
            plane.transfer_many("WRITE", [(info, [data.ctypes.data], [8192], [data.nbytes])], 5.0, tags=[tag])
            where, offset, _, out, _ = plane.read_tagged([info, second], tag, _new_array, 5.0)
            assert where is info and offset == 8192 and np.array_equal(out, data)
            assert plane.read_tagged([info, second], tag_of("tenant", "nowhere"), _new_array, 5.0) is None
            back = np.zeros_like(data)
            plane.register(back.ctypes.data, back.nbytes)
            plane.transfer("READ", second, [back.ctypes.data], [4096], [data.nbytes], 5.0)
            assert np.array_equal(back, data)


def _second_segment(name: str):
    from kvpool.transfer import SegmentMemory
    import msgspec

    memory = SegmentMemory(1 << 20, name=name, lane_host="127.0.0.1")
    return memory, msgspec.structs.replace(memory.segment_info(segment_id=3, node_id="n3"), host_id="another-host")


def _all_back(plane, info) -> bool:
    """Every connection the segment's lane made is idle in it again (none held by a tag read)."""
    lane = plane._routes[info.segment_id].lane
    return lane._open == len(lane._idle)


def test_a_failing_make_closes_every_unread_answer_and_the_connections_serve_the_next_jobs(info):
    """`make` raises with two answers pending: both connections are closed before they go back,
    so the next READ on each gets its own answer, not the tag's (no shifted bytes)."""
    data = np.random.default_rng(11).integers(0, 256, 1 << 16, dtype=np.uint8)
    tag = tag_of("tenant", "make-fails")
    memory, other = _second_segment("lane-unit-make")
    with memory, _plane(data, path="lane") as plane:
        for where in (info, other):
            plane.transfer_many("WRITE", [(where, [data.ctypes.data], [0], [data.nbytes])], 5.0, tags=[tag])

        def failing(size):
            raise MemoryError("no memory for the value")

        for _ in range(3):
            with pytest.raises(MemoryError):
                plane.read_tagged([info, other], tag, failing, 5.0)
        for where in (info, other):
            back = np.zeros_like(data)
            plane.register(back.ctypes.data, back.nbytes)
            plane.transfer("READ", where, [back.ctypes.data], [0], [data.nbytes], 5.0)
            assert np.array_equal(back, data)
            plane.unregister(back.ctypes.data)
            assert _all_back(plane, where)


def test_a_replica_that_knows_the_tag_is_not_drained_and_its_connection_is_remade(info):
    data = np.random.default_rng(12).integers(0, 256, 1 << 16, dtype=np.uint8)
    tag = tag_of("tenant", "replicated")
    memory, other = _second_segment("lane-unit-replica")
    with memory, _plane(data, path="lane") as plane:
        for where in (info, other):
            plane.transfer_many("WRITE", [(where, [data.ctypes.data], [4096], [data.nbytes])], 5.0, tags=[tag])
        for _ in range(3):
            where, offset, _, out, _ = plane.read_tagged([info, other], tag, _new_array, 5.0)
            assert where is info and offset == 4096 and np.array_equal(out, data)
        assert memory._lane.tags.known == 3  # the replica answered each time; its bytes were not read
        back = np.zeros_like(data)
        plane.register(back.ctypes.data, back.nbytes)
        plane.transfer("READ", other, [back.ctypes.data], [4096], [data.nbytes], 5.0)
        assert np.array_equal(back, data)


def test_a_dead_segment_among_those_asked_costs_one_short_connect_then_is_skipped(info):
    """A segment whose lane refuses connections: the others are still read; it is skipped for a
    while after the failure, and its connection goes back to its lane (no leak, no hang)."""
    import msgspec
    import time

    data = np.arange(1 << 12, dtype=np.uint16).view(np.uint8)
    tag = tag_of("tenant", "beside-a-dead-one")
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead = msgspec.structs.replace(info, segment_id=9, agent_name="dead",
                                   lane_address=f"127.0.0.1:{closed.getsockname()[1]}")
    closed.close()  # nothing listens there now: connections are refused
    with _plane(data, path="lane") as plane:
        plane.transfer_many("WRITE", [(info, [data.ctypes.data], [0], [data.nbytes])], 5.0, tags=[tag])
        started = time.monotonic()
        for _ in range(8):
            where, _, _, out, _ = plane.read_tagged([dead, info], tag, _new_array, 5.0)
            assert where is info and np.array_equal(out, data)
        assert time.monotonic() - started < 5.0
        assert _all_back(plane, dead) and _all_back(plane, info)
        with pytest.raises(TransferError) as failure:
            plane._tag_reader._failed_until.clear()
            plane.read_tagged([dead], tag, _new_array, 5.0)
        assert failure.value.segment_ids == [9]
        assert plane.read_tagged([dead], tag, _new_array, 5.0) is None  # skipped now: nothing asked
