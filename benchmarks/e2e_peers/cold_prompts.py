"""Where the TTFT tail sits: cold prompts (most of the prompt new to the trace, so no cache of any
kind can serve it: every configuration computes it) against warm ones (what a KV cache can serve).

A prompt is cold when less than half of it is cacheable in principle: its `ideal_cached_tokens`
(the trace's potential, what an unbounded cache would hold of it) under `COLD_FRACTION` of its
tokens. The first turns of sessions are cold (only a shared system prompt is known), and so are
later turns that bring a large new file. When a trace starts its sessions together, their first
turns arrive as one burst and queue behind each other's prefill: on the demo trace every one of
the slowest 2 % of requests was a first turn of that burst, so the run's P99 TTFT measured the
machine's prefill, not the cache. This table reads the caches apart from that.
"""

from __future__ import annotations

import statistics

import numpy as np

COLD_FRACTION = 0.5
COLUMNS = ("configuration", "cold prompts", "cold: TTFT P99", "warm prompts", "warm: TTFT P50", "warm: TTFT P99",
           "slowest 2 % that are cold")  # fmt: skip


def split(run: dict) -> dict | None:
    """One run's TTFT percentiles for cold and warm prompts, and the share of cold ones among its
    slowest 2 % of requests (at least one request); None without per-request rows."""
    block = run.get("requests")
    if not block or not block.get("rows"):
        return None
    at = {c: i for i, c in enumerate(block["columns"])}
    done = [r for r in block["rows"] if r[at["status"]] == "ok" and r[at["ttft_s"]] is not None]
    if not done:
        return None

    def cold(r: list) -> bool:
        return r[at["ideal_cached_tokens"]] < COLD_FRACTION * r[at["prompt_tokens"]]

    cold_ttft = [r[at["ttft_s"]] for r in done if cold(r)]
    warm_ttft = [r[at["ttft_s"]] for r in done if not cold(r)]
    slowest = sorted(done, key=lambda r: -r[at["ttft_s"]])[: max(1, len(done) // 50)]

    def pct(values: list[float], q: float) -> float | None:
        return float(np.percentile(values, q)) if values else None

    return {"cold_n": len(cold_ttft), "cold_p99": pct(cold_ttft, 99), "warm_n": len(warm_ttft),
            "warm_p50": pct(warm_ttft, 50), "warm_p99": pct(warm_ttft, 99),
            "slowest_cold_share": sum(cold(r) for r in slowest) / len(slowest)}


def rows(saved: list[dict], usable: set[tuple[str, int]], labels: dict[str, str]) -> list[tuple[str, ...]]:
    """Per configuration (in `labels`' order), medians over its usable runs."""
    out = []
    for name, label in labels.items():
        parts = [s for r in saved if (r["config"], r["round"]) in usable and r["config"] == name
                 if (s := split(r)) is not None]  # fmt: skip
        if not parts:
            continue

        def med(key: str, fmt: str) -> str:
            values = [p[key] for p in parts if p[key] is not None]
            return fmt.format(statistics.median(values)) if values else "-"

        out.append((label, med("cold_n", "{:.0f}"), med("cold_p99", "{:.2f} s"), med("warm_n", "{:.0f}"),
                    med("warm_p50", "{:.2f} s"), med("warm_p99", "{:.2f} s"), med("slowest_cold_share", "{:.0%}")))
    return out


def warm_p99_ratios(saved: list[dict], usable: set[tuple[str, int]], kvpool: str, peer: str) -> list[float]:
    """Per round, peer's warm-prompt P99 TTFT / kvpool's (> 1: kvpool's lower)."""
    by_round: dict[int, dict[str, float]] = {}
    for r in saved:
        if (r["config"], r["round"]) in usable and r["config"] in (kvpool, peer):
            s = split(r)
            if s is not None and s["warm_p99"]:
                by_round.setdefault(r["round"], {})[r["config"]] = s["warm_p99"]
    return [v[peer] / v[kvpool] for _, v in sorted(by_round.items()) if len(v) == 2]
