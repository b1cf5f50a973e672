"""KVPoolConnector in the real vLLM (CPU build, tiny seeded Llama in float32), against a real pool
(master and nodes as processes on 127.0.0.1). Each vLLM run is a fresh process; inside one run a
prefix-cache reset makes the next phase see only the pool, as a fresh process would.

The runs are eager (connector_run.py's default) but for the first test's, which save and load
under torch.compile: the connector's per-layer hooks then run inside the compiled graph's pieces.
Runs that do not depend on each other start together, one core each (VLLM_CPU_OMP_THREADS_BIND)."""

from __future__ import annotations

import random
import time

import pytest

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 32  # what the run_vllm fixture configures
LOGPROB_TOL = 1e-4
COMPILED = {"enforce_eager": False}


def on_core(core: int) -> dict:
    return {"set_env": {"VLLM_CPU_OMP_THREADS_BIND": str(core)}}


def prompt(num_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 7990) for _ in range(num_tokens)]


def only(result: dict, phase: int, index: int = 0) -> dict:
    return result["phases"][phase]["outputs"][index]


def counters(result: dict, phase: int) -> dict:
    return result["phases"][phase]["counters"]


def assert_same_answer(got: dict, want: dict) -> None:
    assert got["token_ids"] == want["token_ids"]
    assert max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"])) < LOGPROB_TOL


def test_fresh_process_loads_prefix_and_answers_like_recompute(make_pool, run_vllm):
    pool = make_pool(num_nodes=1)
    p = prompt(100, seed=1)  # 3 full blocks + 4 tokens
    a = run_vllm("A", pool.address, [{"prompts": [p], "max_tokens": 8}], **COMPILED)
    assert only(a, 0)["num_cached_tokens"] == 0  # A computed everything: the no-cache reference
    assert counters(a, 0)["vllm:kvpool_saved_blocks"] >= 3

    b = run_vllm("B", pool.address, [
        {"prompts": [p], "max_tokens": 8},
        {"prompts": [p], "max_tokens": 8, "reset_prefix_cache": True, "corrupt_prompt": p},
    ], **COMPILED)  # fmt: skip
    loaded = only(b, 0)
    assert loaded["num_cached_tokens"] == 3 * BLOCK_SIZE
    assert counters(b, 0)["vllm:kvpool_loaded_blocks"] == 3
    assert counters(b, 0)["vllm:external_prefix_cache_hits"] == 3 * BLOCK_SIZE  # vLLM's own counter
    assert_same_answer(loaded, only(a, 0))

    # the same load with the pooled bytes replaced by noise gives another answer: the KV is used
    assert b["phases"][1]["corrupted_objects"] == 3
    corrupted = only(b, 1)
    assert corrupted["num_cached_tokens"] == 3 * BLOCK_SIZE
    assert corrupted["logprobs"] != loaded["logprobs"]


def test_partial_hit_loads_the_prefix_and_computes_the_rest(make_pool, run_vllm):
    pool = make_pool(num_nodes=1)
    p, suffix = prompt(100, seed=2), prompt(60, seed=3)
    wait_reference = run_vllm.start("ref", None, [{"prompts": [p + suffix], "max_tokens": 6}], **on_core(0))
    # objects of 2 blocks: P's 3 full blocks make 1 object; P+S (160 tokens) then hits 64 tokens
    result = run_vllm("partial", pool.address, [
        {"prompts": [p], "max_tokens": 1},
        {"prompts": [p + suffix], "max_tokens": 6, "reset_prefix_cache": True},
    ], extra_config={"tokens_per_object": 2 * BLOCK_SIZE, "load_async": True}, **on_core(1))  # fmt: skip
    reference = wait_reference()
    assert counters(result, 0)["vllm:kvpool_saved_blocks"] == 2
    hit = only(result, 1)
    assert hit["num_cached_tokens"] == 2 * BLOCK_SIZE
    assert counters(result, 1)["vllm:kvpool_loaded_blocks"] == 2
    assert counters(result, 1)["vllm:external_prefix_cache_hits"] == 2 * BLOCK_SIZE
    assert_same_answer(hit, only(reference, 0))


def test_prompt_longer_than_max_num_batched_tokens(make_pool, run_vllm):
    pool = make_pool(num_nodes=1)
    long_prompt = prompt(300, seed=4)  # 9 full blocks, prefilled in chunks of 64 tokens
    result = run_vllm("chunked", pool.address, [
        {"prompts": [long_prompt], "max_tokens": 6},
        {"prompts": [long_prompt], "max_tokens": 6, "reset_prefix_cache": True},
    ], max_num_batched_tokens=64, extra_config={"load_async": True})  # fmt: skip
    assert counters(result, 0)["vllm:kvpool_saved_blocks"] >= 9  # saved chunk by chunk
    hit = only(result, 1)
    assert hit["num_cached_tokens"] == 9 * BLOCK_SIZE
    assert_same_answer(hit, only(result, 0))


