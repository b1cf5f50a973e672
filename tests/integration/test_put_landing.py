"""A put's PutEnd sent while its bytes are written (client/landing.py), with real master
and node processes: every put written across to a node (the segment lane here) ends while
landing, a same-host copy ends after it, and another client reading right after each put returns
finds it, byte for byte; a PutLanded that never arrives leaves the object unreadable until the
master reclaims it; a write that fails after its end was sent is never readable."""

from __future__ import annotations

import os
import signal
import time

from kvpool.bench import procs
from kvpool.client import PUT_ALLOCATED, PUT_FAILED, Client
from pool_worker import pattern, wait_until
from test_integrity import FAST, _mounted, _port, _put, _stats

KiB = 1024


def _landing_ends(client: Client) -> float:
    return client._metrics.put_ends_landing._value.get()


def test_a_reader_finds_each_put_as_soon_as_it_returns(pool):
    with Client(pool.address, "land", path="lane") as writer, Client(pool.address, "land") as reader:
        for n in range(40):
            keys = [f"batch{n}/{i}" for i in range(2)]
            assert _put(writer, keys, 256 * KiB) == [PUT_ALLOCATED] * 2
            assert reader.exists(keys) == [True, True]  # no retry: found the moment the put returned
            key = f"plain{n}"
            assert writer.put(key, pattern(key, 96 * KiB)) is True
            assert reader.get(key) == pattern(key, 96 * KiB).tobytes()
            for k in keys:
                assert reader.get(k) == pattern(k, 256 * KiB).tobytes()
        assert _landing_ends(writer) == 80
        stats = writer.stats()
        assert stats.landed == 120 and stats.refused_landings == 0
        assert (stats.num_objects, stats.num_pending) == (120, 1)  # the allocation held for the next plain put


def test_a_same_host_copy_ends_after_it_and_an_a_b_client_never_lands(pool):
    with Client(pool.address, "local") as local, Client(pool.address, "local", path="lane", landing=False) as before:
        assert _put(local, ["shm"], 256 * KiB) == [PUT_ALLOCATED]
        assert local.plane.paths() and set(local.plane.paths().values()) == {"shm"}
        assert _put(before, ["lane"], 256 * KiB) == [PUT_ALLOCATED]
        assert before.put("plain", pattern("plain", 96 * KiB)) is True
        assert _landing_ends(local) == _landing_ends(before) == 0
        assert local.stats().landed == 0
        assert [local.get(k) is not None for k in ("shm", "lane", "plain")] == [True, True, True]


def test_an_object_whose_landing_never_arrives_is_never_read_and_is_reclaimed(make_pool, monkeypatch):
    pool = make_pool(num_nodes=1, master_args=("--put-timeout-s", "1"))
    with Client(pool.address, "lost", path="lane") as writer, Client(pool.address, "lost") as reader:
        assert _put(writer, ["landed"], 64 * KiB) == [PUT_ALLOCATED]
        # the PutLanded lost on its way
        monkeypatch.setattr(writer._landings, "land", lambda keys, tokens, checksums=None: True)
        assert _put(writer, ["lost"], 64 * KiB) == [PUT_ALLOCATED]
        assert reader.get("lost") is None and reader.exists(["lost"]) == [False]
        assert _put(reader, ["lost"], 64 * KiB) == [1]  # PUT_EXISTS: pending, not anyone else's to write
        assert _stats(pool.address).num_pending == 1
        wait_until(lambda: _stats(pool.address).num_pending == 0, 5, "the never-landed object reclaimed")
        assert reader.get("lost") is None
        monkeypatch.undo()
        assert _put(reader, ["lost"], 64 * KiB) == [PUT_ALLOCATED]  # the key is free again
        assert writer.get("lost") == pattern("lost", 64 * KiB).tobytes()
        assert writer.get("landed") == pattern("landed", 64 * KiB).tobytes()


def test_a_write_that_fails_after_its_end_was_sent_is_revoked_and_never_read(tmp_path):
    master = procs.start_master(tmp_path)
    address = master.info["address"]
    node = procs.start_node(tmp_path, address, "4MiB", name="node")
    try:
        with Client(address, path="lane", timeout_s=0.5) as writer:
            assert _put(writer, ["ok"], 256 * KiB) == [PUT_ALLOCATED]
            ends = _landing_ends(writer)
            os.kill(node.pid, signal.SIGSTOP)
            try:
                assert _put(writer, ["stuck"], 256 * KiB) == [PUT_FAILED]
                assert _landing_ends(writer) == ends + 1  # its end went out before the write failed
                stats = _stats(address)
                assert (stats.landed, stats.num_pending, stats.quarantined) == (1, 0, 1)
            finally:
                os.kill(node.pid, signal.SIGCONT)
            time.sleep(0.3)
        with Client(address) as reader:
            assert reader.get("stuck") is None
            assert reader.get("ok") == pattern("ok", 256 * KiB).tobytes()
            assert _put(reader, ["stuck"], 256 * KiB) == [PUT_ALLOCATED]  # never ended: the key is free
            assert reader.get("stuck") == pattern("stuck", 256 * KiB).tobytes()
    finally:
        for proc in (node, master):
            proc.stop(grace_s=5.0)


