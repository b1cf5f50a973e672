"""PNG plots of replays: TTFT CDF and TTFT by turn index, one line per run (e.g. without/with pool)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvpool.bench.replay import RequestRecord
from kvpool.bench.reports import ttft_by_turn

Run = tuple[str, list[RequestRecord]]  # (label, records)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_ttft_cdf(runs: list[Run], path: Path, title: str = "Time to first token") -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, records in runs:
        ttft = np.sort([r.ttft_s for r in records if r.status == "ok" and r.ttft_s is not None])
        if len(ttft):
            ax.step(ttft, np.arange(1, len(ttft) + 1) / len(ttft), where="post", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return _save(fig, plt, path)


def plot_ttft_by_turn(runs: list[Run], path: Path, title: str = "TTFT by turn (P50, P90 dashed)") -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, records in runs:
        by_turn = ttft_by_turn(records)
        turns = list(by_turn)
        (line,) = ax.plot(turns, [by_turn[t]["p50"] for t in turns], marker="o", ms=3, label=label)
        ax.plot(turns, [by_turn[t]["p90"] for t in turns], ls="--", color=line.get_color(), alpha=0.6)
    ax.set_yscale("log")
    ax.set_xlabel("turn index")
    ax.set_ylabel("TTFT (s, log scale)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return _save(fig, plt, path)


def plot_comparison(runs: list[Run], path: Path, title: str) -> Path:
    """Both plots side by side in one PNG (the demo's picture)."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for label, records in runs:
        ttft = np.sort([r.ttft_s for r in records if r.status == "ok" and r.ttft_s is not None])
        if len(ttft):
            left.step(ttft, np.arange(1, len(ttft) + 1) / len(ttft), where="post", label=label)
        by_turn = ttft_by_turn(records)
        right.plot(list(by_turn), [v["p50"] for v in by_turn.values()], marker="o", ms=3, label=label)
    left.set(xscale="log", xlabel="TTFT (s, log scale)", ylabel="fraction of requests", title="TTFT CDF")
    right.set(yscale="log", xlabel="turn index", ylabel="P50 TTFT (s, log scale)", title="TTFT by turn")
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    return _save(fig, plt, path)


def plot_run_bars(rows: list[tuple[str, dict]], path: Path, title: str) -> Path:
    """TTFT P50 / P99 and end-to-end P50 per run, bars side by side (log scale): the demo's rows."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 4.5))
    keys = (("ttft_s", "p50", "TTFT P50"), ("ttft_s", "p99", "TTFT P99"), ("e2e_s", "p50", "end-to-end P50"))
    width = 0.8 / len(keys)
    for k, (metric, pct, name) in enumerate(keys):
        values = [(summary.get(metric) or {}).get(pct) or float("nan") for _, summary in rows]
        bars = ax.bar(np.arange(len(rows)) + (k - 1) * width, values, width, label=name)
        ax.bar_label(bars, labels=[f"{v:.2g}" if v == v else "" for v in values], fontsize=7, padding=1)
    ax.set_xticks(np.arange(len(rows)), [label for label, _ in rows], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("seconds (log scale)")
    ax.set_title(title)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, plt, path)


def _save(fig, plt, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
