"""Pool integrity with real processes: nothing stale is ever served, and a master restart keeps
the cache. Every byte read is compared with what its key's writer wrote (pool_worker.pattern)."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from kvpool.bench import procs
from kvpool.client import PUT_ALLOCATED, PUT_FAILED, Client
from kvpool.client.puts import Puts
from kvpool.core import protocol as p
from kvpool.rpc.zmq_channel import MasterChannel
from kvpool.transfer.shm import PeerMapping
from pool_worker import chain_keys, pattern, wait_until

KiB = 1024
MiB = 1024 * KiB
FAST = ("--heartbeat-interval-s", "0.2", "--node-ttl-s", "2")


def _port(address: str) -> str:
    return address.rsplit(":", 1)[1]


def _stats(address: str) -> p.StatsReply | None:
    channel = MasterChannel(address, timeout_s=0.5)
    try:
        return channel.call(p.Stats())
    except Exception:
        return None
    finally:
        channel.close()


def _mounted(address: str, node_ids: set[str]) -> bool:
    stats = _stats(address)
    return stats is not None and {n.node_id for n in stats.nodes if n.state == "alive"} >= node_ids


def _directory_objects(node: procs.ManagedProcess) -> int:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{node.info['metrics_port']}/metrics", timeout=2).read().decode()
    return int(float(next(ln.split()[1] for ln in text.splitlines() if ln.startswith("kvpool_node_directory_objects "))))


def _put(client: Client, keys: list[str], size: int) -> list[int]:
    buf = np.concatenate([pattern(k, size) for k in keys])
    client.register(buf)
    return client.put_from(keys, [[buf.ctypes.data + i * size] for i in range(len(keys))], [[size]] * len(keys))


def _flip_bits(client: Client, keys: list[str], index: int, at: int, bits: int) -> None:
    """Corrupt the stored bytes of keys[index] behind the pool's back: XOR `bits` into its byte
    `at`, through a mapping of the node's segment (the master cannot know)."""
    _, reply, replicas = client._lookup_leased(keys)
    client._release(reply.lease_id)
    replica = replicas[index][0]
    info = client._segments.get({replica.segment_id})[replica.segment_id]
    mapping = PeerMapping(info.shm_path, info.size_bytes, info.agent_name)
    try:
        victim = mapping.base_addr + replica.offset + at
        np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * 1).from_address(victim))[0] ^= bits
    finally:
        mapping.close()


def _read_back(address: str, keys: list[str], size: int) -> tuple[int, int]:
    """(objects served, objects whose bytes differ from their writer's) with a fresh client."""
    served = wrong = 0
    with Client(address) as fresh:
        for key in keys:
            value = fresh.get(key)
            if value is not None:
                served += 1
                wrong += value != pattern(key, size).tobytes()
    return served, wrong


@pytest.mark.parametrize("first", ["node-a", "node-b"])
def test_master_restarts_serve_no_wrong_bytes_and_keep_the_cache(tmp_path, first):
    master = procs.start_master(tmp_path, *FAST)
    address = master.info["address"]
    nodes = {name: procs.start_node(tmp_path, address, "16MiB", "--metrics-port", "0", name=name)
             for name in ("node-a", "node-b")}
    later = "node-b" if first == "node-a" else "node-a"
    size = 64 * KiB
    written: list[str] = []
    try:
        with Client(address, timeout_s=2.0) as client:  # long-lived, as a vLLM worker's
            keys = chain_keys("before", 40)
            assert _put(client, keys, size) == [PUT_ALLOCATED] * 40
            written += keys
            epochs = {client.epoch}
            for restart in range(3):
                wait_until(lambda: sum(map(_directory_objects, nodes.values())) == len(written), 10,
                      "every commit in the nodes' directories")
                master.kill()
                os.kill(nodes[later].pid, signal.SIGSTOP)  # `first` remounts first, `later` after it
                try:
                    master = procs.start_master(tmp_path, *FAST, "--port", _port(address), name=f"master{restart}")
                    wait_until(lambda: _mounted(address, {first}), 10, f"{first} remounted")
                finally:
                    os.kill(nodes[later].pid, signal.SIGCONT)
                wait_until(lambda: _mounted(address, {first, later}), 10, f"{later} remounted")
                keys = chain_keys(f"after{restart}", 20)
                statuses = _put(client, keys, size)
                assert set(statuses) == {PUT_ALLOCATED}, statuses
                written += keys
                epochs.add(client.epoch)
            assert len(epochs) == 4  # every incarnation was seen as a new one
        served, wrong = _read_back(address, written, size)
        assert wrong == 0
        assert served == len(written)  # everything committed before each restart is served again
        stats = _stats(address)
        assert stats.recovered_objects > 0 and stats.rejected_announcements == 0
    finally:
        for proc in [*nodes.values(), master]:
            proc.stop(grace_s=5.0)


