"""Replay summaries and the demo's side-by-side table on hand-made records (known answers)."""

import pytest

from kvpool.bench.demo import RunOutcome
from kvpool.bench.demo_cli import comparison_rows
from kvpool.bench.replay import ReplayConfig, ReplayResult, RequestRecord
from kvpool.bench.reports import percentiles, summarize, summary_markdown
from kvpool.bench.server_metrics import CacheCounters


def record(turn: int, ttft: float, prompt: int = 100, out: int = 3, cached: int = 0, status: str = "ok") -> RequestRecord:
    return RequestRecord(session_id=f"s{turn % 2}", turn_index=turn, endpoint="http://x", start_s=0.0,
                         prompt_tokens=prompt, output_tokens_planned=out, ideal_cached_tokens=prompt // 2,
                         ttft_s=ttft, e2e_s=ttft + 0.1, itl_s=[0.05] * (out - 1), output_tokens=out,
                         cached_tokens=cached, status=status)  # fmt: skip


def result(records, counters=None, duration=10.0) -> ReplayResult:
    return ReplayResult(ReplayConfig(endpoints=("http://x",)), "tiny", 2048, 0.0, duration, records, counters,
                        planned_requests=len(records) + 1)  # fmt: skip


def test_percentiles_known_values_and_empty():
    p = percentiles([1.0, 2.0, 3.0, 4.0, 5.0])
    assert p["p50"] == 3.0 and p["max"] == 5.0 and p["mean"] == 3.0
    assert p["p90"] == pytest.approx(4.6)
    assert percentiles([])["p50"] is None


def test_summary_counts_only_successful_requests():
    recs = [record(0, 1.0, cached=0), record(1, 0.1, cached=50), record(1, 0.3, cached=50),
            record(2, 9.0, status="error")]  # fmt: skip
    counters = CacheCounters(local_queries=300, local_hits=60, external_queries=240, external_hits=120)
    s = summarize(result(recs, counters))
    assert s["requests"] == {"planned": 5, "ok": 3, "error": 1, "skipped": 0, "sessions": 2}
    assert s["tokens"] == {"input": 300, "output": 9}
    assert s["throughput_tok_s"]["input"] == pytest.approx(30.0)
    assert s["ttft_s"]["p50"] == pytest.approx(0.3) and s["ttft_s"]["max"] == pytest.approx(1.0)
    assert s["itl_s"]["p50"] == pytest.approx(0.05)
    assert s["ttft_by_turn_s"][1]["count"] == 2 and s["ttft_by_turn_s"][1]["p50"] == pytest.approx(0.2)
    assert 2 not in s["ttft_by_turn_s"]
    assert s["hit_rate"]["local"] == pytest.approx(0.2)
    assert s["hit_rate"]["external"] == pytest.approx(0.5)
    assert s["hit_rate"]["combined"] == pytest.approx(0.6)
    assert s["hit_rate"]["usage"] == pytest.approx(100 / 300)
    assert s["hit_rate"]["potential"] == pytest.approx(0.5)
    md = summary_markdown(s)
    assert "3 of 5 requests ok (1 failed" in md and "| TTFT |" in md


def test_unknown_counters_stay_unknown():
    s = summarize(result([record(0, 1.0)], counters=None))
    assert s["hit_rate"]["local"] is None and s["server_counters"] is None
    assert "n/a" in summary_markdown(s)


def test_comparison_table_ratios():
    base = RunOutcome("baseline", summary=summarize(result([record(0, 2.0), record(1, 4.0)], duration=10.0)))
    pool = RunOutcome("pool", summary=summarize(result([record(0, 0.1), record(1, 0.3)], duration=5.0)))
    rows = {r[0]: r for r in comparison_rows({"baseline": base, "pool": pool})}  # one row per run
    assert rows["1. round-robin, no pool"][1] == "3.000 s" and rows["1. round-robin, no pool"][-1] == "-"
    assert rows["3. round-robin + pool"][1] == "0.200 s" and rows["3. round-robin + pool"][-1] == "15.0x lower"
    missing = {r[0]: r for r in comparison_rows({"baseline": base, "pool": RunOutcome("pool", error="no connector")})}
    assert missing["3. round-robin + pool"][1] == "n/a" and missing["3. round-robin + pool"][-1] == "no connector"
