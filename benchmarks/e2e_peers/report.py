"""The benchmark's report: results.md (tables), summary.json (the aggregates) and e2e_peers.png."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from rich.table import Table

from e2e_peers import aggregate, cold_prompts, cpu_time
from e2e_peers.aggregate import METRICS, RunRecord, Spread
from e2e_peers.configs import CONFIGS, KVPOOL_CONFIGS, LMCACHE_CONFIGS, MOONCAKE_CONFIGS, OFFLOAD_CONFIGS
from kvpool.bench.demo_cli import _md_table

COLUMNS = ("configuration", "runs ok", "hit rate (potential)", "TTFT P50", "TTFT P90", "TTFT P99", "end-to-end P50",
           "throughput (tok/s)")  # fmt: skip
ROW_METRICS = ("ttft_p50", "ttft_p90", "ttft_p99", "e2e_p50", "throughput")


def _value(name: str, v: float | None) -> str:
    if v is None:
        return "n/a"
    unit = METRICS[name][1]
    if unit == "%":
        return f"{100 * v:.1f} %"
    if unit == "s":
        return f"{v:.3f}" if v < 10 else f"{v:.1f}"
    return f"{v / 1000:.1f} K"


def cell(name: str, s: Spread) -> str:
    """median (min-max), with the unit once."""
    if s.median is None:
        return "n/a"
    unit = {"%": "", "s": " s", "tok/s": ""}[METRICS[name][1]]
    if s.count == 1:
        return _value(name, s.median) + unit
    return f"{_value(name, s.median)} ({_value(name, s.low)}-{_value(name, s.high)}){unit}"


def _configs_in(runs: list[RunRecord]) -> list[str]:
    return [c for c in CONFIGS if any(r.config == c for r in runs)]


def rows(runs: list[RunRecord]) -> list[tuple[str, ...]]:
    out = []
    for name in _configs_in(runs):
        s = aggregate.spreads(runs, name)
        total = sum(r.config == name for r in runs)
        hit = cell("hit_rate", s["hit_rate"]) + f" ({_value('potential_hit_rate', s['potential_hit_rate'].median)})"
        out.append((CONFIGS[name].label, f"{s['ttft_p50'].count} / {total}", hit,
                    *(cell(m, s[m]) for m in ROW_METRICS)))  # fmt: skip
    return out


def _x(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


PEER_CONFIGS = MOONCAKE_CONFIGS + OFFLOAD_CONFIGS + LMCACHE_CONFIGS  # what kvpool is compared with
# like-for-like pairs against the reference and vLLM's own offloading: (kvpool, peer, what is compared)
PAIRS = (("kvpool_rr", "mooncake_store", "the same round-robin router: the pool against the pool"),
         ("kvpool_cache_aware", "mooncake_store_cache_aware", "the same cache_aware router"),
         ("kvpool_cache_aware", "mooncake_store", "each with its best router: ours against the reference as shipped"),
         ("kvpool_rr", "vllm_offload", "the same round-robin router"),
         ("kvpool_cache_aware", "vllm_offload_cache_aware", "the same cache_aware router"))  # fmt: skip


def ratio_rows(runs: list[RunRecord]) -> list[tuple[str, ...]]:
    """Every kvpool configuration against every peer configuration that has usable runs."""
    out = []
    for lm in PEER_CONFIGS:
        if not aggregate.spreads(runs, lm)["ttft_p50"].count:
            continue
        for kv in KVPOOL_CONFIGS:
            if not aggregate.spreads(runs, kv)["ttft_p50"].count:
                continue
            r = aggregate.ratios(runs, kv, lm)
            cells = []
            for m in aggregate.RATIO_METRICS:
                pr = r[m]["per_round"]
                per_round = f"{_x(pr.median)} ({_x(pr.low)}-{_x(pr.high)}, {pr.count} rounds)" if pr.count else "n/a"
                cells.append(f"{_x(r[m]['of_medians'])}; per round {per_round}")
            out.append((f"{CONFIGS[kv].label} vs {CONFIGS[lm].label}", *cells))
    return out


# the goal, against the LMCache configuration best on each metric: (metric, needed ratio, words)
GOALS = (("ttft_p50", 1.3, "P50 TTFT >= 1.3x lower"), ("throughput", 1.3, "throughput >= 1.3x higher"),
         ("ttft_p99", 1.0, "P99 TTFT no worse"))  # fmt: skip


def pair_goals(trace: str) -> tuple[tuple[str, float, str], ...]:
    """The goals against the reference and vLLM's offloading: throughput must lead by 1.3x only on
    the long trace, where the pool is smaller than the working set and eviction decides."""
    throughput = 1.3 if trace == "long" else 1.0
    return (("ttft_p50", 1.3, "P50 TTFT >= 1.3x lower"), ("ttft_p99", 1.0, "P99 TTFT no worse"),
            ("throughput", throughput, f"throughput {'>= 1.3x higher' if throughput > 1 else 'no worse'}"))  # fmt: skip


def _met(r: dict, needed: float) -> bool:
    pr, of_medians = r["per_round"], r["of_medians"]
    return of_medians is not None and of_medians >= needed and (not pr.count or pr.median >= needed)


def pair_lines(runs: list[RunRecord], trace: str) -> list[str]:
    """Per like-for-like pair with usable runs on both sides: each goal's ratio and whether it is met."""
    lines = []
    for kv, peer, words in PAIRS:
        if not (aggregate.spreads(runs, kv)["ttft_p50"].count and aggregate.spreads(runs, peer)["ttft_p50"].count):
            continue
        r = aggregate.ratios(runs, kv, peer)
        cells = []
        for m, needed, goal in pair_goals(trace):
            pr = r[m]["per_round"]
            cells.append(f"{goal}: {_x(r[m]['of_medians'])} (per round {_x(pr.median)}, {_x(pr.low)}-{_x(pr.high)}) "
                         f"{'met' if _met(r[m], needed) else 'NOT met'}")  # fmt: skip
        lines.append(f"- {CONFIGS[kv].label} vs {CONFIGS[peer].label} ({words}): " + "; ".join(cells))
    for kv in dict.fromkeys(kv for kv, _, _ in PAIRS):
        s = aggregate.spreads(runs, kv)
        hit, potential = s["hit_rate"].median, s["potential_hit_rate"].median
        if hit is not None and potential:
            gap = round(100 * (potential - hit), 3)
            lines.append(f"- {CONFIGS[kv].label}: hit rate {100 * hit:.1f} % of a potential {100 * potential:.1f} % "
                         f"-> within 1 point {'met' if gap <= 1.0 else 'NOT met'}")  # fmt: skip
    return lines


