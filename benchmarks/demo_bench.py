"""The demo as a benchmark: `kvpool demo`, its results under benchmarks/results/demo/.

    benchmarks/run.py demo [--variant NAME] [kvpool demo's options ...]

Runs `kvpool demo` (kvpool.bench.demo_cli: routers with and without the pool on an agent trace,
side by side, every vLLM server a real process) with `--output-dir
benchmarks/results/demo/DATE-MACHINE[-VARIANT]/` unless an --output-dir is given, then refreshes
benchmarks/results/demo/LATEST.md. `--variant` names what this run is (a trace, a model: e.g.
claude-code, hybrid-gemma3). Every other option is the demo's own (below).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import results_io  # noqa: E402
from kvpool.cli import main as kvpool_main  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    variant = None
    if "--variant" in argv:
        i = argv.index("--variant")
        if i + 1 >= len(argv):
            print("--variant needs a NAME", file=sys.stderr)
            return 2
        variant = argv[i + 1]
        del argv[i : i + 2]
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return kvpool_main(["demo", *argv])
    dated = not any(a == "--output-dir" or a.startswith("--output-dir=") for a in argv)
    if dated:
        argv += ["--output-dir", str(results_io.result_files("demo", variant).run_folder)]
    code = kvpool_main(["demo", *argv])
    if dated and code == 0:
        results_io.refresh_latest("demo")
    return code


if __name__ == "__main__":
    sys.exit(main())