def test_late_or_duplicate_put_end_is_refused_and_never_completes_another_put(make_pool):
    pool = make_pool(num_nodes=1, master_args=("--put-timeout-s", "0.5"))
    channel = MasterChannel(pool.address, timeout_s=2.0)
    try:
        slow = channel.call(p.PutStart("default", ["k"], [4096], [None]))
        # past put_timeout_s the master reclaims the slow writer's allocation
        wait_until(lambda: _stats(pool.address).num_pending == 0, 5, "the slow put reclaimed")
        with Client(pool.address) as other:
            assert other.put("k", pattern("k", 4096)) is True  # another writer's re-put of the key
            late = channel.call(p.PutEnd("default", ["k"], slow.tokens, [1]))
            assert (late.ended, late.refused) == (0, [0])
            assert other.get("k") == pattern("k", 4096).tobytes()  # untouched by the late end
            again = channel.call(p.PutStart("default", ["d"], [64], [None]))
            assert channel.call(p.PutEnd("default", ["d"], again.tokens, [0])).ended == 1
            assert channel.call(p.PutEnd("default", ["d"], again.tokens, [0])).refused == [0]  # duplicate
            # a put racing a remove: the removed object's token never completes the new one
            first = channel.call(p.PutStart("default", ["r"], [64], [None]))
            channel.call(p.PutEnd("default", ["r"], first.tokens, [0]))
            assert other.remove(["r"]) == 1
            second = channel.call(p.PutStart("default", ["r"], [64], [None]))
            assert second.tokens[0] != first.tokens[0]
            assert channel.call(p.PutEnd("default", ["r"], first.tokens, [0])).refused == [0]
            assert other.exists(["r"]) == [False]  # still the second writer's, pending
            assert channel.call(p.PutEnd("default", ["r"], second.tokens, [0])).ended == 1
            assert other.stats().refused_put_ends == 3
    finally:
        channel.close()


def test_flipped_bytes_in_a_segment_are_a_miss_never_served(make_pool):
    pool = make_pool(num_nodes=1, node_memory="4MiB")
    keys, size = chain_keys("flip", 4), 64 * KiB
    with Client(pool.address) as client:
        assert _put(client, keys, size) == [PUT_ALLOCATED] * 4
        _flip_bits(client, keys, 2, 1000, 0x10)
        assert client.lookup_prefix(keys) == 4  # the master cannot know; the reader finds out
        assert client.get(keys[2]) is None
        buf = np.zeros(4 * size, dtype=np.uint8)
        client.register(buf)
        assert client.get_into(keys, [[buf.ctypes.data + i * size] for i in range(4)], [[size]] * 4) == 2
        for i in range(2):
            assert np.array_equal(buf[i * size : (i + 1) * size], pattern(keys[i], size))
        assert client.get(keys[3]) == pattern(keys[3], size).tobytes()
        assert client._metrics.checksum_mismatches._value.get() >= 2


