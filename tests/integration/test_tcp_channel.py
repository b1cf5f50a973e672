"""The plain TCP channel to the master (rpc/tcp_channel.py) against a real in-process MasterService:
calls go over it, late replies are dropped by id, a restart is seen (epoch listeners) and the call
goes over ZMQ while the lane is gone, bad frames close only the sender's connection, and a master
with authentication offers no lane."""

from __future__ import annotations

import socket
import struct
import time

import pytest

from kvpool.core import protocol as p
from kvpool.master.config import MasterConfig
from kvpool.master.service import MasterService
from kvpool.rpc.zmq_channel import MasterChannel
from kvpool.rpc.credentials import AuthDir
from kvpool.rpc.tcp_channel import LaneChannel


@pytest.fixture
def master():
    service = MasterService(MasterConfig(port=0)).start()
    yield service
    service.stop()


def lookup(channel, keys=("a",)) -> p.LookupReply:
    return channel.call(p.LookupPrefix("t", list(keys), lease=False))


def test_calls_go_over_the_lane_and_late_replies_are_dropped(master):
    channel = LaneChannel(MasterChannel(master.address, timeout_s=5.0))
    try:
        assert isinstance(lookup(channel), p.LookupReply)
        assert channel.on_lane
        assert channel.epoch == master.core.epoch
        # a late reply (to a call that gave up) arrives first and must not answer the next call
        payload = p.request_encoder.encode(p.Stats())
        channel._sock.sendall(struct.pack("<IQ", len(payload), channel.channel.next_request_id()) + payload)
        reply = channel.call(p.Exists("t", ["a", "b", "c"]))
        assert isinstance(reply, p.ExistsReply) and reply.exists == [False, False, False]
    finally:
        channel.close()


def test_one_way_requests_get_no_reply_and_still_take_effect(master):
    sock = raw_lane(master)
    try:
        # a one-way mount (id 0), then a call: the first reply on the wire is the call's
        mount = p.request_encoder.encode(p.MountSegment("n1", "host", 1 << 20, 0, "agent-n1", b""))
        stats = p.request_encoder.encode(p.Stats())
        sock.sendall(struct.pack("<IQ", len(mount), 0) + mount + struct.pack("<IQ", len(stats), 4) + stats)
        request_id, reply = read_reply(sock)
        assert request_id == 4 and isinstance(reply, p.StatsReply)
        assert reply.capacity_bytes == 1 << 20  # the one-way request took effect before the call
        sock.settimeout(0.3)
        with pytest.raises(TimeoutError):
            sock.recv(1)  # and nothing else follows
    finally:
        sock.close()


def test_channel_send_is_one_way_over_the_lane(master):
    channel = LaneChannel(MasterChannel(master.address, timeout_s=5.0))
    try:
        lookup(channel)
        assert channel.on_lane
        channel.send(p.MountSegment("n2", "host", 1 << 20, 0, "agent-n2", b""))
        channel._sock.settimeout(0.3)
        with pytest.raises(TimeoutError):
            channel._sock.recv(1)  # the master answered nothing
        assert channel.call(p.Stats()).capacity_bytes == 1 << 20
    finally:
        channel.close()


def test_the_master_offers_its_lane_over_zmq(master):
    plain = MasterChannel(master.address, timeout_s=5.0)
    assert isinstance(lookup(plain), p.LookupReply)  # a client that never asks for the lane
    offer = plain.call(p.LaneQuery())
    assert isinstance(offer, p.LaneOffer) and offer.port > 0 and offer.unix.startswith("kvpool-lane-")
    plain.close()


