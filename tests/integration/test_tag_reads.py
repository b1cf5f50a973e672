"""Plain gets of values a client never saw, read by tag while GetValue travels (transfer/lane_tags.py,
client/known_places.py), with a real master and nodes over the segment lane: the bytes a
node holds under the key's tag are kept only when the master's answer places the value there and
they match its checksum. A removed, replaced or wrongly tagged value is never served from the tag."""

from __future__ import annotations

import socket
import struct

from kvpool.client import Client
from kvpool.transfer import lane_tags
from kvpool.transfer import segment_lane as sl
from pool_worker import pattern

KiB = 1024
SIZE = 96 * KiB  # over the master's inline limit: on a node


def _tags(client: Client, outcome: str) -> float:
    """The client's tenant's count (clients of one tenant in one process share the metric)."""
    return client._metrics.tag_reads[outcome]._value.get()


def _warm(client: Client, key: str = "warm-up") -> None:
    """A get that teaches a fresh client where the segments are (a tag read needs a known segment):
    of `key`, put now if no client has put it."""
    if client.get(key) is None:
        client.put(key, pattern(key, SIZE))
        client._places.clear()
        assert client.get(key) == pattern(key, SIZE).tobytes()
    assert client._segments.lane_segments(include_local=True)


def test_another_client_reads_values_it_never_saw_by_tag(make_pool):
    pool = make_pool(num_nodes=1, node_memory="8MiB")
    with Client(pool.address, "by-tag", path="lane") as a, Client(pool.address, "by-tag", path="lane") as b:
        keys = [f"k{i}" for i in range(6)]
        for key in keys:  # the first goes the usual way (PutStart), the rest into allocations held ahead
            assert a.put(key, pattern(key, SIZE)) is True
        _warm(b, keys[0])  # b knows no segment yet: the usual get, and now it knows the node
        assert [b.get(k) for k in keys[1:]] == [pattern(k, SIZE).tobytes() for k in keys[1:]]
        assert _tags(b, "used") == len(keys) - 1
        assert b.get(keys[1]) == pattern(keys[1], SIZE).tobytes()  # now a known place: not by tag
        assert _tags(b, "used") == len(keys) - 1
        # a get_array reads by tag too
        with Client(pool.address, "by-tag", path="lane") as c:
            _warm(c, keys[0])
            array = c.get_array(keys[2], dtype="uint8")
            assert array is not None and array.tobytes() == pattern(keys[2], SIZE).tobytes()
        assert _tags(b, "used") == len(keys)


def test_a_removed_or_replaced_value_is_never_served_from_its_tag(make_pool):
    pool = make_pool(num_nodes=1, node_memory="4MiB")
    with Client(pool.address, "stale", path="lane") as a, Client(pool.address, "stale", path="lane") as b:
        assert a.put("gone", pattern("gone", SIZE)) is True
        assert a.put("moved", pattern("moved", SIZE)) is True
        _warm(b)
        used = _tags(b, "used")
        assert a.remove(["gone"]) == 1
        assert a.put("filler", pattern("filler", SIZE)) is True  # may take gone's range: its tag now names filler's bytes
        assert b.get("gone") is None  # the master says no such value, whatever the tag read
        assert a.remove(["moved"]) == 1
        assert a.put("filler2", pattern("filler2", SIZE)) is True
        assert a.put("moved", pattern("moved-new", SIZE)) is True  # re-put: a new tag, a new place
        assert b.get("moved") == pattern("moved-new", SIZE).tobytes()
        assert _tags(b, "used") == used + 1 and _tags(b, "read_again") == 0


