"""The TCP path to a node (transfer/tcp_path.py): a SegmentMemory serving it on loopback and a
DataPlane reaching it as if from another host. Round trips, the request limits, refusals of bad
requests (nothing moves, the connection closes, the server keeps serving), and which jobs take it."""

from __future__ import annotations

import itertools
import os
import socket
import threading
import struct

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.errors import TransferError
from kvpool.transfer import DataPlane, SegmentMemory
from kvpool.transfer import tcp_path as sl
from kvpool.transfer import tcp_path_wire as wire
from kvpool.transfer.config import rdma_available

SEGMENT_BYTES = 4 << 20


@pytest.fixture(scope="module")
def segment():
    with SegmentMemory(SEGMENT_BYTES, name="lane-unit", lane_host="127.0.0.1") as memory:
        yield memory


@pytest.fixture
def info(segment):
    """The segment as a client on another host sees it (so `auto` never maps it)."""
    return msgspec.structs.replace(segment.segment_info(segment_id=1, node_id="n"), host_id="another-host")


@pytest.fixture
def buf():
    return np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)


def _plane(*arrays, **kwargs) -> DataPlane:
    plane = DataPlane(**kwargs)
    for a in arrays:
        plane.register(a.ctypes.data, a.nbytes)
    return plane


def test_the_segment_announces_its_lane(segment):
    assert segment.lane_address.startswith("127.0.0.1:")
    assert segment.mount_request("n").lane_address == segment.lane_address


def test_round_trip_over_the_lane_scattered_regions(info, buf):
    out = np.zeros_like(buf)
    with _plane(buf, out, path="lane") as plane:
        assert plane.path_for(info) == "lane"
        offsets = [i * 9000 for i in range(100)]
        plane.transfer("WRITE", info, [buf.ctypes.data + i * 4096 for i in range(100)], offsets, [4096] * 100, 5)
        plane.transfer("READ", info, [out.ctypes.data + i * 4096 for i in range(100)], offsets, [4096] * 100, 5)
        assert plane.jobs_by_path == {"shm": 0, "nixl": 0, "lane": 2}
    np.testing.assert_array_equal(out[: 100 * 4096], buf[: 100 * 4096])


def test_auto_sends_jobs_up_to_the_limit_over_the_lane_and_larger_ones_to_nixl(info, buf, monkeypatch):
    from kvpool.transfer import config as config_module

    monkeypatch.setattr(config_module, "rdma_available", lambda env=None: True)  # the limit alone decides
    out = np.zeros_like(buf)
    with _plane(buf, out, lane_max_bytes=64 << 10) as plane:
        assert plane.path_for(info) == "nixl"  # the route; its small jobs take the lane
        plane.transfer("WRITE", info, [buf.ctypes.data], [0], [64 << 10], 5)
        assert plane.jobs_by_path["lane"] == 1
        assert plane._endpoint is None  # NIXL is loaded only for the first job that needs it
        plane.transfer("READ", info, [out.ctypes.data], [0], [512 << 10], 5)  # over the limit
        assert plane.jobs_by_path == {"shm": 0, "nixl": 1, "lane": 1}
        assert plane._endpoint is not None
    np.testing.assert_array_equal(out[: 64 << 10], buf[: 64 << 10])


def test_path_nixl_never_takes_the_lane(info, buf):
    with _plane(buf, path="nixl") as plane:
        plane.transfer("WRITE", info, [buf.ctypes.data], [0], [4096], 5)
        assert plane.jobs_by_path == {"shm": 0, "nixl": 1, "lane": 0}


def test_a_job_over_the_request_limits_is_cut_into_requests():
    parts = list(wire.requests([1000, 5000], [0, 100], [10, 25], max_bytes=16, max_regions=2))
    # every part within 16 bytes and 2 regions; together exactly the job
    assert all(sum(sizes) <= 16 and len(sizes) <= 2 for _, _, sizes in parts)
    flat = [(a, o, s) for addrs, offs, sizes in parts for a, o, s in zip(addrs, offs, sizes)]
    assert flat == [(1000, 0, 10), (5000, 100, 6), (5006, 106, 16), (5022, 122, 3)]
    assert list(wire.requests([1], [2], [3])) == [([1], [2], [3])]


