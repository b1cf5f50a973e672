"""`kvpool demo`: the end-to-end demo, its options, the side-by-side table and the result files."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvpool.bench import plots, procs, reports
from kvpool.bench.cli import replay_with_progress
from kvpool.bench.demo import LABELS, ConnectorProbe, Demo, DemoConfig, RunOutcome, ratio

# The published reference (vLLM + Mooncake Store, Kimi-K2.5 on 12 GB200, Codex traces), for context.
REFERENCE = {"throughput": "3.8x", "ttft": "46x lower", "e2e": "8.6x lower", "hit": "1.7 % -> 92.2 %"}
# one session: round-robin then sends consecutive turns to different servers, so the pool must serve
QUICK = {"num_sessions": 1, "max_turns": 4, "scale": 0.05, "time_scale": 0.0}


def _mib(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1 MiB")
    return value * 2**20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DemoConfig()
    parser.description = (
        "Start a kvpool master, two vLLM-CPU OpenAI servers with a tiny Llama written locally, and a "
        "round-robin proxy; replay a scaled Codex-like agent trace twice, without and with the pool "
        "(vLLM's local prefix cache on in both); print throughput, P50 TTFT, P50 end-to-end latency and "
        "hit rate side by side and save JSON, Markdown and a plot. Every process is stopped on exit or Ctrl-C."
    )
    parser.add_argument("--quick", action="store_true",
                        help=f"a smoke run: {QUICK['num_sessions']} session(s) x {QUICK['max_turns']} turns, short prompts, no think time")
    parser.add_argument("--sessions", type=int, default=None, metavar="N", help=f"sessions to replay (default {d.num_sessions})")
    parser.add_argument("--max-turns", type=int, default=None, help=f"turns per session at most (default {d.max_turns})")
    parser.add_argument("--scale", type=float, default=None,
                        help=f"token counts as a fraction of the Codex profile's (default {d.scale})")
    parser.add_argument("--time-scale", type=float, default=None,
                        help=f"tool/think times as a fraction of the trace's (default {d.time_scale}; 0 = none)")
    parser.add_argument("--sessions-file", type=Path, default=None,
                        help="replay this kvpool sessions JSONL instead of a synthesized Codex-like trace "
                             "(`kvpool trace convert` makes one from Claude Code, Mooncake or vLLM traces)")
    parser.add_argument("--sessions-scale", type=float, default=1.0,
                        help="token counts of --sessions-file times this, sharing kept (e.g. 0.03 fits "
                             "Claude Code's 100K-450K-token contexts into the tiny model's 16K; default 1)")
    parser.add_argument("--seed", type=int, default=d.seed, help="trace and prompt seed")
    parser.add_argument("--kv-cache-mib", type=_mib, default=d.kv_cache_bytes, metavar="MIB",
                        help=f"vLLM KV cache per server (default {d.kv_cache_bytes >> 20}; small on purpose)")
    parser.add_argument("--pool-mib", type=_mib, default=d.pool_bytes_per_server, metavar="MIB",
                        help=f"pool memory each server contributes (default {d.pool_bytes_per_server >> 20})")
    parser.add_argument("--max-model-len", type=int, default=d.max_model_len, help="vLLM --max-model-len")
    parser.add_argument("--only", choices=("baseline", "pool"), default=None, help="run one half only")
    parser.add_argument("--output-dir", type=Path, default=Path("demo-results"),
                        help="where demo_summary.json, demo_table.md, demo_ttft.png, demo_records.json go")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where logs, the model and scratch files go (default: a new temporary directory)")


def _config(args: argparse.Namespace) -> DemoConfig:
    base = dict(QUICK) if args.quick else {}
    for key, arg in (("num_sessions", "sessions"), ("max_turns", "max_turns"), ("scale", "scale"), ("time_scale", "time_scale")):
        if getattr(args, arg) is not None:
            base[key] = getattr(args, arg)
    return DemoConfig(
        **base, seed=args.seed, sessions_file=args.sessions_file, sessions_scale=args.sessions_scale,
        kv_cache_bytes=args.kv_cache_mib,
        pool_bytes_per_server=args.pool_mib, max_model_len=args.max_model_len,
        runs=(args.only,) if args.only else ("baseline", "pool"), workdir=args.workdir,
    )  # fmt: skip


def _s(v: float | None) -> str:
    return "n/a" if v is None else (f"{v:.3f} s" if v < 10 else f"{v:.1f} s")


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f} %"


def _x(v: float | None, suffix: str = "") -> str:
    return "n/a" if v is None else f"{v:.1f}x{suffix}"


def comparison_rows(outcomes: dict[str, RunOutcome]) -> list[tuple[str, str, str, str, str]]:
    """(metric, without pool, with pool, ratio, reference) rows of the side-by-side table."""
    b = (outcomes.get("baseline") or RunOutcome("baseline")).summary
    p = (outcomes.get("pool") or RunOutcome("pool")).summary

    def get(s: dict | None, *path: str) -> float | None:
        for key in path:
            if s is None:
                return None
            s = s.get(key)
        return s

    rows = []
    tb, tp = get(b, "throughput_tok_s", "total"), get(p, "throughput_tok_s", "total")
    rows.append(("throughput (tok/s, in+out)", f"{tb:.0f}" if tb else "n/a", f"{tp:.0f}" if tp else "n/a",
                 _x(ratio(tp, tb)), REFERENCE["throughput"]))  # fmt: skip
    ob, op = get(b, "throughput_tok_s", "output"), get(p, "throughput_tok_s", "output")
    rows.append(("output tok/s", f"{ob:.1f}" if ob else "n/a", f"{op:.1f}" if op else "n/a", _x(ratio(op, ob)), ""))
    for key, name, ref in (("ttft_s", "P50 TTFT", REFERENCE["ttft"]), ("e2e_s", "P50 end-to-end", REFERENCE["e2e"])):
        vb, vp = get(b, key, "p50"), get(p, key, "p50")
        rows.append((name, _s(vb), _s(vp), _x(ratio(vb, vp), " lower"), ref))
    for key, name in (("ttft_s", "P90 TTFT"), ("ttft_s", "P99 TTFT"), ("e2e_s", "P99 end-to-end")):
        vb, vp = get(b, key, "p" + name[1:3]), get(p, key, "p" + name[1:3])
        rows.append((name, _s(vb), _s(vp), _x(ratio(vb, vp), " lower"), ""))
    rows.append(("hit rate (local + pool)", _pct(get(b, "hit_rate", "combined")), _pct(get(p, "hit_rate", "combined")),
                 "", REFERENCE["hit"]))  # fmt: skip
    rows.append(("  of which pool", _pct(get(b, "hit_rate", "external")) if get(b, "hit_rate", "external") is not None else "-",
                 _pct(ratio(get(p, "server_counters", "external_hits"), get(p, "server_counters", "local_queries"))), "", ""))  # fmt: skip
    _, fp = get(b, "server_counters", "pool_load_failed_blocks"), get(p, "server_counters", "pool_load_failed_blocks")
    rows.append(("  less failed pool loads", _pct(get(b, "hit_rate", "combined_loaded")),
                 _pct(get(p, "hit_rate", "combined_loaded")) + (f" ({fp:.0f} blocks failed)" if fp else ""), "", ""))  # fmt: skip
    rows.append(("potential hit rate", _pct(get(b, "hit_rate", "potential")), _pct(get(p, "hit_rate", "potential")), "", "94.2 %"))
    for key, name in (("pool_saves_dropped", "saves dropped (blocks pinned past the bound)"),
                      ("pool_saves_deferred", "saves put off a step"),
                      ("pool_lookups_deferred", "lookups answered 'ask again' (step not blocked)"),
                      ("pool_lookups_given_up", "lookups given up (computed without the pool)")):
        value = get(p, "server_counters", key)
        rows.append((name, "-", f"{value:.0f}" if value is not None else "n/a", "", ""))
    rb, rp = get(b, "requests"), get(p, "requests")
    rows.append(("requests ok / planned", f"{rb['ok']} / {rb['planned']}" if rb else "n/a",
                 f"{rp['ok']} / {rp['planned']}" if rp else "n/a", "", ""))  # fmt: skip
    return rows


def _table(outcomes: dict[str, RunOutcome]) -> Table:
    table = Table(title="kvpool demo: the same Codex-like agent trace, two vLLM-CPU servers, round-robin")
    for col in ("metric", "without pool", "with pool", "ratio", "reference (12x GB200)"):
        table.add_column(col, justify="left" if col == "metric" else "right")
    for row in comparison_rows(outcomes):
        table.add_row(*row)
    return table


METHOD = (
    "Method: `kvpool demo` starts two vLLM-CPU OpenAI servers (tiny seeded Llama, local prefix cache on, "
    "worker threads of server i pinned to core i, KV memory per server below what the sessions need "
    "together) behind a round-robin proxy, and replays the same synthesized Codex-like trace (one client "
    "per session, think times scaled) twice: without the pool, then with `kvpool master` and "
    "`KVPoolConnector` (each server contributes an embedded pool segment). Prompts are token ids; each turn "
    "re-sends the previous prompt and the output the server returned. TTFT and end-to-end latency are "
    "measured at the client; hit rates come from vLLM's /metrics (local prefix cache + external/pool hits, "
    "over prompt tokens); the potential hit rate is what one unbounded cache shared by both servers could "
    "have served for the same prompts. The reference column is the published vLLM + Mooncake Store result "
    "(Kimi-K2.5 on 12 GB200, Codex traces), for context only."
)


def _markdown(outcomes: dict[str, RunOutcome], config: DemoConfig, sessions_info: str, machine: dict) -> str:
    lines = ["# kvpool demo", "", METHOD, "", f"Machine at the start: {machine}", "",
             f"Machine at the end: {reports.machine()}", "", f"Trace: {sessions_info}", "",
             f"Config: {config}", "", "| metric | without pool | with pool | ratio | reference (12x GB200) |",
             "|---|---|---|---|---|"]  # fmt: skip
    lines += ["| " + " | ".join(row) + " |" for row in comparison_rows(outcomes)]
    for o in outcomes.values():
        if o.error:
            lines += ["", f"**{o.label}: no numbers.** {o.error}"]
        for w in o.warnings:
            lines += ["", f"{o.label}: warning: {w}"]
        if o.summary:
            lines += ["", reports.summary_markdown(o.summary, title=f"{o.label} (servers started in {o.startup_s:.0f} s)")]
    return "\n".join(lines) + "\n"


def _raise_interrupt(signum, frame):  # SIGTERM -> the same clean-up path as Ctrl-C
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    console = Console()
    try:
        config = _config(args)
    except ValueError as e:
        print(f"kvpool demo: {e}", file=sys.stderr)
        return 2
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    t0 = time.monotonic()
    machine_at_start = reports.machine()
    code = reports.code_version()
    outcomes: dict[str, RunOutcome] = {}
    probe = ConnectorProbe() if "pool" in config.runs else None
    try:
        demo = Demo(config, status=lambda msg: console.print(f"[bold]{msg}[/]"))
        console.print(f"workdir (logs, model): {demo.workdir}")
        sessions = demo.sessions()
        if not sessions:
            print("kvpool demo: no sessions to replay", file=sys.stderr)
            return 2
        num_req = sum(len(s.turns) for s in sessions)
        info = (f"{len(sessions)} sessions, {num_req} requests, "
                f"{sum(s.total_input_tokens for s in sessions)} input / {sum(s.total_output_tokens for s in sessions)} "
                f"output tokens in the trace")  # fmt: skip
        console.print(f"trace: {info}")
        demo.prepare()
        for name in config.runs:
            if name == "pool":
                with console.status("checking that the vLLM connector is importable"):
                    problem = probe.problem()
                if problem:
                    outcomes[name] = RunOutcome(name, error=f"the pool half cannot run: {problem}")
                    console.print(f"[red]{outcomes[name].error}[/]")
                    continue
            outcomes[name] = demo.run_one(
                name, sessions, lambda s, c, d: replay_with_progress(s, c, d, console)
            )
            if outcomes[name].error:
                console.print(f"[red]{LABELS[name]}: {outcomes[name].error}[/]")
            for w in outcomes[name].warnings:
                console.print(f"[yellow]{LABELS[name]}: {w}[/]")
    except KeyboardInterrupt:
        console.print("[red]interrupted: stopping every process[/]")
        procs.stop_all()
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        if probe is not None:
            probe.close()
        procs.stop_all()

    console.print(_table(outcomes))
    out = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    runs = [(o.label, o.result.records) for o in outcomes.values() if o.result is not None]
    payload = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(config).items()}, "trace": info,
               "code": code, "machine_at_start": machine_at_start, "machine": reports.machine(), "duration_s": time.monotonic() - t0,
               "runs": {n: {"summary": o.summary, "error": o.error, "warnings": o.warnings, "startup_s": o.startup_s}
                        for n, o in outcomes.items()},
               "table": comparison_rows(outcomes)}  # fmt: skip
    reports.write_json(out / "demo_summary.json", payload)
    reports.write_json(out / "demo_records.json", {n: reports.to_json(o.result, o.summary, o.label)
                                                   for n, o in outcomes.items() if o.result is not None})  # fmt: skip
    (out / "demo_table.md").write_text(_markdown(outcomes, config, info, machine_at_start) + f"\nCode: {code}\n")
    if runs:
        plots.plot_comparison(runs, out / "demo_ttft.png", "kvpool demo: TTFT without and with the pool")
    console.print(f"results in {out}/ ({time.monotonic() - t0:.0f} s in all)")
    failed = [o for o in outcomes.values() if o.error or o.result is None]
    return 1 if failed else 0
