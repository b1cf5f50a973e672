"""A/B: segment lane jobs that spin (non-blocking sends and receives) or block at once.

    flock /tmp/kvpool-heavy.lock .venv/bin/python benchmarks/peers/ab_segment_lane_spin.py \
        [--processes 4] [--rounds 12] [--spin-us 200] [--out FILE]

Starts the peers benchmark's `kvpool-nixl` peer (master, node and client on three hosts of the
multi-host harness), then `--processes` client processes one after another, each with two
writers and two readers: one pair whose lanes spin ($KVPOOL_SEGMENT_LANE_SPIN_US = `--spin-us`
when their routes are made; segment_lane.py), the other blocking at once (0). Per value size
(64 KiB, 256 KiB, 1 MiB, 4 MiB) and round, each pair in ABBA order: its writer puts 16 values
one call each, then its reader, which never saw them, gets all 16 one call each; bytes compared.
Reported per process: the median put and get time per value each way and the median per-round
ratio blocking / spinning (> 1: spinning faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from kvpool.bench import hosts  # noqa: E402
from servers import HOSTS, PEERS, client_script, emit, median_range, run_script  # noqa: E402

SIZES_KIB = (64, 256, 1024, 4096)
STORAGE = 1 << 30

CLIENT = r'''
import json, statistics, sys, time
import numpy as np
import os
from kvpool.client import Client
spec = json.loads(sys.argv[1])
writers, readers = {}, {}
for name in ("spin", "block"):
    os.environ["KVPOOL_SEGMENT_LANE_SPIN_US"] = str(spec["client_spin_us"][name])  # read when a route's lane is made: now
    writers[name] = Client(spec["masters"][name], "peers", timeout_s=30.0)
    readers[name] = Client(spec["masters"][name], "peers", timeout_s=30.0)
    writers[name].put(f"{spec['tag']}/warm/{name}", b"w" * (1 << 20))
    assert readers[name].get(f"{spec['tag']}/warm/{name}") == b"w" * (1 << 20)
    writers[name].remove([f"{spec['tag']}/warm/{name}"])
rng = np.random.default_rng(spec["seed"])
out = {}
for size_kib in spec["sizes_kib"]:
    size = size_kib << 10
    values = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(16)]
    times = {name: [] for name in readers}
    puts = {name: [] for name in readers}
    for r in range(spec["rounds"] + 2):
        for name in (["spin", "block"] if r % 2 == 0 else ["block", "spin"]):
            keys = [f"{spec['tag']}/{size_kib}/{r}/{name}/{i}" for i in range(16)]
            t = time.perf_counter()
            for k, v in zip(keys, values):
                writers[name].put(k, v)
            if r >= 2:
                puts[name].append((time.perf_counter() - t) / 16)
            t = time.perf_counter()
            got = [readers[name].get(k) for k in keys]
            took = (time.perf_counter() - t) / 16
            if got != values:
                raise SystemExit(f"{name}: plain get returned other bytes")
            del got
            if r >= 2:
                times[name].append(took)
            writers[name].remove(keys)
    out[size_kib] = {"put_spin_us": statistics.median(puts["spin"]) * 1e6,
                     "put_block_us": statistics.median(puts["block"]) * 1e6,
                     "put_block_over_spin": statistics.median(b / s for s, b in zip(puts["spin"], puts["block"])),
                     "spin_us": statistics.median(times["spin"]) * 1e6,
                     "block_us": statistics.median(times["block"]) * 1e6,
                     "block_over_spin": statistics.median(b / s for s, b in zip(times["spin"], times["block"]))}
for c in [*writers.values(), *readers.values()]:
    c.close()
print(json.dumps(out))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=4, help="client processes, one after another (default 4)")
    ap.add_argument("--rounds", type=int, default=12, help="measured rounds per size and process (default 12)")
    ap.add_argument("--spin-us", type=float, default=200.0, help="the clients' spin beyond 1 ns per byte (default 200)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    workdir, script = client_script("ab_segment_lane_spin", CLIENT)
    lines = [f"load average {os.getloadavg()[0]:.1f} at start; {args.processes} client processes, {args.rounds} "
             f"measured rounds per size: each pair (ABBA) puts 16 values, then its fresh reader gets them; "
             f"spin {args.spin_us:.0f} us + 1 ns per byte", ""]
    results = []
    with hosts.HostNetwork(HOSTS) as net:
        pools = []
        try:
            pools.append(PEERS["kvpool-nixl"].start(net, workdir, STORAGE, sys.executable))
            masters = dict.fromkeys(("spin", "block"), pools[0].spec["master"])
            client_spin_us = {"spin": args.spin_us, "block": 0}
            for p in range(args.processes):
                spec = {"masters": masters, "client_spin_us": client_spin_us, "tag": f"p{p}", "seed": p,
                        "rounds": args.rounds, "sizes_kib": list(SIZES_KIB)}
                out = run_script(pools[0], script, spec)
                results.append(out)
                line = f"process {p}: " + "; ".join(
                    f"{k} KiB spin {out[str(k)]['spin_us']:.0f} us, block {out[str(k)]['block_us']:.0f} us, "
                    f"block/spin {out[str(k)]['block_over_spin']:.3f}, put block/spin {out[str(k)]['put_block_over_spin']:.3f}"
                    for k in SIZES_KIB)
                print(line, flush=True)
                lines.append(line)
        finally:
            for pool in pools:
                pool.stop()
    lines += ["", f"load average {os.getloadavg()[0]:.1f} at the end", "",
              "| value | op | spinning, us per value | blocking, us per value | block / spin per process, median [min - max] |",
              "|---|---|---|---|---|"]
    for k in SIZES_KIB:
        rows = [o[str(k)] for o in results]
        for op, prefix in (("get by a fresh reader", ""), ("put", "put_")):
            lines.append(f"| {k} KiB | {op} | {statistics.median(r[prefix + 'spin_us'] for r in rows):.0f} | "
                         f"{statistics.median(r[prefix + 'block_us'] for r in rows):.0f} | "
                         f"{median_range([r[prefix + 'block_over_spin'] for r in rows])} |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
