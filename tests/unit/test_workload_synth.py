"""Synthetic sessions: the published statistics within tolerance, exact structure, determinism."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.workload.analysis import analyze
from kvpool.workload.synth import SynthConfig, synth_sessions

SCALE = 0.05


@pytest.fixture(scope="module")
def codex():
    return synth_sessions(SynthConfig(profile="codex", num_sessions=300, scale=SCALE, seed=3))


def test_codex_matches_published_statistics(codex):
    stats = analyze(codex)
    turns = np.array([len(s.turns) for s in codex])
    assert abs(np.median(turns) - 30) <= 2  # LLM calls per trace: median 30
    assert abs(turns.mean() - 33) <= 2  # ... mean 33
    assert stats.input_output_ratio == pytest.approx(131, rel=0.08)
    assert stats.think_time_s.p50 == pytest.approx(5.2, rel=0.1)  # tool time median 5.2 s
    assert stats.think_time_s.p99 == pytest.approx(81.4, rel=0.3)  # ... P99 81.4 s
    assert stats.new_tokens_per_turn.mean == pytest.approx(2200 * SCALE, rel=0.1)  # ~2.2K per call
    assert stats.first_turn_input_tokens.p50 == pytest.approx(12000 * SCALE, rel=0.1)  # ~12K ...
    assert stats.last_turn_input_tokens.p50 == pytest.approx(80000 * SCALE, rel=0.15)  # ... -> ~80K
    assert 0.9 < stats.global_hits.token_hit_rate < 0.98  # the provider saw 94.2 %


def test_each_turn_extends_the_previous_prompt_and_its_answer(codex):
    for session in codex[:50]:
        for prev, turn in zip(session.turns, session.turns[1:]):
            prev_tokens = session.input_tokens(prev)
            assert session.input_tokens(turn) >= prev_tokens + prev.output_tokens
            full_before = prev_tokens // session.block_size
            assert turn.block_ids[:full_before] == prev.block_ids[:full_before]
            assert turn.think_time_s > 0 and turn.start_offset_s > prev.start_offset_s
    shared = codex[0].shared_prefix_blocks
    assert shared == round(4096 * SCALE) // 16
    assert all(s.turns[0].block_ids[:shared] == list(range(shared)) for s in codex)
    private = [set(b for t in s.turns for b in t.block_ids[shared:]) for s in codex[:20]]
    assert all(not (x & y) for i, x in enumerate(private) for y in private[i + 1:])  # unique across sessions


def test_seed_scaleout_is_exact():
    (session,) = synth_sessions(SynthConfig(profile="seed-scaleout", num_sessions=1, scale=0.1, block_size=16))
    inputs = [session.input_tokens(t) for t in session.turns]
    assert len(inputs) == 30
    assert inputs[0] == 2000 + 1000  # 20K common prefix + 10K first input, scaled
    assert set(np.diff(inputs)) == {90 + 205}  # the 900-token answer + 2,048 new tokens, scaled
    assert {t.output_tokens for t in session.turns} == {90}
    assert {t.think_time_s for t in session.turns} == {0.0}
    assert session.shared_prefix_blocks == 2000 // 16


def test_seeded_and_prefix_stable():
    small = synth_sessions(SynthConfig(num_sessions=3, scale=0.02, seed=5))
    large = synth_sessions(SynthConfig(num_sessions=6, scale=0.02, seed=5))
    other = synth_sessions(SynthConfig(num_sessions=3, scale=0.02, seed=6))
    assert small == large[:3]
    assert small != other


@pytest.mark.parametrize(
    "kwargs, message",
    [({"profile": "nope"}, "unknown profile"), ({"num_sessions": 0}, "num_sessions"),
     ({"scale": 0}, "scale"), ({"block_size": 0}, "block_size"), ({"seed": -1}, "seed")],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SynthConfig(**kwargs)
