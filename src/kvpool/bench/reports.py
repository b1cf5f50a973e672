"""Summaries of a replay: throughput, latency percentiles, TTFT by turn, hit rates; JSON and Markdown.

Pure functions of the records, except `machine()` and the file writers. Percentiles are over
successful requests only; counts say how many failed or were skipped, so nothing is hidden.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict
from pathlib import Path

import numpy as np

from kvpool.bench.replay import ReplayResult, RequestRecord

PERCENTILES = (50, 90, 99)


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in PERCENTILES} | {"mean": None, "max": None}
    arr = np.asarray(values, dtype=float)
    out: dict[str, float | None] = {f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}
    return out | {"mean": float(arr.mean()), "max": float(arr.max())}


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    load = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem_gib, "gpu": None,
            "platform": platform.platform(), "python": platform.python_version(),
            "load_avg_1_5_15m": load}  # other work on the machine skews latencies  # fmt: skip


def code_version() -> dict:
    """The git commit of this checkout and the source files changed since (numbers move with them)."""
    import subprocess

    root = Path(__file__).resolve().parents[3]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                text=True, timeout=10).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=root, capture_output=True,
                               text=True, timeout=10).stdout.split("\n")  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "modified": []}
    return {"commit": commit or None, "modified": [line[3:] for line in dirty if line.strip()]}


def ttft_by_turn(records: list[RequestRecord]) -> dict[int, dict[str, float | int | None]]:
    by_turn: dict[int, list[float]] = {}
    for r in records:
        if r.status == "ok" and r.ttft_s is not None:
            by_turn.setdefault(r.turn_index, []).append(r.ttft_s)
    return {k: {"count": len(v), **percentiles(v)} for k, v in sorted(by_turn.items())}


def summarize(result: ReplayResult) -> dict:
    ok = [r for r in result.records if r.status == "ok"]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    duration = result.duration_s if result.duration_s > 0 else float("nan")
    usage_cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    counters = result.counters
    return {
        "requests": {
            "planned": result.planned_requests,
            "ok": len(ok),
            "error": sum(r.status == "error" for r in result.records),
            "skipped": sum(r.status == "skipped" for r in result.records),
            "sessions": len({r.session_id for r in result.records}),
        },
        "interrupted": result.interrupted,
        "duration_s": result.duration_s,
        "tokens": {"input": input_tokens, "output": output_tokens},
        "throughput_tok_s": {
            "input": input_tokens / duration,
            "output": output_tokens / duration,
            "total": (input_tokens + output_tokens) / duration,
        },
        "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": percentiles([x for r in ok for x in r.itl_s]),
        "e2e_s": percentiles([r.e2e_s for r in ok if r.e2e_s is not None]),
        "ttft_by_turn_s": ttft_by_turn(result.records),
        "hit_rate": {
            # from the servers' /metrics (None: a server could not be read, or a proxy was scraped)
            **(counters.hit_rates(result.config.cache_block_size) if counters is not None
               else {"local": None, "external": None, "combined": None, "combined_loaded": None}),  # fmt: skip
            # from each response's usage (vLLM: --enable-prompt-tokens-details)
            "usage": (sum(usage_cached) / input_tokens) if usage_cached and input_tokens else None,
            # what an unbounded cache shared by every server could have served for these prompts
            "potential": (sum(r.ideal_cached_tokens for r in ok) / input_tokens) if input_tokens else None,
        },
        "server_counters": asdict(counters) if counters is not None else None,
    }


REQUEST_COLUMNS = ("session", "turn", "start_s", "prompt_tokens", "ideal_cached_tokens", "cached_tokens", "ttft_s",
                   "e2e_s", "output_tokens", "status")


def request_rows(records: list[RequestRecord]) -> dict:
    """Every request in a compact table (columns, rows): enough to find and explain a tail request
    without the per-token timings `to_json` keeps."""
    def r3(x: float | None) -> float | None:
        return None if x is None else round(x, 3)

    rows = [[r.session_id, r.turn_index, r3(r.start_s), r.prompt_tokens, r.ideal_cached_tokens, r.cached_tokens,
             r3(r.ttft_s), r3(r.e2e_s), r.output_tokens, r.status] for r in records]  # fmt: skip
    return {"columns": list(REQUEST_COLUMNS), "rows": rows}


def to_json(result: ReplayResult, summary: dict, label: str = "") -> dict:
    return {
        "label": label,
        "model": result.model,
        "max_model_len": result.max_model_len,
        "started_at": result.started_at,
        "machine": machine(),
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(result.config).items()},
        "summary": summary,
        "errors": sorted({r.error for r in result.records if r.error})[:20],
        "records": [asdict(r) for r in result.records],
    }


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=float))


def _fmt(value: float | None, unit: str = "", scale: float = 1.0, digits: int = 3) -> str:
    return "n/a" if value is None or value != value else f"{value * scale:.{digits}g}{unit}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f} %"


def summary_markdown(summary: dict, title: str = "Replay") -> str:
    req, thr, hit = summary["requests"], summary["throughput_tok_s"], summary["hit_rate"]
    lines = [
        f"## {title}",
        "",
        f"{req['ok']} of {req['planned']} requests ok ({req['error']} failed, {req['skipped']} skipped), "
        f"{req['sessions']} sessions, {summary['duration_s']:.1f} s.",
        "",
        "| metric | P50 | P90 | P99 | mean |",
        "|---|---|---|---|---|",
    ]
    for key, name in (("ttft_s", "TTFT"), ("itl_s", "inter-token latency"), ("e2e_s", "end-to-end latency")):
        p = summary[key]
        lines.append(f"| {name} | " + " | ".join(_fmt(p[k], " s") for k in ("p50", "p90", "p99", "mean")) + " |")
    lines += [
        "",
        f"Throughput: {thr['input']:.0f} input tok/s, {thr['output']:.1f} output tok/s, {thr['total']:.0f} total tok/s.",
        "",
        f"Hit rate: combined {_pct(hit['combined'])} (local {_pct(hit['local'])}, pool {_pct(hit['external'])} "
        f"of local misses); less failed pool loads {_pct(hit['combined_loaded'])}; by usage {_pct(hit['usage'])}; "
        f"potential (unbounded shared cache) {_pct(hit['potential'])}.",
        "",
        "| turn | requests | TTFT P50 | TTFT P90 |",
        "|---|---|---|---|",
    ]
    for turn, p in summary["ttft_by_turn_s"].items():
        lines.append(f"| {turn} | {p['count']} | {_fmt(p['p50'], ' s')} | {_fmt(p['p90'], ' s')} |")
    return "\n".join(lines) + "\n"
