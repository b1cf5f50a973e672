"""Storage nodes against a real `kvpool master` (separate processes on 127.0.0.1, OS-chosen ports):
mount, heartbeats, clean SIGTERM exit, SIGKILL -> dropped after the TTL, restart and remount."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import numpy as np
import pytest

from kvpool.bench import procs
from kvpool.core.errors import UnavailableError
from kvpool.core.protocol import GetSegments, Stats
from kvpool.node import NodeConfig, StorageNode
from kvpool.transfer import DataPlane
from kvpool.rpc.zmq_channel import MasterChannel

FAST_HEALTH = ("--node-ttl-s", "1.5", "--heartbeat-interval-s", "0.3")


def _stats(address: str):
    channel = MasterChannel(address, timeout_s=5)
    try:
        return channel.call(Stats())
    finally:
        channel.close()


def _nodes(address: str) -> dict[str, object]:
    return {n.node_id: n for n in _stats(address).nodes}


def _wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def test_node_mounts_and_shows_in_stats(make_pool):
    pool = make_pool(num_nodes=0)
    node = pool.add_node("48MiB", "--metrics-port", "0")
    info = node.info
    assert info["pid"] == node.pid and info["node_id"] == "node0"
    stats = _nodes(pool.address)["node0"]
    assert stats.segment_id == info["segment_id"]
    assert stats.capacity_bytes == 48 << 20
    assert stats.state == "alive"
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{info['metrics_port']}/metrics", timeout=5).read().decode()
    assert "kvpool_node_segment_bytes 5.0331648e+07" in metrics
    assert "kvpool_node_mounted 1.0" in metrics


def test_heartbeats_keep_the_node_past_its_ttl(make_pool):
    pool = make_pool(num_nodes=1, master_args=FAST_HEALTH)
    segment_id = pool.nodes[0].info["segment_id"]
    time.sleep(3 * 1.5)
    stats = _nodes(pool.address)["node0"]
    assert stats.segment_id == segment_id
    assert stats.last_heartbeat_age_s < 1.5


def test_sigterm_unmounts_at_once(make_pool):
    pool = make_pool(num_nodes=2, master_args=("--node-ttl-s", "60"))
    assert set(_nodes(pool.address)) == {"node0", "node1"}
    assert pool.nodes[0].stop() == 0
    # gone right away: the TTL is a minute, so this was the node's own unmount
    assert set(_nodes(pool.address)) == {"node1"}
    assert "unmounted" in pool.nodes[0].tail_log()


def test_sigkill_is_dropped_after_ttl_and_restart_mounts_clean(make_pool):
    pool = make_pool(num_nodes=1, master_args=FAST_HEALTH)
    old_segment_id = pool.nodes[0].info["segment_id"]
    pool.nodes[0].kill()
    _wait_for(lambda: "node0" not in _nodes(pool.address), 10, "the killed node was dropped")
    restarted = procs.start_node(pool.workdir, pool.address, "64MiB", name="node0")
    pool.nodes.append(restarted)
    new_segment_id = restarted.info["segment_id"]
    assert new_segment_id != old_segment_id
    nodes = _stats(pool.address).nodes
    assert [(n.node_id, n.segment_id) for n in nodes] == [("node0", new_segment_id)]


def test_node_remounts_when_the_master_forgot_it(make_pool):
    pool = make_pool(num_nodes=1, master_args=FAST_HEALTH)
    node = pool.nodes[0]
    old_segment_id = node.info["segment_id"]
    os.kill(node.pid, signal.SIGSTOP)  # silent past the TTL, but alive
    try:
        _wait_for(lambda: "node0" not in _nodes(pool.address), 10, "the silent node was dropped")
    finally:
        os.kill(node.pid, signal.SIGCONT)
    stats = _wait_for(lambda: _nodes(pool.address).get("node0"), 10, "the node mounted again")
    assert stats.segment_id != old_segment_id
    # the node rewrites its ready file once the mount reply is in: a moment after the master knows
    _wait_for(lambda: json.loads(node.ready_file.read_text())["segment_id"] == stats.segment_id, 5,
              "the ready file names the new segment")


def test_embedded_node_and_its_segment_carry_bytes(make_pool):
    pool = make_pool(num_nodes=0)
    config = NodeConfig(master_address=pool.address, memory_bytes=8 << 20, node_id="embedded")
    with StorageNode(config) as node:
        assert node.mounted
        channel = MasterChannel(pool.address, timeout_s=5)
        [segment] = channel.call(GetSegments([node.segment_id])).segments
        channel.close()
        data = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8)
        out = np.zeros_like(data)
        with DataPlane(path="nixl") as writer, DataPlane(path="shm") as reader:
            writer.register(data.ctypes.data, data.nbytes)
            reader.register(out.ctypes.data, out.nbytes)
            writer.transfer("WRITE", segment, [data.ctypes.data], [4096], [data.nbytes], timeout_s=10)
            reader.transfer("READ", segment, [out.ctypes.data], [4096], [out.nbytes], timeout_s=10)
        np.testing.assert_array_equal(out, data)
        assert "embedded" in _nodes(pool.address)
    assert "embedded" not in _nodes(pool.address)
    assert not node.mounted


def test_unreachable_master_fails_start_within_its_timeout():
    config = NodeConfig(master_address="tcp://127.0.0.1:9", memory_bytes=1 << 20, timeout_s=0.3, mount_timeout_s=1.0)
    node = StorageNode(config)
    started = time.monotonic()
    with pytest.raises(UnavailableError):
        node.start()
    assert time.monotonic() - started < 5.0
    assert node.segment is None  # the memory was released


def test_sigterm_while_waiting_for_the_master_exits_promptly(tmp_path):
    node = procs.ManagedProcess(
        "waiting", procs.kvpool_argv("node", "--master", "tcp://127.0.0.1:9", "--memory", "8MiB",
                                     "--mount-timeout-s", "120", "--timeout-s", "0.5"), tmp_path)
    node.start(ready_file_arg=False)
    _wait_for(lambda: "mounting" in node.tail_log(), 60, "the node started mounting")  # signals handled from here
    time.sleep(0.5)
    started = time.monotonic()
    assert node.stop(grace_s=10.0) == 0
    assert time.monotonic() - started < 5.0  # not the 120 s mount timeout, not the SIGKILL fallback


def test_bad_memory_size_is_a_clear_error(tmp_path):
    import subprocess

    done = subprocess.run(procs.kvpool_argv("node", "--master", "tcp://127.0.0.1:9", "--memory", "lots"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "cannot read 'lots' as a size" in done.stderr