def test_a_job_larger_than_one_request_round_trips(info, monkeypatch):
    monkeypatch.setattr(wire, "MAX_REQUEST_BYTES", 1 << 20)  # the client's cut; the server keeps 64 MiB
    big = np.random.default_rng(1).integers(0, 256, 3 << 20, dtype=np.uint8)
    out = np.zeros_like(big)
    with _plane(big, out, path="lane") as plane:
        plane.transfer("WRITE", info, [big.ctypes.data], [0], [big.nbytes], 5)
        plane.transfer("READ", info, [out.ctypes.data], [0], [big.nbytes], 5)
    np.testing.assert_array_equal(out, big)


def _raw(segment) -> socket.socket:
    host, port = segment.lane_address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def _reply(sock) -> tuple[int, bytes]:
    head = b""
    while len(head) < wire.REPLY.size:
        head += sock.recv(wire.REPLY.size - len(head))
    status, length = wire.REPLY.unpack(head)
    body = b""
    while len(body) < length:
        body += sock.recv(length - len(body))
    return status, body


@pytest.mark.parametrize("request_bytes,reason", [
    (b"HTTP" + bytes(5), "not a segment-lane request"),
    (struct.pack("<4sBI", b"KVSL", 1, 0), "0 regions"),
    (struct.pack("<4sBI", b"KVSL", 1, wire.MAX_REGIONS + 1), "regions"),
    (struct.pack("<4sBI", b"KVSL", 2, 1) + struct.pack("<QQ", SEGMENT_BYTES - 8, 16), "outside"),
    (struct.pack("<4sBI", b"KVSL", 1, 1) + struct.pack("<QQ", 2**64 - 1, 1), "outside"),
    (struct.pack("<4sBI", b"KVSL", 1, 1) + struct.pack("<QQ", 0, 0), "outside"),
], ids=["not-the-protocol", "no-regions", "too-many-regions", "past-the-end", "offset-overflow", "empty-region"])
def test_bad_requests_are_refused_with_a_reason_and_the_lane_keeps_serving(segment, info, buf, request_bytes, reason):
    with _raw(segment) as sock:
        sock.sendall(request_bytes)
        status, body = _reply(sock)
        assert status == 1 and reason in body.decode()
        assert sock.recv(1) == b""  # closed after the refusal
    out = np.zeros(4096, dtype=np.uint8)
    with _plane(buf, out, path="lane") as plane:  # the server still serves others
        plane.transfer("WRITE", info, [buf.ctypes.data], [0], [4096], 5)
        plane.transfer("READ", info, [out.ctypes.data], [0], [4096], 5)
    np.testing.assert_array_equal(out, buf[:4096])


def test_a_refused_job_is_a_transfer_error_and_the_next_one_reconnects(info, buf, monkeypatch):
    with _plane(buf, path="lane") as plane:
        monkeypatch.setattr(wire, "MAX_REQUEST_BYTES", 1 << 30)  # the client no longer cuts: the server refuses
        monkeypatch.setattr(wire, "MAX_REGIONS", 1 << 30)
        error = plane.transfer_many("READ", [(info, [buf.ctypes.data] * 70000, [0] * 70000, [8] * 70000)], 5)[0]
        assert isinstance(error, TransferError)  # refused ("70000 regions"), or reset while sending
        monkeypatch.undo()
        plane.transfer("READ", info, [buf.ctypes.data], [0], [4096], 5)


def test_closing_the_segment_ends_its_connections(buf):
    memory = SegmentMemory(1 << 20, name="lane-close", lane_host="127.0.0.1")
    info = msgspec.structs.replace(memory.segment_info(1, "n"), host_id="another-host")
    with _plane(buf, path="lane") as plane:
        plane.transfer("WRITE", info, [buf.ctypes.data], [0], [4096], 5)  # a connection is open now
        memory.close()  # returns with its connection threads gone (they touch the mapping)
        error = plane.transfer_many("READ", [(info, [buf.ctypes.data], [0], [4096])], 2)[0]
        assert isinstance(error, TransferError)


