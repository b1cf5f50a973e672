"""Tags on the segment lane (transfer/lane_tags.py): a WRITE that carries a tag has the node record
where it wrote, and READ_TAG returns the bytes there now with their offset; an unknown tag is a
short "not known"; bad tag requests are refused and the lane keeps serving; the index forgets the
least recently used tag first."""

from __future__ import annotations

import socket
import struct

import numpy as np
import pytest

from kvpool.transfer import lane_tags
from kvpool.transfer import segment_lane as sl
from kvpool.transfer.lane_tags import TagIndex, tag_of

import test_segment_lane
from test_segment_lane import _plane

segment, info = test_segment_lane.segment, test_segment_lane.info  # the fixtures, shared


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
        got = reader.read_tagged(info, tag, _new_array, 5.0)
        assert got is not None
        at, length, out, addr = got
        assert (at, length) == (offset, size) and addr == out.ctypes.data
        assert np.array_equal(out, data)
        assert reader.read_tagged(info, tag_of("tenant", "never-written"), _new_array, 5.0) is None
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
        assert plane.read_tagged(info, tag, _new_array, 5.0) is None


def test_the_bytes_read_by_tag_are_whatever_is_there_now(info):
    """A tag says where, not what: a later untagged write over the range is what READ_TAG returns
    (the client checks it against the master's answer, known_places.py)."""
    first, second = np.full(4096, 1, dtype=np.uint8), np.full(4096, 2, dtype=np.uint8)
    tag = tag_of("tenant", "overwritten")
    with _plane(first, second, path="lane") as plane:
        plane.transfer_many("WRITE", [(info, [first.ctypes.data], [40960], [4096])], 5.0, tags=[tag])
        plane.transfer("WRITE", info, [second.ctypes.data], [40960], [4096], 5.0)
        _, _, out, _ = plane.read_tagged(info, tag, _new_array, 5.0)
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
    (sl._HEAD.pack(sl.MAGIC, lane_tags.TAG, 2) + b"\0" * 16, b"one tag"),
    (sl._HEAD.pack(sl.MAGIC, lane_tags.TAG, 1) + struct.pack("<QQ", test_segment_lane.SEGMENT_BYTES - 10, 4096)
     + b"t" * 16, b"outside"),
    (sl._HEAD.pack(sl.MAGIC, lane_tags.TAG, 1) + struct.pack("<QQ", 0, 0) + b"t" * 16, b"outside"),
    (sl._HEAD.pack(sl.MAGIC, lane_tags.READ_TAG, 0), b"one tag"),
])
def test_bad_tag_requests_are_refused_and_the_lane_keeps_serving(segment, info, request_bytes, reason):
    with test_segment_lane._raw(segment) as sock:
        sock.sendall(request_bytes)
        status, body = test_segment_lane._reply(sock)
        assert status == 1 and reason in body
        assert sock.recv(1) == b""  # closed after the refusal
    assert len(segment._lane.tags) < lane_tags.MAX_TAGS  # nothing recorded beyond what the others wrote
    data = np.arange(4096, dtype=np.uint8)
    tag = tag_of("tenant", "after-a-refusal")
    with _plane(data, path="lane") as plane:
        plane.transfer_many("WRITE", [(info, [data.ctypes.data], [0], [4096])], 5.0, tags=[tag])
        assert np.array_equal(plane.read_tagged(info, tag, _new_array, 5.0)[2], data)


def test_a_tag_request_alone_records_and_read_tag_answers_not_known_in_one_short_reply(segment):
    tag = b"r" * 16
    assert _raw(segment, sl._HEAD.pack(sl.MAGIC, lane_tags.READ_TAG, 1) + tag) == \
        sl._REPLY.pack(lane_tags.NOT_KNOWN, 0)
    answer = _raw(segment, sl._HEAD.pack(sl.MAGIC, lane_tags.TAG, 1) + struct.pack("<QQ", 8192, 100) + tag
                  + sl._HEAD.pack(sl.MAGIC, lane_tags.READ_TAG, 1) + tag)
    status, length = sl._REPLY.unpack_from(answer)
    assert (status, length) == (lane_tags.KNOWN, 100)
    assert lane_tags.OFFSET.unpack_from(answer, sl._REPLY.size) == (8192,)
    assert len(answer) == sl._REPLY.size + 8 + 100