def _send_tag(address: str, tag: bytes, offset: int, size: int) -> None:
    """A TAG request as any lane client may send (the lane is not authenticated): `tag` names
    `size` bytes at `offset`, whatever is there."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(sl._HEAD.pack(sl.MAGIC, lane_tags.TAG, 1) + struct.pack("<QQ", offset, size) + tag)
        sock.sendall(sl._HEAD.pack(sl.MAGIC, lane_tags.READ_TAG, 1) + tag)  # answered once the TAG is in
        assert sock.recv(1) == bytes([lane_tags.KNOWN])


def test_a_tag_naming_other_bytes_is_read_again_and_the_right_value_returned(make_pool):
    pool = make_pool(num_nodes=1, node_memory="4MiB")
    with Client(pool.address, "hostile", path="lane") as a, Client(pool.address, "hostile", path="lane") as b:
        assert a.put("victim", pattern("victim", SIZE)) is True
        assert a.put("decoy", pattern("decoy", SIZE)) is True
        decoy = a._places.get("decoy", a._channel.epoch).replicas[0]
        _warm(b)
        used = _tags(b, "used")
        segment = b._segments.get({decoy.segment_id})[decoy.segment_id]
        _send_tag(segment.lane_address, lane_tags.tag_of("hostile", "victim"), decoy.offset, decoy.size)
        assert b.get("victim") == pattern("victim", SIZE).tobytes()
        assert _tags(b, "read_again") == 1 and _tags(b, "used") == used
        # a tag naming another range that holds the very same bytes (another key's copy): the
        # checksum matches, the place does not: read again
        assert a.put("twin", pattern("victim", SIZE)) is True
        twin = a._places.get("twin", a._channel.epoch).replicas[0]
        _send_tag(segment.lane_address, lane_tags.tag_of("hostile", "victim"), twin.offset, twin.size)
        with Client(pool.address, "hostile", path="lane") as d:
            _warm(d)
            assert d.get("victim") == pattern("victim", SIZE).tobytes()
            assert _tags(d, "read_again") == 2 and _tags(d, "used") == used
        # a tag at the right place whose bytes were changed under it: the checksum catches it
        victim = b._places.get("victim", b._channel.epoch)  # where b read it
        assert victim is not None
        with Client(pool.address, "hostile", path="lane") as c:
            _warm(c)
            from test_integrity import _flip_bits

            right = victim.replicas[0]
            _send_tag(segment.lane_address, lane_tags.tag_of("hostile", "victim"), right.offset, right.size)
            _flip_bits(a, ["victim"], 0, 100, 0x01)
            assert c.get("victim") is None  # read by tag, mismatched; read again under the lease: mismatched
            assert _tags(c, "read_again") == 3 and _tags(c, "used") == used


def test_gets_of_values_the_master_holds_stop_reading_by_tag(make_pool):
    pool = make_pool(num_nodes=1, node_memory="4MiB")
    with Client(pool.address, "small", path="lane") as a, Client(pool.address, "small", path="lane") as b:
        assert a.put("big", pattern("big", SIZE)) is True
        _warm(b, "big")
        for i in range(64):
            assert a.put(f"s{i}", pattern(f"s{i}", 4 * KiB)) is True  # held by the master (inline)
        assert [b.get(f"s{i}") for i in range(64)] == [pattern(f"s{i}", 4 * KiB).tobytes() for i in range(64)]
        tried = _tags(b, "unknown")
        assert 16 <= tried <= 16 + 64 // 16  # the first window, then one in sixteen


def test_with_read_by_tag_off_or_without_checksums_no_get_reads_by_tag(make_pool):
    pool = make_pool(num_nodes=1, node_memory="4MiB")
    with Client(pool.address, "off", path="lane") as a:
        for key in ("x", "y"):
            assert a.put(key, pattern(key, SIZE)) is True
        for options in ({"read_by_tag": False}, {"checksums": False}):
            with Client(pool.address, "off", path="lane", **options) as b:
                assert b.get("x") == pattern("x", SIZE).tobytes()  # now b knows the segment
                assert b.get("y") == pattern("y", SIZE).tobytes()
        assert sum(_tags(a, o) for o in ("used", "read_again", "unknown", "failed")) == 0


def test_with_several_nodes_every_known_node_is_asked_and_the_holder_read(make_pool):
    pool = make_pool(num_nodes=3, node_memory="4MiB")
    with Client(pool.address, "nodes", path="lane") as a, Client(pool.address, "nodes", path="lane") as b:
        keys = [f"n{i}" for i in range(12)]
        for key in keys:
            assert a.put(key, pattern(key, SIZE)) is True
        ids = {r.segment_id for k in keys[1:] for r in a._places.get(k, a._channel.epoch).replicas}
        assert len(ids) == 3  # placed by free ratio: spread over the three nodes
        assert len(b._segments.get(ids)) == 3  # b knows the three segments (as after reading from each)
        assert [b.get(k) for k in keys] == [pattern(k, SIZE).tobytes() for k in keys]
        assert _tags(b, "used") == len(keys) and _tags(b, "unknown") == 0


def test_the_node_reports_its_tags_and_tag_reads(make_pool):
    import urllib.request

    pool = make_pool(num_nodes=0)
    node = pool.add_node("4MiB", "--metrics-port", "0")
    with Client(pool.address, "metrics", path="lane") as a, Client(pool.address, "metrics", path="lane") as b:
        for key in ("m0", "m1", "m2"):
            assert a.put(key, pattern(key, SIZE)) is True
        _warm(b, "m0")
        assert b.get("m1") == pattern("m1", SIZE).tobytes()
        assert b.get("absent") is None  # asked, not known
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{node.info['metrics_port']}/metrics", timeout=5).read().decode()
    assert "kvpool_node_lane_tags 3.0" in metrics
    assert 'kvpool_node_lane_tag_reads_total{outcome="known"} 1.0' in metrics
    assert 'kvpool_node_lane_tag_reads_total{outcome="not_known"} 1.0' in metrics