def goal_lines(runs: list[RunRecord], kvpool: str = "kvpool_cache_aware") -> list[str]:
    """Per goal: the best LMCache configuration on that metric, the ratio of medians and per round."""
    if not aggregate.spreads(runs, kvpool)["ttft_p50"].count:
        return []
    lines = []
    for m, needed, words in GOALS:
        best = aggregate.best_of(runs, LMCACHE_CONFIGS, by=m)
        if best is None:
            continue
        r = aggregate.ratios(runs, kvpool, best)[m]
        pr, of_medians = r["per_round"], r["of_medians"]
        met = of_medians is not None and of_medians >= needed and (not pr.count or pr.median >= needed)
        lines.append(f"- {words}, against the best LMCache on it ({CONFIGS[best].label}): ratio of medians "
                     f"{_x(of_medians)}, per round {_x(pr.median)} ({_x(pr.low)}-{_x(pr.high)}, {pr.count} rounds)"
                     f" -> {'met' if met else 'NOT met'}")  # fmt: skip
    hit = aggregate.spreads(runs, kvpool)["hit_rate"].median
    potential = aggregate.spreads(runs, kvpool)["potential_hit_rate"].median
    if hit is not None and potential:
        gap = round(100 * (potential - hit), 3)
        lines.append(f"- hit rate within 1 point of the potential: {100 * hit:.1f} % of {100 * potential:.1f} % "
                     f"-> {'met' if gap <= 1.0 else 'NOT met'}")  # fmt: skip
    return lines


RATIO_COLUMNS = ("pair (> 1: kvpool better)", "P50 TTFT (peer / kvpool)", "P90 TTFT", "P99 TTFT",
                 "throughput (kvpool / peer)")  # fmt: skip


BREAKDOWN_COLUMNS = ("configuration", "client TTFT", "server TTFT", "queue", "prefill (incl. KV load)", "decode",
                     "pool lookup (per call)", "store load (per job)", "store save (per job)")  # fmt: skip
BREAKDOWN_KEYS = ("server_ttft", "queue", "prefill", "decode", "pool_lookup", "pool_load", "pool_save")


