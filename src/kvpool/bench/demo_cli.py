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
from kvpool.bench.demo import COMPARE_RUNS, DEFAULT_RUNS, DEMO_MODELS, LABELS, PD_RUNS, RUN_SPECS, RUNS, ConnectorProbe, Demo, DemoConfig, RunOutcome, ratio
from kvpool.workload.errors import TraceFormatError

# The published reference (vLLM + Mooncake Store, Kimi-K2.5 on 12 GB200, Codex traces), for context.
REFERENCE = {"throughput": "3.8x", "ttft": "46x lower", "e2e": "8.6x lower", "hit": "1.7 % -> 92.2 %"}
# one session: round-robin then sends consecutive turns to different servers, so the pool must serve
QUICK = {"num_sessions": 1, "max_turns": 4, "scale": 0.05, "time_scale": 0.0}


def _mib(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1 MiB")
    return value * 2**20


def _runs(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in RUNS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown run {', '.join(bad) or '(none)'}; choose from {', '.join(RUNS)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DemoConfig()
    parser.description = (
        "Start a kvpool master, two vLLM-CPU OpenAI servers with a tiny Llama written locally, and "
        "`kvpool router`; replay a scaled Codex-like agent trace once per run and print TTFT P50/P99, "
        "end-to-end P50, throughput, hit rates (local and pool) and failed requests side by side; save "
        "JSON, Markdown and a plot. The runs, on the same trace and total memory: "
        + "; ".join(f"{s.label} ({s.name})" for s in RUN_SPECS.values())
        + f". By default {' and '.join(DEFAULT_RUNS)} (rows 1 and 5); --compare runs rows 1-5 (about "
        "2.5x as long); --pd runs the prefill/decode rows 6-8 and row 5. Every process is stopped on exit or Ctrl-C; Ctrl-C during a replay writes the "
        "partial results."
    )
    parser.add_argument("--quick", action="store_true",
                        help=f"a smoke run: {QUICK['num_sessions']} session(s) x {QUICK['max_turns']} turns, short prompts, no think time")
    parser.add_argument("--compare", action="store_true", help="run rows 1-5 of the comparison (aggregated serving)")
    parser.add_argument("--pd", action="store_true",
                        help="prefill/decode disaggregation: 1 prefill + 1 decode instance without the pool, the same "
                             "with the pool memory as local KV, with the pool; and aggregated serving with the pool")
    parser.add_argument("--runs", type=_runs, default=None, metavar="NAME,...",
                        help=f"run exactly these, in order (from {', '.join(RUNS)})")
    parser.add_argument("--only", choices=RUNS, default=None, help="run one row only")
    parser.add_argument("--serve", action="store_true",
                        help="start the cache_aware + pool stack with a tokenizer and chat template (so "
                             "/v1/chat/completions works), print its URL and keep it up until Ctrl-C; no replay")
    parser.add_argument("--sessions", type=int, default=None, metavar="N", help=f"sessions to replay (default {d.num_sessions})")
    parser.add_argument("--max-turns", type=int, default=None, help=f"turns per session at most (default {d.max_turns})")
    parser.add_argument("--scale", type=float, default=None,
                        help=f"token counts as a fraction of the Codex profile's (default {d.scale})")
    parser.add_argument("--time-scale", type=float, default=None,
                        help=f"tool/think times as a fraction of the trace's (default {d.time_scale}; 0 = none)")
    parser.add_argument("--sessions-file", type=Path, default=None,
                        help="replay this trace instead of a synthesized Codex-like one: a kvpool sessions "
                             "JSONL or what `kvpool trace convert` reads (Claude Code, Mooncake or vLLM "
                             "multi-turn files, or a directory of them)")
    parser.add_argument("--sessions-scale", type=float, default=1.0,
                        help="token counts of --sessions-file times this, sharing kept (e.g. 0.03 fits "
                             "Claude Code's 100K-450K-token contexts into the tiny model's 16K; default 1)")
    parser.add_argument("--seed", type=int, default=d.seed, help="trace and prompt seed")
    parser.add_argument("--kv-cache-mib", type=_mib, default=d.kv_cache_bytes, metavar="MIB",
                        help=f"vLLM KV cache per server (default {d.kv_cache_bytes >> 20}; small on purpose)")
    parser.add_argument("--pool-mib", type=_mib, default=d.pool_bytes_per_server, metavar="MIB",
                        help=f"pool memory each server contributes (default {d.pool_bytes_per_server >> 20}); "
                             "run 2 adds it to each server's KV cache instead")
    parser.add_argument("--max-model-len", type=int, default=d.max_model_len, help="vLLM --max-model-len")
    parser.add_argument("--model", choices=DEMO_MODELS, default=d.model,
                        help="the tiny model served: llama (full attention) or gemma3 (sliding-window layers beside "
                             "full attention; vLLM's hybrid KV cache manager stays on with the pool)")
    parser.add_argument("--output-dir", type=Path, default=Path("demo-results"),
                        help="where demo_summary.json, demo_table.md, demo_ttft.png, demo_rows.png, demo_records.json go")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where logs, the model and scratch files go (default: a new temporary directory)")


def _config(args: argparse.Namespace) -> DemoConfig:
    base = dict(QUICK) if args.quick else {}
    for key, arg in (("num_sessions", "sessions"), ("max_turns", "max_turns"), ("scale", "scale"), ("time_scale", "time_scale")):
        if getattr(args, arg) is not None:
            base[key] = getattr(args, arg)
    runs = args.runs or ((args.only,) if args.only else COMPARE_RUNS if args.compare else PD_RUNS if args.pd
                         else DEFAULT_RUNS)
    return DemoConfig(
        **base, seed=args.seed, sessions_file=args.sessions_file, sessions_scale=args.sessions_scale,
        kv_cache_bytes=args.kv_cache_mib,
        pool_bytes_per_server=args.pool_mib, max_model_len=args.max_model_len,
        runs=runs, workdir=args.workdir, model=args.model,
    )  # fmt: skip


def _s(v: float | None) -> str:
    return "n/a" if v is None else (f"{v:.3f} s" if v < 10 else f"{v:.1f} s")


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f} %"


def _x(v: float | None, suffix: str = "") -> str:
    return "n/a" if v is None else f"{v:.1f}x{suffix}"


COLUMNS = ("run", "TTFT P50", "TTFT P99", "end-to-end P50", "throughput (tok/s)", "local hit", "pool hit",
           "failed / skipped", "P50 TTFT vs no pool")  # fmt: skip


def _get(s: dict | None, *path: str):
    for key in path:
        if s is None:
            return None
        s = s.get(key)
    return s


def comparison_rows(outcomes: dict[str, RunOutcome]) -> list[tuple[str, ...]]:
    """One row per run: the figures of COLUMNS, and the P50 TTFT ratio to row 1 (aggregated rows) or
    row 6 (P/D rows), the same serving shape without the pool."""
    firsts = {pd: _get((outcomes.get(base) or RunOutcome(base)).summary, "ttft_s", "p50")
              for pd, base in ((False, "baseline"), (True, "pd"))}  # fmt: skip
    rows = []
    for name, o in outcomes.items():
        s = o.summary
        if s is None:
            rows.append((o.label, *(["n/a"] * (len(COLUMNS) - 2)), o.error or "no numbers"))
            continue
        tput = _get(s, "throughput_tok_s", "total")
        pool_hit = ratio(_get(s, "server_counters", "external_hits"), _get(s, "server_counters", "local_queries"))
        req = s["requests"]
        p50 = _get(s, "ttft_s", "p50")
        vs = "-" if name in ("baseline", "pd") else _x(ratio(firsts[RUN_SPECS[name].pd], p50), " lower")
        rows.append((o.label, _s(p50), _s(_get(s, "ttft_s", "p99")), _s(_get(s, "e2e_s", "p50")),
                     f"{tput:.0f}" if tput else "n/a", _pct(_get(s, "hit_rate", "local")),
                     _pct(pool_hit) if RUN_SPECS[name].pooled else "-", f"{req['error']} / {req['skipped']}", vs))  # fmt: skip
    return rows


def detail_rows(outcomes: dict[str, RunOutcome]) -> list[tuple[str, ...]]:
    """Per run: potential hit rate, pool pressure counters, the router's retries and decisions."""
    rows = []
    for o in outcomes.values():
        s = o.summary
        if s is None:
            continue
        counters, router = s.get("server_counters") or {}, s.get("router") or {}
        decisions = ", ".join(f"{k} {v:.0f}" for k, v in sorted((router.get("decisions") or {}).items())) or "n/a"
        failed_loads = counters.get("pool_load_failed_blocks")
        rows.append((o.label, _pct(_get(s, "hit_rate", "potential")), _pct(_get(s, "hit_rate", "combined")),
                     f"{failed_loads:.0f}" if failed_loads is not None else "n/a",
                     f"{router.get('retries', 0):.0f}" if router else "n/a", decisions,
                     f"{s['requests']['ok']} / {s['requests']['planned']}", f"{o.startup_s:.0f} s"))  # fmt: skip
    return rows


DETAIL_COLUMNS = ("run", "potential hit", "combined hit", "failed pool loads (blocks)", "router retries",
                  "router decisions", "ok / planned", "stack start")  # fmt: skip


def _table(outcomes: dict[str, RunOutcome]) -> Table:
    table = Table(title="kvpool demo: the same Codex-like agent trace, two vLLM-CPU servers, kvpool router")
    for col in COLUMNS:
        table.add_column(col, justify="left" if col == "run" else "right")
    for row in comparison_rows(outcomes):
        table.add_row(*row)
    return table


def _md_table(columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] + ["| " + " | ".join(r) + " |" for r in rows]


MODEL_NAMES = {"llama": "tiny seeded Llama",
               "gemma3": "tiny seeded Gemma 3: 3 sliding-window layers + 1 full, vLLM's hybrid KV cache manager on"}
METHOD = (
    "Method: `kvpool demo` starts two vLLM-CPU OpenAI servers ({model}, local prefix cache on, "
    "worker threads of server i pinned to core i, KV memory per server below what the sessions need "
    "together, KV events published) behind `kvpool router`, and replays the same synthesized Codex-like "
    "trace (one client per session, think times scaled) once per run: round-robin without the pool; "
    "round-robin without the pool but each server's KV memory grown by its pool share; then with "
    "`kvpool master` and `KVPoolConnector` (each server contributes an embedded pool segment) under the "
    "round_robin, session and cache_aware policies; in the P/D rows server 0 prefills and server 1 decodes "
    "(vLLM's NixlConnector hands the KV over, `kvpool router --prefill --decode`), without the pool, with the pool "
    "memory as local KV, and with MultiConnector(NixlConnector, KVPoolConnector), their hit rates the prefill "
    "instance's. Each run starts its own processes. Prompts are token ids; each turn "
    "re-sends the previous prompt and the output the server returned. TTFT and end-to-end latency are "
    "measured at the client; hit rates come from vLLM's /metrics (local prefix cache + external/pool hits, "
    "over prompt tokens); the potential hit rate is what one unbounded cache shared by both servers could "
    "have served for the same prompts. For context, the published vLLM + Mooncake Store result (Kimi-K2.5 "
    f"on 12 GB200, Codex traces, round-robin): throughput {REFERENCE['throughput']}, TTFT {REFERENCE['ttft']}, "
    f"hit rate {REFERENCE['hit']}."
)


def _markdown(outcomes: dict[str, RunOutcome], config: DemoConfig, sessions_info: str, machine: dict) -> str:
    lines = ["# kvpool demo", "", METHOD.replace("{model}", MODEL_NAMES[config.model]), "",
             f"Machine at the start: {machine}", "",
             f"Machine at the end: {reports.machine()}", "", f"Trace: {sessions_info}", "",
             f"Config: {config}", ""]  # fmt: skip
    lines += _md_table(COLUMNS, comparison_rows(outcomes)) + [""] + _md_table(DETAIL_COLUMNS, detail_rows(outcomes))
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


def _serve(demo: Demo, console: Console) -> int:
    """Start the cache_aware + pool stack with a tokenizer and keep it up until Ctrl-C / SIGTERM."""
    demo.prepare(with_tokenizer=True)
    name = "cache_aware"
    started, router_url, server_urls = demo.start_stack(name)
    console.print(f"[bold green]serving[/] {LABELS[name]}: router {router_url} -> {', '.join(server_urls)}")
    console.print(f"  model 'tiny' (OpenAI API): {router_url}/v1/chat/completions, {router_url}/v1/completions; "
                  f"router metrics {router_url}/metrics")
    console.print(f"  try: curl -s {router_url}/v1/chat/completions -H 'content-type: application/json' "
                  """-d '{"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}'""")
    console.print("  Ctrl-C stops every process")
    try:
        while all(p.alive() for p in started):
            time.sleep(0.5)
        dead = [p.name for p in started if not p.alive()]
        console.print(f"[red]{', '.join(dead)} exited; stopping the rest (logs in {demo.workdir})[/]")
        return 1
    finally:
        for proc in reversed(started):
            proc.stop(grace_s=10.0)


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
    interrupted = False
    pooled = args.serve or any(RUN_SPECS[n].pooled for n in config.runs)
    probe = ConnectorProbe() if pooled else None
    info = ""
    try:
        demo = Demo(config, status=lambda msg: console.print(f"[bold]{msg}[/]"))
        console.print(f"workdir (logs, model): {demo.workdir}")
        if args.serve:
            with console.status("checking that the vLLM connector is importable"):
                problem = probe.problem()
            if problem:
                print(f"kvpool demo --serve: the pool cannot run: {problem}", file=sys.stderr)
                return 1
            return _serve(demo, console)
        try:
            sessions = demo.sessions()
        except (TraceFormatError, OSError) as e:
            print(f"kvpool demo: cannot read --sessions-file: {e}", file=sys.stderr)
            return 2
        if not sessions:
            print("kvpool demo: no sessions to replay", file=sys.stderr)
            return 2
        num_req = sum(len(s.turns) for s in sessions)
        info = (f"{len(sessions)} sessions, {num_req} requests, "
                f"{sum(s.total_input_tokens for s in sessions)} input / {sum(s.total_output_tokens for s in sessions)} "
                f"output tokens in the trace")  # fmt: skip
        console.print(f"trace: {info}; runs: {', '.join(LABELS[n] for n in config.runs)}")
        demo.prepare()
        problem = None
        for name in config.runs:
            if RUN_SPECS[name].pooled:
                with console.status("checking that the vLLM connector is importable"):
                    problem = problem or probe.problem()
                if problem:
                    outcomes[name] = RunOutcome(name, error=f"the pool run cannot start: {problem}")
                    console.print(f"[red]{outcomes[name].error}[/]")
                    continue
            outcomes[name] = demo.run_one(
                name, sessions, lambda s, c, d: replay_with_progress(s, c, d, console)
            )
            if outcomes[name].error:
                console.print(f"[red]{LABELS[name]}: {outcomes[name].error}[/]")
            for w in outcomes[name].warnings:
                console.print(f"[yellow]{LABELS[name]}: {w}[/]")
            if outcomes[name].result is not None and outcomes[name].result.interrupted:
                interrupted = True
                break
    except KeyboardInterrupt:
        interrupted = True
    finally:
        signal.signal(signal.SIGTERM, previous)
        if probe is not None:
            probe.close()
        procs.stop_all()
    if interrupted:
        console.print("[red]interrupted: every process stopped[/]")
        if not any(o.result is not None for o in outcomes.values()):
            return 130

    console.print(_table(outcomes))
    out = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    runs = [(o.label, o.result.records) for o in outcomes.values() if o.result is not None]
    payload = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(config).items()}, "trace": info,
               "code": code, "machine_at_start": machine_at_start, "machine": reports.machine(), "duration_s": time.monotonic() - t0,
               "interrupted": interrupted,
               "runs": {n: {"summary": o.summary, "error": o.error, "warnings": o.warnings, "startup_s": o.startup_s}
                        for n, o in outcomes.items()},
               "table": {"columns": COLUMNS, "rows": comparison_rows(outcomes)},
               "details": {"columns": DETAIL_COLUMNS, "rows": detail_rows(outcomes)}}  # fmt: skip
    reports.write_json(out / "demo_summary.json", payload)
    reports.write_json(out / "demo_records.json", {n: reports.to_json(o.result, o.summary, o.label)
                                                   for n, o in outcomes.items() if o.result is not None})  # fmt: skip
    (out / "demo_table.md").write_text(_markdown(outcomes, config, info, machine_at_start) + f"\nCode: {code}\n")
    if runs:
        plots.plot_comparison(runs, out / "demo_ttft.png", "kvpool demo: TTFT by run")
        plots.plot_run_bars([(o.label.replace(", ", ",\n", 1), o.summary) for o in outcomes.values() if o.summary],
                            out / "demo_rows.png", "kvpool demo: latency by run (same trace, same total memory)")  # fmt: skip
    console.print(f"{'partial ' if interrupted else ''}results in {out}/ ({time.monotonic() - t0:.0f} s in all)")
    if interrupted:
        return 130
    failed = [o for o in outcomes.values() if o.error or o.result is None]
    return 1 if failed else 0
