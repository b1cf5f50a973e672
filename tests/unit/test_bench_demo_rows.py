"""The demo's comparison rows and the router counters read from its /metrics."""

from kvpool.bench.demo import RunOutcome, router_counters
from kvpool.bench.demo_cli import COLUMNS, comparison_rows

METRICS = """# HELP kvpool_router_retries_total x
kvpool_router_retries_total{reason="connect"} 2.0
kvpool_router_retries_total{reason="status"} 1.0
kvpool_router_decisions_total{policy="cache_aware",reason="local"} 7.0
kvpool_router_decisions_total{policy="cache_aware",reason="cold"} 3.0
kvpool_router_backend_failures_total{backend="http://a"} 2.0
kvpool_router_pool_index_keys{state="placed"} 12.0
kvpool_router_pool_index_keys{state="pending"} 1.0
"""


def summary(p50, p99, local_hits, pool_hits, error=0, skipped=0):
    return {"ttft_s": {"p50": p50, "p99": p99}, "e2e_s": {"p50": 2 * p50}, "throughput_tok_s": {"total": 1000.0},
            "hit_rate": {"local": local_hits / 100}, "requests": {"error": error, "skipped": skipped},
            "server_counters": {"external_hits": pool_hits, "local_queries": 100.0}}  # fmt: skip


def test_rows_per_run_with_the_ratio_to_row_one():
    outcomes = {"baseline": RunOutcome("baseline", summary=summary(2.0, 9.0, 30, 0, error=1, skipped=3)),
                "cache_aware": RunOutcome("cache_aware", summary=summary(0.1, 0.5, 60, 25)),
                "session": RunOutcome("session", error="could not start")}  # fmt: skip
    rows = comparison_rows(outcomes)
    assert all(len(r) == len(COLUMNS) for r in rows)
    assert rows[0] == ("1. round-robin, no pool", "2.000 s", "9.000 s", "4.000 s", "1000", "30.0 %", "-", "1 / 3", "-")
    assert rows[1] == ("5. cache_aware + pool", "0.100 s", "0.500 s", "0.200 s", "1000", "60.0 %", "25.0 %", "0 / 0",
                       "20.0x lower")  # fmt: skip
    assert rows[2][0] == "4. session + pool" and rows[2][-1] == "could not start"


def test_router_counters_sum_labels():
    c = router_counters(METRICS)
    assert (c["retries"], c["backend_failures"], c["decisions"]) == (3.0, 2.0, {"local": 7.0, "cold": 3.0})
    assert c["pool_keys_placed"] == 12.0
    assert router_counters(None) is None