@pytest.mark.parametrize("unix", ["1", "0"])
def test_a_client_on_the_masters_host_takes_its_unix_socket_else_tcp(master, monkeypatch, unix):
    """The lane over the master's abstract Unix socket where it can be reached (its network
    namespace: the same host), TCP with $KVPOOL_LANE_UNIX=0 or where the name is not there; calls,
    one-way frames and lazy ones (no TCP_CORK on a Unix socket: sent at once) work on either."""
    monkeypatch.setenv("KVPOOL_LANE_UNIX", unix)
    channel = LaneChannel(MasterChannel(master.address, timeout_s=5.0))
    try:
        assert isinstance(lookup(channel), p.LookupReply) and channel.on_lane
        assert channel._sock.family == (socket.AF_UNIX if unix == "1" else socket.AF_INET)
        channel.send(p.MountSegment("n3", "host", 1 << 20, 0, "agent-n3", b""), lazy=True)
        assert channel.call(p.Stats()).capacity_bytes == 1 << 20  # the lazy frame came first
    finally:
        channel.close()
    # a Unix name nobody listens on (a master on another host): TCP
    from kvpool.rpc import tcp_channel as lane_module

    assert lane_module._connect_unix("kvpool-lane-nobody-" + "0" * 16, 1.0) is None


def test_a_restart_is_seen_and_the_call_goes_over_zmq_meanwhile(tmp_path):
    first = MasterService(MasterConfig(port=0)).start()
    port = int(first.address.rsplit(":", 1)[1])
    channel = LaneChannel(MasterChannel(first.address, timeout_s=5.0))
    seen = []
    channel.add_epoch_listener(lambda old, new: seen.append((old, new)))
    try:
        lookup(channel)
        assert channel.on_lane and seen == [(None, first.core.epoch)]
        first.stop()
        second = MasterService(MasterConfig(port=port)).start()
        try:
            assert isinstance(lookup(channel), p.LookupReply)  # the lane broke: answered over ZMQ
            assert seen[-1] == (first.core.epoch, second.core.epoch)
            assert channel.epoch == second.core.epoch
        finally:
            second.stop()
    finally:
        channel.close()


def raw_lane(master) -> socket.socket:
    offer = MasterChannel(master.address).call(p.LaneQuery())
    host = master.address.split("://")[1].rsplit(":", 1)[0]
    return socket.create_connection((host, offer.port), timeout=5.0)


def read_reply(sock: socket.socket) -> tuple[int, p.Reply]:
    head = b""
    while len(head) < 20:
        head += sock.recv(20 - len(head))
    length, request_id, _epoch = struct.unpack("<IQQ", head)
    body = b""
    while len(body) < length:
        body += sock.recv(length - len(body))
    return request_id, p.reply_decoder.decode(body)


def test_undecodable_and_oversized_frames_hurt_only_their_sender(master):
    bad = raw_lane(master)
    bad.sendall(struct.pack("<IQ", 3, 7) + b"\xc1\xc1\xc1")  # 0xc1 is never valid msgpack
    request_id, reply = read_reply(bad)
    assert request_id == 7 and isinstance(reply, p.ErrorReply) and reply.kind == "protocol"
    bad.sendall(struct.pack("<IQ", 2 * master.config.max_message_bytes + 1, 8))  # announces too much
    bad.settimeout(5.0)
    assert bad.recv(100) == b""  # the master closed this connection
    bad.close()
    channel = LaneChannel(MasterChannel(master.address, timeout_s=5.0))
    try:
        assert isinstance(lookup(channel), p.LookupReply) and channel.on_lane  # others are served
    finally:
        channel.close()


def test_a_peer_that_vanishes_mid_request_does_not_stop_the_master(master):
    gone = raw_lane(master)
    payload = p.request_encoder.encode(p.LookupPrefix("t", ["a"], lease=False))
    gone.sendall(struct.pack("<IQ", len(payload), 1) + payload[:-1])  # half a frame, then away
    gone.close()
    time.sleep(0.05)
    channel = LaneChannel(MasterChannel(master.address, timeout_s=5.0))
    try:
        assert isinstance(lookup(channel), p.LookupReply)
    finally:
        channel.close()


