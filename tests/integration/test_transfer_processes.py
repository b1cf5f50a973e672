"""The data plane across real processes: a segment served by another process, reached over NIXL
(UCX) and over the mapped memfd; byte-exact reads and writes, scatter-gather, dead peers."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvpool.core.errors import TransferError
from kvpool.transfer import DataPlane, host_id
from kvpool.transfer.hosting import pattern, read_segment_info

SEGMENT_BYTES = 32 << 20
SEED = 7


class ServedSegment:
    def __init__(self, workdir: Path, name: str, seed: int, segment_id: int) -> None:
        info_path = workdir / f"{name}.segment"
        code = (
            "from kvpool.transfer.hosting import serve_segment; "
            f"serve_segment({str(info_path)!r}, {SEGMENT_BYTES}, fill_seed={seed}, segment_id={segment_id})"
        )
        self.proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
        try:
            self.info = read_segment_info(info_path, timeout_s=60)
        except TimeoutError:
            self.proc.kill()
            raise

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def served(tmp_path):
    segments: list[ServedSegment] = []

    def start(name: str = "seg", seed: int = SEED) -> ServedSegment:
        segments.append(ServedSegment(tmp_path, name, seed, segment_id=len(segments) + 1))
        return segments[-1]

    yield start
    for segment in segments:
        segment.stop()


@pytest.fixture
def expected():
    return pattern(SEED, SEGMENT_BYTES)


def _plane(path: str, *buffers: np.ndarray) -> DataPlane:
    plane = DataPlane(path=path)
    for buf in buffers:
        plane.register(buf.ctypes.data, buf.nbytes)
    return plane


def _random_regions(rng, num_regions: int, region_bytes: int, space_bytes: int) -> np.ndarray:
    """Non-overlapping region offsets in random order."""
    return rng.permutation(space_bytes // region_bytes)[:num_regions] * region_bytes


@pytest.mark.parametrize("path", ["nixl", "shm"])
def test_read_is_byte_exact(served, expected, path):
    segment = served().info
    out = np.zeros(8 << 20, dtype=np.uint8)
    with _plane(path, out) as plane:
        assert plane.path_for(segment) == path
        offsets = [0, 12345, SEGMENT_BYTES - (1 << 20)]
        sizes = [1 << 20, 3 << 20, 1 << 20]
        local = [out.ctypes.data, out.ctypes.data + (1 << 20), out.ctypes.data + (4 << 20)]
        plane.transfer("READ", segment, local, offsets, sizes, timeout_s=10)
    np.testing.assert_array_equal(out[: 1 << 20], expected[: 1 << 20])
    np.testing.assert_array_equal(out[1 << 20 : 4 << 20], expected[12345 : 12345 + (3 << 20)])
    np.testing.assert_array_equal(out[4 << 20 : 5 << 20], expected[-(1 << 20) :])


@pytest.mark.parametrize("write_path,read_path", [("nixl", "shm"), ("shm", "nixl")])
def test_write_then_read_through_the_other_path(served, expected, write_path, read_path):
    segment = served().info
    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, 6 << 20, dtype=np.uint8)
    out = np.zeros_like(src)
    offsets = [4096, 9 << 20, (20 << 20) + 17]
    sizes = [2 << 20, 1 << 20, 3 << 20]
    local = np.cumsum([0] + sizes[:-1]).tolist()
    with _plane(write_path, src) as writer, _plane(read_path, out) as reader:
        writer.transfer("WRITE", segment, [src.ctypes.data + x for x in local], offsets, sizes, timeout_s=10)
        reader.transfer("READ", segment, [out.ctypes.data + x for x in local], offsets, sizes, timeout_s=10)
    np.testing.assert_array_equal(out, src)
    # bytes outside the written regions are untouched
    with _plane(read_path, out) as reader:
        reader.transfer("READ", segment, [out.ctypes.data], [0], [4096], timeout_s=10)
    np.testing.assert_array_equal(out[:4096], expected[:4096])


@pytest.mark.parametrize("path", ["nixl", "shm"])
def test_scatter_gather_many_regions(served, path):
    segment = served().info
    region_bytes, num_regions = 16 << 10, 1024
    rng = np.random.default_rng(2)
    src = rng.integers(0, 256, num_regions * region_bytes, dtype=np.uint8)
    out = np.zeros_like(src)
    remote = _random_regions(rng, num_regions, region_bytes, SEGMENT_BYTES).tolist()
    local_order = rng.permutation(num_regions) * region_bytes  # gather from scattered local slots too
    sizes = [region_bytes] * num_regions
    with _plane(path, src, out) as plane:
        plane.transfer("WRITE", segment, (src.ctypes.data + local_order).tolist(), remote, sizes, timeout_s=20)
        plane.transfer("READ", segment, (out.ctypes.data + local_order).tolist(), remote, sizes, timeout_s=20)
    np.testing.assert_array_equal(out, src)


@pytest.mark.parametrize("path", ["nixl", "shm"])
def test_transfer_many_reports_each_job(served, path):
    alive, doomed = served("alive", seed=11), served("doomed", seed=12)
    out = np.zeros(2 << 20, dtype=np.uint8)
    with _plane(path, out) as plane:
        jobs = [
            (alive.info, [out.ctypes.data], [0], [1 << 20]),
            (doomed.info, [out.ctypes.data + (1 << 20)], [0], [1 << 20]),
        ]
        assert plane.transfer_many("READ", jobs, timeout_s=10) == [None, None]
        np.testing.assert_array_equal(out[: 1 << 20], pattern(11, 1 << 20))
        np.testing.assert_array_equal(out[1 << 20 :], pattern(12, 1 << 20))
        doomed.kill()
        out[:] = 0
        errors = plane.transfer_many("READ", jobs, timeout_s=5)
        assert errors[0] is None
        assert isinstance(errors[1], TransferError)
        np.testing.assert_array_equal(out[: 1 << 20], pattern(11, 1 << 20))


@pytest.mark.parametrize("path", ["nixl", "shm", "auto"])
@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_killed_peer_fails_fast(served, path, op):
    segment = served()
    buf = np.zeros(4 << 20, dtype=np.uint8)
    timeout_s = 5.0
    with _plane(path, buf) as plane:
        plane.transfer(op, segment.info, [buf.ctypes.data], [0], [buf.nbytes], timeout_s=timeout_s)
        segment.kill()
        started = time.monotonic()
        with pytest.raises(TransferError):
            plane.transfer(op, segment.info, [buf.ctypes.data], [0], [buf.nbytes], timeout_s=timeout_s)
        assert time.monotonic() - started < timeout_s + 1.0  # an error, not a hang
        # a process that learns of the segment only now fails just as cleanly
        with _plane(path, buf) as fresh, pytest.raises(TransferError):
            fresh.transfer(op, segment.info, [buf.ctypes.data], [0], [buf.nbytes], timeout_s=timeout_s)


def test_auto_prefers_shared_memory_on_the_same_host(served):
    segment = served().info
    with DataPlane() as plane:
        assert plane.path_for(segment) == "shm"


def test_host_id_is_the_same_in_another_process():
    code = "from kvpool.transfer import host_id; print(host_id())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == host_id()