def breakdown_rows(saved: list[dict], runs: list[RunRecord]) -> list[tuple[str, ...]]:
    """Per configuration, the median over its usable runs of each per-request mean."""
    ok = {(r.config, r.round_index) for r in runs if aggregate.usable(r)}
    out = []
    for name in _configs_in(runs):
        mine = [r for r in saved if (r["config"], r["round"]) in ok and r["config"] == name and r.get("breakdown")]
        if not mine:
            continue

        def med(values: list[float | None]) -> str:
            values = [v for v in values if v is not None]
            if not values:
                return "-"
            m = statistics.median(values)
            return f"{1000 * m:.0f} ms" if m < 1 else f"{m:.2f} s"

        client = med([r["summary"]["ttft_s"].get("mean") for r in mine])
        cells = [med([(r["breakdown"].get(k) or {}).get("mean_s") for r in mine]) for k in BREAKDOWN_KEYS]
        out.append((CONFIGS[name].label, client, *cells))
    return out


def console_table(runs: list[RunRecord]) -> Table:
    table = Table(title="e2e peers: medians (min-max) over rounds")
    for col in COLUMNS:
        table.add_column(col, justify="left" if col == "configuration" else "right")
    for row in rows(runs):
        table.add_row(*row)
    return table


def _loads(saved: list[dict]) -> str:
    loads = [m["load_avg_1_5_15m"][0] for r in saved for key in ("machine_at_start", "machine_at_end")
             if (m := r.get(key)) and m.get("load_avg_1_5_15m")]  # fmt: skip
    return f"{min(loads):.1f}-{max(loads):.1f}" if loads else "n/a"


def _trace_key(settings: dict | list) -> str:
    names = {s.get("trace", "demo") for s in (settings if isinstance(settings, list) else [settings])}
    return names.pop() if len(names) == 1 else "mixed"


def _trace_name(settings: dict | list) -> str:
    names = {s.get("trace", "demo") for s in (settings if isinstance(settings, list) else [settings])}
    return " / ".join(sorted(names)) if names != {"demo"} else "demo's agent"


def markdown(saved: list[dict], runs: list[RunRecord], settings: dict | list, code: dict | list, load_note: str) -> str:
    machine = saved[0].get("machine_at_start") or {}
    ratio_body = ratio_rows(runs)
    lines = [
        f"# kvpool vs its peers (Mooncake Store, vLLM's offloading, LMCache) and plain vLLM, end to end on the "
        f"{_trace_name(settings)} trace", "",
        "Made by `benchmarks/e2e_peers/run.py` (its docstring has the method). Every figure is a median over "
        "rounds with the min-max in brackets; rounds interleave the configurations (order rotated each round).",
        "", f"Trace: {saved[0].get('trace', 'n/a')}.", "",
        f"Machine: {machine.get('cpu')}, {machine.get('cores')} cores, {machine.get('memory_gib')} GiB, no GPU; "
        f"1-minute load average during the runs {_loads(saved)}. {load_note}".rstrip(), "",
        f"Settings: {json.dumps(settings)}", "", f"Code: {code}", "",
        "Where the extra memory goes: " + "; ".join(sorted({f"{r['label']}: {r['memory']}" for r in saved if r.get('memory')})),
        "",
    ]  # fmt: skip
    lines += _md_table(COLUMNS, rows(runs)) + [""]
    if ratio_body:
        lines += ["Ratios of each kvpool configuration to each peer configuration: ratio of the medians; per "
                  "round: the same round's pair, median (min-max).", ""]  # fmt: skip
        lines += _md_table(RATIO_COLUMNS, ratio_body) + [""]
        pairs = pair_lines(runs, _trace_key(settings))
        if pairs:
            lines += ["Goals against the reference (vLLM + MooncakeStoreConnector) and vLLM's own offloading, like "
                      "for like (ratio of medians, per-round median and range; > 1: kvpool better):", "", *pairs, ""]  # fmt: skip
        goals = goal_lines(runs)
        if goals:
            lines += ["Goal: kvpool with the cache_aware router against the LMCache configuration "
                      "that is best on each metric:", "", *goals, ""]  # fmt: skip
    else:
        lines += ["No ratios: no usable run of kvpool or of any LMCache configuration.", ""]
    breakdown = breakdown_rows(saved, runs)
    if breakdown:
        lines += ["Where the time goes: per-request means from the servers' own histograms (vLLM's queue, prefill, "
                  "decode and TTFT; KVPoolConnector's lookup, load and save jobs; MooncakeStoreConnector's load_get and "
                  "save_put operations), median over runs. The client's TTFT "
                  "adds the router and HTTP to the server's.", ""]  # fmt: skip
        lines += _md_table(BREAKDOWN_COLUMNS, breakdown) + [""]
    lines += cold_lines(saved, runs)
    lines += cpu_time.report_lines(saved)
    failed = aggregate.failures(runs)
    if failed:
        lines += ["## Runs without figures", ""]
        by_key = {(r["config"], r["round"]): r for r in saved}
        for f in failed:
            r = by_key[(f.config, f.round_index)]
            req = (r.get("summary") or {}).get("requests")
            why = r.get("error") or f"{req['error']} requests failed, {req['skipped']} skipped: {r.get('errors')}"
            lines += [f"- round {f.round_index + 1}, {r['label']}: {why[-1500:]}".replace("\n", "\n  "), ""]
    return "\n".join(lines) + "\n"


