"""Plots of simulated runs (matplotlib, the `bench` extra): imported only when a plot is asked for."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from kvpool.sim.fleet import SimResult
from kvpool.sim.metrics import Summary


def plot_runs(summaries: Sequence[Summary], results: Sequence[SimResult], path: Path | str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s.name for s in summaries]
    x = np.arange(len(names))
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax = axes[0][0]
    ax.bar(x, [s.throughput_tok_s_per_device for s in summaries], color="tab:blue")
    ax.set_title("throughput per device (tok/s, in + out)")
    ax = axes[0][1]
    ax.bar(x - 0.2, [s.ttft_p50_s for s in summaries], 0.4, label="P50")
    ax.bar(x + 0.2, [s.ttft_p99_s for s in summaries], 0.4, label="P99")
    ax.set_yscale("log")
    ax.set_title("TTFT (s, log)")
    ax.legend()
    ax = axes[1][0]
    ax.bar(x, [s.local_hit_rate * 100 for s in summaries], label="local")
    ax.bar(x, [s.pool_hit_rate * 100 for s in summaries], bottom=[s.local_hit_rate * 100 for s in summaries],
           label="pool")
    ax.set_ylim(0, 100)
    ax.set_title("prompt tokens served from cache (%)")
    ax.legend()
    for a in (axes[0][0], axes[0][1], axes[1][0]):
        a.set_xticks(x)
        a.set_xticklabels(names, rotation=15, ha="right", fontsize=8)
    ax = axes[1][1]
    for s, r in zip(summaries, results):
        t = np.sort([rec.ttft_s for rec in r.records])
        if len(t):
            ax.plot(t, np.arange(1, len(t) + 1) / len(t), label=s.name)
    ax.set_xscale("log")
    ax.set_title("TTFT CDF")
    ax.set_xlabel("s")
    ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_curves(curves: dict[str, tuple[Sequence[float], Sequence[float]]], path: Path | str, title: str,
                xlabel: str, ylabel: str, logx: bool = True) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for label, (xs, ys) in curves.items():
        ax.plot(xs, ys, marker="o", label=label)
    if logx:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
