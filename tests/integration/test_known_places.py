"""Plain gets that read where their client last saw the value while GetValue travels
(client/known_places.py), with a real master and nodes, over shared memory and over
the segment lane: the bytes are kept only when the master's answer still places the value there
and they match its checksum; a moved, replaced, removed or corrupted value is never served from
the old place."""

from __future__ import annotations

import pytest

from kvpool.client import Client
from pool_worker import pattern
from test_integrity import _flip_bits

KiB = 1024
SIZE = 96 * KiB  # over the master's inline limit: on a node


def _early(client: Client, outcome: str) -> float:
    """The client's tenant's count (clients of one tenant in one process share the metric)."""
    return client._metrics.early_reads[outcome]._value.get()


@pytest.mark.parametrize("path", ["auto", "lane"])
def test_a_value_put_or_read_lately_is_read_early_and_a_moved_one_read_again(make_pool, path):
    pool = make_pool(num_nodes=1, node_memory="4MiB")
    tenant = f"early-{path}"  # counts from zero in each case
    with Client(pool.address, tenant, path=path) as a, Client(pool.address, tenant, path=path) as b:
        keys = [f"k{i}" for i in range(4)]
        for key in keys:
            assert a.put(key, pattern(key, SIZE)) is True
        assert [a.get(k) for k in keys[1:]] == [pattern(k, SIZE).tobytes() for k in keys[1:]]  # put ahead: known
        assert _early(a, "used") == 3
        assert b.get("k0") == pattern("k0", SIZE).tobytes()  # b never saw it: read the usual way...
        assert b.get("k0") == pattern("k0", SIZE).tobytes()  # ...then b knows where it is
        assert _early(b, "used") == 4  # (the tenant's count: a's three and b's one)
        # b replaces k1 (a still knows the old place) and fills the freed range with other bytes
        assert b.remove(["k1"]) == 1
        assert b.put("filler", pattern("filler", SIZE)) is True
        assert b.put("k1", pattern("k1-new", SIZE)) is True
        assert a.get("k1") == pattern("k1-new", SIZE).tobytes()
        assert _early(a, "read_again") == 1
        assert a.get("k1") == pattern("k1-new", SIZE).tobytes()  # the new place is the known one now
        assert _early(a, "used") == 5
        # removed by another client: a miss, and a forgets the place
        assert b.remove(["k2"]) == 1
        assert a.get("k2") is None
        assert a._places.get("k2", a._channel.epoch) is None
        # a get_array reads early too
        array = a.get_array("k3", dtype="uint8")
        assert array is not None and array.tobytes() == pattern("k3", SIZE).tobytes()
        assert _early(a, "used") == 6


def test_corrupted_bytes_at_a_known_place_are_a_miss_never_served(make_pool):
    pool = make_pool(num_nodes=1, node_memory="4MiB")
    with Client(pool.address, "corrupted") as client:
        assert client.put("v", pattern("v", SIZE)) is True
        assert client.get("v") == pattern("v", SIZE).tobytes()
        _flip_bits(client, ["v"], 0, 5000, 0x01)
        assert client.get("v") is None  # read early, mismatched, read again under the lease: mismatched
        assert _early(client, "read_again") == 1
        assert client._metrics.checksum_mismatches._value.get() == 1


def test_without_checksums_or_with_known_places_off_nothing_is_read_early(make_pool):
    pool = make_pool(num_nodes=1, node_memory="4MiB")
    for options in ({"checksums": False}, {"known_places": False}):
        key = sorted(options)[0]
        with Client(pool.address, key.replace("_", "-"), **options) as client:
            assert client.put(key, pattern(key, SIZE)) is True
            assert client.get(key) == pattern(key, SIZE).tobytes()
            assert client.get(key) == pattern(key, SIZE).tobytes()
            assert _early(client, "used") == 0 and _early(client, "read_again") == 0


def test_a_known_place_on_a_killed_node_falls_to_the_other_replica(make_pool):
    # the master must not notice the death during the test: the early read fails, the answer
    # still lists both replicas, and the usual read under its lease takes the living one
    pool = make_pool(num_nodes=2, master_args=("--node-ttl-s", "60", "--heartbeat-interval-s", "1"))
    # over the lane: a killed node's shared memory would still be readable through a mapping
    with Client(pool.address, "replicas", num_replicas=2, path="lane") as client:
        keys = [f"r{i}" for i in range(3)]
        for key in keys:
            assert client.put(key, pattern(key, SIZE)) is True
        place = client._places.get("r2", client._channel.epoch)
        assert place is not None and len(place.replicas) == 2  # put ahead, both replicas known
        first = client._segments.get({place.replicas[0].segment_id})[place.replicas[0].segment_id]
        next(n for n in pool.nodes if n.name == first.node_id).kill()  # the node read early
        for key in keys[1:]:
            assert client.get(key) == pattern(key, SIZE).tobytes()
        assert _early(client, "read_again") == 2 and _early(client, "used") == 0


def test_threads_sharing_a_client_read_early_and_get_their_own_bytes(make_pool):
    """Early reads send GetValue without waiting (LaneChannel.begin) while other threads make their
    own calls on the same lane: every answer reaches its own get."""
    import threading

    pool = make_pool(num_nodes=1, node_memory="16MiB")
    errors: list[str] = []
    with Client(pool.address, "threads", path="lane") as client:

        def work(t: int) -> None:
            try:
                keys = [f"t{t}/{i}" for i in range(8)]
                for key in keys:
                    client.put(key, pattern(key, SIZE))
                for _ in range(3):
                    for key in keys:
                        if client.get(key) != pattern(key, SIZE).tobytes():
                            errors.append(key)
                    client.exists(keys)  # a plain call between the gets
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(repr(e))

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not errors, errors
        assert _early(client, "used") > 0
