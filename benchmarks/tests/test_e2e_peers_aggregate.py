"""benchmarks/e2e_peers/aggregate.py: medians, spreads, the best LMCache configuration, ratios."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e_peers.aggregate import RunRecord, Spread, best_of, failures, ratios, spreads, usable  # noqa: E402


def _summary(p50: float, p99: float, tput: float, errors: int = 0, hit: float = 0.5) -> dict:
    return {"requests": {"ok": 10, "error": errors, "skipped": 0}, "ttft_s": {"p50": p50, "p90": p99 / 2, "p99": p99},
            "e2e_s": {"p50": p50 * 2}, "throughput_tok_s": {"total": tput},
            "hit_rate": {"combined": hit, "potential": 0.9}}  # fmt: skip


RUNS = [
    RunRecord("kvpool_rr", 0, _summary(0.2, 1.0, 300.0)),
    RunRecord("lmcache_shm", 0, _summary(0.4, 1.5, 200.0)),
    RunRecord("lmcache_redis", 0, _summary(0.6, 2.0, 150.0)),
    RunRecord("kvpool_rr", 1, _summary(0.3, 1.2, 330.0)),
    RunRecord("lmcache_shm", 1, _summary(0.3, 1.2, 220.0)),
    RunRecord("lmcache_redis", 1, None, error="did not start"),
    RunRecord("kvpool_rr", 2, _summary(0.25, 0.9, 310.0)),
    RunRecord("lmcache_shm", 2, _summary(0.5, 0.9, 100.0, errors=1)),  # a failed request: not counted
]


def test_spread_over_usable_runs_only():
    s = spreads(RUNS, "kvpool_rr")
    assert s["ttft_p50"] == Spread(0.25, 0.2, 0.3, 3)
    assert s["throughput"] == Spread(310.0, 300.0, 330.0, 3)
    assert spreads(RUNS, "lmcache_shm")["ttft_p50"] == Spread(0.35, 0.3, 0.4, 2)
    assert spreads(RUNS, "lmcache_redis")["ttft_p99"].count == 1
    assert spreads(RUNS, "nothing")["ttft_p50"] == Spread(None, None, None, 0)


def test_failed_runs_are_listed_not_averaged():
    assert [(r.config, r.round_index) for r in failures(RUNS)] == [("lmcache_redis", 1), ("lmcache_shm", 2)]
    assert not usable(RunRecord("x", 0, _summary(0.1, 0.1, 1.0), error="replay failed"))


def test_best_lmcache_has_lowest_median_p50():
    assert best_of(RUNS, ("lmcache_shm", "lmcache_redis")) == "lmcache_shm"
    assert best_of(RUNS, ("lmcache_shm", "lmcache_redis"), by="throughput") == "lmcache_shm"
    assert best_of(RUNS, ("absent",)) is None


def test_ratios_oriented_kvpool_better_above_one_and_paired_by_round():
    r = ratios(RUNS, "kvpool_rr", "lmcache_shm")
    assert r["ttft_p50"]["of_medians"] == pytest.approx(0.35 / 0.25)
    # rounds 0 and 1 pair up (round 2's LMCache run failed): 0.4/0.2 and 0.3/0.3
    assert r["ttft_p50"]["per_round"] == Spread(pytest.approx(1.5), pytest.approx(1.0), pytest.approx(2.0), 2)
    assert r["throughput"]["of_medians"] == pytest.approx(310.0 / 210.0)
    assert r["throughput"]["per_round"].low == pytest.approx(330.0 / 220.0)


def test_schedule_interleaves_rounds_and_rotates_the_order():
    from e2e_peers.run import schedule

    assert schedule(("a", "b", "c"), 2) == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a")]


@pytest.mark.parametrize("trace", ["demo", "long", "claude-code"])
def test_each_trace_preset_fits_the_model_and_goes_to_its_own_results(trace, tmp_path):
    from e2e_peers import run

    from kvpool.bench.demo import Demo, DemoConfig

    args = run.parse_args(["--trace", trace])
    assert args.out_dir.parent.name == "e2e_peers" and args.out_dir.name.endswith(f"-{trace}")
    config = DemoConfig(num_sessions=args.sessions, scale=args.scale, max_turns=args.max_turns,
                        sessions_file=args.sessions_file, sessions_scale=args.sessions_scale, workdir=tmp_path)
    sessions = Demo(config).sessions()
    longest = max(len(t.block_ids) * s.block_size + t.tail_tokens + t.output_tokens
                  for s in sessions for t in s.turns)  # fmt: skip
    assert longest <= args.max_model_len
    assert args.max_model_len * 2048 <= 0.9 * args.kv_cache_mib  # vLLM must fit one request of max-model-len
    if trace == "claude-code":
        assert (len(sessions), sum(len(s.turns) for s in sessions)) == (8, 305)  # every call of the six files
    if trace == "long":  # the trace's distinct KV (bf16 tiny model: 2 KiB per token) exceeds the pool
        distinct = sum(len({b for t in s.turns for b in t.block_ids}) * s.block_size for s in sessions)
        assert distinct * 2048 > 2 * args.extra_mib
    assert run.parse_args(["--trace", trace, "--scale", "0.1"]).scale == 0.1  # explicit options win


def test_profile_shares_count_a_sample_once_however_deep_it_recurs(tmp_path):
    from e2e_peers import profile

    path = tmp_path / "p.txt"
    path.write_text("main (a.py:1);load (c.py:9);load (c.py:9) 3\nmain (a.py:1);forward (m.py:2) 6\nidle (b.py:1) 1\n")
    shares = profile.summarize(profile.read_collapsed(path), {"load": ("load (",), "forward": ("forward",),
                                                              "main": ("main",)})
    assert shares == {"load": 0.3, "forward": 0.6, "main": 0.9}


def test_each_goal_is_checked_against_the_lmcache_configuration_best_on_that_metric():
    from e2e_peers.report import goal_lines

    runs = [RunRecord("kvpool_cache_aware", 0, _summary(0.2, 1.0, 300.0, hit=0.895)),
            RunRecord("lmcache_shm", 0, _summary(0.4, 1.5, 250.0)),  # the best throughput
            RunRecord("lmcache_redis", 0, _summary(0.3, 0.9, 100.0))]  # the best P50 and P99
    lines = goal_lines(runs)
    assert "LMCache MP per server + Redis): ratio of medians 1.50x" in lines[0] and lines[0].endswith("-> met")
    assert "LMCache MP, shared memory): ratio of medians 1.20x" in lines[1] and lines[1].endswith("NOT met")
    assert "per server + Redis): ratio of medians 0.90x" in lines[2] and lines[2].endswith("NOT met")
    assert lines[3].endswith("89.5 % of 90.0 % -> met")