def test_an_end_whose_lane_breaks_before_its_reply_is_revoked_and_a_plain_put_made_again(pool, monkeypatch):
    with Client(pool.address, "broken", path="lane") as writer, Client(pool.address, "broken") as reader:
        channel = writer._channel
        finish = channel.finish

        def lane_breaks_first(call):
            channel._close_lane()  # as when the master restarts: whether it took the end is unknown
            return finish(call)

        monkeypatch.setattr(channel, "finish", lane_breaks_first)
        assert _put(writer, ["batch"], 256 * KiB) == [PUT_FAILED]
        assert writer.put("plain", pattern("plain", 96 * KiB)) is True  # made again the usual way
        monkeypatch.undo()
        assert reader.exists(["batch"]) == [False]
        assert reader.get("plain") == pattern("plain", 96 * KiB).tobytes()
        wait_until(lambda: _stats(pool.address).num_pending <= 1, 5, "the ended but unlanded puts revoked")
        assert _put(reader, ["batch"], 256 * KiB) == [PUT_ALLOCATED]  # the key is free


def test_across_a_master_restart_landing_puts_serve_only_their_own_bytes_or_misses(tmp_path):
    master = procs.start_master(tmp_path, *FAST)
    address = master.info["address"]
    node = procs.start_node(tmp_path, address, "16MiB", name="node")
    size = 96 * KiB
    try:
        with Client(address, "restart", path="lane", timeout_s=2.0) as writer:
            before = [f"before{i}" for i in range(4)]
            for key in before:
                assert writer.put(key, pattern(key, size)) is True
            ends = _landing_ends(writer)
            master.kill()
            master = procs.start_master(tmp_path, *FAST, "--port", _port(address), name="master1")
            wait_until(lambda: _mounted(address, {"node"}), 15, "the node remounted")
            after = [f"after{i}" for i in range(4)]
            for key in after:
                assert writer.put(key, pattern(key, size)) is True
            later = iter(f"later{i}" for i in range(1000))

            def lands_again() -> bool:  # once the lane is found again (every 5 s at most), over it
                key = next(later)
                assert writer.put(key, pattern(key, size)) is True
                return _landing_ends(writer) > ends

            wait_until(lands_again, 10, "puts ending while landing with the new master")
            assert _put(writer, ["batch"], size) == [PUT_ALLOCATED]
        with Client(address, "restart") as reader:
            for key in after:
                assert reader.get(key) == pattern(key, size).tobytes()
            assert reader.get("batch") == pattern("batch", size).tobytes()
            for key in before:  # recovered from the node's directory, or a miss: never other bytes
                assert reader.get(key) in (None, pattern(key, size).tobytes())
            assert _stats(address).refused_landings == 0
    finally:
        node.stop(grace_s=5.0)
        master.stop(grace_s=5.0)


def test_a_plain_puts_checksum_taken_while_its_bytes_travel_comes_with_its_landing(pool, monkeypatch):
    """A landing plain put sends its PutEnd without the value's checksum, hashes the value while the
    node takes the bytes in, and sends the checksum with PutLanded: a reader gets the value, the
    master holds its checksum, and a byte flipped in the segment afterwards is a miss."""
    from kvpool.client.checksum import checksum_bytes
    from kvpool.core import protocol
    from test_integrity import _flip_bits

    with Client(pool.address, "sum", path="lane") as writer, Client(pool.address, "sum") as reader:
        sent = []
        send = writer._channel.send
        monkeypatch.setattr(writer._channel, "send", lambda request, **kw: (sent.append(request), send(request, **kw))[1])
        values = {f"v{n}": pattern(f"v{n}", 300 * KiB).tobytes() for n in range(6)}
        for key, value in values.items():
            assert writer.put(key, value) is True
        landings = [r for r in sent if isinstance(r, protocol.PutLanded)]
        # the first put asks for space (its PutEnd carried the checksum); the others write into the
        # allocation held ahead, and their checksums come with the landing
        carried = [r for r in landings if r.checksums]
        assert len(landings) == 6 and len(carried) == 5
        for landing in carried:
            assert landing.checksums == [checksum_bytes(values[landing.keys[0]])]
        _, reply, _ = reader._lookup_leased(list(values))
        reader._release(reply.lease_id)
        assert protocol.unpack_checksums(reply.checksums) == [checksum_bytes(v) for v in values.values()]
        assert all(reader.get(k) == v for k, v in values.items())
        _flip_bits(reader, list(values), 3, 1000, 0x04)
        assert reader.get("v3") is None and reader.get("v4") == values["v4"]