def test_an_authenticated_master_offers_no_lane(tmp_path):
    auth = AuthDir(tmp_path / "auth")
    auth.init(("admin",))
    service = MasterService(MasterConfig(port=0, auth_dir=str(auth.path))).start()
    try:
        assert service._lane is None
    finally:
        service.stop()


def test_large_values_cross_the_lane_whole_however_they_are_split(master):
    """Requests and replies larger than one read (inline values up to 64 KiB, and frames sent in
    pieces with pauses between them) arrive whole: the master reads on while a frame is incomplete."""
    values = {f"v{n}": bytes([n]) * size for n, size in enumerate((1, 60_000, 64 << 10, 65_000))}
    channel = LaneChannel(MasterChannel(master.address, timeout_s=5.0))
    sock = raw_lane(master)
    try:
        for key, value in values.items():
            assert channel.call(p.PutValue("t", key, value)).status == p.PUT_ALLOCATED
        assert channel.on_lane
        for key, value in values.items():
            reply = channel.call(p.GetValue("t", key))
            assert reply.inline and reply.value == value
        # by hand: one frame in three pieces with pauses between them, then two frames in one send
        payload = p.request_encoder.encode(p.PutValue("t", "split", b"s" * 65_000))
        frame = struct.pack("<IQ", len(payload), 7) + payload
        for piece in (frame[:5], frame[5:40_000], frame[40_000:]):
            sock.sendall(piece)
            time.sleep(0.05)
        request_id, reply = read_reply(sock)
        assert request_id == 7 and reply.status == p.PUT_ALLOCATED
        assert channel.call(p.GetValue("t", "split")).value == b"s" * 65_000
        two = b"".join(struct.pack("<IQ", len(x), i) + x for i, x in (
            (8, p.request_encoder.encode(p.GetValue("t", "v2"))), (9, p.request_encoder.encode(p.GetValue("t", "v3")))))
        sock.sendall(two)
        assert [(rid, r.value) for rid, r in (read_reply(sock), read_reply(sock))] == [(8, values["v2"]), (9, values["v3"])]
    finally:
        sock.close()
        channel.close()


def test_a_large_request_received_in_place_across_polls_and_a_peer_gone_midway(master):
    """A request of >= 16 KiB whose head and first part come in one read is received on straight
    into its own body, across as many polls as it takes; a request right behind it is answered
    too, and a peer that leaves halfway through a body costs only its own connection."""
    sock = raw_lane(master)
    try:
        payload = p.request_encoder.encode(p.PutValue("t", "inplace", bytes(range(256)) * 250))
        frame = struct.pack("<IQ", len(payload), 11) + payload
        behind = p.request_encoder.encode(p.GetValue("t", "inplace"))
        for piece in (frame[:20_000], frame[20_000:50_000], frame[50_000:] + struct.pack("<IQ", len(behind), 12) + behind):
            sock.sendall(piece)
            time.sleep(0.05)
        request_id, reply = read_reply(sock)
        assert request_id == 11 and reply.status == p.PUT_ALLOCATED
        request_id, reply = read_reply(sock)
        assert request_id == 12 and reply.value == bytes(range(256)) * 250
    finally:
        sock.close()
    gone = raw_lane(master)
    gone.sendall(frame[:30_000])
    time.sleep(0.05)
    gone.close()
    channel = LaneChannel(MasterChannel(master.address, timeout_s=5.0))
    try:
        assert channel.call(p.GetValue("t", "inplace")).value == bytes(range(256)) * 250 and channel.on_lane
    finally:
        channel.close()


def test_a_large_announced_frame_is_not_allocated_before_its_bytes_come(master):
    """A peer announcing a frame of tens of MiB and sending a few bytes makes the master hold those
    bytes, not a zeroed body of the announced size (the in-place path stops at 1 MiB)."""
    sock = raw_lane(master)
    try:
        sock.sendall(struct.pack("<IQ", 50 << 20, 3) + b"x" * 100)
        time.sleep(0.1)
        lane = master._lane
        (conn,) = [c for c in lane._connections.values()]
        assert conn.body is None and len(conn.inbox) == 12 + 100
    finally:
        sock.close()


