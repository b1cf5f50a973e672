"""`kvpool trace ...` as a user runs it: a real subprocess per command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvpool.workload.model import read_sessions

TRACES = Path(__file__).parents[1] / "data" / "traces"


def kvpool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpool", "trace", *args], capture_output=True, text=True, timeout=120)


def test_synth_then_analyze_json_and_plots(tmp_path: Path):
    out = tmp_path / "codex.jsonl"
    r = kvpool("synth", "--profile", "codex", "--sessions", "8", "--scale", "0.02", "--seed", "1", "-o", str(out))
    assert r.returncode == 0, r.stderr
    sessions = read_sessions(out)
    assert len(sessions) == 8

    plots = tmp_path / "plots"
    r = kvpool("analyze", str(out), "--json", "--plots", str(plots))
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)  # stdout carries only the JSON
    assert stats["num_sessions"] == 8
    assert stats["num_turns"] == sum(len(s.turns) for s in sessions)
    assert stats["input_tokens"] == sum(s.total_input_tokens for s in sessions)
    assert 0.5 < stats["global_hits"]["token_hit_rate"] < 1
    for name in ("trace_context.png", "trace_think_time.png", "trace_turns.png", "trace_hits.png"):
        assert (plots / name).read_bytes()[:4] == b"\x89PNG"


def test_convert_directory_and_table(tmp_path: Path):
    out = tmp_path / "cc.jsonl"
    r = kvpool("convert", str(TRACES / "claude-code"), "-o", str(out))
    assert r.returncode == 0, r.stderr
    sessions = read_sessions(out)
    raw = [json.loads(p.read_text()) for p in sorted((TRACES / "claude-code").glob("*.json"))]
    assert len(sessions) == len(raw) + sum(d["totals"]["subagent_count"] for d in raw)
    assert sum(s.total_input_tokens for s in sessions) == sum(d["totals"]["combined_tokens"]["input"] for d in raw)

    r = kvpool("analyze", str(out))
    assert r.returncode == 0, r.stderr
    assert "potential hit rate" in r.stdout and "input:output ratio" in r.stdout


def test_bad_input_is_one_clear_line_and_writes_nothing(tmp_path: Path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}\n')
    out = tmp_path / "out.jsonl"
    r = kvpool("convert", str(bad), "-o", str(out))
    assert r.returncode == 2
    assert "bad.jsonl: request 0: input_length=600 needs" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()
    r = kvpool("analyze", str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "no such file" in r.stderr
    r = kvpool("synth", "--sessions", "0", "-o", str(out))
    assert r.returncode == 2 and "num_sessions" in r.stderr


def test_help_explains_every_option():
    for action in ("convert", "synth", "analyze"):
        r = kvpool(action, "--help")
        assert r.returncode == 0
        options = [line.split()[0] for line in r.stdout.splitlines() if line.strip().startswith("--")]
        assert options, r.stdout
    r = kvpool("synth", "--help")
    for option in ("--profile", "--sessions", "--scale", "--block-size", "--seed"):
        assert option in r.stdout
