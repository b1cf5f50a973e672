"""A real `kvpool master` process on 127.0.0.1: bad input gets error replies and the master keeps
serving; metrics are served; SIGTERM ends it cleanly."""

import os
import signal
import time
import urllib.request

import msgspec
import pytest
import zmq

from kvpool.bench import procs
from kvpool.core import protocol as p
from kvpool.core.errors import UnavailableError, UsageError
from kvpool.rpc.zmq_channel import MasterChannel

LIMIT = 64 * 1024  # a small --max-message-bytes keeps the oversized cases cheap


@pytest.fixture
def master(tmp_path):
    proc = procs.start_master(tmp_path, "--max-message-bytes", str(LIMIT), "--node-ttl-s", "30")
    yield proc
    proc.stop()


@pytest.fixture
def raw(master):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(master.info["address"])
    yield sock
    sock.close()


def raw_call(sock, *frames, timeout_ms=3000):
    """[request_id, reply] of one raw exchange; every reply also names the master's epoch."""
    sock.send_multipart(list(frames))
    assert sock.poll(timeout_ms), "the master did not answer"
    request_id, epoch, reply = sock.recv_multipart()
    assert len(epoch) == 8 and int.from_bytes(epoch, "little") >> 32, epoch
    return request_id, reply


def assert_still_serving(master):
    channel = MasterChannel(master.info["address"], timeout_s=3.0)
    try:
        assert isinstance(channel.call(p.Stats()), p.StatsReply)
    finally:
        channel.close()
    assert master.alive()


RID = (7).to_bytes(8, "little")
GOOD = p.request_encoder.encode(p.Exists("t", ["a"]))


