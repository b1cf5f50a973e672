"""`kvpool trace {convert,synth,analyze}`: the I/O shell around formats, synth, analysis and report.

Bad input (a missing file, a malformed record, an impossible option) prints one line saying what to
change and exits 2; nothing is written unless the whole input was read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvpool.workload.errors import TraceFormatError
from kvpool.workload.formats import FORMATS, expand_inputs, load_trace
from kvpool.workload.model import Session, write_sessions
from kvpool.workload.synth import PROFILES, SynthConfig, synth_session

_FORMAT_HELP = (
    "input format: auto (detect from the first record), claude-code (kv-cache-tester JSON, 64-token "
    "blocks, subagents become sessions of their own), mooncake (FAST'25 JSONL, 512-token blocks, "
    "one one-turn session per request), vllm-multiturn (vLLM's multi-turn benchmark conversations "
    "JSON, tokenised approximately), kvpool (this tool's session JSONL). Default: auto"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Read agent traces into kvpool's session model (sessions -> turns, prompts as chained block "
        "ids), generate synthetic sessions shaped like published workloads, and measure a trace's "
        "potential prefix-cache hit rate and shape."
    )
    sub = parser.add_subparsers(dest="trace_command", metavar="ACTION", required=True)

    p = sub.add_parser("convert", help="convert trace files to kvpool session JSONL", description=(
        "Convert traces to kvpool session JSONL (one session a line). Several inputs, or a "
        "directory of .json/.jsonl files, are concatenated into one output."))
    p.add_argument("inputs", nargs="+", metavar="IN", help="trace files or directories of them")
    p.add_argument("--format", default="auto", choices=("auto", *FORMATS), help=_FORMAT_HELP)
    p.add_argument("-o", "--output", required=True, metavar="OUT.jsonl", help="where to write the sessions")
    _add_tokenise_options(p)

    p = sub.add_parser("synth", help="generate synthetic agent sessions", description=(
        "Generate seeded synthetic sessions. codex: Codex/SWE-bench Pro shape (calls per session "
        "median 30 / mean 33, context ~12K -> ~80K tokens, ~2.2K new tokens per call, input:output "
        "131:1, tool time median 5.2 s / P99 81.4 s, a 4K-token system prompt shared by all "
        "sessions). seed-scaleout: the reference scale-out load (20K shared prefix, 10K first "
        "input, +900 answer +2,048 new tokens per turn, 30 turns, no think time)."))
    p.add_argument("--profile", choices=tuple(PROFILES), default="codex", help="workload shape (default: codex)")
    p.add_argument("--sessions", type=int, default=100, metavar="N", help="number of sessions (default: 100)")
    p.add_argument("--scale", type=float, default=1.0, metavar="S", help=(
        "multiply every token count by S, e.g. 0.05 for CPU runs; turn counts and times keep "
        "their shape (default: 1.0)"))
    p.add_argument("--block-size", type=int, default=16, metavar="TOKENS", help="tokens per block id (default: 16)")
    p.add_argument("--seed", type=int, default=0, metavar="K", help=(
        "random seed; session i depends only on (seed, i), so more sessions extend a file (default: 0)"))
    p.add_argument("-o", "--output", required=True, metavar="OUT.jsonl", help="where to write the sessions")

    p = sub.add_parser("analyze", help="potential hit rate and shape of a trace", description=(
        "Measure a trace: the prefix-cache hit rate an unbounded cache could reach (one cache "
        "shared by all sessions, and one cache per session), input:output ratio, turns per session, "
        "think time, context growth. A turn hits the longest prefix of its block chain seen before."))
    p.add_argument("inputs", nargs="+", metavar="FILE", help="trace files or directories (any format)")
    p.add_argument("--format", default="auto", choices=("auto", *FORMATS), help=_FORMAT_HELP)
    p.add_argument("--json", action="store_true", help="print the statistics as one JSON object instead of a table")
    p.add_argument("--sessions-detail", action="store_true", help="with --json, add one entry per session")
    p.add_argument("--plots", metavar="DIR", help="also write PNG plots (context growth, think time, turns, hit rate by turn) to DIR")
    _add_tokenise_options(p)


def _add_tokenise_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-size", type=int, default=64, metavar="TOKENS", help=(
        "vllm-multiturn only: tokens per block id (default: 64; other formats carry their own)"))
    p.add_argument("--chars-per-token", type=float, default=4.0, metavar="C", help=(
        "vllm-multiturn only: approximate tokenisation, C characters per token (default: 4)"))


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True,
    )


def _load_all(args: argparse.Namespace, console: Console) -> list[Session]:
    files = expand_inputs(args.inputs)
    sessions: list[Session] = []
    with _progress(console) as progress:
        task = progress.add_task("reading traces", total=len(files))
        for path in files:
            sessions.extend(load_trace(path, args.format, block_size=args.block_size, chars_per_token=args.chars_per_token))
            progress.advance(task)
    seen: set[str] = set()
    for s in sessions:
        if s.session_id in seen:
            raise TraceFormatError(f"session id {s.session_id!r} appears twice; inputs overlap (same file twice?)")
        seen.add(s.session_id)
    return sessions


def _write(sessions: list[Session], output: str, console: Console) -> None:
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    write_sessions(tmp, sessions)
    tmp.replace(out)  # a reader never sees half a file
    turns = sum(len(s.turns) for s in sessions)
    console.print(f"wrote {len(sessions):,} sessions, {turns:,} turns to {out}")


def _convert(args: argparse.Namespace, console: Console) -> int:
    _write(_load_all(args, console), args.output, console)
    return 0


def _synth(args: argparse.Namespace, console: Console) -> int:
    config = SynthConfig(profile=args.profile, num_sessions=args.sessions, scale=args.scale, block_size=args.block_size, seed=args.seed)
    sessions = []
    with _progress(console) as progress:
        task = progress.add_task(f"synthesizing {args.profile}", total=config.num_sessions)
        for i in range(config.num_sessions):
            sessions.append(synth_session(config, i))
            progress.advance(task)
    _write(sessions, args.output, console)
    return 0


def _analyze(args: argparse.Namespace, console: Console) -> int:
    from kvpool.workload.analysis import analyze
    from kvpool.workload.report import save_plots, stats_dict, stats_table

    sessions = _load_all(args, console)
    title = ", ".join(Path(p).name for p in args.inputs)
    with _progress(console) as progress:
        task = progress.add_task("analyzing", total=2 * sum(len(s.turns) for s in sessions))
        stats = analyze(sessions, on_turn=lambda: progress.advance(task))
    if args.json:
        print(json.dumps(stats_dict(stats, with_sessions=args.sessions_detail), indent=2))
    else:
        console.print(stats_table(stats, title))
    if args.plots:
        for path in save_plots(stats, args.plots, title):
            console.print(f"plot: {path}")
    return 0


def run(args: argparse.Namespace) -> int:
    # with --json, stdout carries only the JSON: progress and notes go to stderr
    console = Console(stderr=bool(getattr(args, "json", False)))
    action = {"convert": _convert, "synth": _synth, "analyze": _analyze}[args.trace_command]
    try:
        return action(args, console)
    except (TraceFormatError, ValueError, OSError) as e:
        print(f"kvpool trace {args.trace_command}: {e}", file=sys.stderr)
        return 2