def test_node_killed_before_the_load_means_recompute(make_pool, run_vllm):
    # a long node TTL keeps the dead node's objects listed, so B really tries (and fails) to read
    pool = make_pool(num_nodes=1, master_args=("--node-ttl-s", "600"))
    p = prompt(100, seed=5)
    a = run_vllm("A", pool.address, [{"prompts": [p], "max_tokens": 8}])
    pool.nodes[0].kill()
    # one reader per load mode, both at once: they only read, and the dead node stays dead
    waits = {load_async: run_vllm.start(f"B-{'async' if load_async else 'sync'}", pool.address,
                                        [{"prompts": [p], "max_tokens": 8}], extra_config={"load_async": load_async},
                                        **on_core(int(load_async)))
             for load_async in (True, False)}  # fmt: skip
    for load_async, wait in waits.items():
        b = wait()
        assert counters(b, 0)["vllm:kvpool_load_failed_blocks"] == 3, load_async  # reported; vLLM recomputed them
        if load_async:  # the failure was known before the request was first scheduled
            assert only(b, 0)["num_cached_tokens"] == 0
        assert_same_answer(only(b, 0), only(a, 0))


def test_works_inside_multiconnector_next_to_example_connector(make_pool, run_vllm, tmp_path):
    pool = make_pool(num_nodes=1)
    p = prompt(100, seed=6)
    example_dir = tmp_path / "example-kv"
    example_dir.mkdir()
    result = run_vllm("multi", pool.address, [
        {"prompts": [p], "max_tokens": 6},
        {"prompts": [p], "max_tokens": 6, "reset_prefix_cache": True},
    ], multi_example_dir=str(example_dir), extra_config={"load_async": True})  # fmt: skip
    assert counters(result, 0)["vllm:kvpool_saved_blocks"] >= 3
    assert any(example_dir.iterdir())  # the other connector saved too
    assert only(result, 1)["num_cached_tokens"] == 3 * BLOCK_SIZE  # the first child (the pool) loaded
    assert counters(result, 1)["vllm:kvpool_loaded_blocks"] == 3
    assert_same_answer(only(result, 1), only(result, 0))


def test_unreachable_master_degrades_to_no_pool_and_recovers(tmp_path, run_vllm):
    from kvpool.bench import procs

    port = procs.free_port()
    address = f"tcp://127.0.0.1:{port}"
    p, q = prompt(100, seed=7), prompt(100, seed=8)
    go = tmp_path / "master-is-back"
    wait = run_vllm.start("degraded", address, [
        {"prompts": [p], "max_tokens": 4, "signal_file": str(tmp_path / "phase0-done")},
        {"prompts": [q], "max_tokens": 4, "reset_prefix_cache": True, "wait_file": str(go)},
        {"prompts": [q], "max_tokens": 4, "reset_prefix_cache": True},
    ], extra_config={"timeout_s": 0.5, "retry_initial_s": 0.2, "retry_max_s": 1.0})  # fmt: skip
    deadline = time.monotonic() + 300
    while not (tmp_path / "phase0-done").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    master = procs.start_master(tmp_path / "pool", "--port", str(port))
    node = procs.start_node(tmp_path / "pool", address, "64MiB")
    try:
        go.touch()
        result = wait()
    finally:
        node.stop()
        master.stop()
    assert counters(result, 0)["vllm:kvpool_pool_unavailable"] >= 1  # no master: served without the pool
    assert only(result, 0)["num_cached_tokens"] == 0 and len(only(result, 0)["token_ids"]) == 4
    assert counters(result, 1).get("vllm:kvpool_saved_blocks", 0) >= 3  # the master is back: saves resume
    assert only(result, 2)["num_cached_tokens"] == 3 * BLOCK_SIZE  # and loads
    assert_same_answer(only(result, 2), only(result, 1))


def test_embedded_node_makes_one_vllm_and_a_master_a_pool(make_pool, run_vllm):
    pool = make_pool(num_nodes=0)
    p = prompt(100, seed=9)
    result = run_vllm("embedded", pool.address, [
        {"prompts": [p], "max_tokens": 4},
        {"prompts": [p], "max_tokens": 4, "reset_prefix_cache": True},
    ], extra_config={"pool_memory_bytes": "16MiB"}, wait_embedded_node_s=60)  # fmt: skip
    assert counters(result, 0)["vllm:kvpool_saved_blocks"] == 3
    assert only(result, 1)["num_cached_tokens"] == 3 * BLOCK_SIZE
    assert_same_answer(only(result, 1), only(result, 0))


def test_flipped_bits_in_the_pool_are_recomputed_never_served(make_pool, run_vllm):
    pool = make_pool(num_nodes=1)
    p = prompt(100, seed=12)
    a = run_vllm("writer", pool.address, [{"prompts": [p], "max_tokens": 6}])
    b = run_vllm("reader", pool.address, [
        {"prompts": [p], "max_tokens": 6, "flip_prompt": p},
    ], extra_config={"load_async": False})  # fmt: skip
    assert b["phases"][0]["corrupted_objects"] == 3
    reread = only(b, 0)
    # the pool said "hit", every read failed its checksum: vLLM was told and recomputed all of it
    assert counters(b, 0)["vllm:kvpool_load_failed_blocks"] == 3
    assert counters(b, 0).get("vllm:kvpool_loaded_blocks", 0) == 0
    assert_same_answer(reread, only(a, 0))


def test_a_per_process_block_hash_seed_is_refused_at_start(make_pool, run_vllm):
    pool = make_pool(num_nodes=1)
    with pytest.raises(AssertionError) as failed:  # the run exits non-zero; its log says what to set
        run_vllm("xxhash", pool.address, [{"prompts": [prompt(40, seed=13)], "max_tokens": 1}],
                 prefix_caching_hash_algo="xxhash", unset_env=["PYTHONHASHSEED"])
    assert "PYTHONHASHSEED is not set" in str(failed.value) and "0 % cross-instance hits" in str(failed.value)
