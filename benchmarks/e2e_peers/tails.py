"""Why the slowest requests were slow: each request's route (from `kvpool router`'s access log) next
to what the server then served from cache (from the replay), for every saved run.

A request the router sent somewhere expecting its prefix cached (in that server's own KV, or in the
pool) that the server then recomputed is a "surprise": its recompute queues every request behind it
on that server, and the router, believing the server lightly loaded, may send it more. `--report`
writes OUT/tails.md: per configuration, how many requests were surprises, how many of the slowest
10 % were, and the slowest requests of each run.

An analysis of one e2e_peers run folder (not a benchmark of its own): it writes into that folder.

    python benchmarks/e2e_peers/tails.py --out-dir benchmarks/results/e2e_peers/DATE-MACHINE-TRACE \\
        --attach ~/.cache/kvpool/e2e-peers/work   # runs saved before run.py kept routes
    python benchmarks/e2e_peers/tails.py --out-dir ... --report
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from datetime import datetime
from pathlib import Path

# one line of the router's access log (router/app.py `_log`)
_ROUTE = re.compile(r"session=(\S+)\(\w+\) backend=(\S+) reason=(\S+) attempts=(\d+) prompt=(\d+) local=(\d+) "
                    r"pool=(\d+) ttft_s=(\S+)")
ROUTE_COLUMNS = ("session", "backend", "reason", "prompt_tokens", "local_tokens", "pool_tokens", "estimates")
_ESTIMATES = re.compile(r" est=(\S+)")  # the cache-aware policy's TTFT/queue per backend, when logged
SURPRISE_TOKENS = 1024  # expected cached minus served cached, at least this: a surprise recompute


def _logged_at(line: str) -> float | None:
    """A log line's time (logging's default "%Y-%m-%d %H:%M:%S,mmm", local time) as unix time."""
    try:
        return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    except ValueError:
        return None


def parse_router_log(path: Path, since_unix: float = 0.0, until_unix: float = float("inf")) -> dict:
    """Every routed completion in the router's access log logged within [since_unix, until_unix]
    (one run's: a workdir's log is appended to by every run made in it): {"columns", "rows"}."""
    rows = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            at = _logged_at(line)
            if at is None or not since_unix <= at <= until_unix:
                continue
            m = _ROUTE.search(line)
            if m and m.group(5) != "0":  # /v1/models and the like carry no prompt
                session, backend, reason, _attempts, prompt, local, pool, _ttft = m.groups()
                est = _ESTIMATES.search(line)
                rows.append([session, backend, reason, int(prompt), int(local), int(pool), est.group(1) if est else ""])
    return {"columns": list(ROUTE_COLUMNS), "rows": rows}


def _table(block: dict | None) -> list[dict]:
    return [dict(zip(block["columns"], row)) for row in block["rows"]] if block else []


def joined(run: dict) -> list[dict]:
    """The run's requests, each with its route (matched by session and prompt length) where known."""
    routes: dict[tuple[str, int], list[dict]] = {}
    for r in _table(run.get("routes")):
        routes.setdefault((r["session"], r["prompt_tokens"]), []).append(r)
    out = []
    for req in _table(run.get("requests")):
        route = (routes.get((req["session"], req["prompt_tokens"])) or [None])[0]
        expected = max(route["local_tokens"], route["pool_tokens"]) if route else None
        served = req["cached_tokens"] or 0
        out.append({**req, "route": route, "expected_cached": expected,
                    "surprise": expected is not None and expected - served >= SURPRISE_TOKENS})  # fmt: skip
    return out


def run_tails(run: dict, worst: int = 8) -> dict:
    reqs = [r for r in joined(run) if r["ttft_s"] is not None]
    if not reqs:
        return {}
    ttfts = sorted(r["ttft_s"] for r in reqs)
    p90 = ttfts[int(0.9 * (len(ttfts) - 1))]
    slow = [r for r in reqs if r["ttft_s"] >= p90]
    return {
        "requests": len(reqs), "p90_s": p90,
        "surprises": sum(r["surprise"] for r in reqs),
        "surprise_tokens": sum(max(0, r["expected_cached"] - (r["cached_tokens"] or 0)) for r in reqs if r["surprise"]),
        "slow": len(slow), "slow_surprises": sum(r["surprise"] for r in slow),
        "worst": sorted(reqs, key=lambda r: -r["ttft_s"])[:worst],
    }  # fmt: skip


