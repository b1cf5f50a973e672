"""kvpool end to end against the reference (vLLM + MooncakeStoreConnector), vLLM's own CPU offloading,
LMCache and plain vLLM on agent workloads.

    benchmarks/run.py e2e_peers [--trace demo|long|claude-code] [--rounds 3] [--configs NAME,...] \\
        [--resume] [--out-dir DIR]

Results: a folder benchmarks/results/e2e_peers/DATE-MACHINE-TRACE/ (runs/*.json, summary.json,
results.md, e2e_peers.png) and LATEST.md. Run it alone on the machine.

See `--help` for what each configuration is. Method:
- The same trace (the demo's synthesized Codex-like sessions, or --sessions-file), the same model
  (the demo's tiny seeded Llama), the same two vLLM-CPU servers behind `kvpool router`, the same
  replay client (kvpool.bench.replay), the same extra memory for every configuration.
- Each run starts its configuration's processes, replays the whole trace once, reads the servers'
  counters and stops every process. Rounds: every configuration once per round, the order rotated
  by one each round, so a configuration's runs and its ratio to another come from the same minutes
  of a shared machine. Medians and min-max over rounds are reported (benchmarks/e2e_peers/aggregate.py).
- Each finished run is saved at once under OUT/runs/, so `--resume` continues an interrupted or
  time-limited benchmark and `--report-only` rebuilds the report from what was saved.
- A configuration that cannot start (LMCache's venv cannot be made, redis-server missing, Mooncake
  not installable here, vLLM's offloading on a CPU build, a server dying) is reported with its
  reason and log tail and skipped; the rest go on. A Mooncake run whose servers show no external
  prefix-cache hit measured no store at all: it is reported as a broken harness, never averaged.
"""

from __future__ import annotations

import argparse
import json
import resource
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402

from e2e_peers import breakdown, cpu_time, lmcache_env, profile, report, tails  # noqa: E402
from e2e_peers.aggregate import RunRecord  # noqa: E402
import results_io  # noqa: E402
from e2e_peers.configs import (CONFIGS, LMCACHE_CONFIGS, MOONCAKE_CONFIGS, PeerUnavailable, Setup,  # noqa: E402
                               find_mooncake_master, find_redis_server)
from kvpool.bench import procs, reports  # noqa: E402
from kvpool.bench.cli import replay_with_progress  # noqa: E402
from kvpool.bench.demo import Demo, DemoConfig, _read_metrics  # noqa: E402
from kvpool.bench.replay import ReplayConfig  # noqa: E402

DEFAULT_WORKDIR = Path.home() / ".cache" / "kvpool" / "e2e-peers" / "work"
QUICK = {"num_sessions": 1, "max_turns": 4, "scale": 0.05, "time_scale": 0.0}
REPO = Path(__file__).resolve().parents[2]
# --trace presets: settings a trace needs unless given on the command line; results in a folder named after it
TRACES = {
    "demo": {},  # the demo's own: 12 Codex-like sessions x 12 turns, scale 0.25; the pool holds it all
    # longer contexts (up to 19.5K tokens, 1.4 M input tokens; 20480 still fits the 48 MiB of local
    # KV, 24576 does not) and a pool (2 x 96 MiB) smaller than
    # the trace's distinct KV (~162K tokens, ~316 MiB): eviction decides what hits
    "long": {"scale": 0.4, "extra_mib": 96 << 20, "max_model_len": 20480},
    # the six shared Claude Code traces (8 sessions incl. 2 subagents, 305 calls, 100K-450K-token
    # contexts) scaled x 0.03 to fit the tiny model's 16K context; think times x 0.002 (the longest,
    # 5.4 h, becomes 39 s)
    "claude-code": {"sessions_file": REPO / "tests" / "data" / "traces" / "claude-code",  # vendored copies
                    "sessions_scale": 0.03, "max_turns": 100, "time_scale": 0.002},
}