def test_a_reply_that_cannot_be_encoded_is_an_internal_error_on_either_channel(master, monkeypatch):
    handle = master.core.handle
    monkeypatch.setattr(master.core, "handle", lambda request, now_s, principal: (
        p.OkReply(count=1 << 70) if isinstance(request, p.Exists) else handle(request, now_s, principal)))
    from kvpool.core.errors import KVPoolError

    for channel in (LaneChannel(MasterChannel(master.address, timeout_s=5.0)), MasterChannel(master.address, timeout_s=5.0)):
        try:
            with pytest.raises(KVPoolError, match="could not encode its OkReply"):
                channel.call(p.Exists("t", ["a"]))
            assert isinstance(lookup(channel), p.LookupReply)  # and the master serves on
        finally:
            channel.close()


def test_a_master_that_stops_answering_is_unavailable_at_the_call_deadline(tmp_path):
    """The lane waits with the kernel's timeouts (rpc/timeouts.py): a stopped master makes a
    call fail at its deadline (the lane is closed then, so the next, shorter call waits on ZMQ),
    and calls are answered again once the master resumes."""
    import os
    import signal

    from kvpool.bench import procs
    from kvpool.core.errors import UnavailableError

    master = procs.start_master(tmp_path)
    channel = LaneChannel(MasterChannel(master.info["address"], timeout_s=5.0))
    try:
        assert isinstance(lookup(channel), p.LookupReply) and channel.on_lane
        os.kill(master.pid, signal.SIGSTOP)
        try:
            for timeout_s in (0.3, 0.1):
                started = time.monotonic()
                with pytest.raises(UnavailableError):
                    channel.call(p.Stats(), timeout_s)
                assert timeout_s * 0.8 < time.monotonic() - started < timeout_s + 1.0
        finally:
            os.kill(master.pid, signal.SIGCONT)
        assert isinstance(lookup(channel), p.LookupReply)
    finally:
        channel.close()
        master.stop()


def _lane_on(sock: socket.socket) -> LaneChannel:
    """A LaneChannel whose lane is one end of a socketpair (the other end plays the master)."""
    from kvpool.rpc.timeouts import KernelTimeouts

    channel = LaneChannel(MasterChannel("tcp://127.0.0.1:9", timeout_s=1.0))
    channel._sock, channel._timeouts, channel._inbox = sock, KernelTimeouts(sock), bytearray()
    return channel


def _reply_frame(request_id: int, reply: p.Reply) -> bytes:
    body = p.reply_encoder.encode(reply)
    return struct.pack("<IQQ", len(body), request_id, 1) + body


def test_a_large_reply_arriving_in_pieces_is_read_whole_and_the_next_one_stays_intact():
    """A reply of >= 16 KiB is received straight into its own buffer once its head is in: pieces
    with pauses between them land whole, and a reply sent right behind it is not swallowed."""
    import threading

    ours, master_end = socket.socketpair()
    channel = _lane_on(ours)
    value = bytes(range(256)) * 400  # 100 KiB
    first, second = _reply_frame(5, p.ValueReply(True, value)), _reply_frame(6, p.ValueReply(True, b"small"))

    def master_sends():
        for piece in (first[:30], first[30:70_000], first[70_000:] + second):
            master_end.sendall(piece)
            time.sleep(0.05)

    sender = threading.Thread(target=master_sends)
    sender.start()
    try:
        request = p.GetValue("t", "k")
        request_id, epoch, body = channel._read_frame(ours, time.monotonic() + 5.0, request)
        assert (request_id, epoch) == (5, 1) and p.reply_decoder.decode(body).value == value
        request_id, _, body = channel._read_frame(ours, time.monotonic() + 5.0, request)
        assert request_id == 6 and p.reply_decoder.decode(body).value == b"small"
    finally:
        sender.join()
        ours.close()
        master_end.close()


