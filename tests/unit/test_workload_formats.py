"""Trace readers on the vendored sample traces: counts and token sums computed here from the raw JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvpool.workload.errors import TraceFormatError
from kvpool.workload.formats import detect_format, load_trace, parse_claude_code, parse_mooncake
from kvpool.workload.model import Session, Turn, read_sessions, write_sessions
from kvpool.workload.multiturn import MultiturnConfig, parse_vllm_multiturn

TRACES = Path(__file__).parents[1] / "data" / "traces"
CLAUDE_FILES = sorted((TRACES / "claude-code").glob("*.json"))
MOONCAKE_FILES = sorted((TRACES / "mooncake-fast25").glob("*.jsonl"))


def _raw_claude_requests(requests: list) -> tuple[list[dict], list[dict]]:
    """(the parent's own requests, the subagent entries), straight from the JSON."""
    own = [r for r in requests if "requests" not in r]
    subs = [r for r in requests if "requests" in r]
    return own, subs


def test_sample_traces_are_vendored_with_licenses():
    assert len(CLAUDE_FILES) == 6 and len(MOONCAKE_FILES) == 2
    assert (TRACES / "claude-code" / "LICENSE").is_file()
    assert (TRACES / "mooncake-fast25" / "LICENSE").is_file()


@pytest.mark.parametrize("path", CLAUDE_FILES, ids=lambda p: p.stem)
def test_claude_code_counts_and_token_sums(path: Path):
    raw = json.loads(path.read_text())
    own, subs = _raw_claude_requests(raw["requests"])
    sessions = load_trace(path)
    assert detect_format(path) == "claude-code"

    parent = sessions[0]
    assert parent.session_id == raw["id"] and parent.parent_session_id is None
    assert len(parent.turns) == len(own)
    assert parent.total_input_tokens == sum(r["in"] for r in own)
    assert parent.total_output_tokens == sum(r["out"] for r in own)
    assert [t.think_time_s for t in parent.turns] == [float(r["think_time"]) for r in own]
    assert [t.start_offset_s for t in parent.turns] == [float(r["t"]) for r in own]
    assert [t.block_ids for t in parent.turns] == [r["hash_ids"] for r in own]

    children = sessions[1:]
    assert len(children) == len(subs) == raw["totals"]["subagent_count"]
    for child, sub in zip(children, subs):
        assert child.parent_session_id == parent.session_id
        assert child.session_id == f"{raw['id']}/{sub['agent_id']}"
        assert child.trace_offset_s == pytest.approx(sub["t"])
        assert len(child.turns) == len(sub["requests"])
        assert child.total_input_tokens == sum(r["in"] for r in sub["requests"])
    # the file's own totals agree with ours (parent and subagents both)
    assert parent.total_input_tokens == raw["totals"]["parent_tokens"]["input"]
    assert sum(c.total_input_tokens for c in children) == raw["totals"]["subagent_tokens"]["input"]
    assert len({s.id_scope for s in sessions}) == 1  # ids are local to the file, shared inside it
    assert all(0 <= t.tail_tokens < 64 for s in sessions for t in s.turns)


@pytest.mark.parametrize("path", MOONCAKE_FILES, ids=lambda p: p.stem)
def test_mooncake_counts_and_token_sums(path: Path):
    raw = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    sessions = load_trace(path)
    assert detect_format(path) == "mooncake"
    assert len(sessions) == len(raw)
    assert all(len(s.turns) == 1 and s.block_size == 512 for s in sessions)
    assert sum(s.total_input_tokens for s in sessions) == sum(r["input_length"] for r in raw)
    assert sum(s.total_output_tokens for s in sessions) == sum(r["output_length"] for r in raw)
    assert sum(len(s.turns[0].block_ids) for s in sessions) == sum(r["input_length"] // 512 for r in raw)
    assert sessions[-1].trace_offset_s == pytest.approx(raw[-1]["timestamp"] / 1000)
    assert len({s.id_scope for s in sessions}) == 1  # global ids: one scope


def test_published_mooncake_sizes():
    """The notes' published figures: 12,031 and 3,993 requests, mean inputs 12,035 and 15,325."""
    conv, synth = (load_trace(p) for p in MOONCAKE_FILES)
    assert len(conv) == 12031 and len(synth) == 3993
    assert sum(s.total_input_tokens for s in conv) / len(conv) == pytest.approx(12035, abs=1)
    assert sum(s.total_input_tokens for s in synth) / len(synth) == pytest.approx(15325, abs=1)


def test_claude_code_subagent_nesting_and_errors():
    doc = {
        "id": "x",
        "block_size": 4,
        "requests": [
            {"t": 0, "in": 9, "out": 2, "hash_ids": [1, 2], "think_time": 0},
            {"t": 5, "type": "subagent", "agent_id": "a1", "requests": [{"t": 0, "in": 4, "out": 1, "hash_ids": [7]}]},
            {"t": 9, "in": 13, "out": 3, "hash_ids": [1, 2, 3], "think_time": 4},
        ],
    }
    parent, child = parse_claude_code(doc, "f")
    assert [t.tail_tokens for t in parent.turns] == [1, 1]
    assert child.session_id == "x/a1" and child.parent_session_id == "x" and child.trace_offset_s == 5
    assert child.turns == [Turn(block_ids=[7], tail_tokens=0, output_tokens=1)]

    doc["requests"][0]["in"] = 20  # 2 blocks of 4 cannot hold 20 tokens
    with pytest.raises(TraceFormatError, match="request 0.*in=20"):
        parse_claude_code(doc, "f")
    with pytest.raises(TraceFormatError, match="requests"):
        parse_claude_code({"id": "x"}, "f")


def test_mooncake_drops_the_partial_last_block_and_checks_counts():
    (s,) = parse_mooncake([{"timestamp": 1500, "input_length": 1100, "output_length": 7, "hash_ids": [4, 5, 6]}], "m")
    assert s.turns[0].block_ids == [4, 5] and s.turns[0].tail_tokens == 76 and s.trace_offset_s == 1.5
    with pytest.raises(TraceFormatError, match="request 0: input_length=1100 needs .*3 hash_ids, got 2"):
        parse_mooncake([{"timestamp": 0, "input_length": 1100, "output_length": 7, "hash_ids": [4, 5]}], "m")


def test_vllm_multiturn_prompts_contain_the_history():
    system = "You are a careful coding agent. " * 20
    doc = [
        {"id": "c1", "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "u" * 400},
            {"role": "assistant", "content": "a" * 200},
            {"role": "user", "content": "v" * 300},
        ]},
        {"id": "c2", "messages": [{"role": "system", "content": system}, {"role": "user", "content": "w" * 100},
                                  {"role": "assistant", "content": "b" * 8}]},
    ]
    config = MultiturnConfig(block_size=16, chars_per_token=4)
    c1, c2 = parse_vllm_multiturn(doc, "conv", config)
    t0, t1 = c1.turns
    text0 = f"<|system|>\n{system}\n<|user|>\n{'u' * 400}\n"
    text1 = text0 + f"<|assistant|>\n{'a' * 200}\n<|user|>\n{'v' * 300}\n"
    assert c1.input_tokens(t0) == math.ceil(len(text0) / 4)
    assert c1.input_tokens(t1) == math.ceil(len(text1) / 4)
    assert t0.output_tokens == 50 and t1.output_tokens == config.missing_output_tokens
    assert t1.block_ids[: len(t0.block_ids)] == t0.block_ids  # turn 2 re-sends turn 1 and the answer
    shared = len(f"<|system|>\n{system}\n") // (16 * 4)  # blocks made of the system prompt alone
    assert shared >= 2
    assert c2.turns[0].block_ids[:shared] == t0.block_ids[:shared]  # same text, same ids, one scope
    assert c1.id_scope == c2.id_scope
    assert c2.turns[0].block_ids[shared:] != t0.block_ids[shared: len(c2.turns[0].block_ids)]


def test_vllm_multiturn_rejects_generator_configs_and_bad_messages(tmp_path: Path):
    with pytest.raises(TraceFormatError, match="generator config"):
        parse_vllm_multiturn({"filetype": "generate_conversations"}, "g", MultiturnConfig())
    with pytest.raises(TraceFormatError, match="conversation 0 message 0"):
        parse_vllm_multiturn([{"messages": [{"role": "user", "content": ["img"]}]}], "g", MultiturnConfig())
    path = tmp_path / "conv.json"
    path.write_text(json.dumps([{"id": 1, "messages": [{"role": "user", "content": "hi"}]}], indent=2))
    assert detect_format(path) == "vllm-multiturn"
    (s,) = load_trace(path)
    assert s.session_id == "conv/1"


def test_unknown_format_and_broken_json_are_clear(tmp_path: Path):
    odd = tmp_path / "odd.jsonl"
    odd.write_text('{"foo": 1}\n')
    with pytest.raises(TraceFormatError, match="cannot tell the format"):
        detect_format(odd)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{"timestamp": \n')
    with pytest.raises(TraceFormatError, match="broken.jsonl:2"):
        load_trace(broken)


def test_jsonl_round_trip_keeps_every_field(tmp_path: Path):
    sessions = load_trace(CLAUDE_FILES[-1]) + load_trace(MOONCAKE_FILES[1])[:50]
    sessions.append(Session("s", 16, [Turn([1, 2], 3, 4, 1.5, 0.5)], source="synth", shared_prefix_blocks=1))
    out = tmp_path / "s.jsonl"
    assert write_sessions(out, sessions) == len(sessions)
    again = read_sessions(out)
    assert again == sessions
    assert load_trace(out) == sessions and detect_format(out) == "kvpool"


def test_scale_session_keeps_the_sharing_and_shrinks_tokens():
    from kvpool.workload.model import Session, Turn, scale_session

    s = Session("s", 64, [Turn([1, 2], 40, 300), Turn([1, 2, 3], 10, 1)])
    small = scale_session(s, 1 / 32)
    assert small.block_size == 2 and [t.block_ids for t in small.turns] == [[1, 2], [1, 2, 3]]
    assert [(t.tail_tokens, t.output_tokens) for t in small.turns] == [(1, 9), (0, 1)]
    assert [small.input_tokens(t) for t in small.turns] == [5, 6]
    with pytest.raises(ValueError):
        scale_session(s, 0)
