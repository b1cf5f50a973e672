"""A/B of the master lane on bulk gets and puts across harness hosts (issue 14's open regression).

    flock /tmp/kvpool-heavy.lock .venv/bin/python benchmarks/peers/ab_lane.py [ROUNDS] [--out FILE]

The locked peers run (benchmarks/results/peers/peers.md) had the lane client's bulk rows below the
same build over ZMQ. This isolates it: one master (host m) and one node (host n) stay up; client
processes on host c alternate between `lane` (Client default) and `zmq` (Client(lane=False)),
order reversed every round. Each process writes and reads 48 x 1 MiB, 6 x 16 MiB and 16 objects of
32 x 64 KiB (every byte compared), and splits each get into its master round trip (the leased
lookup), the transfer (DataPlane.transfer_many) and the rest, so a slower row says which part grew.
Prints one JSON line per process and a summary table (medians over rounds, ratio lane / zmq).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from kvpool.bench import hosts, procs

CHILD = r'''
import json, sys, time
import numpy as np
from kvpool.client import Client
from kvpool.transfer import DataPlane

address, variant = sys.argv[1], sys.argv[2]
client = Client(address, "ab", timeout_s=30.0, lane=(variant == "lane"))
spent = {"lookup": 0.0, "transfer": 0.0}

def timed(name, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - t
    return wrapper

client._lookup_leased = timed("lookup", client._lookup_leased)
client.plane.transfer_many = timed("transfer", client.plane.transfer_many)
out = {"variant": variant}
for name, size, n, regions in (("1m", 1 << 20, 48, 1), ("16m", 16 << 20, 6, 1), ("sg", 64 << 10, 16, 32)):
    total = size * n * regions
    src = np.random.default_rng(n).integers(0, 256, total, dtype=np.uint8)
    dst = np.zeros_like(src)
    client.register(src)
    client.register(dst)
    obj = size * regions
    def addrs(buf):
        return [[buf.ctypes.data + i * obj + j * size for j in range(regions)] for i in range(n)]
    sizes = [[size] * regions for _ in range(n)]
    keys = [f"{variant}/{name}/{i}/{time.time_ns()}" for i in range(n)]
    puts, gets, lookups, transfers = [], [], [], []
    for rep in range(5):
        pkeys = [f"{k}/{rep}" for k in keys]
        t = time.perf_counter()
        assert client.put_from(pkeys, addrs(src), sizes, parents=[None] * n) == [0] * n
        puts.append(total / (time.perf_counter() - t) / 1e9)
        dst[:] = 0
        spent["lookup"] = spent["transfer"] = 0.0
        t = time.perf_counter()
        got = client.get_into(pkeys, addrs(dst), sizes)
        elapsed = time.perf_counter() - t
        assert got == n and np.array_equal(src, dst), (name, got)
        gets.append(total / elapsed / 1e9)
        lookups.append(spent["lookup"] * 1e3)
        transfers.append(spent["transfer"] * 1e3)
        client.remove(pkeys)
    med = lambda xs: round(float(np.median(xs[1:])), 3)  # the first repetition warms up
    out[name] = {"get_gbs": med(gets), "put_gbs": med(puts), "lookup_ms": med(lookups), "transfer_ms": med(transfers)}
out["cpu_s"] = round(time.process_time(), 2)
client.close()
print(json.dumps(out))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rounds", nargs="?", type=int, default=6)
    ap.add_argument("--out", type=Path, default=None, help="write every process's JSON and the summary here")
    args = ap.parse_args()
    variants = ["lane", "zmq"]
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    loads = [os.getloadavg()[0]]
    with hosts.HostNetwork(["m", "n", "c"]) as net:
        wd = procs.scratch_dir("ab-lane-")
        master = procs.ManagedProcess("master", net["m"].wrap(procs.kvpool_argv(
            "master", "--insecure", "--host", net["m"].address, "--port", "0")), wd).start(30)
        node = procs.ManagedProcess("node", net["n"].wrap(procs.kvpool_argv(
            "node", "--master", master.info["address"], "--memory", "1GiB")), wd).start(60)
        try:
            for r in range(args.rounds):
                for v in variants if r % 2 == 0 else variants[::-1]:
                    res = subprocess.run(net["c"].wrap([sys.executable, "-c", CHILD, master.info["address"], v]),
                                         capture_output=True, text=True, timeout=600)
                    if res.returncode:
                        print(v, "failed:", res.stderr[-1500:], flush=True)
                        continue
                    runs[v].append(json.loads(res.stdout.splitlines()[-1]))
                    loads.append(os.getloadavg()[0])
                    print(r, json.dumps(runs[v][-1]), f"load {loads[-1]:.1f}", flush=True)
        finally:
            node.stop()
            master.stop()
    lines = [f"rounds {args.rounds}, load average {min(loads):.1f}-{max(loads):.1f}",
             "| objects | metric | lane | zmq | lane / zmq |", "|---|---|---|---|---|"]
    for name in ("1m", "16m", "sg"):
        for metric in ("get_gbs", "put_gbs", "lookup_ms", "transfer_ms"):
            a = [r[name][metric] for r in runs["lane"]]
            b = [r[name][metric] for r in runs["zmq"]]
            if a and b:
                ma, mb = statistics.median(a), statistics.median(b)
                lines.append(f"| {name} | {metric} | {ma:.3f} | {mb:.3f} | {ma / mb:.2f} |")
    cpu = {v: statistics.median([r["cpu_s"] for r in runs[v]]) for v in variants if runs[v]}
    lines.append(f"client CPU seconds per process (median): {cpu}")
    print("\n".join(lines))
    if args.out:
        args.out.write_text(json.dumps({"runs": runs, "loads": loads}, indent=1) + "\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
