"""Markdown, JSON and a plot from the peers benchmark's results (run.py)."""

from __future__ import annotations

import json
import statistics
import textwrap
from pathlib import Path

# (case, field, row title, unit, higher is better)
METRICS = [
    ("get_1m", "get_gbps", "zero-copy get, 1 MiB objects", "GB/s", True),
    ("get_1m", "put_gbps", "zero-copy put, 1 MiB objects", "GB/s", True),
    ("bw_16m", "get_gbps", "zero-copy get, 16 MiB objects", "GB/s", True),
    ("bw_16m", "put_gbps", "zero-copy put, 16 MiB objects", "GB/s", True),
    ("sg", "get_gbps", "scatter-gather get, objects of 32 x 64 KiB", "GB/s", True),
    ("sg", "put_gbps", "scatter-gather put, objects of 32 x 64 KiB", "GB/s", True),
    ("lookup", "chain1000_keys_per_s", "1,000-key batch lookup", "M keys/s", True),
    ("lookup", "rtt_p50_us", "single-key lookup round trip, P50", "us", False),
    ("lookup", "rtt_p99_us", "single-key lookup round trip, P99", "us", False),
    ("plain_64k", "get_gbps", "plain get of 64 KiB values (bytes)", "GB/s", True),
    ("plain_64k", "put_gbps", "plain put of 64 KiB values (bytes)", "GB/s", True),
    ("agent", "loops_per_s", "4 clients, agent-like loop (lookup 9, get 8 x 256 KiB, put 2): loops/s", "loops/s", True),
    ("agent", "p99_ms", "4 clients, agent-like loop: P99 per loop", "ms", False),
    ("agent", "lookup_p99_ms", "agent-like loop: P99 of its lookup", "ms", False),
    ("agent", "get_p99_ms", "agent-like loop: P99 of its get", "ms", False),
    ("agent", "put_p99_ms", "agent-like loop: P99 of its put", "ms", False),
]
GOALS = [  # (case, field, against, factor): kvpool-nixl's value / the peer's, per round
    ("get_1m", "get_gbps", "mooncake-tcp", 1.5),
    ("get_1m", "put_gbps", "mooncake-tcp", 1.5),
    ("bw_16m", "get_gbps", "mooncake-tcp", 1.5),
    ("bw_16m", "put_gbps", "mooncake-tcp", 1.5),
    ("sg", "get_gbps", "mooncake-tcp", 1.5),
    ("lookup", "rtt_p50_us", "mooncake-tcp", 1.0),
    ("agent", "p99_ms", "mooncake-tcp", 1.0),
    ("agent", "p99_ms", "redis", 1.0),
    ("plain_64k", "get_gbps", "redis", 1.0),
    ("plain_64k", "put_gbps", "redis", 1.0),
]
GOALS += [(f"plain_sweep/{size}", field, "redis", 1.0) for size in (4096, 65536, 1 << 20, 4 << 20)
          for field in ("get_gbps", "put_gbps", "reader_get_gbps")]
SUBJECT = "kvpool-nixl"
# The same-host path against the peer's same-host mode ("on both paths"): kvpool-same vs Mooncake IPC.
SAME_HOST_SUBJECT = "kvpool-same"
SAME_HOST_GOALS = [("agent", "p99_ms", "mooncake-ipc", 1.0), ("lookup", "rtt_p50_us", "mooncake-ipc", 1.0)]


for _size, _name in [(4096, "4 KiB"), (65536, "64 KiB"), (1 << 20, "1 MiB"), (4 << 20, "4 MiB")]:
    METRICS += [(f"plain_sweep/{_size}", "get_gbps", f"plain get, {_name} values (sweep)", "GB/s", True),
                (f"plain_sweep/{_size}", "reader_get_gbps", f"plain get by another client, {_name} values (sweep)",
                 "GB/s", True),
                (f"plain_sweep/{_size}", "put_gbps", f"plain put, {_name} values (sweep)", "GB/s", True)]


def _case(r: dict, case: str) -> dict | None:
    """A round's results for `case`; "plain_sweep/65536" names one size of the sweep."""
    top, _, sub = case.partition("/")
    got = r.get(top)
    return got.get(sub) if sub and got is not None else got


def _values(results: dict, peer: str, case: str, field: str) -> dict[int, float]:
    return {r["round"]: _case(r, case)[field] for r in results["rounds"].get(peer, [])
            if _case(r, case) is not None and field in _case(r, case)}  # fmt: skip


def _fmt(value: float, unit: str) -> str:
    if unit == "M keys/s":
        return f"{value / 1e6:.2f}"
    if unit in ("us", "loops/s"):
        return f"{value:.0f}"
    if unit == "ms":
        return f"{value:.1f}"
    return f"{value:.2f}"


def ratios(results: dict, case: str, field: str, peer: str, higher_better: bool, subject: str = SUBJECT) -> list[float]:
    """Per round: how many times better `subject` (kvpool-nixl) is than `peer` (>1: kvpool ahead)."""
    mine, theirs = _values(results, subject, case, field), _values(results, peer, case, field)
    common = sorted(set(mine) & set(theirs))
    return [(mine[r] / theirs[r]) if higher_better else (theirs[r] / mine[r]) for r in common if mine[r] and theirs[r]]


