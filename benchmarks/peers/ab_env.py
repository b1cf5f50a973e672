"""A/B of environment settings on one build: plain put / get of one value at a time, across hosts.

    flock /tmp/kvpool-heavy.lock .venv/bin/python benchmarks/peers/ab_env.py \
        --b KVPOOL_SEGMENT_LANE_SPLIT_BYTES=8388608 [--a NAME=VALUE ...] [--size-kib 1024] \
        [--count 48] [--rounds 8] [--out FILE]

Starts the peers benchmark's `kvpool-nixl` peer (master, node and client on three hosts of the
multi-host harness) once, then client processes alternating between setting A (default: the
environment as it is) and setting B, order reversed every round (ABBA). Each process puts and
gets `--count` values of `--size-kib` one call at a time, 4 passes, the first one not counted (a
new size's first puts ask the master for space), bytes compared, keys removed after each pass.
Reported per round: the mean and median microseconds per put and per get; then the median over
rounds and the median of the per-round ratios B / A of the mean times (< 1: B faster). Settings
that a client reads at start (data-plane thresholds, spin) are what this compares; the master's
and node's settings are the same for both.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from kvpool.bench import hosts, procs  # noqa: E402
from servers import HOSTS, PEERS, emit, median_range, run_script  # noqa: E402

CLIENT = r'''
import json, statistics, sys, time
import numpy as np
from kvpool.client import Client
spec = json.loads(sys.argv[1])
client = Client(spec["master"], spec["tenant"], timeout_s=30)
size, count = spec["size"], spec["count"]
values = [np.random.default_rng(3 + i).integers(0, 256, size, dtype=np.uint8).tobytes() for i in range(count)]
puts, gets = [], []
for p in range(4):
    keys = [f"{spec['tag']}/{p}/{i}" for i in range(count)]
    for key, value in zip(keys, values):
        t = time.perf_counter()
        if not client.put(key, value):
            raise SystemExit(f"put {key} refused")
        puts.append(time.perf_counter() - t)
    got = []
    for key in keys:
        t = time.perf_counter()
        got.append(client.get(key))
        gets.append(time.perf_counter() - t)
    if got != values:
        raise SystemExit("a get returned other bytes")
    client.remove(keys)
puts, gets = puts[count:], gets[count:]
print(json.dumps({op: {"mean_us": statistics.fmean(v) * 1e6, "p50_us": statistics.median(v) * 1e6}
                  for op, v in (("put", puts), ("get", gets))}))
'''


def _setting(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", type=_setting, action="append", default=[], metavar="NAME=VALUE",
                    help="setting A (repeatable; default: the environment as it is)")
    ap.add_argument("--b", type=_setting, action="append", required=True, metavar="NAME=VALUE",
                    help="setting B (repeatable)")
    ap.add_argument("--size-kib", type=int, default=1024)
    ap.add_argument("--count", type=int, default=48, help="values per pass (default 48)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None, help="also write the report here")
    args = ap.parse_args()
    why = hosts.why_unavailable()
    if why is not None:
        raise SystemExit(f"the multi-host harness cannot run here: {why}")
    settings = {"A": dict(args.a), "B": dict(args.b)}
    workdir = procs.scratch_dir("kvpool-ab-env-")
    script = workdir / "ab_env_client.py"
    script.write_text(CLIENT)
    results: dict[str, list[dict]] = {"A": [], "B": []}
    lines = [f"A: {settings['A'] or 'the environment as it is'}; B: {settings['B']}",
             f"plain values of {args.size_kib} KiB across hosts (kvpool-nixl peer), {args.count} per pass, "
             f"3 counted passes per process, {args.rounds} rounds ABBA; load average "
             f"{os.getloadavg()[0]:.1f} at start", ""]
    with hosts.HostNetwork(HOSTS) as net:
        running = PEERS["kvpool-nixl"].start(net, workdir, 1024 << 20, sys.executable)
        try:
            for r in range(args.rounds):
                for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                    spec = {**running.spec, "size": args.size_kib << 10, "count": args.count, "tag": f"{name}{r}"}
                    out = run_script(running, script, spec, env=settings[name])
                    results[name].append(out)
                    line = f"round {r} {name}: " + ", ".join(
                        f"{op} mean {v['mean_us']:.0f} us, P50 {v['p50_us']:.0f}" for op, v in out.items())
                    print(line, flush=True)
                    lines.append(line)
        finally:
            running.stop()
    lines += ["", "| op | A mean us | B mean us | B / A per round, median [min - max] (< 1: B faster) |", "|---|---|---|---|"]
    for op in ("put", "get"):
        ratios = [b[op]["mean_us"] / a[op]["mean_us"] for a, b in zip(results["A"], results["B"])]
        lines.append(f"| {op} | {statistics.median(x[op]['mean_us'] for x in results['A']):.0f} | "
                     f"{statistics.median(x[op]['mean_us'] for x in results['B']):.0f} | "
                     f"{median_range(ratios)} |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
