"""A/B: a small put batch checksummed whole while its PutStart travels, or after the master's
answer, only what it allocated (as before stop 40).

    flock /tmp/kvpool-heavy.lock .venv/bin/python benchmarks/peers/ab_early_batch_checksum.py \
        [--processes 3] [--pairs 600] [--out FILE]

What (client/puts.py EARLY_CHECKSUM_BYTES): the agent loop's put is a new tail of 2 x 256 KiB;
before, a batch was hashed after PutStart's answer (most of a prefix chain usually exists, so
only the allocated part was hashed); now a batch of at most 1 MiB is hashed while PutStart
travels. Starts the peers benchmark's `kvpool-same` (master, node and client on one host) and
`kvpool-nixl` (on three hosts of the multi-host harness) pools, then `--processes` client
processes per pool, one after another, each alternating put_from of 2 new 256 KiB objects
(a chain) with the threshold at 1 MiB and at 0, `--pairs` pairs in ABBA order (the first 100
not counted). Reported: median and P90 put time each way and the median per-pair ratio off / on.
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

POOLS = {"kvpool-same": "same host", "kvpool-nixl": "across hosts"}

CLIENT = r'''
import json, statistics, sys, time
import numpy as np
from kvpool.client import Client, puts
spec = json.loads(sys.argv[1])
c = Client(spec["master"], "peers", timeout_s=30.0)
chunk = 256 << 10
src = np.random.default_rng(spec["seed"]).integers(0, 256, 64 * chunk, dtype=np.uint8)
c.register(src)
base = int(src.ctypes.data)
got = np.zeros(chunk, dtype=np.uint8)
c.register(got)
times = {1: [], 0: []}
for it in range(spec["pairs"]):
    for mode in ((1, 0) if it % 2 else (0, 1)):
        puts.EARLY_CHECKSUM_BYTES = (1 << 20) if mode else 0
        keys = [f"{spec['tag']}/{it}/{mode}/a", f"{spec['tag']}/{it}/{mode}/b"]
        j = (it * 4 + 2 * mode) % 62
        t = time.perf_counter()
        statuses = c.put_from(keys, [[base + j * chunk], [base + (j + 1) * chunk]], [[chunk], [chunk]],
                              parents=[None, keys[0]])
        took = time.perf_counter() - t
        if statuses != [0, 0]:
            raise SystemExit(f"put statuses {statuses}")
        if it >= 100:
            times[mode].append(took)
    if it % 50 == 49:  # each way's last tail read back (bytes and checksum), then the 50 pairs removed
        for mode in (0, 1):
            j = (it * 4 + 2 * mode) % 62
            if c.get_into([f"{spec['tag']}/{it}/{mode}/b"], [[int(got.ctypes.data)]], [[chunk]]) != 1 or \
                    not np.array_equal(got, src[(j + 1) * chunk : (j + 2) * chunk]):
                raise SystemExit("a put was not read back whole")
        c.remove([f"{spec['tag']}/{i}/{m}/{x}" for i in range(it - 49, it + 1) for m in (0, 1) for x in "ab"])
print(json.dumps({"on_us": statistics.median(times[1]) * 1e6, "off_us": statistics.median(times[0]) * 1e6,
                  "on_p90_us": float(np.percentile(times[1], 90) * 1e6),
                  "off_p90_us": float(np.percentile(times[0], 90) * 1e6),
                  "off_over_on": statistics.median(o / n for n, o in zip(times[1], times[0]))}))
c.close()
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=3, help="client processes per pool (default 3)")
    ap.add_argument("--pairs", type=int, default=600, help="put pairs per process, the first 100 not counted")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    workdir, script = client_script("ab_early_batch_checksum", CLIENT)
    lines = [f"load average {os.getloadavg()[0]:.1f} at start; {args.processes} client processes per pool, "
             f"{args.pairs} ABBA pairs of 2 x 256 KiB put_from each", ""]
    results: dict[str, list[dict]] = {}
    with hosts.HostNetwork(HOSTS) as net:
        for peer in POOLS:
            (workdir / peer).mkdir()
            pool = PEERS[peer].start(net, workdir / peer, 1 << 30, sys.executable)
            try:
                for p in range(args.processes):
                    spec = {"master": pool.spec["master"], "tag": f"p{p}", "seed": p, "pairs": args.pairs}
                    out = run_script(pool, script, spec)
                    results.setdefault(peer, []).append(out)
                    line = (f"{peer} process {p}: on {out['on_us']:.0f} us (P90 {out['on_p90_us']:.0f}), off "
                            f"{out['off_us']:.0f} us (P90 {out['off_p90_us']:.0f}), off/on {out['off_over_on']:.3f}")
                    print(line, flush=True)
                    lines.append(line)
            finally:
                pool.stop()
    lines += ["", f"load average {os.getloadavg()[0]:.1f} at the end", "",
              "| pool | hashed during PutStart, us per put (P90) | after it, us per put (P90) | off / on per process, median [min - max] |",
              "|---|---|---|---|"]
    for peer, outs in results.items():
        lines.append(f"| {POOLS[peer]} | {statistics.median(o['on_us'] for o in outs):.0f} "
                     f"({statistics.median(o['on_p90_us'] for o in outs):.0f}) | "
                     f"{statistics.median(o['off_us'] for o in outs):.0f} "
                     f"({statistics.median(o['off_p90_us'] for o in outs):.0f}) | "
                     f"{median_range([o['off_over_on'] for o in outs])} |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
