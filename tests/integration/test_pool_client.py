"""The pool through the client, with real processes: a master, two storage nodes, and client
processes on 127.0.0.1 (ports chosen by the OS). Every read is verified byte for byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY

from kvpool.client import PUT_ALLOCATED, PUT_EXISTS, Client
from kvpool.master.inline import entry_cost
from kvpool.core import protocol
from kvpool.core.errors import UsageError
from pool_worker import chain_keys, pattern, scattered_regions

KiB = 1024
MiB = 1024 * KiB


def test_put_in_one_process_get_in_another(pool):
    put = pool.run_worker("put", "--prefix", "chain", "--num-keys", "24", "--size-bytes", str(256 * KiB))
    assert put["statuses"] == [PUT_ALLOCATED] * 24
    got = pool.run_worker("get", "--prefix", "chain", "--num-keys", "24", "--size-bytes", str(256 * KiB))
    assert got == {**got, "count": 24, "mismatched": []}
    # a second put of the same chain writes nothing
    again = pool.run_worker("put", "--prefix", "chain", "--num-keys", "24", "--size-bytes", str(256 * KiB))
    assert again["statuses"] == [PUT_EXISTS] * 24
    with Client(pool.address) as client:
        before = client.stats()
        client.ping()  # a round trip that changes nothing
        stats = client.stats()
        assert (stats.lookups, stats.num_objects) == (before.lookups, 24)
        assert sorted(n.num_objects for n in stats.nodes) == [12, 12]  # free-ratio placement alternates
        assert client.get("chain/5") == pattern("chain/5", 256 * KiB).tobytes()


@pytest.mark.parametrize("path", ["shm", "nixl"])
def test_scatter_gather_across_processes(pool, path):
    args = ("--prefix", f"sg-{path}", "--num-keys", "16", "--size-bytes", str(64 * KiB), "--path", path)
    assert pool.run_worker("put", *args, "--regions", "8")["statuses"] == [PUT_ALLOCATED] * 16
    # read back with another layout (4 regions per object) in another process
    got = pool.run_worker("get", *args, "--regions", "4")
    assert got["count"] == 16 and got["mismatched"] == []


def test_scatter_gather_in_process_layouts_differ(pool):
    num_keys, size = 8, 48 * KiB
    keys = chain_keys("sg", num_keys)
    src = np.zeros(num_keys * size, dtype=np.uint8)
    dst = np.full(num_keys * size, 0xEE, dtype=np.uint8)
    with Client(pool.address) as client:
        client.register(src)
        client.register(dst)
        src_addrs, src_sizes = scattered_regions(src.ctypes.data, num_keys, size, 6)
        for i, key in enumerate(keys):
            value = pattern(key, size)
            for k, addr in enumerate(src_addrs[i]):
                off = addr - src.ctypes.data
                src[off : off + size // 6] = value[k * size // 6 : (k + 1) * size // 6]
        assert client.put_from(keys, src_addrs, src_sizes) == [PUT_ALLOCATED] * num_keys
        # destination: object i at [i*size, (i+1)*size) as two unequal regions
        dst_addrs = [[dst.ctypes.data + i * size, dst.ctypes.data + i * size + 1000] for i in range(num_keys)]
        dst_sizes = [[1000, size - 1000] for _ in range(num_keys)]
        assert client.get_into(keys, dst_addrs, dst_sizes) == num_keys
        for i, key in enumerate(keys):
            assert np.array_equal(dst[i * size : (i + 1) * size], pattern(key, size))


def test_values_bytes_numpy_torch(pool):
    with Client(pool.address, "values") as client:
        assert client.put("b", b"hello pool") is True
        assert client.put("b", b"other bytes") is False  # existed: nothing written
        assert client.get("b") == b"hello pool"
        array = np.arange(300_000, dtype=np.float32)  # 1.2 MB: larger than the initial staging buffer
        assert client.put("np", array, parent="b") is True
        assert np.array_equal(client.get_array("np", np.float32), array)
        tensor = torch.randn(64, 128, dtype=torch.bfloat16)
        client.register(tensor)  # registered: put goes straight from the tensor
        assert client.put("t", tensor) is True
        back = client.get_tensor("t", torch.bfloat16, (64, 128))
        assert torch.equal(back, tensor)
        assert client.get("missing") is None and client.get_array("missing") is None
        assert client.lookup_prefix(["b", "np", "missing", "t"]) == 2
        assert client.exists(["t", "missing", "b"]) == [True, False, True]
        assert client.remove(["t", "missing"]) == 1
        assert client.get("t") is None


@pytest.mark.parametrize("path", ["shm", "lane", "nixl"])
def test_plain_values_skip_the_staging_buffer_where_their_route_allows(pool, path):
    """A plain put is written straight from the caller's value and a plain get read straight
    into the bytes it returns where the route carries unregistered memory (shared memory, the
    segment lane); over NIXL both go through the registered staging buffer. Bytes are the same."""
    with Client(pool.address, f"plain-{path}", path=path, staging_bytes=64 * KiB) as client:
        values = {f"{path}/{i}": pattern(f"{path}/{i}", size).tobytes()
                  for i, size in enumerate([300 * KiB, 1 * MiB, 3 * MiB + 5])}
        for key, value in values.items():
            assert client.put(key, value) is True
        for key, value in values.items():
            assert client.get(key) == value
            assert client.get_array(key).tobytes() == value
        staged = client._staging.array.nbytes
        assert staged == 64 * KiB if path != "nixl" else staged >= 3 * MiB + 5
        assert set(client.plane.jobs_by_path) == {"shm", "nixl", "lane"}
        used = {p for p, jobs in client.plane.jobs_by_path.items() if jobs}
        assert used == ({"nixl"} if path == "nixl" else {path})


def test_a_checksum_that_fails_while_put_start_travels_revokes_the_put(pool, monkeypatch):
    """One object's checksum runs while its PutStart is in flight; if it raises, the error
    reaches the caller after the reply and the allocation is revoked, so the key can be put again."""
    with Client(pool.address, "early") as client:
        def broken(addrs, sizes):
            raise RuntimeError("checksum broke")

        monkeypatch.setattr(client._puts, "checksums", broken)
        with pytest.raises(RuntimeError, match="checksum broke"):
            client.put("k", b"x" * (300 * KiB))
        monkeypatch.undo()
        assert client.get("k") is None
        assert client.put("k", b"y" * (300 * KiB)) is True  # not "exists": the first was revoked
        assert client.get("k") == b"y" * (300 * KiB)


def test_tenants_are_isolated(pool):
    with Client(pool.address, "alice") as alice, Client(pool.address, "bob") as bob:
        assert alice.put("shared-name", b"alice's secret") is True
        assert bob.get("shared-name") is None
        assert bob.exists(["shared-name"]) == [False]
        assert bob.lookup_prefix(["shared-name"]) == 0
        assert bob.remove(["shared-name"]) == 0
        assert bob.put("shared-name", b"bob's value") is True  # not PUT_EXISTS: another namespace
        assert alice.get("shared-name") == b"alice's secret"
        assert bob.get("shared-name") == b"bob's value"


def test_eviction_is_visible_through_the_client(make_pool):
    pool = make_pool(num_nodes=2, node_memory="8MiB")
    with Client(pool.address, "evict") as client:
        for i in range(40):  # 40 MiB of independent objects into 16 MiB
            assert client.put(f"obj{i}", pattern(f"obj{i}", MiB)) is True
        stats = client.stats()
        assert stats.evictions > 0 and stats.used_bytes <= stats.capacity_bytes
        present = client.exists([f"obj{i}" for i in range(40)])
        assert not present[0] and present[39]  # LRU: the oldest went, the newest stayed
        for i in range(40):
            value = client.get(f"obj{i}")
            assert value is None or value == pattern(f"obj{i}", MiB).tobytes()


def test_many_threads_share_one_client(pool):
    errors: list[BaseException] = []
    with Client(pool.address, "threads") as client:

        def work(t: int) -> None:
            try:
                for i in range(10):  # small values kept by the master and larger ones on nodes, mixed
                    key = f"t{t}/{i}"
                    value = pattern(key, (32 if i % 2 else 96) * KiB + 64 * t)
                    assert client.put(key, value) is True
                    assert client.get(key) == value.tobytes()
            except BaseException as e:  # reported below, in the test's thread
                errors.append(e)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
        assert not errors, errors
        stats = client.stats()
        assert (stats.num_objects, stats.inline_values) == (20, 20)


def test_lease_expired_reads_are_never_reported(make_pool):
    # a 1 us lease cannot outlive a master round trip: every read finishes after it
    pool = make_pool(num_nodes=1, master_args=("--lease-ttl-s", "0.000001", "--max-lease-hold-s", "1"))
    size = 128 * KiB  # over the master's inline limit: on a node, read under a lease
    with Client(pool.address, "lease") as client:
        assert client.put("k0", b"x" * size) is True
        before = REGISTRY.get_sample_value("kvpool_client_lease_expiries_total", {"tenant": "lease"}) or 0
        buf = np.zeros(size, dtype=np.uint8)
        client.register(buf)
        assert client.get_into(["k0"], [[buf.ctypes.data]], [[size]]) == 0
        assert client.get("k0") is None
        after = REGISTRY.get_sample_value("kvpool_client_lease_expiries_total", {"tenant": "lease"})
        assert after == before + 2


def test_client_metrics_count_what_callers_were_told(pool):
    labels = {"tenant": "metrics"}

    def value(name: str, extra: dict | None = None) -> float:
        return REGISTRY.get_sample_value(name, {**labels, **(extra or {})}) or 0.0

    with Client(pool.address, "metrics") as client:
        client.put("a", b"1" * 1000)
        client.put("a", b"1" * 1000)
        client.get("a")
        client.get("nope")
    assert value("kvpool_client_put_keys_total", {"status": "stored"}) == 1
    assert value("kvpool_client_put_keys_total", {"status": "exists"}) == 1
    assert value("kvpool_client_put_bytes_total") == 1000
    assert value("kvpool_client_get_keys_total") == 2
    assert value("kvpool_client_hit_keys_total") == 1
    assert value("kvpool_client_get_bytes_total") == 1000
    assert value("kvpool_client_op_seconds_count", {"op": "get"}) == 2
    assert value("kvpool_client_op_seconds_count", {"op": "put"}) == 2


def test_status_cli_table_and_json(pool):
    with Client(pool.address, "status") as client:
        client.put("k", b"v" * 100_000)
        client.put("small", b"s" * 1000)
        client.get("k")
    run = [sys.executable, "-m", "kvpool", "status", "--master", pool.address]
    as_json = json.loads(subprocess.run([*run, "--json"], capture_output=True, text=True, check=True, timeout=60).stdout)
    assert as_json["num_objects"] == 1 and len(as_json["nodes"]) == 2 and as_json["hit_keys"] >= 1
    assert (as_json["inline_values"], as_json["inline_bytes"]) == (1, entry_cost("status", "small", 1000))
    table = subprocess.run(run, capture_output=True, text=True, check=True, timeout=60, env={**os.environ, "COLUMNS": "160"})
    assert "node0" in table.stdout and "node1" in table.stdout and "hit rate" in table.stdout
    assert "small values in the master" in table.stdout
    helped = subprocess.run([*run[:4], "--help"], capture_output=True, text=True, check=True, timeout=60)
    assert "--json" in helped.stdout and "--timeout-s" in helped.stdout


def test_reads_release_their_leases_so_removed_space_is_freed_at_once(make_pool):
    # a 60 s lease: without the release, removed objects would hold their space for a minute
    pool = make_pool(num_nodes=1, master_args=("--lease-ttl-s", "60", "--max-lease-hold-s", "60"))
    size = 128 * KiB  # over the master's inline limit: node objects, read under leases
    keys = chain_keys("rel", 4)
    buf = np.zeros(4 * size, dtype=np.uint8)
    with Client(pool.address, "release") as reader, Client(pool.address, "release") as other:
        reader.register(buf)
        for key in keys:
            assert reader.put(key, pattern(key, size), parent=None) is True
        addrs = [[buf.ctypes.data + i * size] for i in range(4)]
        assert reader.get_into(keys, addrs, [[size]] * 4) == 4
        assert reader.get(keys[0]) == pattern(keys[0], size).tobytes()
        # a reader that has not finished: a leased lookup of keys[0], not released yet
        held = other._channel.call(protocol.LookupPrefix("release", [keys[0]], lease=True))
        assert held.num_hit == 1 and held.lease_id > 0
        # a failed read (regions of the wrong size) still releases its lease
        with pytest.raises(UsageError, match="holds"):
            reader.get_into(keys[:2], addrs[:2], [[size - 64]] * 2)
        assert reader.remove(keys) == 4
        stats = reader.stats()  # same connection: the releases were handled before this
        assert stats.lease_releases == 3
        # only keys[0], still held by the unfinished reader, and the allocation the reader holds
        # for its next plain put (client/ahead.py)
        assert (stats.used_bytes, stats.num_pending) == (2 * size, 1)
        assert other._channel.call(protocol.ReleaseLeases("release", [held.lease_id])).count == 1
        assert reader.stats().used_bytes == size