def test_a_flipped_byte_is_found_by_the_checksum_taken_during_a_large_scattered_copy(make_pool, monkeypatch):
    """Same-host reads checksum each object right after its copy (memcopy.copy_objects), also in
    the runs of whole objects the helper threads take: 24 objects of 16 x 64 KiB regions, the
    13th with one flipped byte, are read as 12 hits; no object is checksummed a second time."""
    from kvpool.client import reads as reads_module
    from kvpool.transfer import memcopy

    monkeypatch.setattr(memcopy, "_num_cpus", 3)  # helper threads even on a one-CPU runner
    pool = make_pool(num_nodes=1, node_memory="64MiB")
    keys, regions, region = chain_keys("scatter", 24), 16, 64 * KiB
    size = regions * region
    with Client(pool.address) as client:
        assert _put(client, keys, size) == [PUT_ALLOCATED] * 24
        _flip_bits(client, keys, 12, 5 * region + 7, 0x01)
        after_copy = []
        monkeypatch.setattr(reads_module, "checksum_objects", lambda *a: after_copy.append(a) or [])
        mismatches = client._metrics.checksum_mismatches._value.get()  # the tenant's, shared in this process
        buf = np.zeros(24 * size + 16, dtype=np.uint8)
        client.register(buf)
        base = buf.ctypes.data + 16  # 16 bytes past the segment's alignment: numpy's loop copies it
        # object i's region k lies at slot k * 24 + i: scattered, as a paged KV cache is
        addrs = [[base + (k * 24 + i) * region for k in range(regions)] for i in range(24)]
        assert client.get_into(keys, addrs, [[region] * regions] * 24) == 12
        assert not after_copy  # every checksum was taken during the copy
        for i in range(12):
            got = np.concatenate([buf[a - buf.ctypes.data : a - buf.ctypes.data + region] for a in addrs[i]])
            assert np.array_equal(got, pattern(keys[i], size))
        assert client._metrics.checksum_mismatches._value.get() == mismatches + 1


@pytest.mark.parametrize("path", ["shm", "lane"])
def test_a_small_batch_hashed_while_its_put_start_travels_records_each_written_objects_own_checksum(
        make_pool, monkeypatch, path):
    """A put batch of at most 1 MiB is checksummed whole while its PutStart travels (puts.py); the
    master then allocates only some of it (the middle key exists): each written object must carry
    its own checksum, not its neighbour's, or a fresh reader's get would be a miss. Hashed before
    the answer: `_checksums` is not called again after it."""
    from kvpool.client import puts

    pool = make_pool(num_nodes=1, node_memory="64MiB")
    keys, size = chain_keys(f"early-sums-{path}", 3), 128 * KiB
    assert 3 * size <= puts.EARLY_CHECKSUM_BYTES
    buf = np.concatenate([pattern(k, size) for k in keys])
    addrs = [[buf.ctypes.data + i * size] for i in range(3)]
    with Client(pool.address, path=path) as client:
        client.register(buf)
        assert client.put_from([keys[1]], [addrs[1]], [[size]]) == [PUT_ALLOCATED]
        hashed = []
        real = Puts.checksums
        monkeypatch.setattr(Puts, "checksums", lambda self, a, z: hashed.append(len(a)) or real(self, a, z))
        assert client.put_from(keys, addrs, [[size]] * 3) == [PUT_ALLOCATED, p.PUT_EXISTS, PUT_ALLOCATED]
        assert hashed == [3]  # the whole batch, once, before the master answered
    assert _read_back(pool.address, keys, size) == (3, 0)


