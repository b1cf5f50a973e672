"""Presenting TraceStats: a rich table, a JSON-ready dict, and PNG plots (matplotlib, Agg backend).

Rules: the numbers come from `analysis`; nothing here computes a statistic of its own beyond
grouping per-turn records for a plot. `save_plots` is the only function that writes files.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from rich.table import Table

from kvpool.workload.analysis import HitCounts, Percentiles, TraceStats


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def _num(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:,.2f}"


def _dist(p: Percentiles | None, fmt=_num) -> str:
    if p is None:
        return "-"
    return f"P50 {fmt(p.p50)} | P90 {fmt(p.p90)} | P99 {fmt(p.p99)} | mean {fmt(p.mean)} | max {fmt(p.max)}"


def _hits(h: HitCounts) -> str:
    return f"{_pct(h.token_hit_rate)} of tokens, {_pct(h.block_hit_rate)} of blocks"


def stats_table(stats: TraceStats, title: str) -> Table:
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value")
    rows = [
        ("sessions", f"{stats.num_sessions:,} ({stats.num_subagent_sessions:,} subagents)"),
        ("turns (LLM calls)", f"{stats.num_turns:,}"),
        ("input / output tokens", f"{stats.input_tokens:,} / {stats.output_tokens:,}"),
        ("input:output ratio", "-" if stats.input_output_ratio is None else f"{stats.input_output_ratio:,.1f} : 1"),
        ("potential hit rate, shared cache", _hits(stats.global_hits)),
        ("potential hit rate, per-session cache", _hits(stats.session_hits)),
        ("per-session hit rate (shared cache)", _dist(stats.global_session_hit_rate, _pct)),
        ("turns per session", _dist(stats.turns_per_session)),
        ("think time before a call (s)", _dist(stats.think_time_s)),
        ("context per call (tokens)", _dist(stats.input_tokens_per_turn)),
        ("context at first call (tokens)", _dist(stats.first_turn_input_tokens)),
        ("context at last call (tokens)", _dist(stats.last_turn_input_tokens)),
        ("new tokens per call (tokens)", _dist(stats.new_tokens_per_turn)),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def stats_dict(stats: TraceStats, with_sessions: bool = False) -> dict:
    """A JSON-ready summary; per-turn records are left out (they can be millions)."""

    def hits(h: HitCounts) -> dict:
        return asdict(h) | {"token_hit_rate": h.token_hit_rate, "block_hit_rate": h.block_hit_rate}

    def dist(p: Percentiles | None) -> dict | None:
        return None if p is None else asdict(p)

    out = {
        "num_sessions": stats.num_sessions,
        "num_subagent_sessions": stats.num_subagent_sessions,
        "num_turns": stats.num_turns,
        "input_tokens": stats.input_tokens,
        "output_tokens": stats.output_tokens,
        "input_output_ratio": stats.input_output_ratio,
        "global_hits": hits(stats.global_hits),
        "session_hits": hits(stats.session_hits),
        "global_session_hit_rate": dist(stats.global_session_hit_rate),
        "turns_per_session": dist(stats.turns_per_session),
        "think_time_s": dist(stats.think_time_s),
        "input_tokens_per_turn": dist(stats.input_tokens_per_turn),
        "first_turn_input_tokens": dist(stats.first_turn_input_tokens),
        "last_turn_input_tokens": dist(stats.last_turn_input_tokens),
        "new_tokens_per_turn": dist(stats.new_tokens_per_turn),
    }
    if with_sessions:
        out["sessions"] = [
            {
                "session_id": s.session_id,
                "parent_session_id": s.parent_session_id,
                "num_turns": s.num_turns,
                "input_tokens": s.input_tokens,
                "output_tokens": s.output_tokens,
                "global_hits": hits(s.global_hits),
                "session_hits": hits(s.session_hits),
            }
            for s in stats.sessions
        ]
    return out


def save_plots(stats: TraceStats, out_dir: Path | str, title: str, max_sessions_drawn: int = 60) -> list[Path]:
    """Write trace_context.png, trace_think_time.png, trace_turns.png, trace_hits.png; return the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    by_session: dict[int, list] = {}
    for r in stats.turns:
        by_session.setdefault(r.session_index, []).append(r)
    written: list[Path] = []

    def finish(fig, name: str) -> None:
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    fig, ax = plt.subplots(figsize=(7, 4))
    for records in list(by_session.values())[:max_sessions_drawn]:
        ax.plot([r.turn_index for r in records], [r.input_tokens / 1000 for r in records], lw=0.8, alpha=0.6)
    ax.set_xlabel("turn (LLM call) in session")
    ax.set_ylabel("context sent (K tokens)")
    ax.set_title(f"context growth, {min(len(by_session), max_sessions_drawn)} sessions")
    finish(fig, "trace_context.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    thinks = np.array([r.think_time_s for r in stats.turns if r.turn_index > 0])
    thinks = thinks[thinks > 0]
    if len(thinks):
        ax.hist(thinks, bins=np.logspace(np.log10(thinks.min()), np.log10(thinks.max()) + 1e-9, 50))
        ax.set_xscale("log")
    ax.set_xlabel("think / tool time before a call (s)")
    ax.set_ylabel("calls")
    ax.set_title("think time" + ("" if len(thinks) else " (none in this trace)"))
    finish(fig, "trace_think_time.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist([len(rs) for rs in by_session.values()], bins=40)
    ax.set_xlabel("turns per session")
    ax.set_ylabel("sessions")
    ax.set_title("turns per session")
    finish(fig, "trace_turns.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    max_turn = max((r.turn_index for r in stats.turns), default=0) + 1
    hit = np.zeros(max_turn)
    total = np.zeros(max_turn)
    for r in stats.turns:
        hit[r.turn_index] += r.global_hit_tokens
        total[r.turn_index] += r.input_tokens
    shown = total > 0
    ax.plot(np.arange(max_turn)[shown], 100 * hit[shown] / total[shown], marker=".")
    ax.set_ylim(0, 100)
    ax.set_xlabel("turn (LLM call) in session")
    ax.set_ylabel("potential hit rate (% of tokens)")
    ax.set_title(f"unbounded shared cache: {_pct(stats.global_hits.token_hit_rate)} overall")
    finish(fig, "trace_hits.png")
    return written