def test_a_large_reply_that_stalls_or_breaks_midway_ends_the_call_and_the_lane():
    from kvpool.core.errors import UnavailableError
    from kvpool.rpc.tcp_channel import _LaneBroken

    frame = _reply_frame(5, p.ValueReply(True, b"v" * 100_000))
    for how in ("stall", "close"):
        ours, master_end = socket.socketpair()
        channel = _lane_on(ours)
        master_end.sendall(frame[:50_000])
        if how == "close":
            master_end.close()
        started = time.monotonic()
        with pytest.raises(UnavailableError if how == "stall" else _LaneBroken):
            channel._read_frame(ours, started + 0.3, p.GetValue("t", "k"))
        if how == "stall":
            assert 0.25 < time.monotonic() - started < 1.5
            assert not channel.on_lane  # half a frame read: the connection cannot carry another
            master_end.close()
        ours.close()



def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Two ends of a real loopback TCP connection (TCP_CORK needs TCP, not a Unix socketpair)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        ours = socket.create_connection(server.getsockname())
        theirs, _ = server.accept()
    ours.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return ours, theirs


def _read_frames(sock: socket.socket, count: int) -> list[tuple[int, p.Request]]:
    head, got, frames = struct.Struct("<IQ"), b"", []
    while len(frames) < count:
        got += sock.recv(1 << 16)
        while len(got) >= head.size and len(got) >= head.size + head.unpack_from(got)[0]:
            length, request_id = head.unpack_from(got)
            frames.append((request_id, p.request_decoder.decode(got[head.size:head.size + length])))
            got = got[head.size + length:]
    return frames


@pytest.mark.skipif(not hasattr(socket, "TCP_CORK"), reason="TCP_CORK is Linux's")
def test_a_lazy_one_way_frame_rides_with_the_next_call_or_leaves_within_the_cork_limit():
    """A lazy frame (a lease release) waits in the socket: the master end sees nothing until the
    next call's frame, then both, in order; alone it still leaves within the kernel's 200 ms, and
    an eager send right behind it takes it along at once."""
    import select
    import threading

    ours, master_end = _tcp_pair()
    channel = _lane_on(ours)
    release = p.ReleaseLeases("t", [7])
    try:
        channel.send(release, lazy=True)
        assert select.select([master_end], [], [], 0.1)[0] == []  # corked: nothing on the wire yet
        frames = []

        def master_answers():
            frames.extend(_read_frames(master_end, 2))
            master_end.sendall(_reply_frame(frames[1][0], p.OkReply()))

        answering = threading.Thread(target=master_answers)
        answering.start()
        assert isinstance(channel.call(p.Stats(), timeout_s=5.0), p.OkReply)
        answering.join(5.0)
        assert [(i, type(r)) for i, r in frames] == [(0, p.ReleaseLeases), (frames[1][0], p.Stats)]
        assert frames[0][1] == release and not channel._corked

        channel.send(release, lazy=True)
        started = time.monotonic()
        assert select.select([master_end], [], [], 2.0)[0], "a lone lazy frame never left"
        assert time.monotonic() - started < 1.0
        assert _read_frames(master_end, 1) == [(0, release)]

        channel.send(release, lazy=True)
        channel.send(release)
        assert select.select([master_end], [], [], 0.1)[0]
        assert _read_frames(master_end, 2) == [(0, release), (0, release)]
    finally:
        ours.close()
        master_end.close()


