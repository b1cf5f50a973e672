"""DataPlane in one process: a SegmentMemory and a DataPlane side by side (NIXL loopback between
two agents, and the segment's memfd mapped a second time). Argument checks, routes, lifetimes."""

from __future__ import annotations


import numpy as np
import pytest

from kvpool.core.errors import TransferError, UsageError
from kvpool.transfer import DataPlane, SegmentMemory
from kvpool.transfer.shm import PeerMapping

SEGMENT_BYTES = 4 << 20


@pytest.fixture(scope="module")
def segment():
    with SegmentMemory(SEGMENT_BYTES, name="unit") as memory:
        yield memory


@pytest.fixture
def info(segment):
    return segment.segment_info(segment_id=1, node_id="unit-node")


@pytest.fixture
def buf():
    return np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)


@pytest.mark.parametrize("path", ["shm", "nixl"])
def test_round_trip_in_one_process(info, buf, path):
    out = np.zeros_like(buf)
    with DataPlane(path=path) as plane:
        plane.register(buf.ctypes.data, buf.nbytes)
        plane.register(out.ctypes.data, out.nbytes)
        assert plane.path_for(info) == path
        half = buf.nbytes // 2
        plane.transfer("WRITE", info, [buf.ctypes.data + half, buf.ctypes.data], [100, 100 + half], [half, half], 5)
        plane.transfer("READ", info, [out.ctypes.data], [100], [buf.nbytes], 5)
    np.testing.assert_array_equal(out[:half], buf[half:])
    np.testing.assert_array_equal(out[half:], buf[:half])


def test_empty_job_is_a_no_op(info):
    with DataPlane() as plane:
        assert plane.transfer_many("READ", [(info, [], [], [])], timeout_s=1) == [None]


@pytest.mark.parametrize(
    "local_offset,remote,size,match",
    [
        (0, SEGMENT_BYTES - 10, 11, "outside segment"),
        (0, -1, 10, "outside segment"),
        (0, 0, 0, "outside segment"),
        ((1 << 20) - 5, 0, 10, "not inside memory registered"),
    ],
)
def test_regions_are_checked_before_anything_moves(info, buf, local_offset, remote, size, match):
    with DataPlane(path="shm") as plane:
        plane.register(buf.ctypes.data, buf.nbytes)
        with pytest.raises(UsageError, match=match):
            plane.transfer("READ", info, [buf.ctypes.data + local_offset], [remote], [size], 5)


def test_unregistered_memory_is_refused(info, buf):
    with DataPlane(path="shm") as plane, pytest.raises(UsageError, match="registered"):
        plane.transfer("READ", info, [buf.ctypes.data], [0], [16], 5)


def test_bad_arguments(info, buf):
    with DataPlane() as plane:
        plane.register(buf.ctypes.data, buf.nbytes)
        with pytest.raises(UsageError, match="differ in length"):
            plane.transfer("READ", info, [buf.ctypes.data], [0, 1], [1], 5)
        with pytest.raises(UsageError, match="READ or WRITE"):
            plane.transfer("COPY", info, [buf.ctypes.data], [0], [1], 5)
        with pytest.raises(UsageError, match="timeout_s"):
            plane.transfer("READ", info, [buf.ctypes.data], [0], [1], 0)
        with pytest.raises(UsageError, match="integers"):
            plane.transfer("READ", info, ["x"], [0], [1], 5)
        with pytest.raises(UsageError, match="overlaps"):
            plane.register(buf.ctypes.data + 10, 100)
        plane.register(buf.ctypes.data, buf.nbytes)  # the same memory again is fine
        with pytest.raises(UsageError, match="no registered memory"):
            plane.unregister(buf.ctypes.data + 1)
        with pytest.raises(UsageError):
            plane.register(0, 10)
    with pytest.raises(ValueError, match="path"):
        DataPlane(path="rdma")


def test_unregister_then_transfer_is_refused(info, buf):
    with DataPlane(path="nixl") as plane:
        plane.register(buf.ctypes.data, buf.nbytes)
        plane.transfer("READ", info, [buf.ctypes.data], [0], [64], 5)
        plane.unregister(buf.ctypes.data)
        with pytest.raises(UsageError, match="registered"):
            plane.transfer("READ", info, [buf.ctypes.data], [0], [64], 5)