def _configs(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in CONFIGS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown {', '.join(bad) or '(none)'}; choose from {', '.join(CONFIGS)}")
    return names


def _mib(text: str) -> int:
    if int(text) < 1:
        raise argparse.ArgumentTypeError("must be >= 1 MiB")
    return int(text) * 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = DemoConfig()
    p = argparse.ArgumentParser(
        description="Replay the same agent trace through two vLLM-CPU servers behind `kvpool router` under "
        "each configuration, in interleaved rounds, and report hit rate (vs the potential), TTFT P50/P90/P99, "
        "end-to-end P50 and throughput as medians with min-max, kvpool's ratios to every peer and the "
        "like-for-like goals against the reference (vLLM + MooncakeStoreConnector; Mooncake's wheel is installed "
        "into this venv on first use if it changes nothing here). Configurations: " + "; ".join(f"{n}: {c.label}" for n, c in CONFIGS.items()) + ". "
        "Every configuration gets the same extra memory (--extra-mib per server): more local KV, LMCache's "
        "DRAM (one server, or one per vLLM plus Redis), each server's Mooncake global segment, vLLM's CPU "
        "offloading tier, or kvpool's pool segments. LMCache runs from its own "
        "venv, made on first use (several minutes, needs pip's index). Ctrl-C stops every process; finished "
        "runs are kept (--resume continues).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )  # fmt: skip
    p.add_argument("--configs", type=_configs, default=tuple(CONFIGS), metavar="NAME,...",
                   help=f"configurations to run, from {', '.join(CONFIGS)}")
    p.add_argument("--trace", choices=tuple(TRACES), default="demo",
                   help="a preset trace: demo (the demo's), long (longer contexts, a pool smaller than the "
                        "trace: eviction matters), claude-code (the shared Claude Code traces, scaled); the "
                        "results folder is named after it; explicit options override the preset")
    p.add_argument("--rounds", type=int, default=3, help="runs per configuration (one per round)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 1 session x 4 short turns, 1 round")
    p.add_argument("--sessions", type=int, default=d.num_sessions, help="sessions in the synthesized trace")
    p.add_argument("--max-turns", type=int, default=d.max_turns, help="turns per session at most")
    p.add_argument("--scale", type=float, default=d.scale, help="token counts as a fraction of the Codex profile's")
    p.add_argument("--time-scale", type=float, default=d.time_scale, help="think times x this (0 = none)")
    p.add_argument("--sessions-file", type=Path, default=None,
                   help="replay this trace instead: a sessions JSONL or what `kvpool trace convert` reads")
    p.add_argument("--sessions-scale", type=float, default=1.0, help="token counts of --sessions-file x this")
    p.add_argument("--seed", type=int, default=d.seed, help="trace and prompt seed")
    p.add_argument("--kv-cache-mib", type=_mib, default=d.kv_cache_bytes, metavar="MIB",
                   help="each vLLM server's own KV cache (small on purpose: the sessions do not fit)")
    p.add_argument("--extra-mib", type=_mib, default=d.pool_bytes_per_server, metavar="MIB",
                   help="extra memory per server, given to each configuration its own way")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len, help="vLLM --max-model-len")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="results: runs/*.json (one per run), summary.json, results.md, e2e_peers.png (default: "
                        "benchmarks/results/e2e_peers/DATE-MACHINE-TRACE/; with --resume or --report-only the "
                        "newest such folder of the trace)")
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="model, logs and scratch files")
    p.add_argument("--lmcache-venv", type=Path, default=lmcache_env.DEFAULT_DIR, help="LMCache's own venv")
    p.add_argument("--no-install", action="store_true", help="do not make LMCache's venv; skip LMCache if missing")
    p.add_argument("--resume", action="store_true", help="keep the runs already under OUT/runs/ and do the rest")
    p.add_argument("--report-only", action="store_true", help="rebuild the report from OUT/runs/; run nothing")
    p.add_argument("--stop-after-min", type=float, default=None,
                   help="start no new run after this many minutes (the report covers what finished)")
    p.add_argument("--load-note", default="", help="what else ran on the machine, for the report")
    p.add_argument("--profile", action="store_true",
                   help="sample each vLLM server with py-spy during the replay into OUT/profiles/ (costs a few "
                        "percent: give profiled runs their own --out-dir)")
    preset = TRACES[p.parse_known_args(argv)[0].trace]
    p.set_defaults(**{("sessions" if k == "num_sessions" else k): v for k, v in preset.items()})
    args = p.parse_args(argv)
    if args.out_dir is None:
        earlier = results_io.newest("e2e_peers", args.trace) if args.resume or args.report_only else None
        args.out_dir = earlier or results_io.result_files("e2e_peers", args.trace).run_folder
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.quick:
        args.rounds = 1
        for key, value in QUICK.items():
            setattr(args, {"num_sessions": "sessions"}.get(key, key), value)
    return args


