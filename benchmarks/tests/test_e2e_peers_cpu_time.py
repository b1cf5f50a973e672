"""benchmarks/e2e_peers/cpu_time.py: CPU seconds per process and thread, read from /proc."""

import subprocess
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e_peers.cpu_time import Timeline, report_lines, snapshot, usage  # noqa: E402
from e2e_peers.profile import py_spy  # noqa: E402

# a parent that idles and a child with one thread spinning under a pool-style name
CHILD = textwrap.dedent("""
    import threading, time
    def spin():
        end = time.monotonic() + 60
        while time.monotonic() < end:
            pass
    threading.Thread(target=spin, name="kvpool-save_0", daemon=True).start()
    print("ready", flush=True)
    time.sleep(60)
""")
PARENT = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {CHILD!r}]); time.sleep(60)"


def test_a_busy_named_thread_of_a_child_process_is_charged_to_its_root():
    parent = subprocess.Popen([sys.executable, "-c", PARENT])
    try:
        time.sleep(1.5)  # the child has started its thread
        before = snapshot({"server": parent.pid})
        time.sleep(1.0)
        rows = usage(before, snapshot({"server": parent.pid}, names=True))
    finally:
        subprocess.run(["pkill", "-P", str(parent.pid)])
        parent.kill()
    busiest = rows[0]
    assert busiest["label"] == "server"
    assert busiest["thread"] == ("kvpool-save" if py_spy() else "python")  # Python's name, through py-spy
    assert 0.5 < busiest["cpu_s"] < 1.6  # one core for the second between the snapshots
    assert sum(r["cpu_s"] for r in rows[1:]) < 0.5  # the sleeping main threads


def test_report_takes_medians_over_rounds_per_configuration():
    def run(rnd: int, save_s: float) -> dict:
        cpu = [{"label": "vllm0", "process": "VLLM::EngineCore", "thread": "MainThread", "cpus": "0", "cpu_s": 50.0},
               {"label": "vllm0", "process": "VLLM::EngineCore", "thread": "kvpool-save", "cpus": "0",
                "cpu_s": save_s}]  # fmt: skip
        return {"config": "kv", "label": "kvpool", "round": rnd, "cpu": cpu, "replay_wall_s": 100.0, "error": None}

    text = "\n".join(report_lines([run(0, 1.0), run(1, 3.0), run(2, 8.0)]))
    assert "| vllm0 / VLLM::EngineCore / kvpool-save | 0 | 3.0 |" in text
    assert "53 CPU-s in a 100 s replay" in text
    assert report_lines([{"config": "kv", "error": "did not start"}]) == []


def test_timeline_samples_each_period_what_each_thread_spent():
    parent = subprocess.Popen([sys.executable, "-c", PARENT])
    try:
        time.sleep(1.0)
        with Timeline({"server": parent.pid}, period_s=0.3) as timeline:
            time.sleep(1.0)
    finally:
        subprocess.run(["pkill", "-P", str(parent.pid)])
        parent.kill()
    assert len(timeline.samples) >= 2
    for at_s, spent in timeline.samples:
        busy = max(spent.items(), key=lambda kv: kv[1])
        assert busy[0].startswith("server / python /") and 0.1 < busy[1] <= 0.45  # the spinning thread