def test_rdma_available_follows_ucx_tls(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    assert rdma_available() is False
    monkeypatch.setenv("UCX_TLS", "rc_x,tcp")  # names an RDMA transport: then the devices decide
    devices = os.path.isdir("/sys/class/infiniband") and any(True for _ in os.scandir("/sys/class/infiniband"))
    assert rdma_available() is devices


def test_a_lane_pools_connections_up_to_its_maximum(segment):
    lane = sl.TcpPath(segment.lane_address, max_connections=2)
    a, b = lane.try_acquire(), lane.try_acquire()
    assert a is not None and b is not None and lane.try_acquire() is None  # both in use: the job goes to NIXL
    lane.release(a)
    assert lane.try_acquire() is a  # idle connections are reused
    lane.close()
    lane.release(a)
    lane.release(b)
    assert lane._open == 0


def test_threads_share_a_route_and_every_byte_is_right(info, buf):
    import threading

    outs = [np.zeros(64 << 10, dtype=np.uint8) for _ in range(6)]
    with _plane(buf, *outs, path="auto", lane_max_bytes=1 << 20) as plane:
        plane.transfer("WRITE", info, [buf.ctypes.data], [0], [buf.nbytes], 5)
        failures = []

        def reader(k: int) -> None:
            for n in range(40):
                off = ((k * 40 + n) * 4096) % (buf.nbytes - outs[k].nbytes)
                plane.transfer("READ", info, [outs[k].ctypes.data], [off], [outs[k].nbytes], 5)
                if not np.array_equal(outs[k], buf[off : off + outs[k].nbytes]):
                    failures.append((k, n))

        threads = [threading.Thread(target=reader, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert failures == []
        # up to 4 connections at once; a job finding all of them busy went to NIXL instead
        assert plane.jobs_by_path["lane"] + plane.jobs_by_path["nixl"] == 1 + 6 * 40
        assert plane.jobs_by_path["lane"] > 0


def test_connections_over_the_limit_are_closed_and_jobs_still_complete(buf):
    memory = SegmentMemory(1 << 20, name="lane-cap", lane_host="127.0.0.1")
    memory._lane._max_connections = 2
    info = msgspec.structs.replace(memory.segment_info(1, "n"), host_id="another-host")
    try:
        hogs = [_raw(memory) for _ in range(2)]  # idle connections holding both slots
        with _plane(buf, path="lane") as plane:
            error = plane.transfer_many("READ", [(info, [buf.ctypes.data], [0], [4096])], 2)[0]
            assert isinstance(error, TransferError)  # closed on accept: a clear failure, not a hang
            hogs.pop().close()
            for _ in range(50):  # the server notices the closed hog as soon as it reads EOF
                if plane.transfer_many("READ", [(info, [buf.ctypes.data], [0], [4096])], 2)[0] is None:
                    break
            else:
                raise AssertionError("the lane never took a connection again")
        for hog in hogs:
            hog.close()
    finally:
        memory.close()


def test_without_rdma_reads_and_scatter_gather_or_split_writes_of_any_size_take_the_lane(info, monkeypatch):
    from kvpool.transfer import config as config_module

    monkeypatch.setattr(config_module, "rdma_available", lambda env=None: False)
    big = np.zeros(3 << 20, dtype=np.uint8)
    with _plane(big, lane_max_bytes=1 << 20) as plane:
        assert plane.lane_region_bytes == 256 << 10
        small_regions = [big.ctypes.data + i * (64 << 10) for i in range(48)]  # 3 MiB in 64 KiB regions
        plane.transfer("WRITE", info, small_regions, [i * (64 << 10) for i in range(48)], [64 << 10] * 48, 5)
        plane.transfer("READ", info, [big.ctypes.data], [0], [3 << 20], 5)  # any read
        assert plane.jobs_by_path["lane"] == 2
        plane.transfer("WRITE", info, [big.ctypes.data], [0], [3 << 20], 5)  # over the limit, split in two
        assert plane.jobs_by_path == {"shm": 0, "nixl": 0, "lane": 3}
        plane.lane_split_bytes = 0  # no split: one stream lost to NIXL's writes from 4 MiB
        plane.transfer("WRITE", info, [big.ctypes.data], [0], [3 << 20], 5)
        assert plane.jobs_by_path == {"shm": 0, "nixl": 1, "lane": 3}
    monkeypatch.setattr(config_module, "rdma_available", lambda env=None: True)
    with _plane(big, lane_max_bytes=1 << 20) as plane:
        assert plane.lane_region_bytes == 0  # with RDMA only small jobs


def test_a_peer_that_never_answers_is_a_timeout_within_the_deadline(buf):
    """The lane's sockets wait with the kernel's timeouts (rpc/timeouts.py): a node that takes
    the request and says nothing ends the job at its deadline, as a TransferError."""
    import time

    silent = socket.create_server(("127.0.0.1", 0))
    try:
        conn = sl.TcpPathConnection(f"127.0.0.1:{silent.getsockname()[1]}")
        started = time.monotonic()
        with pytest.raises(TransferError, match="timed out"):
            conn.transfer("READ", [buf.ctypes.data], [0], [4096], time.monotonic() + 0.3)
        assert 0.25 < time.monotonic() - started < 1.5
        with pytest.raises(TransferError, match="timed out"):  # a new connection, a shorter deadline
            conn.transfer("READ", [buf.ctypes.data], [0], [4096], time.monotonic() + 0.1)
        conn.close()
    finally:
        silent.close()


def test_sent_is_called_once_per_write_when_its_bytes_are_out_before_the_node_answers(info, buf):
    """transfer_many(sent=): a lane WRITE calls it once its bytes are handed to the kernel, while
    its answer is still awaited (a node that reads the whole request and never answers: sent ran,
    then the job timed out); once for a split write; never for a READ."""
    import time

    calls = []
    with _plane(buf, path="lane") as plane:
        plane.lane_split_bytes = 0
        assert plane.transfer_many("WRITE", [(info, [buf.ctypes.data], [0], [buf.nbytes])], 5,
                                   sent=lambda: calls.append("whole")) == [None]
        plane.lane_split_bytes = 256 << 10
        assert plane.transfer_many("WRITE", [(info, [buf.ctypes.data], [0], [buf.nbytes])], 5,
                                   sent=lambda: calls.append("split")) == [None]
        assert plane.transfer_many("READ", [(info, [buf.ctypes.data], [0], [buf.nbytes])], 5,
                                   sent=lambda: calls.append("read")) == [None]
    assert calls == ["whole", "split"]

    silent = socket.create_server(("127.0.0.1", 0))
    taken = threading.Event()

    def take_and_say_nothing():
        peer, _ = silent.accept()
        with peer:
            need = wire.HEAD.size + wire.REGION.size + 4096
            while need > 0:
                need -= len(peer.recv(need))
            taken.set()
            time.sleep(1.0)

    threading.Thread(target=take_and_say_nothing, daemon=True).start()
    try:
        conn = sl.TcpPathConnection(f"127.0.0.1:{silent.getsockname()[1]}")
        seen = []
        with pytest.raises(TransferError, match="timed out"):
            conn.transfer("WRITE", [buf.ctypes.data], [0], [4096], time.monotonic() + 0.5, sent=lambda: seen.append(1))
        assert seen == [1] and taken.wait(1)
        conn.close()
    finally:
        silent.close()


def test_a_peer_that_reads_a_trickle_cannot_hold_a_write_past_its_deadline():
    """The kernel's send timeout bounds each send, not the job: a node taking a few KiB at a time
    would keep a blocking sendmsg going; the job still ends at its deadline."""
    import threading
    import time

    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def trickle() -> None:
        conn, _ = server.accept()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        while not stop.is_set():
            try:
                conn.recv(4096)
            except OSError:
                return
            time.sleep(0.01)
        conn.close()

    reader = threading.Thread(target=trickle, daemon=True)
    reader.start()
    big = np.zeros(16 << 20, dtype=np.uint8)
    try:
        conn = sl.TcpPathConnection(f"127.0.0.1:{server.getsockname()[1]}")
        started = time.monotonic()
        with pytest.raises(TransferError, match="timed out"):
            conn.transfer("WRITE", [big.ctypes.data], [0], [big.nbytes], time.monotonic() + 0.5)
        assert time.monotonic() - started < 2.0
        conn.close()
    finally:
        stop.set()
        server.close()
        reader.join(timeout=5)


def test_a_write_given_up_on_stays_in_flight_until_the_node_closes_its_end():
    """A WRITE that timed out may still land (its bytes wait in the node's socket): its error
    carries a handle that is done only when the node, having read all of it, closes; a READ that
    timed out carries none (nothing lands but what we receive ourselves)."""
    import time

    server = socket.create_server(("127.0.0.1", 0))
    resume = threading.Event()
    got = []

    def stopped_node() -> None:
        conn, _ = server.accept()
        resume.wait(10)  # a stopped node: reads nothing until it resumes
        while data := conn.recv(1 << 16):
            got.append(len(data))  # the cut request's bytes, then EOF from the client
        conn.close()

    node = threading.Thread(target=stopped_node, daemon=True)
    node.start()
    data = np.ones(256 << 10, dtype=np.uint8)
    try:
        conn = sl.TcpPathConnection(f"127.0.0.1:{server.getsockname()[1]}")
        with pytest.raises(TransferError, match="timed out") as raised:
            conn.transfer("WRITE", [data.ctypes.data], [0], [data.nbytes], time.monotonic() + 0.3)
        stuck = raised.value.in_flight
        assert stuck is not None and not stuck.wait(0.3)  # may still land: fenced
        resume.set()
        assert stuck.wait(5.0)  # the node read what it got and closed: over
        assert sum(got) >= data.nbytes
        node.join(5)
    finally:
        server.close()

    silent = socket.create_server(("127.0.0.1", 0))
    try:
        conn = sl.TcpPathConnection(f"127.0.0.1:{silent.getsockname()[1]}")
        with pytest.raises(TransferError, match="timed out") as raised:
            conn.transfer("READ", [data.ctypes.data], [0], [4096], time.monotonic() + 0.2)
        assert raised.value.in_flight is None
    finally:
        silent.close()


@settings(deadline=None)  # up to 60K byte pairs per example: slow on a loaded 2-core machine, not wrong
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=12), st.floats(0, 1))
def test_a_job_cut_in_halves_covers_the_same_bytes_in_order(sizes, where):
    from kvpool.transfer.tcp_path_halves import halves as _halves

    addrs = list(itertools.accumulate([1 << 20] + sizes[:-1]))  # contiguous local regions
    offsets = list(itertools.accumulate([7 << 20] + [s * 2 for s in sizes[:-1]]))  # spread remote ones
    at = int(sum(sizes) * where)
    first, second = _halves(addrs, offsets, sizes, at)
    assert sum(first[2]) == at and sum(second[2]) == sum(sizes) - at
    assert all(n > 0 for n in first[2] + second[2])

    def byte_pairs(a, o, s):  # (local byte, remote byte) for every byte, in order
        return [(x + k, y + k) for x, y, n in zip(a, o, s) for k in range(n)]

    assert byte_pairs(*first) + byte_pairs(*second) == byte_pairs(addrs, offsets, sizes)


def test_a_large_read_runs_as_two_halves_on_two_connections(segment, info, buf):
    """A READ of lane_read_split_bytes or more runs half on a second connection of the same lane, at once;
    every byte lands where it belongs (regions of odd sizes, one cut in the middle)."""
    src = np.random.default_rng(5).integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros(1 << 20, dtype=np.uint8)
    sizes = [100_003, 300_001, 48_000, (1 << 20) - 448_004]
    with _plane(src, dst, path="lane") as plane:
        plane.lane_split_bytes = 0
        plane.transfer("WRITE", info, [src.ctypes.data], [0], [src.nbytes], 5)
        lane = next(r.lane for r in plane._routes.values() if r.lane is not None)
        assert lane._open == 1
        plane.lane_read_split_bytes = 64 << 10
        local = list(itertools.accumulate([dst.ctypes.data] + sizes[:-1]))
        remote = list(itertools.accumulate([0] + sizes[:-1]))
        plane.transfer("READ", info, local, remote, sizes, 5)
        assert np.array_equal(src, dst)
        assert lane._open == 2  # the second half had a connection of its own
        for _ in range(5):  # again: second halves run on kept threads, none started per read
            dst[:] = 0
            plane.transfer("READ", info, local, remote, sizes, 5)
            assert np.array_equal(src, dst)
        halves = [t for t in threading.enumerate() if t.name.startswith("kvpool-lane-half")]
        assert 1 <= len(halves) <= 4


def test_a_large_write_runs_as_two_halves_and_every_byte_lands_in_place(info):
    """A WRITE of lane_split_bytes or more is split like a READ (the cut inside a region): the
    segment then holds exactly the source's bytes, written over two connections at once."""
    src = np.random.default_rng(6).integers(0, 256, 3 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    sizes = [1_000_001, 777_777, (3 << 20) - 1_777_778]
    local = list(itertools.accumulate([src.ctypes.data] + sizes[:-1]))
    remote = list(itertools.accumulate([4096] + sizes[:-1]))
    with _plane(src, dst, path="lane") as plane:
        plane.lane_split_bytes = 1 << 20
        plane.transfer("WRITE", info, local, remote, sizes, 5)
        lane = next(r.lane for r in plane._routes.values() if r.lane is not None)
        assert lane._open == 2
        plane.lane_read_split_bytes = 0  # read back on one connection: nothing but the write decides
        plane.transfer("READ", info, [dst.ctypes.data], [4096], [src.nbytes], 5)
    assert np.array_equal(src, dst)


def test_a_split_read_from_a_silent_node_ends_at_its_deadline(info, buf):
    import time

    silent = socket.create_server(("127.0.0.1", 0))
    quiet = msgspec.structs.replace(info, segment_id=99, lane_address=f"127.0.0.1:{silent.getsockname()[1]}")
    try:
        with _plane(buf, path="lane") as plane:
            plane.lane_read_split_bytes = 64 << 10
            started = time.monotonic()
            error = plane.transfer_many("READ", [(quiet, [buf.ctypes.data], [0], [buf.nbytes])], 0.3)[0]
            assert isinstance(error, TransferError) and time.monotonic() - started < 1.5
    finally:
        silent.close()


def test_a_split_write_to_a_silent_node_is_fenced_until_both_halves_are_over(info):
    import time

    silent = socket.create_server(("127.0.0.1", 0))  # connections queue, nothing is ever read
    quiet = msgspec.structs.replace(info, segment_id=98, lane_address=f"127.0.0.1:{silent.getsockname()[1]}")
    src = np.ones(SEGMENT_BYTES, dtype=np.uint8)  # two halves; the node answers neither
    with _plane(src, path="lane") as plane:
        plane.lane_split_bytes = 64 << 10
        started = time.monotonic()
        error = plane.transfer_many("WRITE", [(quiet, [src.ctypes.data], [0], [src.nbytes])], 0.3)[0]
        assert isinstance(error, TransferError) and time.monotonic() - started < 1.5
        assert error.in_flight is not None and not error.in_flight.wait(0.2)
        silent.close()  # the queued connections are reset: neither half can land any more
        assert error.in_flight.wait(5.0)


def test_unregistered_memory_goes_over_the_lane_and_a_read_prepares_its_regions_first(info):
    """`unregistered=True`: local memory the plane never registered (a plain value's bytes) is
    carried by the lane, not refused; `before_landing` sees every region of a READ once its
    request is sent, before its bytes land (a reader faults fresh pages in meanwhile)."""
    src = np.random.default_rng(7).integers(0, 256, 3 << 20, dtype=np.uint8)  # registered nowhere
    dst = np.zeros_like(src)
    seen = []

    def before_landing(addr, size):
        seen.append((addr, size, int(dst[(addr - dst.ctypes.data) + size - 1])))  # nothing landed yet

    with _plane() as plane:
        with pytest.raises(Exception, match="registered"):
            plane.transfer("WRITE", info, [src.ctypes.data], [0], [src.nbytes], 5)  # as always
        assert plane.carries_unregistered("WRITE", info, src.nbytes)
        regions = [src.ctypes.data, src.ctypes.data + (1 << 20)]
        sizes = [1 << 20, 2 << 20]
        errors = plane.transfer_many("WRITE", [(info, regions, [0, 1 << 20], sizes)], 5, unregistered=True)
        assert errors == [None]
        dst[:] = 0
        errors = plane.transfer_many("READ", [(info, [dst.ctypes.data, dst.ctypes.data + (1 << 20)], [0, 1 << 20],
                                               sizes)], 5, unregistered=True, before_landing=before_landing)
        assert errors == [None]
        assert np.array_equal(src, dst)
        assert plane.jobs_by_path == {"shm": 0, "nixl": 0, "lane": 2}
    # the 3 MiB read ran as two halves, each preparing its own part: every byte exactly once, and
    # each part before its bytes came (its last byte still the 0 it was set to)
    covered = np.zeros(dst.nbytes, dtype=np.int64)
    for addr, size, last in seen:
        covered[addr - dst.ctypes.data : addr - dst.ctypes.data + size] += 1
        assert last == 0 or src[addr - dst.ctypes.data + size - 1] == 0
    assert (covered == 1).all() and len(seen) >= 3


def test_unregistered_memory_never_goes_to_nixl(info, monkeypatch):
    """Where only NIXL would carry a job (path nixl, or a large one with RDMA), a call from
    unregistered memory fails with a TransferError and moves nothing; the plane says so first."""
    from kvpool.transfer import config as config_module

    src = np.ones(1 << 20, dtype=np.uint8)
    with _plane(path="nixl") as plane:
        assert not plane.carries_unregistered("WRITE", info, src.nbytes)
        error = plane.transfer_many("WRITE", [(info, [src.ctypes.data], [0], [src.nbytes])], 5, unregistered=True)[0]
        assert isinstance(error, TransferError) and "unregistered" in str(error)
        assert plane.jobs_by_path == {"shm": 0, "nixl": 0, "lane": 0}
    monkeypatch.setattr(config_module, "rdma_available", lambda env=None: True)  # NIXL takes jobs over 256 KiB
    with _plane() as plane:
        assert plane.carries_unregistered("READ", info, 256 << 10)
        assert not plane.carries_unregistered("READ", info, 1 << 20)
