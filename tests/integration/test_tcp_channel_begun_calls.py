"""Calls begun on the lane and finished later (LaneChannel.begin / finish, client/landing.py): a
begun call's reply read by another call is kept for its finish, an abandoned one is dropped, a lane
that closes in between or a master that never answers fails the finish; and the master handles the
one-way frames of one wake-up before the calls read with them (a PutLanded before a lookup)."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from kvpool.core import protocol as p
from kvpool.core.errors import UnavailableError
from kvpool.master.config import MasterConfig
from kvpool.master.service import MasterService
from kvpool.rpc.zmq_channel import MasterChannel
from kvpool.rpc.tcp_channel import LaneChannel
from test_tcp_channel import _lane_on, _reply_frame, read_reply


def read_request(sock: socket.socket) -> tuple[int, p.Request]:
    head = b""
    while len(head) < 12:
        head += sock.recv(12 - len(head))
    length, request_id = struct.unpack("<IQ", head)
    body = b""
    while len(body) < length:
        body += sock.recv(length - len(body))
    return request_id, p.request_decoder.decode(body)


@pytest.fixture
def lane():
    ours, master_end = socket.socketpair()
    channel = _lane_on(ours)
    yield channel, master_end
    ours.close()
    master_end.close()


def test_a_begun_calls_reply_read_by_another_call_is_kept_for_its_finish(lane):
    channel, master_end = lane
    begun = channel.begin(p.Stats())
    first_id, first = read_request(master_end)
    assert isinstance(first, p.Stats) and first_id == begun.request_id
    got = {}
    caller = threading.Thread(target=lambda: got.update(reply=channel.call(p.Exists("t", ["k"]))))
    caller.start()
    second_id, second = read_request(master_end)
    assert isinstance(second, p.Exists)
    # the master answers in order: the begun call's reply comes first and the other call reads it
    master_end.sendall(_reply_frame(first_id, p.OkReply(count=7)) + _reply_frame(second_id, p.ExistsReply([True])))
    caller.join(5.0)
    assert got["reply"] == p.ExistsReply([True])
    assert channel._parked  # kept, not dropped
    assert channel.finish(begun) == p.OkReply(count=7)
    assert not channel._parked and not channel._awaited


def test_an_abandoned_calls_reply_is_dropped_and_a_finish_after_the_lane_closed_fails(lane):
    channel, master_end = lane
    begun = channel.begin(p.Stats())
    first_id, _ = read_request(master_end)
    channel.abandon(begun)
    master_end.sendall(_reply_frame(first_id, p.OkReply(count=1)))
    caller = threading.Thread(target=lambda: channel.call(p.Stats()))
    caller.start()
    second_id, _ = read_request(master_end)
    master_end.sendall(_reply_frame(second_id, p.OkReply(count=2)))
    caller.join(5.0)
    assert not channel._parked
    begun = channel.begin(p.Stats())
    channel._close_lane()  # the lane broke: whether the master took the call is unknown
    with pytest.raises(UnavailableError, match="closed before it answered"):
        channel.finish(begun)


def test_a_finish_whose_reply_never_comes_is_unavailable_at_the_calls_deadline(lane):
    channel, master_end = lane
    begun = channel.begin(p.Stats(), timeout_s=0.2)
    read_request(master_end)
    started = time.monotonic()
    with pytest.raises(UnavailableError):
        channel.finish(begun)
    assert time.monotonic() - started < 2.0
    assert not channel.on_lane and not channel._awaited


def test_without_a_lane_nothing_is_begun():
    channel = LaneChannel(MasterChannel("tcp://127.0.0.1:9", timeout_s=0.2))
    channel._next_look_s = float("inf")  # no lane offered
    try:
        assert channel.begin(p.Stats()) is None
    finally:
        channel.close()


def test_one_way_frames_of_a_wake_up_are_handled_before_its_calls():
    """A reader's lookup and a writer's PutLanded both waiting when the master wakes: the reader
    sees the object even though its connection is polled first."""
    service = MasterService(MasterConfig(port=0))
    service.bind()
    host = service.address.split("://")[1].rsplit(":", 1)[0]
    try:
        core = service.core
        core.handle(p.MountSegment("n1", "host", 1 << 20, 0, "agent-n1", b""), 0.0)
        put = core.handle(p.PutStart("t", ["k"], [4096], [None]), 0.0)
        core.handle(p.PutEnd("t", ["k"], list(put.tokens), [0], landing=True), 0.0)
        reader = socket.create_connection((host, service._lane.port), timeout=5.0)
        writer = socket.create_connection((host, service._lane.port), timeout=5.0)
        for _ in range(3):  # accept both, the reader first: its connection comes first in a poll
            service._serve_with_lane(50)
        lookup = p.request_encoder.encode(p.LookupPrefix("t", ["k"], lease=False))
        reader.sendall(struct.pack("<IQ", len(lookup), 9) + lookup)
        time.sleep(0.05)
        landed = p.request_encoder.encode(p.PutLanded("t", ["k"], list(put.tokens)))
        writer.sendall(struct.pack("<IQ", len(landed), 0) + landed)  # one way
        time.sleep(0.05)
        service._serve_with_lane(50)  # one wake-up finds both
        request_id, reply = read_reply(reader)
        assert request_id == 9 and reply.num_hit == 1
        reader.close()
        writer.close()
    finally:
        service._close()
