"""Replay bookkeeping against a small local server: a failed turn ends its session and the rest
are counted as skipped (no turn vanishes), the session id header is sent, and Ctrl-C writes the
partial results with the unfinished turns counted as skipped."""

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time

from router_fakes import FakeBackend

from kvpool.bench.replay import ReplayConfig, replay
from kvpool.bench.reports import summarize
from kvpool.workload.model import Session, Turn, write_sessions

BS = 16


def sessions(num_sessions=3, num_turns=4) -> list[Session]:
    return [Session(f"s{i}", BS, [Turn(list(range(1, k + 2)), tail_tokens=3, output_tokens=4) for k in range(num_turns)])
            for i in range(num_sessions)]  # fmt: skip


class BackendThread:
    """A FakeBackend served from its own thread and event loop (replay runs its own loop)."""

    def __init__(self, **kw) -> None:
        self.backend = FakeBackend("a", **kw)
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        def serve():
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.backend.start())
            ready.set()
            self.loop.run_forever()

        threading.Thread(target=serve, daemon=True).start()
        ready.wait(10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.backend.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def test_a_failed_turn_ends_its_session_and_the_rest_is_skipped():
    server = BackendThread(fail_from_request=5)  # requests 0-4 ok, then 500s
    try:
        result = replay(sessions(), ReplayConfig(endpoints=(server.backend.url,), time_scale=0, concurrency=1))
    finally:
        server.stop()
    by_session = {s: [r.status for r in result.records if r.session_id == s] for s in ("s0", "s1", "s2")}
    assert by_session == {"s0": ["ok"] * 4, "s1": ["ok", "error", "skipped", "skipped"],
                          "s2": ["error", "skipped", "skipped", "skipped"]}  # fmt: skip
    assert all("session ended: turn" in r.error for r in result.records if r.status == "skipped")
    summary = summarize(result)["requests"]
    assert summary["ok"] + summary["error"] + summary["skipped"] == summary["planned"] == 12
    assert (summary["error"], summary["skipped"]) == (2, 5)
    assert [r["headers"].get("x-session-id") for r in server.backend.requests[:5]] == ["s0"] * 4 + ["s1"]


def test_ctrl_c_writes_partial_results(tmp_path):
    server = BackendThread(num_tokens=40, token_delay_s=0.1)  # 4 s a request
    trace = tmp_path / "sessions.jsonl"
    write_sessions(trace, sessions(num_sessions=2, num_turns=3))
    out = tmp_path / "out"
    try:
        proc = subprocess.Popen([sys.executable, "-m", "kvpool", "bench", "replay", "--sessions", str(trace),
                                 "--endpoint", server.backend.url, "--time-scale", "0", "--output-dir", str(out)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        deadline = time.monotonic() + 60
        while len(server.backend.requests) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(server.backend.requests) == 2  # both sessions' first turns are in flight
        proc.send_signal(signal.SIGINT)
        stdout, _ = proc.communicate(timeout=60)
    finally:
        server.stop()
    assert proc.returncode == 130, stdout[-2000:]
    assert "interrupted" in stdout
    data = json.loads((out / "replay.json").read_text())
    statuses = [r["status"] for r in data["records"]]
    assert statuses == ["skipped"] * 6  # the 2 in flight and the 4 not sent, none vanished
    assert all("interrupted" in r["error"] for r in data["records"])
    assert data["summary"]["interrupted"] is True