def write_report(results: dict, out_dir: Path, name: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(results, indent=2))
    from servers import PEERS

    peers = [p for p in results["rounds"] if results["rounds"][p]]
    m = results["machine"]
    lines = [
        "# kvpool side by side with Mooncake Store and Redis", "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB (a VM), kernel "
        f"{m['kernel']}, Python {m['python']}. Load average {results['load_avg_start'][0]:.1f} at start, "
        f"{results['load_avg_end'][0]:.1f} at the end: other work on the same cores "
        "moves absolute figures by tens of percent between runs; the ratios come from the same rounds.",
        "",
        f"Rounds: {results['config']['rounds']} measured after one warm-up round, peers in rotated order per "
        f"round; figures are medians over rounds{' (--quick sizes)' if results['config']['quick'] else ''}. "
        "Method: `method.md`. Script: `benchmarks/peers/run.py`.",
    ]  # fmt: skip
    if results["config"].get("note"):
        lines += ["", results["config"]["note"]]
    lines += ["", "| case | unit | " + " | ".join(PEERS[p].label for p in peers) + " |",
              "|---|---|" + "---|" * len(peers)]  # fmt: skip
    for case, field, title, unit, _ in METRICS:
        cells = []
        for p in peers:
            v = list(_values(results, p, case, field).values())
            cells.append(_fmt(statistics.median(v), unit) if v else "-")
        if any(c != "-" for c in cells):
            lines.append(f"| {title} | {unit} | " + " | ".join(cells) + " |")
    # the cross-host subject when it ran, else the same-host one (a same-host-only run)
    subject = next((s for s in (SUBJECT, SAME_HOST_SUBJECT) if s in peers), None)
    others = [p for p in peers if p != subject]
    if subject is not None and others:
        lines += ["", f"## {PEERS[subject].label} against each peer: per-round ratios, median [min - max]",
                  "", ">1: kvpool better (higher bandwidth, lower latency).", "",
                  "| case | " + " | ".join(PEERS[p].label for p in others) + " |", "|---|" + "---|" * len(others)]  # fmt: skip
        for case, field, title, unit, higher in METRICS:
            cells = []
            for p in others:
                rs = ratios(results, case, field, p, higher, subject)
                cells.append(f"{statistics.median(rs):.2f} [{min(rs):.2f} - {max(rs):.2f}]" if rs else "-")
            if any(c != "-" for c in cells):
                lines.append(f"| {title} | " + " | ".join(cells) + " |")
        lines += ["", "## Goals", ""]
        goals = [(SUBJECT, *g) for g in GOALS if SUBJECT in peers]
        goals += [(SAME_HOST_SUBJECT, *g) for g in SAME_HOST_GOALS if SAME_HOST_SUBJECT in peers]
        for subject, case, field, against, factor in goals:
            title, higher = next((t, h) for c, f, t, _, h in METRICS if (c, f) == (case, field))
            rs = ratios(results, case, field, against, higher, subject)
            if subject != SUBJECT:
                title = f"{PEERS[subject].label}: {title}"
            if not rs:
                lines.append(f"- {title}: not measured")
                continue
            med = statistics.median(rs)
            verdict = "met" if med >= factor else "NOT met"
            level = "at or above" if higher else "at or below"
            goal = f">= {factor}x {against}" if factor != 1.0 else f"{level} {against}'s"
            lines.append(f"- {title}: {goal}: median ratio {med:.2f} (range {min(rs):.2f}-{max(rs):.2f}) -> {verdict}")
    if results["skipped"]:
        lines += ["", "## Skipped peers", ""] + [f"- {p}: {why}" for p, why in results["skipped"].items()]
    if results["failed"]:
        lines += ["", "## Failed client runs", ""] + [
            f"- {p}: {msg.splitlines()[0]}" for p, msgs in results["failed"].items() for msg in msgs
        ]
    routes = {p: sorted({x for r in results["rounds"][p] for x in r.get("route", [])}) for p in peers}
    lines += ["", "kvpool routes taken by the clients: " + ", ".join(f"{p}: {routes[p]}" for p in peers if routes[p])]
    (out_dir / f"{name}.md").write_text("\n".join(lines) + "\n")
    _plot(results, peers, out_dir / f"{name}.png")


def _plot(results: dict, peers: list[str], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    from servers import PEERS

    bw = [(c, f, t) for c, f, t, u, _ in METRICS if u == "GB/s"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [3, 1]})
    width = 0.8 / max(1, len(peers))
    for k, p in enumerate(peers):
        meds, lo, hi = [], [], []
        for c, f, _ in bw:
            v = list(_values(results, p, c, f).values())
            med = statistics.median(v) if v else 0.0
            meds.append(med)
            lo.append(med - min(v) if v else 0)
            hi.append(max(v) - med if v else 0)
        xs = [i + k * width for i in range(len(bw))]
        ax1.bar(xs, meds, width, yerr=[lo, hi], label=PEERS[p].label, capsize=2)
    ax1.set_xticks([i + 0.4 - width / 2 for i in range(len(bw))])
    ax1.set_xticklabels([textwrap.fill(t, 18) for _, _, t in bw], fontsize=7)
    ax1.set_ylabel("GB/s (median over rounds; bars: min-max)")
    ax1.legend(fontsize=8)
    for k, p in enumerate(peers):
        v50 = list(_values(results, p, "lookup", "rtt_p50_us").values())
        v99 = list(_values(results, p, "lookup", "rtt_p99_us").values())
        if v50:
            ax2.bar([k - 0.2], [statistics.median(v50)], 0.4, color=f"C{k}")
            ax2.bar([k + 0.2], [statistics.median(v99)], 0.4, color=f"C{k}", alpha=0.5)
    ax2.set_xticks(range(len(peers)))
    ax2.set_xticklabels([PEERS[p].label.replace(" ", "\n", 1) for p in peers], fontsize=7)
    ax2.set_ylabel("single-key lookup round trip, us (solid P50, light P99)")
    m = results["machine"]
    fig.suptitle(f"kvpool vs Mooncake Store vs Redis; {m['cores']}-core VM ({m['cpu']}), shared; hosts = network namespaces",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
