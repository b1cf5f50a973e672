"""`kvpool demo` as a process: any trace format is read, a missing one is one clear line."""


def test_demo_reads_any_trace_format_and_refuses_a_missing_one_clearly(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from kvpool.bench.demo import read_trace

    traces = Path(__file__).resolve().parents[1] / "data" / "traces"
    sessions = read_trace(traces / "claude-code")  # a directory of kv-cache-tester JSON files
    assert len(sessions) == 8 and {s.source for s in sessions} == {"claude-code"}
    out = subprocess.run([sys.executable, "-m", "kvpool", "demo", "--sessions-file", str(tmp_path / "none"),
                          "--workdir", str(tmp_path / "wd")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "cannot read --sessions-file" in out.stderr and "Traceback" not in out.stderr
