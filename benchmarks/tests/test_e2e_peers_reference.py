"""benchmarks/e2e_peers against the reference: its configurations, the broken-harness check, the
like-for-like goals and the report lines they make."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e_peers import report  # noqa: E402
from e2e_peers.aggregate import RunRecord  # noqa: E402
from e2e_peers.configs import CONFIGS, MOONCAKE_CONFIGS, OFFLOAD_CONFIGS, SERVER_PATH, Setup  # noqa: E402
from e2e_peers.run import harness_problem  # noqa: E402


def _summary(p50: float, p99: float, tput: float, hit: float = 0.88, external: float | None = 0.4) -> dict:
    return {"requests": {"ok": 10, "error": 0, "skipped": 0}, "ttft_s": {"p50": p50, "p90": p99 / 2, "p99": p99},
            "e2e_s": {"p50": p50 * 2}, "throughput_tok_s": {"total": tput},
            "hit_rate": {"combined": hit, "potential": 0.89, "external": external}}  # fmt: skip


def test_a_mooncake_run_without_external_hits_is_a_broken_harness():
    assert harness_problem("mooncake_store", _summary(1.0, 2.0, 100.0, external=0.0)).startswith("broken harness")
    assert harness_problem("mooncake_store_cache_aware", _summary(1.0, 2.0, 100.0, external=None))
    assert harness_problem("mooncake_store", _summary(1.0, 2.0, 100.0)) is None
    assert harness_problem("kvpool_rr", _summary(1.0, 2.0, 100.0, external=0.0)) is None  # its own checks elsewhere


def test_the_reference_configurations_and_their_routers():
    assert MOONCAKE_CONFIGS == ("mooncake_store", "mooncake_store_cache_aware")
    assert OFFLOAD_CONFIGS == ("vllm_offload", "vllm_offload_cache_aware")
    assert CONFIGS["mooncake_store"].policy == CONFIGS["kvpool_rr"].policy == "round_robin"
    assert CONFIGS["mooncake_store_cache_aware"].policy == CONFIGS["kvpool_cache_aware"].policy == "cache_aware"
    # the servers' PYTHONPATH holds the shim only (a module named like the stdlib's would shadow it)
    assert sorted(p.name for p in SERVER_PATH.glob("*.py")) == ["mooncake_cpu_shim.py"]


def test_mooncake_is_skipped_with_its_reason_when_not_installed():
    setup = Setup(model_dir=Path("m"), kv_cache_bytes=1, extra_bytes_per_server=1, mooncake_master=None)
    assert "not installed" in CONFIGS["mooncake_store"].problem(setup)
    assert CONFIGS["mooncake_store"].problem(Setup(Path("m"), 1, 1, mooncake_master=Path("/bin/true"))) is None


def test_pair_goals_need_more_throughput_only_on_the_long_trace():
    assert dict((m, x) for m, x, _ in report.pair_goals("demo")) == {"ttft_p50": 1.3, "ttft_p99": 1.0, "throughput": 1.0}
    assert dict((m, x) for m, x, _ in report.pair_goals("long"))["throughput"] == 1.3


def test_pair_lines_compare_like_for_like_and_say_what_is_met():
    runs = [RunRecord("kvpool_rr", k, _summary(0.5, 2.0, 110.0)) for k in range(2)]
    runs += [RunRecord("mooncake_store", k, _summary(0.8, 1.9, 100.0)) for k in range(2)]
    runs += [RunRecord("kvpool_cache_aware", 0, _summary(0.4, 1.0, 120.0, hit=0.80))]
    lines = report.pair_lines(runs, "demo")
    same_router = next(ln for ln in lines if ln.startswith(f"- {CONFIGS['kvpool_rr'].label} vs"))
    assert "P50 TTFT >= 1.3x lower: 1.60x" in same_router and "1.60x) met" in same_router
    assert "P99 TTFT no worse: 0.95x" in same_router and "NOT met" in same_router
    best = next(ln for ln in lines if ln.startswith(f"- {CONFIGS['kvpool_cache_aware'].label} vs"))
    assert "each with its best router" in best and "P50 TTFT >= 1.3x lower: 2.00x" in best
    # no cache_aware reference run: no such pair
    assert not any("the same cache_aware router" in ln for ln in lines)
    hits = [ln for ln in lines if "hit rate" in ln]
    assert any("88.0 % of a potential 89.0 %" in ln and "met" in ln and "NOT" not in ln for ln in hits)
    assert any("80.0 %" in ln and "NOT met" in ln for ln in hits)



def test_counters_are_summed_over_servers_and_label_sets():
    from e2e_peers import breakdown

    a = ('# HELP vllm:kvpool_lookups_total x\nvllm:kvpool_lookups_total{engine="0"} 10.0\n'
         'vllm:kvpool_lookups_deferred_total{engine="0"} 4.0\nvllm:external_prefix_cache_hits_total{a="1"} 256.0\n')
    b = 'vllm:kvpool_lookups_total{engine="0"} 5.0\nvllm:external_prefix_cache_hits_total{a="2"} 128.0\n'
    assert breakdown.counters([a, None, b]) == {"lookups": 15.0, "lookups_deferred": 4.0, "external_hits": 384.0}


def test_mooncake_operations_fill_the_load_and_save_columns():
    from e2e_peers import breakdown

    text = ('vllm:mooncake_store_operation_time_seconds_sum{engine="0",operation="load_get",status="ok"} 0.6\n'
            'vllm:mooncake_store_operation_time_seconds_count{engine="0",operation="load_get",status="ok"} 20.0\n'
            'vllm:mooncake_store_operation_time_seconds_sum{engine="0",operation="save_exists",status="ok"} 9.0\n'
            'vllm:mooncake_store_operation_time_seconds_count{engine="0",operation="save_exists",status="ok"} 9.0\n'
            'vllm:mooncake_store_operation_time_seconds_sum{engine="0",operation="save_put",status="ok"} 1.0\n'
            'vllm:mooncake_store_operation_time_seconds_count{engine="0",operation="save_put",status="ok"} 10.0\n'
            'vllm:request_queue_time_seconds_sum{engine="0"} 2.0\nvllm:request_queue_time_seconds_count{engine="0"} 4.0\n')
    means = breakdown.merge([text])
    assert means["pool_load"]["mean_s"] == 0.03 and means["pool_save"]["mean_s"] == 0.1
    assert means["queue"]["mean_s"] == 0.5 and "pool_lookup" not in means
