"""The disk tier with real processes: a `kvpool master` and a `kvpool node --disk` on 127.0.0.1.
DRAM holds a quarter of the data; everything is served again from disk (promoted back), also
after the node restarts; corrupt and truncated files are detected and dropped, never served; a
full disk is a logged, counted error and the objects stay served from DRAM while they are there.
Every byte read is compared with what its key's writer wrote (pool_worker.pattern)."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import numpy as np

from kvpool.bench import procs
from kvpool.client import PUT_ALLOCATED, Client
from kvpool.core import protocol as p
from kvpool.rpc.zmq_channel import MasterChannel
from pool_worker import chain_keys, pattern, wait_until

KiB = 1024
MiB = 1024 * KiB
SIZE = 512 * KiB
FAST = ("--heartbeat-interval-s", "0.2", "--node-ttl-s", "3")


def _stats(address: str) -> p.StatsReply:
    channel = MasterChannel(address, timeout_s=2)
    try:
        return channel.call(p.Stats())
    finally:
        channel.close()


def _metric(node: procs.ManagedProcess, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{node.info['metrics_port']}/metrics", timeout=2).read().decode()
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name) and not ln.startswith("#"))


def _put(client: Client, keys: list[str]) -> list[int]:
    buf = np.concatenate([pattern(k, SIZE) for k in keys])
    client.register(buf)
    return client.put_from(keys, [[buf.ctypes.data + i * SIZE] for i in range(len(keys))], [[SIZE]] * len(keys))


def _get_waiting(client: Client, key: str, timeout_s: float = 5.0) -> bytes | None:
    """A reader that waits for a promotion: the first lookup of a disk-only key is a miss that
    starts it (LookupReply.num_promoting), a later one hits."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = client.get(key)
        if value is not None or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def _read_all(address: str, keys: list[str]) -> tuple[int, int]:
    served = wrong = 0
    with Client(address) as client:
        for key in keys:
            value = _get_waiting(client, key)
            if value is not None:
                served += 1
                wrong += value != pattern(key, SIZE).tobytes()
    return served, wrong


def _start_node(tmp_path: Path, address: str, disk: Path, disk_size: str, name: str = "node0"):
    return procs.start_node(tmp_path, address, "4MiB", "--disk", str(disk), "--disk-size", disk_size,
                            "--metrics-port", "0", name=name)


def test_dram_evictions_stay_on_disk_and_survive_a_node_restart(tmp_path):
    master = procs.start_master(tmp_path, *FAST)
    address = master.info["address"]
    disk = tmp_path / "disk"
    node = _start_node(tmp_path, address, disk, "64MiB")
    keys = chain_keys("s0", 8) + chain_keys("s1", 8)  # 8 MiB through a 4 MiB segment
    try:
        with Client(address) as client:
            for i in range(0, len(keys), 4):
                assert _put(client, keys[i : i + 4]) == [PUT_ALLOCATED] * 4
                # written back and known to the master before the next batch evicts them
                wait_until(lambda: _stats(address).tiers[0].num_objects >= i + 4, 10, "write-backs")
        stats = _stats(address)
        tier = stats.tiers[0]
        assert stats.num_objects == len(keys)  # nothing dropped: the evicted ones are on disk
        assert tier.num_objects == len(keys) and tier.demotions >= len(keys) - 8 and tier.num_disk_only >= 8
        with Client(address) as client:  # the older chain went to disk; a lookup can wait for its promotion
            assert client.lookup_prefix(keys[4:8]) == 0  # disk only: a miss that starts their promotion
            assert client.lookup_prefix(keys[:4], promotion_wait_s=5.0) == 4  # waited: hits now
        served, wrong = _read_all(address, keys)
        assert (served, wrong) == (len(keys), 0)
        assert _stats(address).tiers[0].promotions >= 8
        assert _metric(node, 'kvpool_node_promotions_total{outcome="ok"}') >= 8

        # the node dies and restarts: new empty DRAM, the same disk; it announces what the disk holds
        node.kill()
        node = _start_node(tmp_path, address, disk, "64MiB", name="node0")
        wait_until(lambda: _stats(address).num_objects == len(keys), 10, "the disk announced")
        served, wrong = _read_all(address, keys)
        assert (served, wrong) == (len(keys), 0)
        assert _stats(address).recovered_objects >= len(keys)
    finally:
        node.stop()
        master.stop()