def test_a_large_same_host_put_checksums_each_object_during_its_copy(make_pool, monkeypatch):
    """A same-host put of 8 MiB or more checksums each object right after copying it (from the
    CPU's caches), not on another thread beside the copy: 24 scattered objects of 16 x 64 KiB
    (the helper threads take runs of whole objects), none checksummed apart; what it recorded is
    the writer's bytes: a fresh reader gets all 24, then a flipped byte is a miss."""
    from kvpool.transfer import memcopy

    monkeypatch.setattr(memcopy, "_num_cpus", 3)  # helper threads even on a one-CPU runner
    pool = make_pool(num_nodes=1, node_memory="64MiB")
    keys, regions, region = chain_keys("scatter-put", 24), 16, 64 * KiB
    size = regions * region
    buf = np.zeros(24 * size + 16, dtype=np.uint8)
    base = buf.ctypes.data + 16
    addrs = [[base + (k * 24 + i) * region for k in range(regions)] for i in range(24)]
    for i, key in enumerate(keys):
        value = pattern(key, size)
        for k, addr in enumerate(addrs[i]):
            off = addr - buf.ctypes.data
            buf[off : off + region] = value[k * region : (k + 1) * region]
    with Client(pool.address) as client:
        client.register(buf)
        apart = []
        real = Puts.checksums
        monkeypatch.setattr(Puts, "checksums", lambda self, a, z: apart.append(len(a)) or real(self, a, z))
        assert client.put_from(keys, addrs, [[region] * regions] * 24) == [PUT_ALLOCATED] * 24
        assert sum(apart) == 0  # every object was checksummed during its copy
    served, wrong = _read_back(pool.address, keys, size)
    assert (served, wrong) == (24, 0)
    with Client(pool.address) as client:
        _flip_bits(client, keys, 5, 1000, 0x04)
        assert client.get(keys[5]) is None
        assert client.get(keys[6]) == pattern(keys[6], size).tobytes()


def _assert_only_own_bytes_or_misses(address: str, keys: list[str], size: int, never: str) -> None:
    """A fresh reader gets each key's own bytes or a miss, never other bytes; `never` is a miss."""
    with Client(address) as fresh:
        for key in keys:
            value = fresh.get(key)
            assert value is None or value == pattern(key, size).tobytes(), key
        assert fresh.get(never) is None