def attach(out_dir: Path, workdir: Path) -> int:
    """Add (or redo) `routes` of saved runs, from workdir/r<k>-<config>/router.log, the lines
    logged after each run started."""
    n = 0
    for path in sorted((out_dir / "runs").glob("r*-*.json")):
        run = json.loads(path.read_text())
        log = workdir / path.stem / "router.log"
        if not log.exists() or not run.get("started_at"):
            continue
        summary = run.get("summary") or {}
        until = run["started_at"] + (run.get("startup_s") or 0.0) + summary.get("duration_s", 0.0) + 60.0
        run["routes"] = parse_router_log(log, run["started_at"], until)
        path.write_text(json.dumps(run, indent=1, default=float))
        n += 1
    return n


def report(out_dir: Path) -> str:
    runs = [json.loads(p.read_text()) for p in sorted((out_dir / "runs").glob("r*-*.json"))]
    by_config: dict[str, list[tuple[dict, dict]]] = {}
    for run in runs:
        tails = run_tails(run)
        if tails:
            by_config.setdefault(run["label"], []).append((run, tails))
    md = ["# The slowest requests: routed expecting a cached prefix, then recomputed?", "",
          f"Made by `benchmarks/e2e_peers/tails.py --report` from `runs/*.json` (requests from the replay, "
          f"routes from the router's access log). A surprise: the router expected at least {SURPRISE_TOKENS} "
          "more cached tokens (its own KV-event view of the server, or the pool ledger) than the server "
          "served. Medians over runs, min-max in brackets.", "",
          "| configuration | runs | surprises per run | surprise tokens per run | slowest 10 %: surprises |",
          "|---|---|---|---|---|"]
    for label, items in by_config.items():
        def stat(key: str) -> str:
            xs = [t[key] for _, t in items]
            return f"{statistics.median(xs):g} ({min(xs):g}-{max(xs):g})"
        slow = f"{sum(t['slow_surprises'] for _, t in items)} of {sum(t['slow'] for _, t in items)}"
        md.append(f"| {label} | {len(items)} | {stat('surprises')} | {stat('surprise_tokens')} | {slow} |")
    for label, items in by_config.items():
        for run, tails in items:
            md += ["", f"**{label}, round {run['round'] + 1}** (TTFT P90 {tails['p90_s']:.1f} s):", "",
                   "| session | turn | TTFT | prompt | cached (served) | routed | expected cached | surprise |",
                   "|---|---|---|---|---|---|---|---|"]
            for r in tails["worst"]:
                route = r["route"]
                where = f"{route['backend'].rsplit(':', 1)[-1]} ({route['reason']})" if route else "?"
                md.append(f"| {r['session']} | {r['turn']} | {r['ttft_s']:.1f} s | {r['prompt_tokens']} | "
                          f"{r['cached_tokens']} | {where} | {r['expected_cached']} | {'yes' if r['surprise'] else ''} |")
    text = "\n".join(md) + "\n"
    (out_dir / "tails.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Explain the slowest requests of saved e2e_peers runs: the router's "
                                "expectation against what the server served from cache.")
    p.add_argument("--out-dir", type=Path, required=True, help="an e2e_peers results folder (with runs/)")
    p.add_argument("--attach", type=Path, default=None, metavar="WORKDIR",
                   help="first add routes to runs saved without them, from WORKDIR/r<k>-<config>/router.log")
    p.add_argument("--report", action="store_true", help="write OUT/tails.md and print it")
    args = p.parse_args(argv)
    if args.attach is not None:
        print(f"routes attached to {attach(args.out_dir, args.attach)} runs")
    if args.report:
        print(report(args.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
