"""Medians and spreads over repeated runs, and kvpool's ratios to the best LMCache configuration.

Pure: plain dicts in (one `reports.summarize` summary per run), plain dicts out; no I/O.

Rules:
- A run counts only if it finished with a summary and none of its requests failed or was skipped
  (a run with failures is listed, never averaged in): `usable()` says which.
- Per configuration and metric: the median and the min-max over its usable runs.
- "Best LMCache" is chosen per metric: the LMCache configuration with the best median on it (the
  goal's comparison is against the hardest peer on each metric, not one peer picked by P50). Ratios are given two
  ways: of the medians, and per round (the same round's kvpool and LMCache runs, minutes apart on
  the same machine) with the median and range of those, which cancels slow drifts of the load.
- Every ratio is oriented so that > 1 means kvpool is better: TTFT ratios are LMCache / kvpool,
  throughput ratios kvpool / LMCache.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

# name -> (path in a summary, unit, lower is better)
METRICS: dict[str, tuple[tuple[str, ...], str, bool]] = {
    "hit_rate": (("hit_rate", "combined"), "%", False),
    "potential_hit_rate": (("hit_rate", "potential"), "%", False),
    "ttft_p50": (("ttft_s", "p50"), "s", True),
    "ttft_p90": (("ttft_s", "p90"), "s", True),
    "ttft_p99": (("ttft_s", "p99"), "s", True),
    "e2e_p50": (("e2e_s", "p50"), "s", True),
    "throughput": (("throughput_tok_s", "total"), "tok/s", False),
}
RATIO_METRICS = ("ttft_p50", "ttft_p90", "ttft_p99", "throughput")


@dataclass(frozen=True)
class RunRecord:
    config: str
    round_index: int
    summary: dict | None
    error: str | None = None


@dataclass(frozen=True)
class Spread:
    median: float | None
    low: float | None
    high: float | None
    count: int

    @classmethod
    def of(cls, values: list[float]) -> "Spread":
        if not values:
            return cls(None, None, None, 0)
        return cls(statistics.median(values), min(values), max(values), len(values))


def metric(summary: dict | None, name: str) -> float | None:
    value = summary
    for key in METRICS[name][0]:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return float(value) if isinstance(value, (int, float)) else None


def usable(run: RunRecord) -> bool:
    if run.summary is None or run.error is not None:
        return False
    req = run.summary.get("requests") or {}
    return req.get("ok", 0) > 0 and req.get("error", 0) == 0 and req.get("skipped", 0) == 0


def spreads(runs: list[RunRecord], config: str) -> dict[str, Spread]:
    mine = [r for r in runs if r.config == config and usable(r)]
    return {name: Spread.of([v for r in mine if (v := metric(r.summary, name)) is not None]) for name in METRICS}


def _better_ratio(name: str, kvpool: float | None, other: float | None) -> float | None:
    if kvpool is None or other is None or kvpool <= 0 or other <= 0:
        return None
    return other / kvpool if METRICS[name][2] else kvpool / other


def best_of(runs: list[RunRecord], configs: tuple[str, ...], by: str = "ttft_p50") -> str | None:
    """The configuration among `configs` with the best median `by` (None if none has usable runs)."""
    scored = [(s.median, c) for c in configs if (s := spreads(runs, c)[by]).median is not None]
    if not scored:
        return None
    return (min if METRICS[by][2] else max)(scored)[1]


def ratios(runs: list[RunRecord], kvpool: str, other: str) -> dict[str, dict[str, float | None | Spread]]:
    """kvpool vs `other` per metric: {"of_medians": x, "per_round": Spread}, > 1 = kvpool better."""
    a, b = spreads(runs, kvpool), spreads(runs, other)
    by_round: dict[int, dict[str, RunRecord]] = {}
    for r in runs:
        if usable(r) and r.config in (kvpool, other):
            by_round.setdefault(r.round_index, {})[r.config] = r
    out: dict[str, dict[str, float | None | Spread]] = {}
    for name in RATIO_METRICS:
        paired = [_better_ratio(name, metric(pair[kvpool].summary, name), metric(pair[other].summary, name))
                  for pair in by_round.values() if kvpool in pair and other in pair]  # fmt: skip
        out[name] = {"of_medians": _better_ratio(name, a[name].median, b[name].median),
                     "per_round": Spread.of([x for x in paired if x is not None])}  # fmt: skip
    return out


def failures(runs: list[RunRecord]) -> list[RunRecord]:
    return [r for r in runs if not usable(r)]