def test_closed_plane_refuses_work(info, buf):
    plane = DataPlane()
    plane.close()
    with pytest.raises(UsageError, match="closed"):
        plane.register(buf.ctypes.data, buf.nbytes)


@pytest.mark.parametrize("path", ["shm", "nixl"])
def test_forget_segment_then_use_it_again(info, buf, path):
    with DataPlane(path=path) as plane:
        plane.register(buf.ctypes.data, buf.nbytes)
        plane.transfer("WRITE", info, [buf.ctypes.data], [0], [4096], 5)
        plane.forget_segment(info.segment_id)
        plane.forget_segment(info.segment_id)  # twice is fine
        plane.forget_segment(12345)  # never seen is fine
        out = np.zeros(4096, dtype=np.uint8)
        plane.register(out.ctypes.data, out.nbytes)
        plane.transfer("READ", info, [out.ctypes.data], [0], [4096], 5)
    np.testing.assert_array_equal(out, buf[:4096])


def test_shm_path_refused_for_another_host(info):
    import msgspec

    elsewhere = msgspec.structs.replace(info, host_id="some-other-host")
    with DataPlane(path="shm") as plane, pytest.raises(TransferError, match="host"):
        plane.path_for(elsewhere)
    with DataPlane(path="auto") as plane:
        assert plane.path_for(elsewhere) == "nixl"


def test_mapping_checks_the_segment_token(segment):
    with pytest.raises(ValueError, match="not the segment"):
        PeerMapping(segment.shm_path, SEGMENT_BYTES, token="somebody-else")
    with pytest.raises(ValueError, match="/proc"):
        PeerMapping("/dev/shm/x", SEGMENT_BYTES, token=segment.agent_name)
    with pytest.raises(ValueError, match="smaller"):
        PeerMapping(segment.shm_path, 2 * SEGMENT_BYTES, token=segment.agent_name)


def test_segment_memory_rejects_bad_sizes():
    with pytest.raises(ValueError):
        SegmentMemory(0)


@pytest.mark.parametrize("bad", ["remote", "local"])
def test_long_lists_are_checked_too(info, buf, bad):
    n = 200  # past the Python-loop threshold: the vectorized check
    local = [buf.ctypes.data + i * 64 for i in range(n)]
    remote = [i * 64 for i in range(n)]
    if bad == "remote":
        remote[150] = SEGMENT_BYTES - 32
    else:
        local[150] = buf.ctypes.data + buf.nbytes - 32
    with DataPlane(path="shm") as plane:
        plane.register(buf.ctypes.data, buf.nbytes)
        with pytest.raises(UsageError, match="region 150"):
            plane.transfer("READ", info, local, remote, [64] * n, 5)


@pytest.mark.parametrize("many", [False, True])  # the Python loop and the vectorised check
def test_one_job_never_mixes_host_and_gpu_memory(info, buf, many):
    n = 100 if many else 2
    with DataPlane(path="shm") as plane:
        plane.register(buf.ctypes.data, buf.nbytes // 2)
        # the other half stands in for GPU memory: the plane only records where it lies
        plane.register(buf.ctypes.data + buf.nbytes // 2, buf.nbytes // 2, device=0)
        addrs = [buf.ctypes.data + 64] * (n - 1) + [buf.ctypes.data + buf.nbytes // 2 + 64]
        with pytest.raises(UsageError, match=r"different memories \(host, cuda:0\)"):
            plane.transfer("READ", info, addrs, [0] * n, [64] * n, 5)


def test_device_must_be_a_cuda_index(buf):
    with DataPlane() as plane, pytest.raises(UsageError, match="CUDA device index"):
        plane.register(buf.ctypes.data, buf.nbytes, device=-1)


def test_gpu_job_without_a_gpu_is_a_transfer_error_and_the_plane_keeps_working(info, buf):
    out = np.zeros_like(buf)
    with DataPlane(path="shm") as plane:
        plane.register(out.ctypes.data, out.nbytes, device=0)  # no GPU here: CUDA refuses it cleanly
        with pytest.raises(TransferError, match="CUDA|libcudart"):
            plane.transfer("READ", info, [out.ctypes.data], [0], [4096], 5)
        plane.register(buf.ctypes.data, buf.nbytes)
        plane.transfer("WRITE", info, [buf.ctypes.data], [0], [4096], 5)  # host jobs still move
