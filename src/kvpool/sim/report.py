"""Side-by-side tables of simulated runs (Markdown, JSON-ready dicts). Pure: strings and dicts out."""

from __future__ import annotations

from typing import Sequence

from kvpool.sim.metrics import Summary

ROWS: list[tuple[str, str, str]] = [
    # (label, Summary field, format); ratio direction follows from "lower" in the label
    ("throughput (tok/s per device, in+out)", "throughput_tok_s_per_device", "{:,.0f}"),
    ("throughput (tok/s, in+out)", "throughput_tok_s", "{:,.0f}"),
    ("P50 TTFT", "ttft_p50_s", "{:.3g} s"),
    ("P90 TTFT", "ttft_p90_s", "{:.3g} s"),
    ("P99 TTFT", "ttft_p99_s", "{:.3g} s"),
    ("P50 end-to-end", "e2e_p50_s", "{:.3g} s"),
    ("P99 end-to-end", "e2e_p99_s", "{:.3g} s"),
    ("hit rate (local + pool)", "hit_rate", "{:.1%}"),
    ("  local", "local_hit_rate", "{:.1%}"),
    ("  pool", "pool_hit_rate", "{:.1%}"),
    ("preemptions", "preemptions", "{:,}"),
    ("pool evictions (blocks)", "pool_evictions", "{:,}"),
    ("mean instance utilisation", "mean_utilisation", "{:.0%}"),
    ("requests done / unfinished", "requests", "{}"),
    ("makespan", "makespan_s", "{:,.0f} s"),
]

HIGHER_IS_BETTER = {"throughput_tok_s_per_device", "throughput_tok_s", "hit_rate", "local_hit_rate", "pool_hit_rate"}
RATIO_FIELDS = ("throughput_tok_s_per_device", "ttft_p50_s", "e2e_p50_s")


def ratio(base: Summary, other: Summary, field: str) -> float:
    a, b = getattr(base, field), getattr(other, field)
    if field in HIGHER_IS_BETTER:
        return b / a if a else float("inf")
    return a / b if b else float("inf")


def markdown_table(summaries: Sequence[Summary], reference: dict[str, str] | None = None) -> str:
    """Columns: each run; then `other / first` ratios (better = > 1) when there are two or more."""
    head = ["metric", *(s.name for s in summaries)]
    if len(summaries) > 1:
        head += [f"{s.name} vs {summaries[0].name}" for s in summaries[1:]]
    if reference:
        head.append("reference")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, field, fmt in ROWS:
        if field == "requests":
            cells = [f"{s.requests} / {s.unfinished}" for s in summaries]
        else:
            cells = [fmt.format(getattr(s, field)) for s in summaries]
        if len(summaries) > 1:
            for s in summaries[1:]:
                cells.append(f"{ratio(summaries[0], s, field):.2f}x" if field in RATIO_FIELDS or field.startswith("ttft")
                             else "")
        if reference:
            cells.append(reference.get(field, ""))
        lines.append("| " + " | ".join([label, *cells]) + " |")
    return "\n".join(lines)


def as_json(summaries: Sequence[Summary]) -> list[dict]:
    return [s.as_dict() for s in summaries]
