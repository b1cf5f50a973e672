"""TCP-path jobs that spin (transfer/tcp_path.py): a whole job sends and receives without
blocking while its spin lasts and moves the same bytes; planes made without the spin and halves of
split jobs never spin; a job past its spin blocks, and a lane whose jobs come late stops spinning."""

from __future__ import annotations

import itertools
import socket
import threading

import numpy as np
import pytest

from kvpool.transfer import DataPlane
from kvpool.transfer import tcp_path as sl
from kvpool.transfer import tcp_path_wire as wire
from kvpool.transfer.config import DEFAULT_TCP_SPIN_US, TCP_SPIN_ENV
import test_tcp_path
from test_tcp_path import _plane

segment, info = test_tcp_path.segment, test_tcp_path.info  # the fixtures, shared


def _count_spins(monkeypatch) -> list[int]:
    """Every non-blocking send or receive a lane job makes (tcp_path_wire.spin_flags' answers)."""
    spun = []
    real = wire.spin_flags

    def counted(*args):
        flags, until = real(*args)
        if flags:
            spun.append(flags)
        return flags, until

    monkeypatch.setattr(wire, "spin_flags", counted)
    return spun


def test_a_whole_job_spins_and_every_byte_is_right_a_lane_without_spin_and_halves_never_do(info, monkeypatch):
    """A job run whole on the caller's thread sends and receives without blocking while its spin
    lasts (tcp_path.py); the bytes are the same as blocking. A plane made with
    $KVPOOL_SEGMENT_LANE_SPIN_US=0 never spins (the variable unset again later), nor does either
    half of a split job."""
    src = np.random.default_rng(11).integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    sizes = [4096 + 7 * i for i in range(60)]
    local_src = list(itertools.accumulate([src.ctypes.data] + sizes[:-1]))
    local_dst = list(itertools.accumulate([dst.ctypes.data] + sizes[:-1]))
    remote = [i * 20_000 for i in range(60)]
    spun = _count_spins(monkeypatch)
    with _plane(src, dst, path="lane") as plane:
        plane.transfer("WRITE", info, local_src, remote, sizes, 5)
        plane.transfer("READ", info, local_dst, remote, sizes, 5)
        lane = next(r.lane for r in plane._routes.values() if r.lane is not None)
        assert lane.spin.spin_s == DEFAULT_TCP_SPIN_US * 1e-6 and lane.spin.spins
    assert spun, "a whole job made only blocking sends and receives"
    assert np.array_equal(src[: sum(sizes)], dst[: sum(sizes)])

    spun.clear()
    monkeypatch.setenv(TCP_SPIN_ENV, "0")
    dst[:] = 0
    with _plane(src, dst, path="lane") as plane:  # the variable is read when the plane is made
        monkeypatch.delenv(TCP_SPIN_ENV)
        plane.transfer("READ", info, local_dst, remote, sizes, 5)
        assert plane.lane_spin_s == 0
    assert not spun
    assert np.array_equal(src[: sum(sizes)], dst[: sum(sizes)])

    with _plane(src, dst, path="lane") as plane:  # spins by default, but halves never
        plane.lane_read_split_bytes = plane.lane_split_bytes = 64 << 10
        plane.transfer("WRITE", info, local_src, remote, sizes, 5)
        plane.transfer("READ", info, local_dst, remote, sizes, 5)
        lane = next(r.lane for r in plane._routes.values() if r.lane is not None)
        assert lane._open == 2  # split: each job ran as two halves
    assert not spun


def test_a_job_past_its_spin_blocks_and_a_lane_whose_jobs_come_late_stops_spinning(monkeypatch):
    """A peer that answers a READ 60 ms late: the job spins (5 ms, its spin), then blocks (its
    thread's CPU time stays far below the wait) and gets the right bytes; after a few such jobs
    the lane's policy no longer spins at all (spin.py), and quick jobs bring it back."""
    import time

    from kvpool.rpc.spin import SpinPolicy

    payload = np.random.default_rng(3).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    server = socket.create_server(("127.0.0.1", 0))
    delay_s = [0.06]

    def serve() -> None:
        peer, _ = server.accept()
        with peer:
            while True:
                need, got = wire.HEAD.size + wire.REGION.size, b""
                while len(got) < need:
                    chunk = peer.recv(need - len(got))
                    if not chunk:
                        return
                    got += chunk
                time.sleep(delay_s[0])
                peer.sendall(wire.REPLY.pack(0, len(payload)) + payload)

    threading.Thread(target=serve, daemon=True).start()
    spun = _count_spins(monkeypatch)
    policy = SpinPolicy(0.005)
    out = np.zeros(4096, dtype=np.uint8)
    conn = sl.TcpPathConnection(f"127.0.0.1:{server.getsockname()[1]}")
    try:
        for job in range(7):
            before = len(spun)
            out[:] = 0
            cpu, wall = time.thread_time(), time.monotonic()
            conn.transfer("READ", [out.ctypes.data], [0], [4096], time.monotonic() + 5, spin=policy)
            cpu, wall = time.thread_time() - cpu, time.monotonic() - wall
            assert out.tobytes() == payload
            assert wall >= 0.05 and cpu < 0.04, (wall, cpu)  # blocked through most of the wait
            if job == 0:
                assert len(spun) > before  # a new lane spins first
            if job == 6:
                assert not policy.spins and len(spun) == before  # six late jobs: the spin is off
        delay_s[0] = 0.0
        for _ in range(200):  # quick answers: spinning again
            conn.transfer("READ", [out.ctypes.data], [0], [4096], time.monotonic() + 5, spin=policy)
            if policy.spins:
                break
        assert policy.spins and out.tobytes() == payload
    finally:
        conn.close()
        server.close()


def test_the_spin_variable_is_checked_when_a_plane_is_made(monkeypatch):
    monkeypatch.setenv(TCP_SPIN_ENV, "fast")
    with pytest.raises(ValueError, match="KVPOOL_SEGMENT_LANE_SPIN_US"):
        DataPlane()
    monkeypatch.setenv(TCP_SPIN_ENV, "50")
    with DataPlane() as plane:
        assert plane.lane_spin_s == pytest.approx(50e-6)
