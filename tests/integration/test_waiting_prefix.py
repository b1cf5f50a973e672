"""A request stuck in vLLM's queue keeps its prefix in a full pool (connector/waiting.py), against a
real master and storage node: the connector's scheduler half touches the waiting request's prefix,
and the master's LRU then evicts another session's chain instead. Without the touch, the waiting
request's older prefix is what goes."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from kvpool.client import Client
from kvpool.connector.health import PoolHealth
from kvpool.connector.keys import hash_hex
from kvpool.connector.plan import Geometry
from kvpool.connector.scheduler import SchedulerSide

MiB = 1 << 20
BS = 4  # tokens per block (one block per object)


def chain(tag: int, n: int) -> list[bytes]:
    return [bytes([tag, i]) * 16 for i in range(n)]


def put_chain(client: Client, hashes: list[bytes]) -> None:
    parent = None
    for h in hashes:
        key = hash_hex(h)
        assert client.put(key, np.full(MiB, h[1], dtype=np.uint8), parent=parent) is True
        parent = key


@pytest.mark.parametrize("touch_waiting_s", [1.0, 0.0])
def test_a_waiting_requests_prefix_survives_eviction_only_when_touched(make_pool, touch_waiting_s):
    pool = make_pool(num_nodes=1, node_memory="8MiB")  # eight 1 MiB objects
    waiting_session, other_session, newcomer = chain(0xA0, 3), chain(0xB0, 3), chain(0xC0, 4)
    with Client(pool.address, "t") as client:
        put_chain(client, waiting_session)
        time.sleep(0.05)  # the master's LRU clock: the other session's chain is newer
        put_chain(client, other_session)
        now = [0.0]
        side = SchedulerSide(Geometry(BS, 1), make_client=lambda: Client(pool.address, "t"),
                             health=PoolHealth("test", 60.0, 60.0), num_workers=1, save_decode=True,
                             load_async=True, clock=lambda: now[0], touch_waiting_s=touch_waiting_s)  # fmt: skip
        request = SimpleNamespace(request_id="r", num_tokens=3 * BS + 1, num_prompt_tokens=3 * BS + 1,
                                  num_computed_tokens=0, block_hashes=waiting_session)  # fmt: skip
        side.on_new_request(request)  # vLLM queues it behind others
        now[0] = 1.5
        side.build_connector_meta(SimpleNamespace())  # an engine step while it still waits
        touched = 0
        for _ in range(300):
            taken = side.stats.take()
            touched += taken.data.get("prefix_touched_objects", 0) if taken is not None else 0
            if touched or not touch_waiting_s:
                break
            threading.Event().wait(0.01)
        side.close()
        assert touched == (3 if touch_waiting_s else 0)
        put_chain(client, newcomer)  # 10 MiB into 8: the pool evicts chain tails, least recently used first
        waiting_kept = client.exists([hash_hex(h) for h in waiting_session])
        other_kept = client.exists([hash_hex(h) for h in other_session])
        assert client.stats().evictions >= 2
    if touch_waiting_s:
        assert waiting_kept == [True, True, True] and not other_kept[-1]  # the idle session's tail went
    else:
        assert not waiting_kept[-1] and other_kept == [True, True, True]  # LRU took the waiting prefix
