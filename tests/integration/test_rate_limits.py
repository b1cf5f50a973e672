"""Rate limits with a real master: one client floods it with big lookups and is refused
(RateLimitedError); another, asking little, is always answered, and correctly."""

from __future__ import annotations

import threading

from kvpool.bench import procs
from kvpool.client import Client
from kvpool.core import protocol as p
from kvpool.core.errors import RateLimitedError
from kvpool.rpc.zmq_channel import MasterChannel


def test_a_flooding_client_is_limited_and_the_others_are_served(tmp_path):
    master = procs.start_master(tmp_path, "--rate-limit-keys-per-s", "20000", "--rate-limit-burst-keys", "20000")
    node = procs.start_node(tmp_path, master.info["address"], "16MiB")
    stop = threading.Event()
    outcome = {"answered": 0, "limited": 0}

    def flood() -> None:
        channel = MasterChannel(master.info["address"], timeout_s=5.0)
        keys = [f"flood-{i}" for i in range(2000)]
        try:
            while not stop.is_set():
                try:
                    channel.call(p.LookupPrefix("flood", keys))
                    outcome["answered"] += 1
                except RateLimitedError as e:
                    assert "keys/s" in str(e)
                    outcome["limited"] += 1
        finally:
            channel.close()

    flooder = threading.Thread(target=flood)
    try:
        with Client(master.info["address"], tenant="polite") as polite:
            assert polite.put("mine", b"polite bytes")
            flooder.start()
            for _ in range(200):
                assert polite.get("mine") == b"polite bytes"  # never refused: its own bucket is full
            stop.set()
            flooder.join(10)
        assert outcome["limited"] > 0 and outcome["answered"] >= 10
    finally:
        stop.set()
        node.stop(grace_s=5.0)
        master.stop(grace_s=5.0)
