"""Plain puts into an allocation held ahead (client/ahead.py), with real processes: a
master, nodes, clients; a master restart. After the first plain put of a size, the next ones are
their write and one PutEnd; every byte read is compared with what its writer wrote."""

from __future__ import annotations

import time

from kvpool.bench import procs
from kvpool.client import Client, ahead
from pool_worker import pattern, wait_until
from test_integrity import FAST, _mounted, _port, _stats

KiB = 1024
SIZE = 96 * KiB  # over the master's inline limit: on a node


def _ahead_puts(client: Client) -> float:
    return client._metrics.puts_ahead._value.get()


def test_plain_puts_of_one_size_after_the_first_are_written_ahead_and_read_back(pool):
    keys = [f"v{i}" for i in range(6)]
    with Client(pool.address, "ahead") as client:
        for key in keys:
            assert client.put(key, pattern(key, SIZE)) is True
        assert _ahead_puts(client) == 5  # the first asked for the allocation the second used, and so on
        assert [client.get(key) for key in keys] == [pattern(k, SIZE).tobytes() for k in keys]
        stats = client.stats()
        assert (stats.num_objects, stats.num_pending) == (6, 1)  # one allocation held for the next put
        assert client.put("v0", pattern("other", SIZE)) is False  # a put never overwrites
        assert client.get("v0") == pattern("v0", SIZE).tobytes()
        assert client.put("bigger", pattern("bigger", 2 * SIZE)) is True  # another size: the usual way
        assert client.put("bigger2", pattern("bigger2", 2 * SIZE)) is True
        assert _ahead_puts(client) == 7  # "v0" again (existed) and "bigger2"
        assert client.get("bigger") == pattern("bigger", 2 * SIZE).tobytes()
        assert client.get("bigger2") == pattern("bigger2", 2 * SIZE).tobytes()
        assert client.lookup_prefix([ahead.KEY_PREFIX]) == 0
        wait_until(lambda: client.stats().num_pending == 1, 5, "unused allocations given back")
    wait_until(lambda: _stats(pool.address).num_pending == 0, 5, "the closed client's allocation given back")
    with Client(pool.address, "ahead") as reader:
        assert reader.stats().num_objects == 8
        assert [reader.get(key) for key in keys] == [pattern(k, SIZE).tobytes() for k in keys]


def test_an_allocation_older_than_its_freshness_limit_is_given_back_not_written(pool):
    with Client(pool.address, "stale") as client:
        assert client.put("a", pattern("a", SIZE)) is True
        time.sleep(ahead.FRESH_S + 0.05)
        assert client.put("b", pattern("b", SIZE)) is True  # the usual way: the held one was too old
        assert _ahead_puts(client) == 0
        assert client.put("c", pattern("c", SIZE)) is True
        assert _ahead_puts(client) == 1
        assert [client.get(k) for k in "abc"] == [pattern(k, SIZE).tobytes() for k in "abc"]
        wait_until(lambda: client.stats().num_pending == 1, 5, "the stale allocation given back")


def test_after_a_master_restart_the_old_allocation_is_never_written(tmp_path):
    master = procs.start_master(tmp_path, *FAST)
    address = master.info["address"]
    node = procs.start_node(tmp_path, address, "16MiB", "--metrics-port", "0", name="node")
    try:
        with Client(address, timeout_s=2.0) as client:
            assert client.put("before", pattern("before", SIZE)) is True
            assert client.put("before2", pattern("before2", SIZE)) is True
            master.kill()
            master = procs.start_master(tmp_path, *FAST, "--port", _port(address), name="master1")
            wait_until(lambda: _mounted(address, {"node"}), 15, "the node remounted")
            written = _ahead_puts(client)
            keys = [f"after{i}" for i in range(4)]
            for key in keys:
                assert client.put(key, pattern(key, SIZE)) is True
            assert _ahead_puts(client) == written + 3  # the first after the restart went the usual way
            assert [client.get(k) for k in keys] == [pattern(k, SIZE).tobytes() for k in keys]
            # places seen under the old master are never read early (known_places.py)
            assert client._places.get("before2", client._channel.epoch) is None
            assert client.get("before2") in (None, pattern("before2", SIZE).tobytes())
        with Client(address) as fresh:
            assert [fresh.get(k) for k in keys] == [pattern(k, SIZE).tobytes() for k in keys]
            for key in ("before", "before2"):
                assert fresh.get(key) in (None, pattern(key, SIZE).tobytes())
    finally:
        node.stop(grace_s=5.0)
        master.stop(grace_s=5.0)


def test_an_idle_writers_allocation_is_reclaimed_and_a_chained_put_gives_one_back(pool):
    with Client(pool.address, "idle") as client:
        assert client.put("a", pattern("a", SIZE)) is True
        assert client.stats().num_pending == 1
        wait_until(lambda: client.stats().num_pending == 0, 5, "the unused allocation reclaimed by the master")
        stats = client.stats()
        assert stats.ahead_expired == 1 and stats.num_objects == 1
        assert client.put("b", pattern("b", SIZE)) is True  # the usual way again (the slot was too old)
        assert client.put("b/c", pattern("b/c", SIZE), parent="b") is True  # a chain: the slot given back
        wait_until(lambda: client.stats().num_pending == 0, 5, "the allocation given back by the chained put")
        assert client.stats().ahead_expired == 1
        assert [client.get(k) for k in ("a", "b", "b/c")] == [pattern(k, SIZE).tobytes() for k in ("a", "b", "b/c")]



def test_threads_sharing_a_client_each_write_their_own_values(pool):
    """One slot at most, taken and granted under a lock: threads putting at once never share one."""
    import threading

    keys = [[f"t{t}/{i}" for i in range(15)] for t in range(4)]
    failures = []
    with Client(pool.address, "threads") as client:
        def writer(mine):
            try:
                for key in mine:
                    assert client.put(key, pattern(key, SIZE)) is True
            except BaseException as e:  # noqa: BLE001 - reported below
                failures.append(e)

        threads = [threading.Thread(target=writer, args=(mine,)) for mine in keys]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert failures == []
        assert _ahead_puts(client) >= 1
        flat = [k for mine in keys for k in mine]
        assert [client.get(k) for k in flat] == [pattern(k, SIZE).tobytes() for k in flat]
        stats = client.stats()
        assert stats.num_objects == 60 and stats.num_pending <= 1
