"""Prompt building for the replay, the potential-hit ledger, and vLLM counter parsing (pure)."""

import pytest

from kvpool.bench.prompts import PrefixLedger, SessionPrompts, TokenSpace
from kvpool.bench.server_metrics import CacheCounters, parse_counters, total_delta
from kvpool.workload.model import Session, Turn

BS = 16


def make_session(sid: str, turns: list[list[int]], tails: list[int] | None = None, shared: int = 0) -> Session:
    tails = tails or [0] * len(turns)
    return Session(sid, BS, [Turn(ids, tail, output_tokens=4) for ids, tail in zip(turns, tails)],
                   shared_prefix_blocks=shared)  # fmt: skip


def test_tokens_are_deterministic_in_range_and_scoped():
    space = TokenSpace(vocab_size=50, seed=1)
    a = space.block("s1", 7, BS)
    assert a == TokenSpace(vocab_size=50, seed=1).block("s1", 7, BS)
    assert len(a) == BS and all(3 <= t < 50 for t in a)
    assert a != space.block("s2", 7, BS)  # block ids are local to a session
    assert a != space.block("s1", 8, BS)
    assert a != TokenSpace(vocab_size=50, seed=2).block("s1", 7, BS)
    assert space.block(None, 7, BS) == space.block(None, 7, BS)


def test_bad_token_space_is_rejected():
    with pytest.raises(ValueError):
        TokenSpace(vocab_size=3)


def test_turn_extends_previous_prompt_with_returned_output():
    s = make_session("s", [[1, 2], [1, 2, 3, 4], [1, 2, 3, 4]], tails=[3, 5, 0])
    p = SessionPrompts(s, TokenSpace(1000))
    first = p.next_prompt(0, None)
    assert len(first) == 2 * BS + 3
    out = [900, 901, 902, 903]
    second = p.next_prompt(1, out)
    assert second[: len(first)] == first and second[len(first) : len(first) + 4] == out
    assert len(second) == 4 * BS + 5  # the trace's length: new tokens = target - prompt - output
    third = p.next_prompt(2, [7, 7])
    assert third[: len(second) + 2] == second + [7, 7]
    assert len(third) == len(second) + 2 + 1  # the trace asks for fewer: still one new token


def test_shared_prefix_blocks_match_across_sessions_and_the_rest_does_not():
    space = TokenSpace(1000)
    a = SessionPrompts(make_session("a", [[10, 11, 12]], shared=2), space).next_prompt(0, None)
    b = SessionPrompts(make_session("b", [[10, 11, 12]], shared=2), space).next_prompt(0, None)
    assert a[: 2 * BS] == b[: 2 * BS] and a[2 * BS :] != b[2 * BS :]


def test_partial_overlap_keeps_only_the_shared_part_and_disjoint_starts_over():
    s = make_session("s", [[1, 2, 3], [1, 2, 9, 9], [5]])
    p = SessionPrompts(s, TokenSpace(1000))
    first = p.next_prompt(0, None)
    second = p.next_prompt(1, [1, 1, 1])
    assert second[: 2 * BS] == first[: 2 * BS] and second[2 * BS : 3 * BS] != first[2 * BS :]
    assert len(second) == 4 * BS
    third = p.next_prompt(2, [1])
    assert len(third) == BS and third[:BS] != first[:BS]


def test_ledger_counts_leading_blocks_and_never_the_last_token():
    ledger = PrefixLedger(block_size=4)
    prompt = list(range(10))
    assert ledger.hit_tokens(prompt) == 0
    ledger.add(prompt)
    assert ledger.hit_tokens(prompt) == 8  # 2 full blocks; the partial third one is not cached
    assert ledger.hit_tokens(list(range(8))) == 4  # whole-prompt hit leaves the last token (its block) to compute
    assert ledger.hit_tokens(prompt + [99] * 6) == 8
    assert ledger.hit_tokens([42] + prompt) == 0  # prefix identity is positional


METRICS = """# HELP vllm:prefix_cache_queries Prefix cache queries
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 1000.0
vllm:prefix_cache_queries_created{engine="0",model_name="tiny"} 1.79e+09
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 250.0
vllm:external_prefix_cache_queries_total{engine="0",model_name="tiny"} 750.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="tiny"} 600.0
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 1000.0
garbage line
vllm:kvpool_loaded_blocks_total{engine="0",model_name="tiny"} 3.0
vllm:kvpool_load_failed_blocks_total{engine="0",model_name="tiny"} 2.0
vllm:prefix_cache_hits_total{engine="1",model_name="tiny"} 50.0
"""


def test_parse_counters_sums_label_sets_and_ignores_created_and_junk():
    c = parse_counters(METRICS)
    assert c is not None
    assert (c.local_queries, c.local_hits, c.external_queries, c.external_hits) == (1000, 300, 750, 600)
    rates = c.hit_rates()
    assert rates["local"] == pytest.approx(0.3)
    assert rates["external"] == pytest.approx(0.8)
    assert rates["combined"] == pytest.approx(0.9)
    assert (c.pool_loaded_blocks, c.pool_load_failed_blocks) == (3, 2)
    assert c.hit_rates(block_size=100)["combined_loaded"] == pytest.approx((300 + 600 - 200) / 1000)
    assert rates["combined_loaded"] is None  # unknown without the block size


def test_no_vllm_counters_is_none_not_zero():
    assert parse_counters("proxy_requests_total 5\n") is None
    assert total_delta([CacheCounters()], [None]) is None
    assert CacheCounters().hit_rates(16) == {"local": None, "external": None, "combined": None, "combined_loaded": None}


def test_sessions_with_one_id_scope_share_block_tokens():
    space = TokenSpace(1000)
    a = Session("a", BS, [Turn([5, 6], 0, 1)], id_scope="trace")
    b = Session("b", BS, [Turn([5, 7], 0, 1)], id_scope="trace")
    pa, pb = SessionPrompts(a, space).next_prompt(0, None), SessionPrompts(b, space).next_prompt(0, None)
    assert pa[:BS] == pb[:BS] and pa[BS:] != pb[BS:]