def schedule(configs: tuple[str, ...], rounds: int) -> list[tuple[int, str]]:
    """(round, config) in run order: each round every configuration, the order rotated by one."""
    return [(k, configs[(i + k) % len(configs)]) for k in range(rounds) for i in range(len(configs))]


def run_path(out_dir: Path, round_index: int, config: str) -> Path:
    return out_dir / "runs" / f"r{round_index}-{config}.json"


def load_runs(out_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out_dir / "runs").glob("r*-*.json"))]


def run_one(name: str, round_index: int, setup: Setup, sessions, args, workdir: Path, console: Console) -> dict:
    peer = CONFIGS[name]
    out = {"config": name, "label": peer.label, "round": round_index, "machine_at_start": reports.machine(),
           "started_at": time.time(), "summary": None, "error": None, "memory": None, "startup_s": None}  # fmt: skip
    problem = peer.problem(setup)
    if problem is not None:
        out["error"] = problem
        return out
    t0 = time.monotonic()
    try:
        stack = peer.start(setup, workdir)
    except PeerUnavailable as e:
        out["error"] = str(e)
        return out
    try:
        out["startup_s"], out["memory"] = time.monotonic() - t0, stack.memory_note
        config = ReplayConfig(endpoints=(stack.router_url,), metrics_urls=tuple(stack.server_urls),
                              time_scale=args.time_scale, seed=args.seed, request_timeout_s=600.0)  # fmt: skip
        title = f"round {round_index + 1} {peer.label}"
        roots = {p.name: p.pid for p in stack.procs}
        cpu_before, self_before = cpu_time.snapshot(roots), resource.getrusage(resource.RUSAGE_SELF)
        replay_t0 = time.monotonic()
        timeline = cpu_time.Timeline(roots)
        if args.profile:
            servers = {p.name: p.pid for p in stack.procs if p.name.startswith("vllm")}
            with profile.profiled(servers, args.out_dir / "profiles" / f"r{round_index}-{name}") as paths, timeline:
                result = replay_with_progress(sessions, config, title, console)
            out["profiles"] = [str(p) for p in paths]
        else:
            with timeline:
                result = replay_with_progress(sessions, config, title, console)
        out["replay_wall_s"] = round(time.monotonic() - replay_t0, 2)
        out["cpu"] = cpu_time.usage(cpu_before, cpu_time.snapshot(roots, names=True))
        out["cpu"].append(cpu_time.self_usage(self_before, "replay client"))
        out["cpu_timeline"] = timeline.samples
        out["summary"] = reports.summarize(result)
        out["requests"] = reports.request_rows(result.records)
        texts = [_read_metrics(url) for url in stack.server_urls]
        out["breakdown"], out["counters"] = breakdown.merge(texts), breakdown.counters(texts)
        out["interrupted"] = result.interrupted
        out["errors"] = sorted({r.error for r in result.records if r.error})[:10]
        if out["summary"]["requests"]["error"]:
            out["log_tails"] = stack.log_tails()
        broken = harness_problem(name, out["summary"])
        if broken:
            out["error"], out["log_tails"] = broken, stack.log_tails()
            console.print(f"[bold red]{broken}[/]")
    except (RuntimeError, OSError) as e:
        out["error"] = f"replay failed: {e}"
        out["log_tails"] = stack.log_tails()
    finally:
        stack.stop()
    out["routes"] = tails.parse_router_log(workdir / "router.log", out["started_at"])  # tails.py: the slowest
    out["machine_at_end"] = reports.machine()
    return out


