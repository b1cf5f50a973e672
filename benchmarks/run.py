"""Run a benchmark by name: `benchmarks/run.py NAME [ARGS...]`, `benchmarks/run.py --list`.

NAME is an entry of benchmarks/registry.py; ARGS go to the benchmark unchanged (`run.py NAME --help`
shows the benchmark's own options). The benchmark runs in a child process of this Python, with
src/ and benchmarks/ on PYTHONPATH, and writes benchmarks/results/NAME/DATE-MACHINE.* and
benchmarks/results/NAME/LATEST.md (results_io.py). The exit status is the benchmark's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS_DIR))

import registry  # noqa: E402

USAGE = __doc__ + """
Options (before NAME):
  --list       the benchmarks: name, kind, what runs, what it measures
  -h, --help   this text

Kinds: micro (one component, no vLLM), system (master, nodes and vLLM on one machine), peers
(kvpool beside other stores), e2e (serving fleets on a trace). Heavy benchmarks start many
processes: run one at a time on a quiet machine (benchmarks/method.md). Two builds, or one build
under two environments, side by side on any of them: benchmarks/ab.py.
"""


def command(bench: registry.Benchmark, args: list[str]) -> list[str]:
    if bench.is_module:
        return [sys.executable, "-m", bench.target.removeprefix("-m ").strip(), *bench.leading_args, *args]
    return [sys.executable, str(BENCHMARKS_DIR / bench.target), *bench.leading_args, *args]


def environment() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(BENCHMARKS_DIR.parent / "src"), str(BENCHMARKS_DIR)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def listing() -> str:
    width = max(len(b.name) for b in registry.BENCHMARKS)
    target_width = max(len(b.target + "".join(" " + a for a in b.leading_args)) for b in registry.BENCHMARKS)
    rows = []
    for kind in registry.KINDS:
        for b in (b for b in registry.BENCHMARKS if b.kind == kind):
            target = b.target + "".join(" " + a for a in b.leading_args)
            rows.append(f"{b.name:<{width}}  {b.kind:<6}  {target:<{target_width}}  {b.description}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "--list":
        print(listing())
        return 0
    try:
        bench = registry.get(argv[0])
    except KeyError as e:
        print(e.args[0], file=sys.stderr)
        return 2
    return subprocess.call(command(bench, argv[1:]), env=environment())


if __name__ == "__main__":
    sys.exit(main())