def test_a_master_restart_keeps_both_tiers(tmp_path):
    master = procs.start_master(tmp_path, *FAST)
    address = master.info["address"]
    node = _start_node(tmp_path, address, tmp_path / "disk", "64MiB")
    keys = chain_keys("m", 12)  # 6 MiB: some only on disk, some in DRAM too
    try:
        with Client(address) as client:
            for i in range(0, len(keys), 4):
                assert _put(client, keys[i : i + 4]) == [PUT_ALLOCATED] * 4
                wait_until(lambda: _stats(address).tiers[0].num_objects >= i + 4, 10, "write-backs")
        before = _stats(address).tiers[0]
        assert before.num_disk_only > 0 and before.num_objects == len(keys)
        wait_until(lambda: _metric(node, 'kvpool_node_tier_objects{tier="disk"}') == len(keys), 5, "files")
        time.sleep(0.5)  # the node's directory catches up with the last commits
        master.kill()
        master = procs.start_master(tmp_path, *FAST, "--port", address.rsplit(":", 1)[1], name="master1")
        wait_until(lambda: (s := _stats(address)).num_objects == len(keys) and s.tiers and s.nodes[0].state == "alive",
              10, "both tiers announced to the new master")
        after = _stats(address).tiers[0]
        assert (after.num_objects, after.num_disk_only) == (len(keys), before.num_disk_only)
        served, wrong = _read_all(address, keys)
        assert (served, wrong) == (len(keys), 0)
    finally:
        node.stop()
        master.stop()


def test_corrupt_and_truncated_files_are_dropped_never_served(tmp_path):
    master = procs.start_master(tmp_path, *FAST)
    address = master.info["address"]
    disk = tmp_path / "disk"
    node = _start_node(tmp_path, address, disk, "64MiB")
    keys = chain_keys("c", 6)
    try:
        with Client(address) as client:
            assert _put(client, keys) == [PUT_ALLOCATED] * 6
        wait_until(lambda: _stats(address).tiers[0].num_objects == 6, 10, "write-backs")
        assert node.stop() == 0
        files = sorted(disk.glob("*/*.kv"))
        assert len(files) == 6
        corrupt, truncated = files[0], files[1]
        with open(corrupt, "r+b") as f:  # one byte of the payload flipped: found when it is read
            f.seek(4096 + 1000)
            byte = f.read(1)
            f.seek(4096 + 1000)
            f.write(bytes([byte[0] ^ 0xFF]))
        with open(truncated, "r+b") as f:  # cut short: found when the disk is opened
            f.truncate(4096 + SIZE // 2)
        node = _start_node(tmp_path, address, disk, "64MiB", name="node0")
        wait_until(lambda: _stats(address).num_objects == 5, 10, "5 intact files announced")
        assert not truncated.exists()
        served, wrong = _read_all(address, keys)
        assert wrong == 0 and served == 4  # the corrupt one failed its checksum on promotion
        assert not corrupt.exists()
        assert _metric(node, 'kvpool_node_disk_errors_total{kind="corrupt"}') == 1
        assert _metric(node, 'kvpool_node_promotions_total{outcome="failed"}') == 1
        assert _stats(address).num_objects == 4
    finally:
        node.stop()
        master.stop()


def test_a_full_disk_is_an_error_in_logs_and_metrics_and_objects_stay_served(tmp_path):
    master = procs.start_master(tmp_path, *FAST)
    address = master.info["address"]
    node = _start_node(tmp_path, address, tmp_path / "disk", "1MiB")  # room for one 512 KiB object (+ header)
    keys = chain_keys("f", 4)
    try:
        with Client(address) as client:
            assert _put(client, keys) == [PUT_ALLOCATED] * 4
            wait_until(lambda: _metric(node, 'kvpool_node_disk_errors_total{kind="full"}') >= 3, 10, "disk full counted")
            assert _metric(node, 'kvpool_node_writebacks_total{outcome="written"}') == 1
            assert "disk tier full" in node.tail_log()
            for key in keys:  # still in DRAM: served as usual
                assert client.get(key) == pattern(key, SIZE).tobytes()
        wait_until(lambda: _stats(address).tiers[0].num_objects == 1, 5, "the one write-back reported")
    finally:
        node.stop()
        master.stop()