@pytest.mark.parametrize(
    "payload, fragment",
    [
        (b"\xff\x00garbage", "undecodable"),
        (GOOD[: len(GOOD) // 2], "undecodable"),  # truncated msgpack
        (msgspec.msgpack.encode({"type": "exists", "tenant": 5, "keys": "a"}), "undecodable"),  # wrong types
        (msgspec.msgpack.encode({"type": "launch_missiles"}), "undecodable"),  # unknown tag
        (msgspec.msgpack.encode([1, 2, 3]), "undecodable"),
        (b"", "undecodable"),
        (b"x" * (LIMIT + 1), "exceeds"),  # oversized, answered
    ],
)
def test_bad_payloads_get_protocol_errors_and_the_master_keeps_serving(master, raw, payload, fragment):
    request_id, reply = raw_call(raw, RID, payload)
    assert request_id == RID
    error = p.reply_decoder.decode(reply)
    assert isinstance(error, p.ErrorReply) and error.kind == "protocol" and fragment in error.message
    assert_still_serving(master)


def test_wrong_frame_shapes_get_protocol_errors(master, raw):
    _, reply = raw_call(raw, GOOD)  # no request id
    assert p.reply_decoder.decode(reply).kind == "protocol"
    request_id, reply = raw_call(raw, b"short", GOOD)
    assert p.reply_decoder.decode(reply).kind == "protocol"
    request_id, reply = raw_call(raw, RID, GOOD, b"extra")
    assert request_id == RID and p.reply_decoder.decode(reply).kind == "protocol"
    request_id, reply = raw_call(raw, RID, GOOD)
    assert p.reply_decoder.decode(reply) == p.ExistsReply([False])


def test_a_frame_far_over_the_limit_is_dropped_and_the_master_survives(master, raw):
    raw.send_multipart([RID, b"x" * (3 * LIMIT)])
    assert not raw.poll(1000)  # ZMQ closed that connection before buffering the frame
    assert_still_serving(master)


def test_usage_errors_and_misses_through_the_channel(master):
    channel = MasterChannel(master.info["address"], timeout_s=3.0)
    try:
        with pytest.raises(UsageError, match="tenant"):
            channel.call(p.LookupPrefix("", ["a"]))
        with pytest.raises(UsageError, match="sizes must match"):
            channel.call(p.PutStart("t", ["a", "b"], [1], [None, None]))
        with pytest.raises(UsageError, match="> 0"):
            channel.call(p.PutStart("t", ["a"], [-5], [None]))
        reply = channel.call(p.LookupPrefix("t", ["never-put"]))
        assert reply.num_hit == 0 and reply.replica_lists() == [] and reply.lease_id == 0
        seg = channel.call(p.MountSegment("n1", "h", 1 << 20, 0, "agent", b"meta", None)).segment_id
        put = channel.call(p.PutStart("t", ["a", "b"], [100, 2 << 20], [None, "a"]))
        assert put.statuses == [p.PUT_ALLOCATED, p.PUT_NO_SPACE] and "larger than the largest segment" in put.message
        with pytest.raises(UsageError, match="must match"):
            channel.call(p.PutEnd("t", ["a"], [put.tokens[0]], []))
        assert channel.call(p.PutEnd("t", ["a"], [put.tokens[0] + 1], [0])).refused == [0]  # not its token
        assert channel.call(p.PutEnd("t", ["a"], [put.tokens[0]], [77])).ended == 1
        hit = channel.call(p.LookupPrefix("t", ["a", "b"]))
        assert hit.replica_lists() == [[p.Replica(seg, 0, 100)]] and p.unpack_checksums(hit.checksums) == [77]
        stats = channel.call(p.Stats())
        assert (stats.num_objects, stats.hit_keys, stats.miss_keys) == (1, 1, 2)
    finally:
        channel.close()


def test_metrics_are_served(master):
    channel = MasterChannel(master.info["address"], timeout_s=3.0)
    segment_id = channel.call(p.MountSegment("n1", "h", 1 << 20, 0, "agent", b"", None)).segment_id
    channel.close()
    deadline = time.monotonic() + 5
    while True:  # the snapshot is published each tick (0.2 s)
        text = urllib.request.urlopen(f"http://127.0.0.1:{master.info['metrics_port']}/metrics").read().decode()
        if 'kvpool_master_node_capacity_bytes{node_id="n1"' in text or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert "kvpool_master_capacity_bytes 1.048576e+06" in text
    assert f'kvpool_master_node_capacity_bytes{{node_id="n1",segment_id="{segment_id}",state="alive"}}' in text
    assert f'kvpool_master_info{{epoch="{channel.epoch:016x}"}} 1.0' in text
    assert "kvpool_master_evictions_total" in text
    # `kvpool master` owns its process: the collector's pauses are counted (gc_pauses.py)
    assert 'kvpool_master_gc_pauses_total{generation="0"}' in text
    assert 'kvpool_master_gc_pause_seconds_total{generation="2"}' in text
    assert "kvpool_master_gc_pause_max_seconds" in text


def test_sigterm_stops_the_master_cleanly(tmp_path):
    proc = procs.start_master(tmp_path)
    assert proc.info["pid"] == proc.pid
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.popen.wait(timeout=10) == 0
    channel = MasterChannel(proc.info["address"], timeout_s=0.5)
    with pytest.raises(UnavailableError):
        channel.call(p.Stats())
    channel.close()
    proc.stop()


def test_master_service_runs_in_process_and_stops():
    from kvpool.master import MasterConfig, MasterService

    service = MasterService(MasterConfig(metrics_port=None)).start()
    try:
        channel = MasterChannel(service.address, timeout_s=3.0)
        seg = channel.call(p.MountSegment("n1", "h", 4096, 0, "agent", b"", None)).segment_id
        put = channel.call(p.PutStart("t", ["a"], [10], [None]))
        assert put.replicas == [[p.Replica(seg, 0, 10)]]
        assert channel.call(p.PutEnd("t", ["a"], put.tokens, [0])).ended == 1
        assert channel.call(p.LookupPrefix("t", ["a"], lease=False)).num_hit == 1
        channel.close()
    finally:
        service.stop()
    assert service._thread is None and service._socket is None


def test_an_idle_master_evicts_down_to_the_low_watermark_between_requests():
    """Above the high watermark, the put evicts only its share; the master's idle loop takes the pool
    down to the low watermark in slices, with no tick (the tick interval is a minute here)."""
    from kvpool.master import MasterConfig, MasterService

    size = 64 << 10
    service = MasterService(MasterConfig(metrics_port=None, tick_interval_s=60.0, node_ttl_s=600.0,
                                         high_watermark=0.9, low_watermark=0.5)).start()
    channel = MasterChannel(service.address, timeout_s=3.0)
    try:
        channel.call(p.MountSegment("n1", "h", 100 * size, 0, "agent", b"", None))
        for batch in range(10):  # 100 objects: the last batch crosses 0.9
            keys = [f"k{batch}-{i}" for i in range(10)]
            put = channel.call(p.PutStart("t", keys, [size] * 10, [None] * 10))
            assert put.statuses == [p.PUT_ALLOCATED] * 10, put
            assert channel.call(p.PutEnd("t", keys, put.tokens, [0] * 10)).ended == 10
        deadline = time.monotonic() + 5.0
        while channel.call(p.Stats()).used_bytes > 50 * size and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = channel.call(p.Stats())
        assert stats.used_bytes == 50 * size, stats  # the low watermark, and no further
        assert stats.evictions == 50
    finally:
        channel.close()
        service.stop()


def test_the_master_command_freezes_the_collector_each_tick_and_an_in_process_one_does_not():
    import gc
    import threading

    from kvpool.master import MasterConfig, MasterService

    gc.unfreeze()
    try:
        service = MasterService(MasterConfig(metrics_port=None, tick_interval_s=0.05)).start()
        time.sleep(0.3)  # several ticks
        service.stop()
        assert gc.get_freeze_count() == 0  # in-process: the host process's collector is left alone
        service = MasterService(MasterConfig(metrics_port=None, tick_interval_s=0.05))
        service.bind()
        thread = threading.Thread(target=service.serve_forever, kwargs={"owns_process": True}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 5.0
        while gc.get_freeze_count() == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        service.request_stop()
        thread.join(5.0)
        assert gc.get_freeze_count() > 0  # `kvpool master` (cli.py) serves with owns_process=True
    finally:
        gc.unfreeze()


def test_idle_work_that_fails_is_logged_and_retried_once_a_tick_without_spinning(monkeypatch, caplog):
    from kvpool.master import MasterConfig, MasterCore, MasterService

    calls = []

    def broken(self, now_s):
        calls.append(now_s)
        raise RuntimeError("a bug in idle work")

    monkeypatch.setattr(MasterCore, "has_idle_work", property(lambda self: True))
    monkeypatch.setattr(MasterCore, "idle_work", broken)
    service = MasterService(MasterConfig(metrics_port=None, tick_interval_s=0.1)).start()
    try:
        time.sleep(0.55)
        channel = MasterChannel(service.address, timeout_s=3.0)
        assert isinstance(channel.call(p.Stats()), p.StatsReply)  # still serving
        channel.close()
    finally:
        service.stop()
    assert 2 <= len(calls) <= 8  # about once per 0.1 s tick, not a busy loop
    assert "internal error in the master's idle work" in caplog.text
