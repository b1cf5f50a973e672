"""A/B of two builds, or of one build under two environments, on any registered benchmark.

    benchmarks/ab.py --builds A B [--env K=V ...] [--env-a K=V ...] [--rounds 6] [--label NAME] \\
        -- BENCHMARK [ARGS...]

    benchmarks/ab.py --builds main HEAD -- master_tail --rounds 2           # two commits
    benchmarks/ab.py --builds HEAD HEAD --env KVPOOL_SEGMENT_LANE_SPIN_US=0 -- plain_phases
    benchmarks/ab.py --builds HEAD WORKTREE -- peers --peers kvpool-nixl --cases plain

A and B are git revisions, or WORKTREE (this checkout as it is, uncommitted changes included).
Each revision is checked out into a temporary git worktree whose benchmarks/ is replaced by this
checkout's, so both sides run the same benchmark code against their own src/ (the product is what
differs, never the measurement). `--env K=V` sets a variable for B's runs, `--env-a K=V` for A's:
with A == B that is an A/B of a setting (what a client, node or master reads at start). A choice
no environment variable makes (a Client option, a code path) is compared as two builds: the
commit that changes it against its parent.

Rules of the comparison (benchmarks/method.md):
- interleaved: round k runs A then B, round k+1 B then A (ABBA), so drift in the machine's load
  falls on both sides alike; `--warmup` rounds run first and are left out;
- each run is the benchmark's own process tree, writing its results to a scratch folder
  ($KVPOOL_RESULTS_DIR), never to benchmarks/results;
- every number in the runs' JSON whose key names a percentile or extreme (p50, p99_us, max, mean,
  `--metrics` to choose others) is paired A with B within a round; reported per metric: the median
  of A and of B over rounds and the median [min - max] of the per-round ratios B / A. For a time,
  B / A < 1: B faster; for a rate (GB/s, keys/s), > 1: B faster.
Writes benchmarks/results/BENCHMARK/DATE-MACHINE-ab-LABEL.{json,md} and refreshes its LATEST.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

BENCHMARKS_DIR = Path(__file__).resolve().parent
REPO = BENCHMARKS_DIR.parent
sys.path.insert(0, str(BENCHMARKS_DIR))

import registry  # noqa: E402
import results_io  # noqa: E402

WORKTREE = "WORKTREE"
PERCENTILE_KEY = r"(^|_)(p\d{2,3}(\.\d+)?|max|min|mean|median)(_|$)"


@dataclass(frozen=True)
class Side:
    label: str  # "A" or "B"
    revision: str
    env: dict[str, str]


@dataclass
class Run:
    side: str
    round_index: int
    metrics: dict[str, float] = field(default_factory=dict)


def parse_env(pairs: list[str], flag: str) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"{flag} takes NAME=VALUE, got {pair!r}")
        env[key] = value
    return env


def checkout(revision: str, scratch: Path) -> Path:
    """A tree to run `revision` from: its src/, this checkout's benchmarks/ (results left out)."""
    if revision == WORKTREE:
        return REPO
    tree = scratch / f"tree-{re.sub(r'[^A-Za-z0-9_.-]+', '-', revision)}"
    if tree.exists():
        return tree
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet", str(tree), revision], check=True)
    shutil.rmtree(tree / "benchmarks", ignore_errors=True)
    shutil.copytree(BENCHMARKS_DIR, tree / "benchmarks", ignore=shutil.ignore_patterns("results", "__pycache__"))
    return tree


def remove_checkouts(scratch: Path) -> None:
    for tree in scratch.glob("tree-*"):
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)


def flatten(value: object, prefix: str = "") -> dict[str, float]:
    """Every number in a JSON document, keyed by its path (`a.b.0.c`)."""
    if isinstance(value, bool):
        return {}
    if isinstance(value, (int, float)):
        return {prefix: float(value)}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    out: dict[str, float] = {}
    for key, item in items:
        out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _undated(part: str) -> str:
    """`2026-12-07-2cpu-epyc.json` -> `RUN.json`: A's and B's files of one run pair up by name."""
    stem, dot, ext = part.partition(".")
    return f"RUN{dot}{ext}" if results_io.DATED.match(stem) else part


def collect(results_dir: Path, metric_key: re.Pattern) -> dict[str, float]:
    """The metrics of one run: the numbers in every JSON it wrote whose key `metric_key` selects."""
    metrics: dict[str, float] = {}
    for path in sorted(results_dir.rglob("*.json")):
        name = "/".join(_undated(p) for p in path.relative_to(results_dir).parts)
        for key, number in flatten(json.loads(path.read_text())).items():
            if metric_key.search(key.rsplit(".", 1)[-1]):
                metrics[f"{name}:{key}"] = number
    return metrics


def run_once(side: Side, tree: Path, bench: str, args: list[str], round_index: int, scratch: Path,
             metric_key: re.Pattern) -> Run:  # fmt: skip
    results_dir = scratch / f"{side.label}-r{round_index}"
    env = {**os.environ, **side.env, "KVPOOL_RESULTS_DIR": str(results_dir)}
    log = scratch / f"{side.label}-r{round_index}.log"
    print(f"round {round_index}: {side.label} ({side.revision}{' ' + str(side.env) if side.env else ''})", flush=True)
    with log.open("w") as out:
        code = subprocess.call([sys.executable, str(tree / "benchmarks" / "run.py"), bench, *args], env=env,
                               cwd=tree, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    if code != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"{side.label} round {round_index} failed (exit {code}); log {log}:\n{tail}")
    return Run(side.label, round_index, collect(results_dir, metric_key))


