"""The fleet simulator on small traces: exact agreement with `kvpool trace analyze` when nothing is
ever evicted, exact block-cache order, and the scheduler's invariants (every turn served once,
KV blocks all returned, preemption under pressure, the pool raising hits)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from kvpool.sim.config import FleetConfig, PoolConfig, SchedulerConfig
from kvpool.sim.cost import StepCost
from kvpool.sim.fleet import Fleet, simulate
from kvpool.sim.hardware import ACCELERATORS, MODELS
from kvpool.sim.kvcache import BlockCache
from kvpool.sim.metrics import summarize
from kvpool.workload.analysis import analyze
from kvpool.workload.formats import load_trace
from kvpool.workload.synth import SynthConfig, synth_sessions

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces" / "claude-code"


def _spaced(sessions, gap_s=1e7):
    """Sessions far apart in time: the simulator serves them in the order analyze counts them."""
    return [msgspec.structs.replace(s, trace_offset_s=i * gap_s) for i, s in enumerate(sessions)]


def _unbounded(block_tokens: int, pool: bool = False, instances: int = 1) -> FleetConfig:
    return FleetConfig(
        name="unbounded", model="llama-8b", accelerator="h100", num_instances=instances,
        kv_capacity_tokens=10**9,
        scheduler=SchedulerConfig(block_tokens=block_tokens, recompute_last_token=False, cache_decode_kv=False),
        pool=PoolConfig(capacity_bytes=float("inf") if pool else 0.0),
    )


def _hit_tokens(result) -> tuple[int, int]:
    return (sum(r.local_hit_tokens + r.pool_hit_tokens for r in result.records),
            sum(r.prompt_tokens for r in result.records))


@pytest.mark.parametrize("pool", [False, True])
def test_unbounded_hit_rate_equals_trace_analyze_on_synthetic_codex(pool):
    sessions = _spaced(synth_sessions(SynthConfig(profile="codex", num_sessions=6, block_size=16, scale=0.25, seed=3)))
    stats = analyze(sessions)
    # with the pool, 3 instances round-robin: a session's turns land on different instances and
    # only the pool can serve them, so the pool alone must reach the potential
    result = simulate(_unbounded(16, pool=pool, instances=3 if pool else 1), sessions)
    assert result.unfinished == 0
    assert _hit_tokens(result) == (stats.global_hits.hit_tokens, stats.global_hits.total_tokens)


def test_unbounded_hit_rate_equals_trace_analyze_on_claude_code():
    sessions = _spaced(load_trace(TRACES / "trace_0038.json"))
    stats = analyze(sessions)
    result = simulate(_unbounded(64), sessions)
    assert _hit_tokens(result) == (stats.global_hits.hit_tokens, stats.global_hits.total_tokens)


def test_block_cache_evicts_free_blocks_oldest_first_and_tails_before_heads():
    cache = BlockCache(4)
    cache.allocate(3)
    cache.register([1, 2, 3])  # one request computed the chain 1 -> 2 -> 3
    cache.release([1, 2, 3], 0)  # tail first into the LRU: 3, 2, 1
    assert list(cache.lru) == [3, 2, 1] and cache.free_blocks == 4
    assert cache.prefix_hit([1, 2, 3], 3) == 3 and cache.probe([1, 2, 3, 4]) == 3
    cache.acquire([1])  # a hit on the head holds it
    cache.allocate(2)  # 1 held + 2 new + 2 cached would be 5 > 4: the oldest free block (3) goes
    assert list(cache.lru) == [2] and cache.evictions == 1 and 3 not in cache.ref
    with pytest.raises(ValueError):
        cache.allocate(2)


def test_register_shares_a_block_another_request_computed_meanwhile():
    cache = BlockCache(8)
    cache.allocate(2)
    cache.register([7, 8])  # request A
    cache.allocate(2)
    cache.register([7, 9])  # request B computed 7 too: shares A's, frees its duplicate
    assert cache.used == 3 and cache.ref == {7: 2, 8: 1, 9: 1}


def test_every_turn_served_once_and_blocks_returned_under_kv_pressure():
    sessions = synth_sessions(SynthConfig(profile="seed-scaleout", num_sessions=6, block_size=64, scale=0.05))
    config = FleetConfig(model="llama-8b", accelerator="h100", num_instances=2, kv_capacity_tokens=12_000,
                         scheduler=SchedulerConfig(block_tokens=64, max_num_batched_tokens=2048))
    fleet = Fleet(config, sessions)
    result = fleet.run()
    assert result.unfinished == 0
    served = sorted((r.session_index, r.turn_index) for r in result.records)
    assert served == sorted((i, t) for i, s in enumerate(sessions) for t in range(len(s.turns)))
    assert result.preemptions > 0  # 3 sessions of up to ~6K tokens on 12K tokens of KV
    for inst in fleet.instances:
        assert inst.cache.used == 0 and not inst.running and not inst.waiting
    for r in result.records:
        assert r.arrival_s <= r.first_token_s <= r.finish_s


@pytest.mark.parametrize("observed_wait", [True, False])
def test_cache_aware_routing_sees_how_long_each_instance_has_left_a_request_waiting(observed_wait):
    sessions = synth_sessions(SynthConfig(profile="seed-scaleout", num_sessions=6, block_size=64, scale=0.05))
    config = FleetConfig(model="llama-8b", accelerator="h100", num_instances=2, kv_capacity_tokens=12_000,
                         router="cache_aware", observed_wait=observed_wait,
                         scheduler=SchedulerConfig(block_tokens=64, max_num_batched_tokens=2048))
    fleet = Fleet(config, sessions)
    seen: list[float] = []
    choose = fleet.policy.choose

    def spy(request, views):
        seen.extend(v.oldest_wait_s for v in views)
        return choose(request, views)

    fleet.policy.choose = spy
    result = fleet.run()
    assert result.unfinished == 0
    assert all(not inst.unanswered for inst in fleet.instances)  # every request's first token ends its wait
    if observed_wait:  # KV pressure queues requests: some arrival sees an instance with one waiting
        assert max(seen) > 0
    else:
        assert set(seen) == {0.0}


def test_late_binding_holds_requests_until_an_instance_has_room():
    sessions = synth_sessions(SynthConfig(profile="seed-scaleout", num_sessions=6, block_size=64, scale=0.05))
    config = FleetConfig(model="llama-8b", accelerator="h100", num_instances=2, kv_capacity_tokens=12_000,
                         router="cache_aware", max_waiting=1, pool=PoolConfig(capacity_bytes=1e12),
                         scheduler=SchedulerConfig(block_tokens=64, max_num_batched_tokens=2048))
    fleet = Fleet(config, sessions)
    held, send = [], fleet._send

    def spy(req, now_s):
        held.append(now_s - req.arrival_s)
        send(req, now_s)
        assert all(len(inst.unanswered) <= 1 for inst in fleet.instances)  # never more than N waiting there

    fleet._send = spy
    result = fleet.run()
    assert result.unfinished == 0 and not fleet.held
    assert max(held) > 0  # some requests waited at the router
    for r in result.records:
        assert r.arrival_s <= r.first_token_s  # TTFT counts the time held


def test_pool_turns_round_robin_misses_into_hits_and_faster_first_tokens():
    # think times desynchronise the sessions, so round-robin scatters each one's turns
    sessions = synth_sessions(SynthConfig(profile="codex", num_sessions=8, block_size=64, scale=0.25))
    base = dict(model="llama-8b", accelerator="h100", num_instances=4, kv_capacity_tokens=40_000,
                scheduler=SchedulerConfig(block_tokens=64))
    without = summarize(simulate(FleetConfig(**base), sessions))
    with_pool = summarize(simulate(FleetConfig(**base, pool=PoolConfig(capacity_bytes=1e12)), sessions))
    assert with_pool.hit_rate > without.hit_rate + 0.3
    assert with_pool.pool_hit_rate > 0 and without.pool_hit_rate == 0
    assert with_pool.ttft_p50_s < without.ttft_p50_s


def test_disaggregated_fleet_serves_every_turn_with_first_token_from_decode():
    sessions = synth_sessions(SynthConfig(profile="seed-scaleout", num_sessions=4, block_size=64, scale=0.05))
    config = FleetConfig(model="llama-8b", accelerator="h100", disaggregated=True, kv_capacity_tokens=100_000,
                         scheduler=SchedulerConfig(block_tokens=64), pool=PoolConfig(capacity_bytes=1e12))
    result = simulate(config, sessions)
    assert result.unfinished == 0 and result.num_devices == 2
    assert all(r.instance.startswith("prefill") for r in result.records)
    assert summarize(result).hit_rate > 0.5


def test_roofline_decode_is_bandwidth_bound_and_prefill_compute_bound():
    cost = StepCost(MODELS["llama-70b"], ACCELERATORS["h100"], 4)
    acc = ACCELERATORS["h100"]
    weights_s = MODELS["llama-70b"].weight_bytes / (acc.memory_bandwidth_bytes_s * acc.bandwidth_efficiency * 4)
    assert cost.decode_s(1, 1000) == pytest.approx(weights_s + acc.step_overhead_s, rel=0.01)
    # prefill: time per token grows with the context (attention), and 8K tokens cost far more than 1 decode
    assert cost.prefill_s(1024, 64_000) / 1024 > cost.prefill_s(1024, 0) / 1024 * 1.5
    assert cost.prefill_s(8192) > 20 * cost.decode_s(1, 1000)


def test_config_errors_say_what_to_change():
    with pytest.raises(ValueError, match="devices_per_instance"):
        FleetConfig(model="llama-70b", accelerator="h100", devices_per_instance=1)
    with pytest.raises(ValueError, match="multiple of the trace"):
        Fleet(FleetConfig(scheduler=SchedulerConfig(block_tokens=100)), synth_sessions(SynthConfig(num_sessions=1)))


def test_cli_runs_configurations_side_by_side_and_writes_reports(tmp_path, capsys):
    from kvpool.cli import main

    code = main(["sim", "--sessions", "3", "--scale", "0.1", "--instances", "2", "--kv-tokens", "20000",
                 "--router", "round_robin", "--router", "session", "--pool-gb", "0", "--pool-gb", "10",
                 "-o", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "sim_report.json").read_text())
    assert [s["name"] for s in report["summaries"]] == [
        "round_robin, no pool", "round_robin, pool 10 GB", "session, no pool", "session, pool 10 GB"]
    assert (tmp_path / "sim_report.png").stat().st_size > 0
    assert "| P50 TTFT |" in (tmp_path / "sim_report.md").read_text()
    assert main(["sim", "--pool-gb", "-1"]) == 2
    assert "--pool-gb must be >= 0" in capsys.readouterr().err


def test_a_small_pool_evicts_through_the_master_and_serves_less_than_a_large_one():
    sessions = synth_sessions(SynthConfig(profile="codex", num_sessions=8, block_size=64, scale=0.25))
    base = dict(model="llama-8b", accelerator="h100", num_instances=4, kv_capacity_tokens=40_000,
                scheduler=SchedulerConfig(block_tokens=64))
    kv_block = 64 * MODELS["llama-8b"].kv_bytes_per_token
    small = simulate(FleetConfig(**base, pool=PoolConfig(capacity_bytes=300 * kv_block, num_nodes=2)), sessions)
    large = simulate(FleetConfig(**base, pool=PoolConfig(capacity_bytes=1e12)), sessions)
    assert small.pool_evictions > 0 and large.pool_evictions == 0
    assert 0 < summarize(small).pool_hit_rate < summarize(large).pool_hit_rate