def test_transfer_to_a_stopped_node_times_out_and_nothing_lands_in_reused_space(tmp_path, monkeypatch):
    # UCX over TCP needs the target to progress, as across hosts; on one host it would use CMA,
    # which completes without the target (tests/notes in transfer/nixlio.py)
    monkeypatch.setenv("UCX_TLS", "tcp")
    master = procs.start_master(tmp_path)
    address = master.info["address"]
    node = procs.start_node(tmp_path, address, "4MiB", name="node", env={"UCX_TLS": "tcp"})
    size = 256 * KiB
    try:
        with Client(address, path="nixl", timeout_s=0.5) as remote, Client(address, path="shm") as local:
            assert _put(local, ["warm"], size) == [PUT_ALLOCATED]
            os.kill(node.pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                assert _put(remote, ["stuck"], size) == [PUT_FAILED]
                assert time.monotonic() - started < 2.0  # the writer gives up at its deadline
                assert _stats(address).quarantined == 1  # its range is held, not reusable
                # a same-host writer fills the node's memory meanwhile (shared memory needs no
                # progress from the node): none of it may land where the stuck write will
                filler = chain_keys("filler", 12)  # with warm and stuck: 3.5 of 4 MiB, no eviction
                assert _put(local, filler, size) == [PUT_ALLOCATED] * 12
                out = np.ones(size, dtype=np.uint8)
                remote.register(out)
                reader = threading.Thread(
                    target=lambda: remote.get_into(["warm"], [[out.ctypes.data]], [[size]]), daemon=True
                )
                reader.start()
                reader.join(1.5)
                assert reader.is_alive()  # a read that may still land does not return before it ends
            finally:
                os.kill(node.pid, signal.SIGCONT)
            reader.join(10)
            assert not reader.is_alive()
            out[:] = 7
            time.sleep(0.3)
            assert (out == 7).all()  # once returned, nothing more is written into the reader's memory
            wait_until(lambda: _stats(address).quarantined == 0, 5, "the quarantine ended after the write landed")
            assert _read_back(address, ["warm", *filler], size) == (13, 0)  # the late write hit none of them
            more = chain_keys("more", 14)
            _put(local, more, size)  # now the stuck write's range is reused
        _assert_only_own_bytes_or_misses(address, ["warm", *filler, *more], size, never="stuck")
    finally:
        for proc in (node, master):
            proc.stop(grace_s=5.0)


def test_a_lane_write_to_a_stopped_node_stays_fenced_until_its_bytes_can_no_longer_land(tmp_path):
    # The segment lane (plain TCP): a write the client gave up on may still sit in the node's
    # socket and land when the node resumes; its range must stay quarantined until then.
    master = procs.start_master(tmp_path)
    address = master.info["address"]
    node = procs.start_node(tmp_path, address, "4MiB", name="node")
    size = 256 * KiB
    try:
        with Client(address, path="lane", timeout_s=0.5) as remote, Client(address, path="shm") as local:
            assert _put(local, ["warm"], size) == [PUT_ALLOCATED]
            assert _put(remote, ["lane-ok"], size) == [PUT_ALLOCATED]  # the lane works
            os.kill(node.pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                assert _put(remote, ["stuck"], size) == [PUT_FAILED]
                assert time.monotonic() - started < 2.0  # the writer gives up at its deadline
                assert _stats(address).quarantined == 1  # its range is held while its bytes may land
                filler = chain_keys("filler", 11)  # with warm, lane-ok and stuck: 3.5 of 4 MiB
                assert _put(local, filler, size) == [PUT_ALLOCATED] * 11
                time.sleep(0.5)
                assert _stats(address).quarantined == 1
            finally:
                os.kill(node.pid, signal.SIGCONT)
            wait_until(lambda: _stats(address).quarantined == 0, 5, "the quarantine ended once the node closed")
            assert _read_back(address, ["warm", "lane-ok", *filler], size) == (13, 0)  # none overwritten
            more = chain_keys("more", 14)
            _put(local, more, size)  # the stuck write's range is reused now, and stays intact
            assert _put(remote, ["after"], size) == [PUT_ALLOCATED]  # the lane reconnects
        _assert_only_own_bytes_or_misses(address, ["warm", "lane-ok", *filler, *more, "after"], size, never="stuck")
    finally:
        for proc in (node, master):
            proc.stop(grace_s=5.0)


def test_a_standby_master_takes_over_with_the_cache(tmp_path):
    primary = procs.start_master(tmp_path, *FAST, name="primary")
    standby_port = str(procs.free_port())
    addresses = f"{primary.info['address']},tcp://127.0.0.1:{standby_port}"
    nodes = [procs.start_node(tmp_path, addresses, "8MiB", "--timeout-s", "0.5", name=f"n{i}") for i in range(2)]
    standby = None
    size = 32 * KiB
    try:
        with Client(addresses, timeout_s=0.5) as client:
            keys = chain_keys("ha", 30)
            assert _put(client, keys, size) == [PUT_ALLOCATED] * 30
            time.sleep(0.6)
            primary.kill()
            standby = procs.start_master(tmp_path, *FAST, "--port", standby_port, name="standby")
            standby_address = standby.info["address"]
            wait_until(lambda: _mounted(standby_address, {"n0", "n1"}), 15, "both nodes on the standby")

            def hits():
                try:
                    return client.lookup_prefix(keys) == 30
                except Exception:  # the call that finds the primary gone moves the client to the standby
                    return False

            wait_until(hits, 10, "the client served by the standby")
            assert client._channel.address == standby_address
        assert _read_back(standby_address, keys, size) == (30, 0)
    finally:
        for proc in [*nodes, primary, *([standby] if standby else [])]:
            proc.stop(grace_s=5.0)
