"""`kvpool demo` smoke runs: a tiny trace through round-robin without and with the pool, and
clean-up on SIGTERM."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm


def processes_using(path: Path) -> list[int]:
    """Live processes whose command line or environment mentions `path` (vLLM's spawned workers
    only carry it in their environment: TMPDIR)."""
    needle = str(path).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "cmdline").read_bytes() or needle in (entry / "environ").read_bytes():
                if b"State:\tZ" not in (entry / "status").read_bytes():
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def demo(tmp_path: Path, vllm_cache_root: Path, *args: str) -> subprocess.Popen:
    # the demo keeps one vLLM cache per server index in its workdir; start those from what the
    # session's vLLMs learned (model-class info: else each server inspects it in a subprocess that
    # imports vLLM again), as a second demo in the same workdir would
    modelinfos = vllm_cache_root / "modelinfos"
    if modelinfos.is_dir():
        for i in range(2):
            shutil.copytree(modelinfos, tmp_path / "work" / f"vllm-cache-{i}" / "modelinfos")
    return subprocess.Popen(
        [sys.executable, "-m", "kvpool", "demo", "--quick", "--workdir", str(tmp_path / "work"),
         "--output-dir", str(tmp_path / "out"), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def test_quick_demo_runs_both_halves_and_cleans_up(tmp_path, vllm_cache_root):
    proc = demo(tmp_path, vllm_cache_root, "--runs", "baseline,pool")
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:]
    assert "results in" in out and "round-robin" in out  # rich wraps the table to the pipe's 80 columns

    summary = json.loads((tmp_path / "out" / "demo_summary.json").read_text())
    base, pool = summary["runs"]["baseline"], summary["runs"]["pool"]
    assert base["error"] is None and pool["error"] is None
    for run in (base, pool):
        req = run["summary"]["requests"]
        assert req["ok"] == req["planned"] == 4, run
        assert run["summary"]["server_counters"]["prompt_tokens"] == run["summary"]["tokens"]["input"]
    assert base["summary"]["server_counters"]["external_queries"] == 0  # no connector in the baseline
    # round-robin sends each turn to the other server: only the pool can serve the previous turn there
    assert pool["summary"]["server_counters"]["external_hits"] > 0
    assert pool["summary"]["hit_rate"]["combined"] > base["summary"]["hit_rate"]["combined"]
    assert pool["summary"]["hit_rate"]["combined"] <= pool["summary"]["hit_rate"]["potential"] + 1e-9

    for run in (base, pool):
        assert run["summary"]["router"]["decisions"] == {"next": 4.0}  # the router's own count, round-robin
    # the router follows the master: the pool's keys meet the blocks of vLLM's own KV events
    assert pool["summary"]["router"]["pool_keys_placed"] > 0
    assert base["summary"]["router"]["pool_keys_placed"] == 0
    table = (tmp_path / "out" / "demo_table.md").read_text()
    assert "| run | TTFT P50 | TTFT P99 |" in table and "| 3. round-robin + pool |" in table
    assert (tmp_path / "out" / "demo_ttft.png").stat().st_size > 1000
    records = json.loads((tmp_path / "out" / "demo_records.json").read_text())
    assert set(records) == {"baseline", "pool"} and len(records["pool"]["records"]) == 4
    assert processes_using(tmp_path / "work") == []


def test_sigterm_stops_every_process(tmp_path, vllm_cache_root):
    proc = demo(tmp_path, vllm_cache_root, "--only", "baseline")  # SIGTERM while the servers start: no results, exit 130
    log = tmp_path / "work" / "baseline" / "vllm0.log"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if log.exists() and "EngineCore" in log.read_text(errors="replace"):
            break  # the server has spawned its engine process: a tree to clean up
        time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()[0][-3000:]
    assert processes_using(tmp_path / "work")  # servers are up or starting
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-3000:]
    assert "interrupted" in out
    deadline = time.monotonic() + 30
    while processes_using(tmp_path / "work") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_using(tmp_path / "work") == []