def harness_problem(name: str, summary: dict) -> str | None:
    """Why a finished run of a peer's store measures no store at all, else None."""
    if name in MOONCAKE_CONFIGS and not summary["hit_rate"].get("external"):
        return ("broken harness: the Mooncake servers show no external prefix-cache hits "
                "(vllm:external_prefix_cache_hits stayed 0), so MooncakeStoreConnector never loaded")  # fmt: skip
    return None


def demo_config(args: argparse.Namespace) -> DemoConfig:
    """The demo settings these options describe (trace, memory, model length, workdir)."""
    return DemoConfig(num_sessions=args.sessions, scale=args.scale, max_turns=args.max_turns,
                      time_scale=args.time_scale, seed=args.seed, sessions_file=args.sessions_file,
                      sessions_scale=args.sessions_scale, kv_cache_bytes=args.kv_cache_mib,
                      pool_bytes_per_server=args.extra_mib, max_model_len=args.max_model_len,
                      workdir=args.workdir)  # fmt: skip


def prepare(args: argparse.Namespace, console: Console) -> tuple[list, Setup]:
    """The trace's sessions and the model (the demo's own), LMCache's venv, the shared Setup."""
    demo = Demo(demo_config(args), status=console.print)
    sessions = demo.sessions()
    demo.prepare()
    lmcache_python = None
    if any(n in LMCACHE_CONFIGS for n in args.configs):
        try:
            lmcache_python = lmcache_env.ensure(args.lmcache_venv, install=not args.no_install, status=console.print)
        except lmcache_env.LMCacheEnvError as e:
            console.print(f"[red]LMCache configurations will be skipped: {e}[/]")
    mooncake_master = None
    if any(n in MOONCAKE_CONFIGS for n in args.configs):
        try:
            mooncake_master = ensure_mooncake(args.workdir, install=not args.no_install)
        except PeerUnavailable as e:
            console.print(f"[red]Mooncake configurations will be skipped: {e}[/]")
    setup = Setup(model_dir=demo.model_dir, kv_cache_bytes=args.kv_cache_mib, extra_bytes_per_server=args.extra_mib,
                  max_model_len=args.max_model_len, lmcache_python=lmcache_python,
                  redis_server=find_redis_server(), mooncake_master=mooncake_master)  # fmt: skip
    return sessions, setup


def ensure_mooncake(workdir: Path, install: bool) -> Path:
    """`mooncake_master` next to our interpreter, with Mooncake's Python client importable here (vLLM's
    connector runs in our vLLM servers), installing the wheel and its Debian libraries if allowed."""
    from peers.run import ensure_peer

    python = ensure_peer("mooncake", workdir, install)
    if Path(python) != Path(sys.executable) or find_mooncake_master() is None:
        raise PeerUnavailable(f"Mooncake's wheel would change packages of this environment ({python}); "
                              "vLLM's connector needs it beside vLLM")  # fmt: skip
    return find_mooncake_master()


