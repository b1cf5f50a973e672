"""Faults through the client, with real processes: a node SIGKILLed mid-workload, the master
unreachable, objects that cannot fit, malformed input. Contents are always verified."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvpool.client import PUT_ALLOCATED, PUT_FAILED, PUT_NO_SPACE, Client
from kvpool.core.errors import CapacityError, TransferError, UnavailableError, UsageError
from pool_worker import chain_keys, pattern

KiB = 1024
MiB = 1024 * KiB
# The master must not notice the death during the test: the client alone has to cope.
SLOW_HEALTH = ("--node-ttl-s", "60", "--heartbeat-interval-s", "1")


def _put_chain(client: Client, keys: list[str], size: int, buf: np.ndarray) -> list[int]:
    for i, key in enumerate(keys):
        buf[i * size : (i + 1) * size] = pattern(key, size)
    addrs = [[buf.ctypes.data + i * size] for i in range(len(keys))]
    return client.put_from(keys, addrs, [[size]] * len(keys))


def _get_chain(client: Client, keys: list[str], size: int, buf: np.ndarray) -> int:
    buf[:] = 0
    addrs = [[buf.ctypes.data + i * size] for i in range(len(keys))]
    count = client.get_into(keys, addrs, [[size]] * len(keys))
    for i in range(count):  # no reader ever receives bytes other than what was put
        assert np.array_equal(buf[i * size : (i + 1) * size], pattern(keys[i], size)), keys[i]
    return count


def test_killed_node_with_two_replicas_reads_fall_to_the_other(make_pool):
    pool = make_pool(num_nodes=2, master_args=SLOW_HEALTH)
    keys, size = chain_keys("r2", 16), 128 * KiB
    buf = np.zeros(len(keys) * size, dtype=np.uint8)
    with Client(pool.address, num_replicas=2) as client:
        client.register(buf)
        assert _put_chain(client, keys, size, buf) == [PUT_ALLOCATED] * 16
        assert _get_chain(client, keys, size, buf) == 16
        pool.nodes[0].kill()
        started = time.monotonic()
        assert _get_chain(client, keys, size, buf) == 16  # every object still has its other copy
        assert time.monotonic() - started < client.config.timeout_s


@pytest.mark.parametrize("path", ["shm", "nixl"])
def test_killed_node_with_one_replica_fails_fast_never_wrong(make_pool, path):
    pool = make_pool(num_nodes=2, master_args=SLOW_HEALTH)
    keys, size = chain_keys(f"r1-{path}", 16), 128 * KiB
    buf = np.zeros(len(keys) * size, dtype=np.uint8)
    with Client(pool.address, timeout_s=3.0, path=path) as client:
        client.register(buf)
        assert _put_chain(client, keys, size, buf) == [PUT_ALLOCATED] * 16
        dead = pool.nodes[0].info["segment_id"]
        on_dead = [i for i, r in enumerate(_replicas(client, keys)) if r == dead]
        assert on_dead, "placement should have used both nodes"
        pool.nodes[0].kill()
        started = time.monotonic()
        count = _get_chain(client, keys, size, buf)
        elapsed_s = time.monotonic() - started
        assert count == on_dead[0]  # the chain is readable up to the first object on the dead node
        assert elapsed_s < client.config.timeout_s + 1.0  # failed, not hung


def test_puts_in_flight_on_a_killed_node_are_revoked(make_pool):
    pool = make_pool(num_nodes=2, master_args=SLOW_HEALTH)
    size = 256 * KiB
    with Client(pool.address, timeout_s=3.0) as client:
        pool.nodes[1].kill()  # the master still believes in it, and places half the objects there
        keys = [f"inflight/{i}" for i in range(8)]
        buf = np.zeros(len(keys) * size, dtype=np.uint8)
        client.register(buf)
        statuses = _put_chain(client, keys, size, buf)
        assert set(statuses) == {PUT_ALLOCATED, PUT_FAILED}
        failed = [k for k, st in zip(keys, statuses) if st == PUT_FAILED]
        stored = [k for k, st in zip(keys, statuses) if st == PUT_ALLOCATED]
        assert client.exists(failed) == [False] * len(failed)  # revoked, not left pending
        for key in stored:
            assert client.get(key) == pattern(key, size).tobytes()
        with pytest.raises(TransferError) as err:  # a single put that lands on the dead node says so
            for i in range(8):
                client.put(f"single/{i}", pattern(f"single/{i}", size), parent=None)
        assert "revoked" in str(err.value)


def test_master_unreachable_fails_within_timeout(make_pool):
    pool = make_pool(num_nodes=1)
    client = Client(pool.address, timeout_s=0.5)
    try:
        assert client.put("k", b"v" * 100) is True
        pool.master.kill()
        buf = np.zeros(100, dtype=np.uint8)
        client.register(buf)
        calls = [
            lambda: client.put("k2", b"v"),
            lambda: client.get("k"),
            lambda: client.get_into(["k"], [[buf.ctypes.data]], [[100]]),
            lambda: client.put_from(["k3"], [[buf.ctypes.data]], [[100]]),
            lambda: client.lookup_prefix(["k"]),
            lambda: client.exists(["k"]),
            lambda: client.remove(["k"]),
            lambda: client.stats(),
        ]
        for call in calls:
            started = time.monotonic()
            with pytest.raises(UnavailableError, match="did not answer"):
                call()
            assert time.monotonic() - started < 2.0
    finally:
        client.close()


def test_never_started_master_is_unavailable_not_a_hang():
    with Client("tcp://127.0.0.1:9", timeout_s=0.3) as client:  # port 9: nothing listens
        started = time.monotonic()
        with pytest.raises(UnavailableError):
            client.get("k")
        assert time.monotonic() - started < 2.0


def test_object_larger_than_any_segment_is_a_capacity_error(make_pool):
    pool = make_pool(num_nodes=2, node_memory="4MiB")
    with Client(pool.address) as client:
        with pytest.raises(CapacityError, match="larger than the largest segment"):
            client.put("huge", np.zeros(5 * MiB, dtype=np.uint8))
        buf = np.zeros(5 * MiB, dtype=np.uint8)
        client.register(buf)
        assert client.put_from(["huge", "fits"], [[buf.ctypes.data], [buf.ctypes.data]], [[5 * MiB], [MiB]]) == [
            PUT_NO_SPACE,
            PUT_ALLOCATED,
        ]
        assert client.exists(["huge", "fits"]) == [False, True]


def test_pool_full_of_pinned_objects_is_a_capacity_error(make_pool):
    pool = make_pool(num_nodes=1, node_memory="4MiB")
    with Client(pool.address) as client:
        for i in range(3):
            assert client.put(f"pinned{i}", pattern(f"pinned{i}", MiB), pinned=True) is True
        with pytest.raises(CapacityError, match="pool full"):
            client.put("one-too-many", pattern("x", 2 * MiB))
        for i in range(3):  # nothing was lost
            assert client.get(f"pinned{i}") == pattern(f"pinned{i}", MiB).tobytes()


def test_malformed_input_is_a_usage_error_and_loses_nothing(pool):
    with Client(pool.address, "usage") as client:
        assert client.put("keep", b"kept value") is True
        buf = np.zeros(4096, dtype=np.uint8)
        unregistered = np.zeros(4096, dtype=np.uint8)
        client.register(buf)
        a = buf.ctypes.data
        bad_calls = {
            "mismatched lengths": lambda: client.put_from(["a", "b"], [[a]], [[8]]),
            "regions vs sizes": lambda: client.get_into(["a"], [[a, a + 8]], [[8]]),
            "key not a string": lambda: client.put_from([7], [[a]], [[8]]),
            "empty key": lambda: client.exists([""]),
            "keys as a string": lambda: client.lookup_prefix("abc"),
            "duplicate put keys": lambda: client.put_from(["d", "d"], [[a], [a]], [[8], [8]]),
            "zero size": lambda: client.put_from(["z"], [[a]], [[0]]),
            "unregistered memory": lambda: client.put_from(["u"], [[unregistered.ctypes.data]], [[4096]]),
            "region past registered end": lambda: client.get_into(["keep"], [[a + 4000]], [[200]]),
            "wrong total size": lambda: client.get_into(["keep"], [[a]], [[11]]),
            "bad parents": lambda: client.put_from(["p"], [[a]], [[8]], parents=["x", "y"]),
            "value type": lambda: client.put("v", {"not": "memory"}),
            "empty value": lambda: client.put("v", b""),
            "bad memory to register": lambda: client.register("a string"),
            "non-contiguous array": lambda: client.put("v", np.zeros((8, 8))[:, 0]),
        }
        for what, call in bad_calls.items():
            with pytest.raises(UsageError):
                call()
            assert client.get("keep") == b"kept value", what
        assert client.exists(["a", "d", "z", "u", "p", "v"]) == [False] * 6
    with pytest.raises(UsageError, match="closed"):
        client.get("keep")
    with pytest.raises(ValueError, match="path"):
        Client(pool.address, path="carrier-pigeon")
    with pytest.raises(ValueError, match="tcp://"):
        Client("127.0.0.1:5555")


def _replicas(client: Client, keys: list[str]) -> list[int]:
    """The segment holding each key (one replica each), via a leased lookup."""
    _, reply, replicas = client._lookup_leased(keys)
    client._release(reply.lease_id)
    return [rs[0].segment_id for rs in replicas]
