"""What an idle pool costs the machine: CPU of a `kvpool master` and a `kvpool node` doing nothing.

    benchmarks/run.py idle_cpu [--seconds 20] [--rounds 3] [--delays-us 1000,10000,100000]

An embedded node (the connector's `pool_memory_bytes`) runs inside a vLLM server and inherits its
pinning to the forward's core, so every idle wake-up of the node is taken from the model. Per
round and per NIXL progress-thread fallback period (KVPOOL_NIXL_PROGRESS_DELAY_US, transfer/
nixlio.py), this starts a master and a node with a 64 MiB segment, lets it settle, then reads each
process's CPU seconds (utime + stime, /proc) over `--seconds` of idleness, per thread. The
periods alternate within a round, the order reversed every round. Results go to
benchmarks/results/idle_cpu/DATE-MACHINE.{json,md} (and LATEST.md): median over rounds of the share
of one core.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import results_io  # noqa: E402
from e2e_peers import cpu_time  # noqa: E402
from kvpool.bench import procs  # noqa: E402
from kvpool.transfer.config import PROGRESS_DELAY_ENV  # noqa: E402



def measure(delay_us: int, seconds: float, workdir: Path) -> dict:
    master = procs.start_master(workdir, name=f"master-{delay_us}")
    try:
        node = procs.start_node(workdir, master.info["address"], "64MiB", name=f"node-{delay_us}",
                                env={PROGRESS_DELAY_ENV: str(delay_us)})  # fmt: skip
        try:
            time.sleep(3.0)  # past the start (the segment's population, the first heartbeats)
            roots = {"master": master.pid, "node": node.pid}
            before = cpu_time.snapshot(roots)
            time.sleep(seconds)
            rows = cpu_time.usage(before, cpu_time.snapshot(roots, names=True))
        finally:
            node.stop()
    finally:
        master.stop()
    share = {label: sum(r["cpu_s"] for r in rows if r["label"] == label) / seconds for label in ("master", "node")}
    return {"delay_us": delay_us, "share_of_core": share, "threads": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="idle time measured per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--delays-us", default="1000,10000,100000",
                    help="NIXL progress-thread fallback periods to compare, microseconds")
    ap.add_argument("--out", type=Path, default=None,
                    help="output path without extension (default: benchmarks/results/idle_cpu/DATE-MACHINE)")
    args = ap.parse_args(argv)
    delays = [int(d) for d in args.delays_us.split(",") if d.strip()]
    runs = []
    with tempfile.TemporaryDirectory(prefix="kvpool-idle-") as tmp:
        for k in range(args.rounds):
            for delay in delays if k % 2 == 0 else delays[::-1]:
                run = measure(delay, args.seconds, Path(tmp))
                run["round"] = k
                runs.append(run)
                print(f"round {k + 1} delay {delay} us: node {100 * run['share_of_core']['node']:.2f} % of a core, "
                      f"master {100 * run['share_of_core']['master']:.2f} %", flush=True)  # fmt: skip
    lines = ["# An idle pool's CPU (benchmarks/idle_cpu_bench.py)", "",
             f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {results_io.this_machine().describe()} ("
             f"Python {platform.python_version()}); a master and a node (64 MiB) idle for {args.seconds:.0f} s per "
             f"run, {args.rounds} rounds, periods alternating. Median over rounds, % of one core.", "",
             "| NIXL progress fallback period | node | master |", "|---|---|---|"]  # fmt: skip
    for delay in delays:
        mine = [r for r in runs if r["delay_us"] == delay]
        node = statistics.median(r["share_of_core"]["node"] for r in mine)
        master = statistics.median(r["share_of_core"]["master"] for r in mine)
        lines.append(f"| {delay / 1000:g} ms | {100 * node:.2f} % | {100 * master:.2f} % |")
    out = args.out or results_io.result_files("idle_cpu").prefix
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    Path(f"{out}.json").write_text(json.dumps(runs, indent=1))
    print("\n".join(lines))
    if args.out is None:
        results_io.refresh_latest("idle_cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
