"""Calls begun on the ZMQ control channel and finished later (MasterChannel.begin / finish, used by
a plain get that reads where its value was while GetValue travels: client/known_places.py). The
master's end is a ROUTER socket the test answers by hand, in the order each case needs: a begun
call's reply read by another call is kept for its finish, an abandoned one is dropped, a reset
socket fails the finish at once, a master that never answers fails it at its deadline."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from kvpool.core import protocol as p
from kvpool.core.errors import UnavailableError
from kvpool.rpc.zmq_channel import MasterChannel

EPOCH = (7).to_bytes(8, "little")


@pytest.fixture
def master_end():
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    channel = MasterChannel(f"tcp://127.0.0.1:{port}", timeout_s=2.0, context=context)
    yield channel, router
    channel.close()
    router.close()
    context.term()


def receive(router) -> tuple[bytes, bytes, p.Request]:
    assert router.poll(2000), "no request reached the master's end"
    peer, request_id, payload = router.recv_multipart()
    return peer, request_id, p.request_decoder.decode(payload)


def answer(router, peer: bytes, request_id: bytes, reply) -> None:
    router.send_multipart([peer, request_id, EPOCH, p.reply_encoder.encode(reply)])


def test_a_begun_calls_reply_read_by_another_call_is_kept_for_its_finish(master_end):
    channel, router = master_end
    begun = channel.begin(p.Stats())
    peer, first_id, first = receive(router)
    assert isinstance(first, p.Stats) and int.from_bytes(first_id, "little") == begun.request_id
    got = {}
    caller = threading.Thread(target=lambda: got.update(reply=channel.call(p.Exists("t", ["k"]))))
    caller.start()
    _, second_id, second = receive(router)
    assert isinstance(second, p.Exists)
    # the begun call's reply comes first: the other call reads it, and keeps it
    answer(router, peer, first_id, p.OkReply(count=7))
    answer(router, peer, second_id, p.ExistsReply([True]))
    caller.join(5.0)
    assert got["reply"] == p.ExistsReply([True])
    assert channel._parked
    assert channel.finish(begun) == p.OkReply(count=7)
    assert not channel._parked and not channel._awaited
    assert channel.epoch == 7


def test_an_abandoned_calls_reply_is_dropped_and_a_reset_socket_fails_the_finish_at_once(master_end):
    channel, router = master_end
    begun = channel.begin(p.Stats())
    peer, request_id, _ = receive(router)
    channel.abandon(begun)
    answer(router, peer, request_id, p.OkReply(count=1))
    caller_reply = {}
    caller = threading.Thread(target=lambda: caller_reply.update(reply=channel.call(p.Stats())))
    caller.start()
    _, second_id, _ = receive(router)
    answer(router, peer, second_id, p.OkReply(count=2))
    caller.join(5.0)
    assert caller_reply["reply"] == p.OkReply(count=2) and not channel._parked  # the abandoned one dropped
    again = channel.begin(p.Stats())
    receive(router)
    with channel._lock:
        channel._close_socket()  # as a fail-over or a refused handshake does
    started = time.monotonic()
    with pytest.raises(UnavailableError):
        channel.finish(again)
    assert time.monotonic() - started < 0.5


def test_a_master_that_never_answers_fails_the_finish_at_its_deadline(master_end):
    channel, router = master_end
    begun = channel.begin(p.Stats(), timeout_s=0.3)
    receive(router)
    started = time.monotonic()
    with pytest.raises(UnavailableError):
        channel.finish(begun)
    assert 0.1 < time.monotonic() - started < 1.5
