"""A master restart under a running vLLM: the storage node keeps its objects and its directory,
announces them to the new master on the same address, and the connector, back from its back-off,
loads the prefix saved before the crash. While the master is down vLLM serves without the pool."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import pytest

from kvpool.bench import procs
from test_connector import BLOCK_SIZE, assert_same_answer, counters, only, prompt

pytestmark = pytest.mark.vllm

HEARTBEAT = ("--heartbeat-interval-s", "0.2")  # the node's directory and re-mount follow within ~0.2 s
# the connector gives up on a dead master within 0.5-1 s and tries it again at most 0.5 s later
FAST_RETRY = {"retry_initial_s": 0.2, "retry_max_s": 0.5, "timeout_s": 1.0, "lookup_timeout_s": 0.5}


def wait_until(what: str, ready, timeout_s: float = 60.0, every_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} after {timeout_s:.0f} s")
        time.sleep(every_s)


def node_directory_objects(node: procs.ManagedProcess) -> float:
    url = f"http://127.0.0.1:{node.info['metrics_port']}/metrics"
    with urllib.request.urlopen(url, timeout=2.0) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("kvpool_node_directory_objects "):
                return float(line.split()[1])
    return 0.0


def recovered_objects(address: str) -> int:
    from kvpool.client import Client

    with Client(address, timeout_s=1.0) as client:
        return client.stats().recovered_objects


def test_prefix_saved_before_a_master_crash_is_loaded_after_its_restart(make_pool, run_vllm, tmp_path: Path):
    pool = make_pool(num_nodes=0, master_args=HEARTBEAT)
    node = pool.add_node("64MiB", "--metrics-port", "0")
    address = pool.address
    port = address.rsplit(":", 1)[1]
    p, q = prompt(100, seed=11), prompt(100, seed=12)  # 3 full blocks + 4 tokens each
    saved, recomputed, master_down, master_back = (tmp_path / n for n in ("saved", "recomputed", "down", "back"))
    wait = run_vllm.start("restart", address, [
        {"prompts": [p], "max_tokens": 8, "signal_file": str(saved)},
        {"prompts": [q, p], "max_tokens": 8, "reset_prefix_cache": True, "wait_file": str(master_down),
         "signal_file": str(recomputed)},
        {"prompts": [p], "max_tokens": 8, "reset_prefix_cache": True, "wait_file": str(master_back)},
    ], extra_config=FAST_RETRY)  # fmt: skip

    wait_until("vLLM did not finish phase 0", saved.exists, timeout_s=240)
    wait_until("the node's directory did not list P's objects", lambda: node_directory_objects(node) >= 3)
    pool.master.kill()
    master_down.touch()

    wait_until("vLLM did not finish phase 1 (master down)", recomputed.exists, timeout_s=120)
    pool.master = procs.start_master(pool.workdir, "--port", port, *HEARTBEAT, name="master2")
    assert pool.address == address
    wait_until("the new master did not recover P's objects", lambda: recovered_objects(address) >= 3, every_s=0.1)
    master_back.touch()
    result = wait(120)

    first = only(result, 0)
    assert first["num_cached_tokens"] == 0  # computed without any cache: the reference
    assert counters(result, 0)["vllm:kvpool_saved_blocks"] >= 3

    # master down: both prompts served, recomputed (the prefix cache was reset, the pool is gone)
    for served in result["phases"][1]["outputs"]:
        assert served["num_cached_tokens"] == 0 and len(served["token_ids"]) == 8
    assert counters(result, 1)["vllm:kvpool_pool_unavailable"] >= 1
    assert_same_answer(only(result, 1, 1), first)

    # the new master serves what the node announced: a pool hit, the same answer as the recompute
    hit = only(result, 2)
    assert hit["num_cached_tokens"] == 3 * BLOCK_SIZE
    loaded = counters(result, 2)["vllm:kvpool_loaded_blocks"] - counters(result, 1).get("vllm:kvpool_loaded_blocks", 0)
    assert loaded == 3
    assert_same_answer(hit, first)
