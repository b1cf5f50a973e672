"""A put answered "stored" survives a master crash however soon after it came: its objects were in
their nodes' directories before the answer (master/durability.py), and plain values kept by the
master itself were on a node too."""

from __future__ import annotations

from kvpool.bench import procs
from kvpool.client import PUT_ALLOCATED, Client
from pool_worker import pattern, wait_until
from test_integrity import FAST, _mounted, _read_back, _stats

KiB = 1024
MiB = 1024 * KiB


def test_objects_put_just_before_a_master_crash_are_served_again(tmp_path):
    master = procs.start_master(tmp_path, *FAST)
    address = master.info["address"]
    nodes = [procs.start_node(tmp_path, address, "64MiB", name=f"n{i}") for i in range(2)]
    size = 1 * MiB
    written: list[str] = []
    try:
        for crash in range(3):
            keys = [f"crash{crash}/{i}" for i in range(20)]
            with Client(address, timeout_s=2.0) as client:
                for key in keys:
                    assert client.put(key, pattern(key, size).tobytes()) is True
            master.kill()  # at once: the last put was answered a moment ago
            written += keys
            master = procs.start_master(tmp_path, *FAST, "--port", address.rsplit(":", 1)[1], name=f"m{crash}")
            wait_until(lambda: _mounted(address, {"n0", "n1"}), 15, "both nodes remounted and announced")
            served, wrong = _read_back(address, written, size)
            assert wrong == 0
            assert served == len(written), f"crash {crash}: {served} of {len(written)} served again"
        stats = _stats(address)
        assert stats.recovered_objects >= 20
    finally:
        for proc in [*nodes, master]:
            proc.stop(grace_s=5.0)


def test_inline_values_survive_a_master_crash_and_a_removed_one_stays_removed(tmp_path):
    master = procs.start_master(tmp_path, *FAST)
    address = master.info["address"]
    nodes = [procs.start_node(tmp_path, address, "16MiB", name=f"n{i}") for i in range(2)]
    try:
        with Client(address, timeout_s=2.0) as client:
            keys = [f"small/{i}" for i in range(50)]
            for key in keys:
                assert client.put(key, pattern(key, 4 * KiB).tobytes()) is True
            removed = keys[:5]
            client.remove(removed)
            stats = _stats(address)
            assert stats.inline_values == 45  # held by the master itself, copied to a node
        master.kill()
        master = procs.start_master(tmp_path, *FAST, "--port", address.rsplit(":", 1)[1], name="m1")
        wait_until(lambda: _mounted(address, {"n0", "n1"}), 15, "both nodes remounted and announced")
        with Client(address) as fresh:
            for key in removed:
                assert fresh.get(key) is None
        served, wrong = _read_back(address, keys[5:], 4 * KiB)
        assert (served, wrong) == (45, 0)
    finally:
        for proc in [*nodes, master]:
            proc.stop(grace_s=5.0)


def test_objects_put_across_to_a_node_while_their_end_travels_survive_a_crash_right_after(tmp_path):
    """A put written over the node's TCP path ends while its bytes travel (client/landing.py) and is
    made readable by a one-way PutLanded: its end's reply already waited for the node, so a crash
    right after the put returns loses nothing."""
    master = procs.start_master(tmp_path, *FAST)
    address = master.info["address"]
    node = procs.start_node(tmp_path, address, "64MiB", name="n0")
    size = 256 * KiB
    try:
        with Client(address, "durable", path="lane", timeout_s=2.0) as writer:
            ends_before = writer._metrics.put_ends_landing._value.get()  # the counter is the process's
            keys = [f"landed/{i}" for i in range(20)]
            for key in keys:
                buf = pattern(key, size)
                writer.register(buf)
                assert writer.put_from([key], [[buf.ctypes.data]], [[size]]) == [PUT_ALLOCATED]
            assert writer._metrics.put_ends_landing._value.get() - ends_before == 20  # each end travelled with its bytes
        master.kill()
        master = procs.start_master(tmp_path, *FAST, "--port", address.rsplit(":", 1)[1], name="m1")
        wait_until(lambda: _mounted(address, {"n0"}), 15, "the node remounted and announced")
        with Client(address, "durable") as reader:
            got = [reader.get(key) for key in keys]
        assert sum(v is not None for v in got) == 20
        assert all(v == pattern(k, size).tobytes() for k, v in zip(keys, got))
    finally:
        for proc in [node, master]:
            proc.stop(grace_s=5.0)
