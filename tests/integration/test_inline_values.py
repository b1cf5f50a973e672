"""Small plain values kept by the master (master/inline.py), with real processes: a master,
nodes, clients; restarts of the master. Every byte read is compared with what its writer wrote."""

from __future__ import annotations

import numpy as np

from kvpool.bench import procs
from kvpool.client import Client
from kvpool.master.inline import entry_cost
from pool_worker import chain_keys, pattern, wait_until
from test_integrity import FAST, _directory_objects, _mounted, _port

KiB = 1024


def test_small_values_go_to_the_master_and_larger_ones_to_nodes(pool):
    sizes = {"one": 1, "4k": 4 * KiB, "limit": 64 * KiB, "over": 64 * KiB + 1}
    with Client(pool.address, "inline") as client:
        for name, size in sizes.items():
            assert client.put(name, pattern(name, size)) is True
            assert client.put(name, b"other") is False  # a put never overwrites, inline or not
        stats = client.stats()
        charged = sum(entry_cost("inline", name, size) for name, size in sizes.items() if name != "over")
        assert (stats.inline_values, stats.inline_bytes, stats.num_objects) == (3, charged, 1)
        for name, size in sizes.items():
            assert client.get(name) == pattern(name, size).tobytes()
            assert np.array_equal(client.get_array(name), pattern(name, size))
    with Client(pool.address, "inline") as client:  # one namespace: node puts of inline keys exist, and back
        src = np.zeros(256 * KiB, dtype=np.uint8)
        client.register(src)
        addr = int(src.ctypes.data)
        assert client.put_from(["4k", "fresh"], [[addr], [addr]], [[4 * KiB], [4 * KiB]]) == [1, 0]  # EXISTS, ALLOCATED
        assert client.put("fresh", b"x") is False
        assert client.exists(["one", "over", "fresh", "none"]) == [True, True, True, False]
        # reads see both: a counting lookup walks through inline and node keys, get_into copies
        # the inline values that follow the node hits
        assert client.lookup_prefix(["one", "over", "4k", "none"]) == 3
        dst = np.zeros(256 * KiB, dtype=np.uint8)
        client.register(dst)
        base = int(dst.ctypes.data)
        got = client.get_into(["over", "4k", "one", "none"], [[base], [base + 128 * KiB], [base + 192 * KiB], [base]],
                              [[64 * KiB + 1], [4 * KiB], [1], [1]])
        assert got == 3
        assert dst[: 64 * KiB + 1].tobytes() == pattern("over", 64 * KiB + 1).tobytes()
        assert dst[128 * KiB : 132 * KiB].tobytes() == pattern("4k", 4 * KiB).tobytes()
        assert dst[192 * KiB] == pattern("one", 1)[0]
        assert client.remove(["one", "over", "none"]) == 2
        assert client.get("one") is None and client.get("over") is None
        assert client.put("one", b"again") is True and client.get("one") == b"again"


def test_a_master_without_inline_values_stores_them_on_nodes(make_pool):
    pool = make_pool(num_nodes=1, master_args=("--inline-capacity", "0"))
    with Client(pool.address, "off") as client:
        for i in range(3):
            assert client.put(f"k{i}", pattern(f"k{i}", 4 * KiB)) is True  # the first learns the limit: 0
        assert [client.get(f"k{i}") for i in range(3)] == [pattern(f"k{i}", 4 * KiB).tobytes() for i in range(3)]
        stats = client.stats()
        assert (stats.inline_values, stats.num_objects) == (0, 3)


def test_a_master_restart_keeps_small_values_through_their_node_copy_and_never_brings_back_an_old_one(tmp_path):
    """A restarted master takes its inline values back from the node that kept a copy; a value
    removed and put again before the next restart comes back as the new bytes, never the old."""
    master = procs.start_master(tmp_path, *FAST)
    address = master.info["address"]
    node = procs.start_node(tmp_path, address, "16MiB", "--metrics-port", "0", name="node")
    small = chain_keys("small", 30)
    large = chain_keys("large", 5)
    try:
        with Client(address, timeout_s=2.0) as client:
            for key in small:
                assert client.put(key, pattern(key, 2 * KiB)) is True
            for key in large:
                assert client.put(key, pattern(key, 96 * KiB)) is True
            for restart in range(2):
                master.kill()
                master = procs.start_master(tmp_path, *FAST, "--port", _port(address), name=f"master{restart}")
                wait_until(lambda: _mounted(address, {"node"}), 15, "the node remounted")
                wait_until(lambda: client.exists(large) == [True] * 5, 15, "the node's objects recovered")
                version = "" if restart == 0 else "/v2"
                assert [client.get(key) for key in small] == [pattern(k + version, 2 * KiB).tobytes() for k in small]
                assert [client.get(key) for key in large] == [pattern(k, 96 * KiB).tobytes() for k in large]
                assert client.remove(small) == 30
                for key in small:
                    assert client.put(key, pattern(key + "/v2", 2 * KiB)) is True
        with Client(address) as fresh:
            assert [fresh.get(key) for key in small] == [pattern(k + "/v2", 2 * KiB).tobytes() for k in small]
            assert fresh.stats().inline_taken_back == 30
    finally:
        node.stop(grace_s=5.0)
        master.stop(grace_s=5.0)


def test_when_pinned_values_fill_the_masters_room_a_small_value_goes_to_a_node(make_pool):
    pool = make_pool(num_nodes=1, master_args=("--inline-capacity", "1KiB", "--max-inline", "512"))
    with Client(pool.address, "full") as client:
        assert client.put("pinned", b"p" * 500, pinned=True) is True
        assert client.put("small", b"s" * 500) is True  # no room in the master: stored on the node
        stats = client.stats()
        assert (stats.inline_values, stats.num_objects) == (1, 1)
        assert client.get("pinned") == b"p" * 500 and client.get("small") == b"s" * 500


def test_a_master_that_predates_inline_values_still_serves_plain_values(tmp_path):
    """An older master answers PutValue / GetValue with a protocol error: the client falls back to
    nodes and leased lookups for good (a rolling upgrade must not break plain values)."""
    from kvpool.core import protocol as p
    from kvpool.master.config import MasterConfig
    from kvpool.master.service import MasterService

    service = MasterService(MasterConfig(port=0))
    for kind in (p.PutValue, p.GetValue):
        del service.core._handlers[kind]  # as a master from before them: "unknown request type"
    service.start()
    node = procs.start_node(tmp_path, service.address, "16MiB")
    try:
        with Client(service.address, "old") as client:
            for i in range(3):
                assert client.put(f"k{i}", pattern(f"k{i}", 4 * KiB)) is True
            assert [client.get(f"k{i}") for i in range(3)] == [pattern(f"k{i}", 4 * KiB).tobytes() for i in range(3)]
            assert client.get("missing") is None
            stats = client.stats()
            assert (stats.inline_values, stats.num_objects) == (0, 3)
    finally:
        node.stop(grace_s=5.0)
        service.stop()
