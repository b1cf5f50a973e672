"""Unbounded-cache hit rates and shape statistics on hand-made traces with answers worked out here."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.workload.analysis import PrefixCache, _common_prefix, analyze
from kvpool.workload.model import Session, Turn

BS = 4


def _hand_trace() -> list[Session]:
    # A and B share a 2-block system prompt (ids 0, 1); their id 10 is private to each.
    a = Session("A", BS, [Turn([0, 1, 10, 11], 2, 3), Turn([0, 1, 10, 11, 12, 13], 1, 5, start_offset_s=2.0, think_time_s=2.0)],
                shared_prefix_blocks=2)
    b = Session("B", BS, [Turn([0, 1, 10, 20], 0, 2), Turn([0, 1, 10, 20, 21], 3, 2, start_offset_s=4.0, think_time_s=4.0)],
                shared_prefix_blocks=2, trace_offset_s=1.0)
    # C and D share a scope (a Claude Code parent and subagent); E has the same numbers, privately.
    c = Session("C", BS, [Turn([5, 6, 7], 0, 1)], id_scope="file", trace_offset_s=0.5)
    d = Session("D", BS, [Turn([5, 6, 8], 0, 1)], id_scope="file", parent_session_id="C", trace_offset_s=0.7)
    e = Session("E", BS, [Turn([5, 6, 7], 0, 1)], trace_offset_s=0.8)
    return [a, b, c, d, e]


def test_hit_rates_by_hand():
    stats = analyze(_hand_trace())
    # global, in time order: A0 0 | C 0 | D 2 (C's 5,6) | E 0 | B0 2 (system prompt) | A1 4 | B1 4
    hit_blocks = 0 + 0 + 2 + 0 + 2 + 4 + 4
    total_blocks = 4 + 6 + 4 + 5 + 3 + 3 + 3
    total_tokens = (4 * 4 + 2) + (6 * 4 + 1) + 16 + (5 * 4 + 3) + 12 * 3
    assert stats.global_hits.hit_blocks == hit_blocks == 12
    assert stats.global_hits.total_blocks == total_blocks == 28
    assert stats.global_hits.hit_tokens == hit_blocks * BS
    assert stats.global_hits.total_tokens == total_tokens == 118
    assert stats.global_hits.token_hit_rate == pytest.approx(48 / 118)
    # each session alone: only A1 and B1 hit their own first turns
    assert stats.session_hits.hit_blocks == 8
    assert stats.session_hits.token_hit_rate == pytest.approx(32 / 118)

    per = {s.session_id: s for s in stats.sessions}
    assert per["B"].global_hits.hit_blocks == 6 and per["B"].session_hits.hit_blocks == 4
    assert per["D"].global_hits.hit_blocks == 2 and per["E"].global_hits.hit_blocks == 0
    assert stats.num_subagent_sessions == 1


def test_shape_statistics_by_hand():
    stats = analyze(_hand_trace())
    assert stats.input_tokens == 118 and stats.output_tokens == 3 + 5 + 2 + 2 + 1 + 1 + 1
    assert stats.input_output_ratio == pytest.approx(118 / 15)
    assert stats.turns_per_session.p50 == 1 and stats.turns_per_session.mean == pytest.approx(7 / 5)
    assert stats.think_time_s.count == 2 and stats.think_time_s.p50 == pytest.approx(3.0)
    assert stats.new_tokens_per_turn.count == 2 and stats.new_tokens_per_turn.mean == 7  # 25-18, 23-16
    assert stats.first_turn_input_tokens.max == 18 and stats.last_turn_input_tokens.max == 25


def test_totals_do_not_depend_on_session_order():
    sessions = _hand_trace()
    expected = analyze(sessions).global_hits
    rng = random.Random(7)
    for _ in range(5):
        shuffled = [s for s in sessions]
        rng.shuffle(shuffled)
        # same times: the order only breaks ties, and tie order must not change the totals
        flat = [Session(s.session_id, s.block_size, s.turns, shared_prefix_blocks=s.shared_prefix_blocks,
                        id_scope=s.id_scope) for s in shuffled]
        assert analyze(flat).global_hits.hit_blocks == 12 == expected.hit_blocks


def test_empty_trace_has_no_rates():
    stats = analyze([])
    assert stats.global_hits.token_hit_rate is None and stats.turns_per_session is None


def _naive_hits(sessions: list[Session]) -> int:
    seen: set[tuple] = set()
    hits = 0
    order = sorted((s.trace_offset_s + t.start_offset_s, si, ti) for si, s in enumerate(sessions) for ti, t in enumerate(s.turns))
    for _, si, ti in order:
        s = sessions[si]
        ids = s.turns[ti].block_ids
        keys = [(tuple(s.block_scope(j) for j in range(i + 1)), tuple(ids[: i + 1])) for i in range(len(ids))]
        n = 0
        while n < len(keys) and keys[n] in seen:
            n += 1
        hits += n
        seen.update(keys)
    return hits


chains = st.lists(st.lists(st.integers(0, 3), max_size=8), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(chains, st.integers(0, 2), st.sampled_from([None, "x"])), min_size=1, max_size=4))
def test_matches_a_naive_prefix_set(spec):
    sessions = [
        Session(f"s{i}", 2, [Turn(ids, 0, 1, start_offset_s=float(k)) for k, ids in enumerate(turns)],
                shared_prefix_blocks=shared, id_scope=scope)
        for i, (turns, shared, scope) in enumerate(spec)
    ]
    assert analyze(sessions).global_hits.hit_blocks == _naive_hits(sessions)


@given(st.lists(st.integers(0, 2), max_size=12), st.lists(st.integers(0, 2), max_size=12))
def test_common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    assert _common_prefix(a, b) == n


def test_prefix_cache_reuses_the_previous_turn():
    s = Session("s", 4, [])
    cache = PrefixCache()
    hit, nodes = cache.add(s, [1, 2, 3])
    assert hit == 0 and len(cache) == 3
    hit, nodes2 = cache.add(s, [1, 2, 4, 5], known=([1, 2, 3], nodes))
    assert hit == 2 and nodes2[:2] == nodes[:2] and len(cache) == 5
