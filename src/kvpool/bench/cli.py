"""`kvpool bench ...`: benchmarks. `replay` replays agent sessions against OpenAI-compatible endpoints."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvpool.bench import plots, reports
from kvpool.bench.replay import ReplayConfig, ReplayResult, RequestRecord, replay
from kvpool.workload.model import Session, read_sessions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    p = sub.add_parser(
        "replay",
        help="replay agent sessions (kvpool session JSONL) against OpenAI-compatible endpoints",
        description="Replay agent sessions: one client per session, turns in order with think time; each "
        "prompt = previous prompt + the server's returned output + new tokens (token-id prompts). "
        "Reports throughput, TTFT / inter-token / end-to-end percentiles, TTFT by turn and hit rates.",
    )
    p.add_argument("--sessions", required=True, type=Path, help="sessions JSONL (`kvpool trace ...` writes it)")
    p.add_argument("--endpoint", action="append", required=True, metavar="URL",
                   help="base URL of a vLLM OpenAI server or a router (repeat: requests go round-robin)")
    p.add_argument("--metrics-url", action="append", metavar="URL",
                   help="base URL whose /metrics has vLLM's counters, one per server (repeat); default: the "
                   "endpoints. Give the servers here when --endpoint is a proxy.")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply every think time by this (0 = no waits; default 1)")
    p.add_argument("--max-sessions", type=int, default=None, help="replay only the first N sessions")
    p.add_argument("--concurrency", type=int, default=None, help="at most N sessions at once (default: all)")
    p.add_argument("--ramp-up-s", type=float, default=0.0, help="spread session starts over this many seconds")
    p.add_argument("--vocab-size", type=int, default=8000,
                   help="the served model's vocabulary size; prompt tokens are drawn from [3, vocab) (default 8000, "
                   "the tiny test model)")
    p.add_argument("--model", default=None, help="model name to request (default: the first the endpoint lists)")
    p.add_argument("--seed", type=int, default=0, help="seed of the block-id -> tokens mapping")
    p.add_argument("--cache-block-size", type=int, default=128,
                   help="the engine's KV block size in tokens, for the potential hit rate (vLLM CPU: 128)")
    p.add_argument("--request-timeout-s", type=float, default=600.0, help="give up on one request after this")
    p.add_argument("--output-dir", type=Path, default=Path("replay-results"),
                   help="where replay.json, replay.md, ttft_cdf.png and ttft_by_turn.png go")
    p.add_argument("--label", default="replay", help="name of this run in the results and plots")
    p.epilog = ("A failed request ends its session; the session's remaining turns are counted as skipped. "
                "Ctrl-C writes the partial results (requests not finished counted as skipped) and exits 130.")


def replay_with_progress(sessions: list[Session], config: ReplayConfig, description: str,
                         console: Console | None = None) -> ReplayResult:  # fmt: skip
    """Run a replay behind a rich progress bar (requests done of planned, failures)."""
    console = console or Console(stderr=True)
    planned = sum(len(s.turns) for s in sessions[: config.max_sessions or len(sessions)])
    failed = [0]
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("[red]{task.fields[failed]} not ok"), TimeElapsedColumn(),
                  console=console, transient=False) as progress:  # fmt: skip
        task = progress.add_task(description, total=planned, failed=0)

        def on_record(record: RequestRecord) -> None:
            failed[0] += record.status != "ok"
            progress.update(task, advance=1, failed=failed[0])

        result = replay(sessions, config, on_record)
        progress.update(task, completed=planned)  # sessions cut short by a failure count as done
    return result


def write_results(result: ReplayResult, output_dir: Path, label: str) -> dict:
    summary = reports.summarize(result)
    output_dir.mkdir(parents=True, exist_ok=True)
    reports.write_json(output_dir / "replay.json", reports.to_json(result, summary, label))
    (output_dir / "replay.md").write_text(reports.summary_markdown(summary, title=f"Replay: {label}")
                                          + f"\nMachine: {reports.machine()}\n\nConfig: {result.config}\n")
    plots.plot_ttft_cdf([(label, result.records)], output_dir / "ttft_cdf.png")
    plots.plot_ttft_by_turn([(label, result.records)], output_dir / "ttft_by_turn.png")
    return summary


def run(args: argparse.Namespace) -> int:
    if getattr(args, "bench_command", None) != "replay":
        print("usage: kvpool bench replay --sessions FILE --endpoint URL [...]; see `kvpool bench replay --help`",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        sessions = read_sessions(args.sessions)
        config = ReplayConfig(
            endpoints=tuple(args.endpoint), metrics_urls=tuple(args.metrics_url) if args.metrics_url else None,
            time_scale=args.time_scale, max_sessions=args.max_sessions, concurrency=args.concurrency,
            ramp_up_s=args.ramp_up_s, vocab_size=args.vocab_size, seed=args.seed, model=args.model,
            cache_block_size=args.cache_block_size, request_timeout_s=args.request_timeout_s,
        )  # fmt: skip
    except (OSError, ValueError) as e:
        print(f"kvpool bench replay: {e}", file=sys.stderr)
        return 2
    if not sessions:
        print(f"kvpool bench replay: {args.sessions} holds no session", file=sys.stderr)
        return 2
    console = Console()
    try:
        result = replay_with_progress(sessions, config, f"replay {args.label}", console)
    except (RuntimeError, OSError) as e:
        print(f"kvpool bench replay: {e}", file=sys.stderr)
        return 1
    summary = write_results(result, args.output_dir, args.label)
    console.print(reports.summary_markdown(summary, title=f"Replay: {args.label}"))
    if result.interrupted:
        console.print(f"[red]interrupted: partial results (the rest counted as skipped) in {args.output_dir}/[/]")
        return 130
    console.print(f"results in {args.output_dir}/")
    return 0 if summary["requests"]["ok"] else 1