def compare(runs: list[Run]) -> list[dict]:
    """Per metric found in every run: medians of A and B and the per-round ratios B / A."""
    rounds = sorted({r.round_index for r in runs})
    by = {(r.side, r.round_index): r.metrics for r in runs}
    keys = set.intersection(*(set(m) for m in by.values())) if by else set()
    rows = []
    for key in sorted(keys):
        a = [by[("A", k)][key] for k in rounds]
        b = [by[("B", k)][key] for k in rounds]
        ratios = sorted(y / x for x, y in zip(a, b) if x != 0)
        if not ratios:
            continue
        rows.append({"metric": key, "a_median": statistics.median(a), "b_median": statistics.median(b),
                     "ratio_median": statistics.median(ratios), "ratio_min": ratios[0], "ratio_max": ratios[-1],
                     "rounds": len(ratios)})  # fmt: skip
    return rows


def markdown(bench: str, sides: tuple[Side, Side], args: list[str], rows: list[dict], rounds: int, warmup: int) -> str:
    machine = results_io.this_machine()
    lines = [f"# A/B on `{bench}`: B / A per metric", "",
             f"`benchmarks/ab.py` on {machine.describe()} ({machine.name}), {results_io.today()}: {rounds} interleaved "
             f"rounds (ABBA) after {warmup} warm-up round(s); benchmark arguments `{' '.join(args) or '(none)'}`.", ""]
    for side in sides:
        env = ", ".join(f"{k}={v}" for k, v in side.env.items()) or "environment unchanged"
        lines.append(f"- {side.label}: `{side.revision}`, {env}")
    lines += ["", "Ratio B / A: for a time, < 1 means B is faster; for a rate, > 1. Method: "
              "[benchmarks/method.md](../../method.md).", "",
              "| metric | A (median) | B (median) | B / A, median [min - max] |", "|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| `{r['metric']}` | {r['a_median']:.4g} | {r['b_median']:.4g} | "
                     f"{r['ratio_median']:.3f} [{r['ratio_min']:.3f} - {r['ratio_max']:.3f}] |")
    if not rows:
        lines.append("| (no metric found in every run: see --metrics) | | | |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, sep, theirs = (argv[: argv.index("--")], "--", argv[argv.index("--") + 1:]) if "--" in argv else (argv, "", [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--builds", nargs=2, metavar=("A", "B"), required=True,
                        help=f"git revisions, or {WORKTREE} for this checkout as it is")
    parser.add_argument("--env", action="append", default=[], metavar="K=V", help="set for B's runs (repeatable)")
    parser.add_argument("--env-a", action="append", default=[], metavar="K=V", help="set for A's runs (repeatable)")
    parser.add_argument("--rounds", type=int, default=6, help="measured rounds, each running A and B (default 6)")
    parser.add_argument("--warmup", type=int, default=0, help="rounds run first and left out (default 0)")
    parser.add_argument("--metrics", default=PERCENTILE_KEY,
                        help="regular expression on a JSON key's last part: the metrics compared "
                             "(default: percentiles and extremes)")
    parser.add_argument("--label", default=None, help="names the result file (default: the builds)")
    parser.add_argument("--keep-scratch", action="store_true", help="keep the runs' scratch folder and logs")
    args = parser.parse_args(ours)
    if not sep or not theirs:
        parser.error("give the benchmark after `--`: ab.py --builds A B -- BENCHMARK [ARGS...]")
    bench, bench_args = theirs[0], theirs[1:]
    try:
        registry.get(bench)
    except KeyError as e:
        parser.error(e.args[0])
    if args.rounds < 1 or args.warmup < 0:
        parser.error("--rounds must be >= 1 and --warmup >= 0")
    sides = (Side("A", args.builds[0], parse_env(args.env_a, "--env-a")), Side("B", args.builds[1], parse_env(args.env, "--env")))
    if sides[0].revision == sides[1].revision and sides[0].env == sides[1].env:
        parser.error("A and B are the same build with the same environment: give different builds or --env")
    metric_key = re.compile(args.metrics)

    scratch = Path(tempfile.mkdtemp(prefix="kvpool-ab-"))
    runs: list[Run] = []
    try:
        trees = {side.label: checkout(side.revision, scratch) for side in sides}
        for k in range(args.warmup + args.rounds):
            for side in sides if k % 2 == 0 else sides[::-1]:
                run = run_once(side, trees[side.label], bench, bench_args, k, scratch, metric_key)
                if k >= args.warmup:
                    runs.append(run)
    finally:
        remove_checkouts(scratch)
        if not args.keep_scratch:
            shutil.rmtree(scratch, ignore_errors=True)
        else:
            print(f"scratch kept: {scratch}")
    rows = compare(runs)
    text = markdown(bench, sides, bench_args, rows, args.rounds, args.warmup)
    label = args.label or f"{sides[0].revision}-vs-{sides[1].revision}"
    files = results_io.result_files(bench, f"ab-{label}")
    files.folder.mkdir(parents=True, exist_ok=True)
    files.md.write_text(text)
    files.json.write_text(json.dumps({"benchmark": bench, "args": bench_args, "sides": [vars(s) for s in sides],
                                      "rounds": args.rounds, "warmup": args.warmup, "rows": rows,
                                      "runs": [vars(r) for r in runs]}, indent=1))  # fmt: skip
    results_io.refresh_latest(bench)
    print(text)
    print(f"wrote {files.md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