def _print_outcome(console: Console, outcome: dict) -> None:
    if outcome["error"]:
        console.print(f"[red]{outcome['label']}: {outcome['error'][-2000:]}[/]")
        return
    s = outcome["summary"]
    console.print(f"  TTFT P50 {s['ttft_s']['p50']:.3f} s, P99 {s['ttft_s']['p99']:.3f} s, "
                  f"{s['throughput_tok_s']['total']:.0f} tok/s, hit {_pct(s['hit_rate']['combined'])} "
                  f"of {_pct(s['hit_rate']['potential'])}, {s['requests']['error']} failed")  # fmt: skip


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console()
    out_dir: Path = args.out_dir
    if args.report_only:
        return _write_report(args, console)
    if not args.resume and any((out_dir / "runs").glob("r*-*.json")):
        console.print(f"[red]{out_dir}/runs/ holds earlier runs: pass --resume to keep them, or move them away[/]")
        return 2
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    code = reports.code_version()
    t0 = time.monotonic()
    try:
        sessions, setup = prepare(args, console)
        plan = schedule(args.configs, args.rounds)
        console.print(f"trace: {_trace_info(sessions)}; {len(plan)} runs ({args.rounds} rounds x {len(args.configs)} "
                      f"configurations); workdir {args.workdir}; results {out_dir}")  # fmt: skip
        for i, (k, name) in enumerate(plan):
            path = run_path(out_dir, k, name)
            if path.exists():
                continue
            if args.stop_after_min is not None and time.monotonic() - t0 > args.stop_after_min * 60:
                console.print(f"[yellow]--stop-after-min reached: {len(plan) - i} runs not started[/]")
                break
            console.print(f"[bold][{i + 1}/{len(plan)}] round {k + 1}: {CONFIGS[name].label}[/]")
            workdir = args.workdir / f"r{k}-{name}"
            outcome = run_one(name, k, setup, sessions, args, workdir, console)
            outcome["trace"], outcome["settings"], outcome["code"] = _trace_info(sessions), _settings(args), code
            if outcome.get("interrupted"):
                console.print("[red]interrupted: this run is not saved[/]")
                raise KeyboardInterrupt
            reports.write_json(path, outcome)
            _print_outcome(console, outcome)
    except KeyboardInterrupt:
        console.print("[red]interrupted: every process stopped; finished runs are kept (--resume continues)[/]")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        procs.stop_all()
    return _write_report(args, console)


def _unique(values: list) -> list:
    return [v for i, v in enumerate(values) if v not in values[:i]]


def _write_report(args: argparse.Namespace, console: Console) -> int:
    saved = load_runs(args.out_dir)
    if not saved:
        console.print(f"[red]no runs under {args.out_dir}/runs/[/]")
        return 1
    runs = [RunRecord(r["config"], r["round"], r["summary"], r["error"]) for r in saved]
    settings, codes = _unique([r.get("settings") for r in saved]), _unique([r.get("code") for r in saved])
    if len(settings) > 1:
        console.print("[yellow]the saved runs were made with different settings: the report lists them all[/]")
    paths = report.write(args.out_dir, saved, runs, settings=settings[0] if len(settings) == 1 else settings,
                         code=codes[0] if len(codes) == 1 else codes, load_note=args.load_note)  # fmt: skip
    console.print(report.console_table(runs))
    console.print(f"results: {', '.join(str(p) for p in paths)}")
    if args.out_dir.resolve().parent == (results_io.results_root() / "e2e_peers").resolve():  # also a relative --out-dir
        results_io.refresh_latest("e2e_peers")
    return 0


def _settings(args: argparse.Namespace) -> dict:
    keys = ("trace", "configs", "rounds", "sessions", "max_turns", "scale", "time_scale", "sessions_file", "sessions_scale",
            "seed", "kv_cache_mib", "extra_mib", "max_model_len")  # fmt: skip
    out = {k: (_shown(v) if isinstance(v, Path) else v) for k in keys if (v := getattr(args, k)) is not None}
    return out | {"kv_cache_mib": args.kv_cache_mib >> 20, "extra_mib": args.extra_mib >> 20}


def _shown(path: Path) -> str:
    """A path as results record it: relative to the repository when inside it (no machine's paths)."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def _trace_info(sessions) -> str:
    return (f"{len(sessions)} sessions, {sum(len(s.turns) for s in sessions)} requests, "
            f"{sum(s.total_input_tokens for s in sessions)} input / {sum(s.total_output_tokens for s in sessions)} "
            "output tokens")  # fmt: skip


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f} %"


if __name__ == "__main__":
    sys.exit(main())
