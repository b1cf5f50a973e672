"""The master's tail on a full pool: how long each call holds its one thread.

    benchmarks/run.py master_tail [--base REV] [--rounds 4] [--loops 20000] \
        [--pool-mib 1024] [--object-kib 256] [--segments 1] [--modes saturated,idle,idle+freeze] \
        [--variant NAME] [--out PREFIX]

Writes benchmarks/results/master_tail/DATE-MACHINE[-VARIANT].{json,md} and LATEST.md.

Every client of a pool waits on the master's one thread, so one slow call (a batch of evictions,
the timed work) delays every request queued behind it. This drives `MasterCore` in-process (no
sockets: the time is the master's own work per call) with the peers benchmark's agent-like loop
(per loop: a lookup of 9 keys, a leased lookup of 8, its release, PutStart and PutEnd of 2 new
256 KiB objects; 8 sessions) on a 1 GiB segment (`--pool-mib`, `--object-kib`) that it fills
first, so every put runs where eviction does. `--segments N` splits the pool over N segments of N
nodes, as a fleet's master sees it (each put then has N segments to place on). A heartbeat and the timed work (`tick`) run every 0.2 s of simulated time (0.5 ms
a loop). Reported per call type: P50 / P99 / P99.9 / max and the total; the garbage collector's
pauses are counted apart (they land on whichever call allocates at the time).

Three ways to run the working tree: "saturated" (the master never idle: no idle work, as when
requests queue back to back), "idle slices" (one `MasterCore.idle_work` slice between loops, as a
master with spare time does between requests) and the same plus `gc.freeze()` after each tick
(what `kvpool master` does: its collections then walk only what the last tick made). With `--base REV` the loop also runs on the
code of git revision REV (exported with `git archive`) in the first of `--modes` (by default
saturated: builds before 88e46ef have no idle work),
all alternating in one run (order reversed every round), and the report gives per-round ratios
base / each (> 1: the working tree is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CALLS = ("lookup", "leased", "release", "put_start", "put_end", "tick")
MODES = {"saturated": "saturated", "idle": "idle slices", "idle+freeze": "idle slices + gc.freeze per tick"}

CHILD = r'''
import gc, json, sys, time
import numpy as np
from kvpool.core import protocol as p
from kvpool.master.access import OPEN
from kvpool.master.config import MasterConfig
from kvpool.master.core import MasterCore

loops, mode, pool_bytes, chunk = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
num_segments = int(sys.argv[5])
idle, freeze = mode in ("idle", "idle+freeze"), mode == "idle+freeze"
pauses, started = [], [0.0]
def on_gc(phase, info):
    if phase == "start":
        started[0] = time.perf_counter()
    else:
        pauses.append(time.perf_counter() - started[0])
gc.callbacks.append(on_gc)
core = MasterCore(MasterConfig())
idle = idle and hasattr(core, "idle_work")  # older builds have none
segs = [core.handle(p.MountSegment(f"n{i}", f"h{i}", pool_bytes // num_segments, 0, f"a{i}", b""), 0.0,
                   OPEN).segment_id for i in range(num_segments)]
acked, now = dict.fromkeys(segs, 0), 1.0
chains = [[f"a/s{s}/c{i}" for i in range(8)] for s in range(8)]
for keys in chains:
    r = core.handle(p.PutStart("peers", keys, [chunk] * 8, [None] * 8, 1, False), now, OPEN)
    core.handle(p.PutEnd("peers", keys, list(r.tokens), [1] * 8), now, OPEN)
samples = {k: [] for k in ("lookup", "leased", "release", "put_start", "put_end", "tick")}
next_tick, warm = now + 0.2, pool_bytes // chunk  # puts of twice the pool fill it first: not measured
for n in range(warm + loops):
    s = n % 8
    now += 0.0005
    tail = [f"a/s{s}/t{n}/{j}" for j in range(2)]
    t0 = time.perf_counter()
    core.handle(p.LookupPrefix("peers", chains[s] + tail[:1], lease=False), now, OPEN)
    t1 = time.perf_counter()
    r = core.handle(p.LookupPrefix("peers", chains[s], lease=True), now, OPEN)
    t2 = time.perf_counter()
    core.handle(p.ReleaseLeases("peers", [r.lease_id]), now, OPEN)
    t3 = time.perf_counter()
    r = core.handle(p.PutStart("peers", tail, [chunk] * 2, [None] * 2, 1, False), now, OPEN)
    t4 = time.perf_counter()
    core.handle(p.PutEnd("peers", tail, list(r.tokens), [1] * 2), now, OPEN)
    t5 = time.perf_counter()
    if n >= warm:
        for name, a, b in (("lookup", t0, t1), ("leased", t1, t2), ("release", t2, t3), ("put_start", t3, t4),
                           ("put_end", t4, t5)):
            samples[name].append(b - a)
    if idle and core.has_idle_work:  # a master with spare time: one slice between loops
        core.idle_work(now)
    if now >= next_tick:
        for i, seg in enumerate(segs):
            beat = core.handle(p.Heartbeat(f"n{i}", [seg], [acked[seg]]), now, OPEN)
            for d in beat.deltas:
                acked[seg] = d.first_seq + len(d.ops) - 1
        t = time.perf_counter()
        core.tick(now)
        if freeze:  # what `kvpool master` does after each tick (service.py)
            gc.freeze()
        if n >= warm:
            samples["tick"].append(time.perf_counter() - t)
        next_tick = now + 0.2
    if n == warm:
        pauses.clear()
stats = core.stats(now)
if stats.evictions == 0 or stats.capacity_bytes == 0:
    raise SystemExit("the pool never filled (or its segment expired): nothing measured")
out = {"evictions": stats.evictions, "fill": stats.used_bytes / stats.capacity_bytes, "gc_pauses_us": []}
for name, v in samples.items():
    us = np.array(v) * 1e6
    out[name] = {"p50": float(np.percentile(us, 50)), "p99": float(np.percentile(us, 99)),
                 "p999": float(np.percentile(us, 99.9)), "max": float(us.max()), "total_ms": float(us.sum() / 1e3),
                 "n": len(us)}
out["gc_pauses_us"] = sorted((float(x * 1e6) for x in pauses), reverse=True)[:20]
out["gc_pause_count"] = len(pauses)
print(json.dumps(out))
'''


def export(rev: str, into: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "src"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "src"


def measure(src: Path, args, mode: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    argv = [sys.executable, "-c", CHILD, str(args.loops), mode, str(args.pool_mib << 20), str(args.object_kib << 10),
            str(args.segments)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"measurement failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(runs: dict[str, list[dict]], base: str | None, args, started: str) -> str:
    names = list(runs)
    lines = ["# The master's tail on a full pool (benchmarks/master_tail_bench.py)", "",
             f"Run {started} on {platform.node() or 'this machine'} ({os.cpu_count()} CPUs, Python "
             f"{platform.python_version()}), load average {os.getloadavg()[0]:.1f} at the end. `MasterCore` in-process "
             f"(no sockets); per round {args.loops} agent-like loops on a full {args.pool_mib} MiB pool of "
             f"{args.object_kib} KiB objects ({(args.pool_mib << 10) // args.object_kib} objects) in "
             f"{args.segments} segment(s) of as many nodes, after "
             f"{(args.pool_mib << 10) // args.object_kib} loops that fill it; {args.rounds} rounds, " + ", ".join(names) + " alternating (order "
             "reversed every round).", "",
             "Microseconds the call held the master's thread: median over rounds of each round's percentile.", ""]
    head = "| call | " + " | ".join(f"{n} P50 | {n} P99 | {n} P99.9 | {n} max" for n in names) + " |"
    lines += [head, "|" + "---|" * (1 + 4 * len(names))]
    for call in CALLS:
        cells = []
        for n in names:
            for q in ("p50", "p99", "p999", "max"):
                cells.append(f"{statistics.median(r[call][q] for r in runs[n]):.0f}")
        lines.append(f"| {call} | " + " | ".join(cells) + " |")
    lines += ["", "Garbage-collector pauses per round (counted apart; median count, largest pause over rounds):", ""]
    for n in names:
        lines.append(f"- {n}: {statistics.median(r['gc_pause_count'] for r in runs[n]):.0f} pauses, largest "
                     f"{max(max(r['gc_pauses_us'], default=0) for r in runs[n]):.0f} us; evictions per round "
                     f"{statistics.median(r['evictions'] for r in runs[n]):.0f}, fill at the end "
                     f"{statistics.median(r['fill'] for r in runs[n]):.3f}")
    for other in names[1:] if base else []:
        lines += ["", f"Per-round ratios {names[0]} / {other} (> 1: {other} is faster), median [min - max]:", ""]
        lines += ["| call | P50 | P99 | P99.9 | max |", "|---|---|---|---|---|"]
        for call in CALLS:
            cells = []
            for q in ("p50", "p99", "p999", "max"):
                ratios = [a[call][q] / b[call][q] for a, b in zip(runs[names[0]], runs[other])]
                cells.append(f"{statistics.median(ratios):.2f} [{min(ratios):.2f} - {max(ratios):.2f}]")
            lines.append(f"| {call} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", help="a git revision to compare with the working tree, side by side")
    parser.add_argument("--rounds", type=int, default=4, help="measured rounds (default 4)")
    parser.add_argument("--loops", type=int, default=20000, help="measured loops per round (default 20000)")
    parser.add_argument("--pool-mib", type=int, default=1024, help="the segment's size (default 1024)")
    parser.add_argument("--object-kib", type=int, default=256, help="the size of each object put (default 256)")
    parser.add_argument("--segments", type=int, default=1, help="nodes the pool is split over (default 1)")
    parser.add_argument("--modes", default="saturated,idle,idle+freeze",
                        help="how the working tree runs, of saturated, idle, idle+freeze (default all three); "
                             "the base runs in the first")
    parser.add_argument("--variant", default=None,
                        help="names this configuration in the file name (e.g. 256k, segments16)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output path without extension (default: benchmarks/results/master_tail/DATE-MACHINE[-VARIANT])")
    args = parser.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    from rich.progress import Progress

    with tempfile.TemporaryDirectory() as tmp:
        if args.segments < 1:
            parser.error(f"--segments must be >= 1, got {args.segments}")
        modes = args.modes.split(",")
        if not modes or not set(modes) <= set(MODES):
            parser.error(f"--modes takes some of {', '.join(MODES)}, got {args.modes!r}")
        builds = {MODES[mode]: (REPO / "src", mode) for mode in modes}
        if args.base:
            builds = {f"base {args.base}": (export(args.base, Path(tmp)), modes[0]), **builds}
        runs: dict[str, list[dict]] = {name: [] for name in builds}
        order = list(builds)
        with Progress() as progress:
            task = progress.add_task("master tail", total=args.rounds * len(order))
            for r in range(args.rounds):
                for name in order if r % 2 == 0 else order[::-1]:
                    runs[name].append(measure(builds[name][0], args, builds[name][1]))
                    progress.advance(task)
    sys.path.insert(0, str(REPO / "benchmarks"))
    import results_io

    out = args.out or results_io.result_files("master_tail", args.variant).prefix
    out.parent.mkdir(parents=True, exist_ok=True)
    text = report(runs, args.base, args, started)
    Path(f"{out}.md").write_text(text)
    summary = {"started": started, "loops": args.loops, "pool_mib": args.pool_mib, "object_kib": args.object_kib,
               "segments": args.segments, "modes": args.modes, "runs": runs}
    Path(f"{out}.json").write_text(json.dumps(summary, indent=1))
    print(text)
    if args.out is None:
        results_io.refresh_latest("master_tail")


if __name__ == "__main__":
    main()