def test_meanwhile_runs_once_after_the_request_left_and_before_its_reply_is_read():
    """`call(..., meanwhile=f)`: f runs after the request is on the wire (the master already has
    it while f works) and before the reply is awaited, once, on the lane and over ZMQ alike."""
    ours, theirs = _tcp_pair()
    channel = _lane_on(ours)
    seen = []

    def meanwhile():
        theirs.settimeout(2.0)
        seen.append(_read_frames(theirs, 1)[0])  # the request arrived before meanwhile returned
        theirs.sendall(_reply_frame(seen[-1][0], p.OkReply(count=7)))

    try:
        reply = channel.call(p.Exists("t", ["a"]), meanwhile=meanwhile)
        assert reply == p.OkReply(count=7) and len(seen) == 1 and isinstance(seen[0][1], p.Exists)
    finally:
        channel.close()
        theirs.close()


def test_meanwhile_over_zmq(master):
    channel = MasterChannel(master.address, timeout_s=5.0)
    calls = []
    try:
        reply = channel.call(p.Exists("t", ["a"]), meanwhile=lambda: calls.append(time.monotonic()))
        assert isinstance(reply, p.ExistsReply) and len(calls) == 1
    finally:
        channel.close()


@pytest.mark.parametrize("reply_after_s", [0.0, 0.05])
def test_a_call_spins_then_blocks_and_reads_its_reply_either_way(reply_after_s):
    """The reply is read whether it comes while the call spins (spin_s) or after it blocked."""
    import threading

    ours, theirs = _tcp_pair()
    channel = _lane_on(ours)
    channel.spin_s = 0.01

    def master():
        theirs.settimeout(2.0)
        request_id, _ = _read_frames(theirs, 1)[0]
        time.sleep(reply_after_s)
        theirs.sendall(_reply_frame(request_id, p.OkReply(count=3)))

    thread = threading.Thread(target=master)
    thread.start()
    try:
        assert channel.call(p.Exists("t", ["a"])) == p.OkReply(count=3)
    finally:
        thread.join()
        channel.close()
        theirs.close()


def test_the_spin_comes_from_the_environment_and_a_bad_value_is_refused(monkeypatch):
    from kvpool.rpc import config

    monkeypatch.setenv(config.TCP_SPIN_ENV, "250")
    assert LaneChannel(MasterChannel("tcp://127.0.0.1:9")).spin_s == pytest.approx(250e-6)
    monkeypatch.setenv(config.TCP_SPIN_ENV, "0")
    assert LaneChannel(MasterChannel("tcp://127.0.0.1:9")).spin_s == 0.0
    assert not LaneChannel(MasterChannel("tcp://127.0.0.1:9")).spin.spins
    monkeypatch.delenv(config.TCP_SPIN_ENV)
    assert LaneChannel(MasterChannel("tcp://127.0.0.1:9")).spin_s == pytest.approx(config.DEFAULT_TCP_SPIN_US * 1e-6)
    monkeypatch.setenv(config.TCP_SPIN_ENV, "fast")
    with pytest.raises(ValueError, match="microseconds"):
        LaneChannel(MasterChannel("tcp://127.0.0.1:9"))


def test_a_channel_whose_replies_come_late_stops_spinning_and_spins_again_once_they_are_quick():
    """Each call's wait is the spin policy's sample (spin.py), measured on a real socket: replies
    later than spin_s stop the spin within a few calls, quick ones bring it back."""
    import threading

    ours, theirs = _tcp_pair()
    channel = _lane_on(ours)
    channel.spin_s = 0.002
    delays = [0.02] * 6 + [0.0] * 12

    def master():
        theirs.settimeout(5.0)
        for delay in delays:
            request_id, _ = _read_frames(theirs, 1)[0]
            time.sleep(delay)
            theirs.sendall(_reply_frame(request_id, p.OkReply(count=1)))

    thread = threading.Thread(target=master)
    thread.start()
    spun = []
    try:
        for _ in delays:
            spun.append(channel.spin.spins)
            assert channel.call(p.Exists("t", ["a"])) == p.OkReply(count=1)
    finally:
        thread.join()
        channel.close()
        theirs.close()
    assert spun[0] and not spun[6]  # six late replies: no spin for the first quick call
    assert spun[-1]  # twelve quick ones: spinning again