def cold_lines(saved: list[dict], runs: list[RunRecord], kvpool: str = "kvpool_cache_aware") -> list[str]:
    """Cold prompts apart from warm ones (cold_prompts.py): where the TTFT tail sits."""
    usable = {(r.config, r.round_index) for r in runs if aggregate.usable(r)}
    body = cold_prompts.rows(saved, usable, {n: CONFIGS[n].label for n in _configs_in(runs)})
    if not body:
        return []
    lines = [f"Cold prompts (less than {cold_prompts.COLD_FRACTION:.0%} of the prompt cacheable even in principle: "
             "first turns, new files; every configuration computes them) and warm ones (what a cache can serve), "
             "median over runs (cold_prompts.py):", ""]  # fmt: skip
    lines += _md_table(cold_prompts.COLUMNS, body) + [""]
    for peer in PEER_CONFIGS:
        ratios = cold_prompts.warm_p99_ratios(saved, usable, kvpool, peer)
        if ratios:
            lines.append(f"- warm prompts' P99 TTFT, {CONFIGS[peer].label} / {CONFIGS[kvpool].label} per round: "
                         + ", ".join(f"{r:.2f}x" for r in ratios) + f" (median {statistics.median(ratios):.2f}x)")
    return lines + [""]


def plot(runs: list[RunRecord], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [n for n in _configs_in(runs) if aggregate.spreads(runs, n)["ttft_p50"].count]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    x = np.arange(len(names))
    for j, (m, label) in enumerate((("ttft_p50", "P50"), ("ttft_p90", "P90"), ("ttft_p99", "P99"))):
        s = [aggregate.spreads(runs, n)[m] for n in names]
        med = np.array([v.median for v in s])
        err = np.array([[v.median - v.low for v in s], [v.high - v.median for v in s]])
        ax1.bar(x + (j - 1) * 0.27, med, 0.27, yerr=err, capsize=3, label=label)
    ax1.set_xticks(x, [CONFIGS[n].label.replace(", ", ",\n", 1) for n in names], fontsize=7)
    ax1.set_ylabel("TTFT (s)")
    ax1.set_yscale("log")
    ax1.legend()
    ax1.set_title("TTFT, median over rounds (bars: min-max)")
    s = [aggregate.spreads(runs, n)["throughput"] for n in names]
    med = np.array([v.median for v in s]) / 1000
    err = np.array([[v.median - v.low for v in s], [v.high - v.median for v in s]]) / 1000
    ax2.bar(x, med, 0.6, yerr=err, capsize=3, color="tab:green")
    ax2.set_xticks(x, [CONFIGS[n].label.replace(", ", ",\n", 1) for n in names], fontsize=7)
    ax2.set_ylabel("throughput (K tok/s, input + output)")
    ax2.set_title("throughput, median over rounds")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write(out_dir: Path, saved: list[dict], runs: list[RunRecord], settings: dict | list, code: dict | list,
          load_note: str) -> list[Path]:  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "results.md"
    md.write_text(markdown(saved, runs, settings, code, load_note))
    present = _configs_in(runs)
    summary = {"settings": settings, "code": code,
               "configs": {n: {m: vars(s) for m, s in aggregate.spreads(runs, n).items()} for n in present},
               "best_lmcache_by_metric": {m: aggregate.best_of(runs, LMCACHE_CONFIGS, by=m)
                                          for m in aggregate.RATIO_METRICS},
               "ratios": {f"{kv}/{lm}": {m: {"of_medians": r["of_medians"], "per_round": vars(r["per_round"])}
                                         for m, r in aggregate.ratios(runs, kv, lm).items()}
                          for kv in KVPOOL_CONFIGS if kv in present for lm in PEER_CONFIGS if lm in present},
               "goals": goal_lines(runs), "pair_goals": pair_lines(runs, _trace_key(settings))}  # fmt: skip
    js = out_dir / "summary.json"
    js.write_text(json.dumps(summary, indent=1))
    paths = [md, js]
    if any(aggregate.usable(r) for r in runs):
        paths.append(plot(runs, out_dir / "e2e_peers.png"))
    timelines = cpu_time.plot_timelines(saved, out_dir / "cpu_timeline.png")
    if timelines is not None:
        paths.append(timelines)
    return paths
