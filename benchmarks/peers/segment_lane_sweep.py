"""Segment lane vs NIXL by job size, across harness hosts: what the lane's limit rests on.

    benchmarks/run.py segment_lane_sweep [--rounds 4] [--out FILE]

A SegmentMemory serving its lane on host n (no master: the DataPlane alone, no checksums or
round trips to a master); a client process on host c with two DataPlanes, path "lane" and path
"nixl" (UCX_TLS=tcp), registered on one buffer. Per round, each plane (order alternating) runs
one job per size (256 KiB .. 64 MiB in 1 MiB regions, WRITE then READ, repeated to ~32 MiB per
size). Prints GB/s medians over rounds and every round's figure.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from kvpool.bench import hosts

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import results_io  # noqa: E402

SERVER = r'''
import os, sys, time, msgspec
from kvpool.transfer.segment import SegmentMemory
seg = SegmentMemory(256 << 20, name="sweep", lane_host=sys.argv[1])
tmp = sys.argv[2] + ".tmp"
open(tmp, "wb").write(msgspec.msgpack.encode(seg.segment_info(1, "sweep")))
os.rename(tmp, sys.argv[2])
while os.getppid() != 1:
    time.sleep(0.5)
'''

CLIENT = r'''
import sys, time, numpy as np
from kvpool.transfer.hosting import read_segment_info
from kvpool.transfer.plane import DataPlane
info, rounds = read_segment_info(sys.argv[1]), int(sys.argv[2])
buf = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)
planes = {}
for path in ("lane", "nixl"):
    planes[path] = DataPlane(path=path)
    planes[path].register(buf.ctypes.data, buf.nbytes)
res = {}
for r in range(rounds):
    for path in (["lane", "nixl"] if r % 2 == 0 else ["nixl", "lane"]):
        plane = planes[path]
        for total in (256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20):
            region = min(total, 1 << 20)
            n = total // region
            addrs = [buf.ctypes.data + i * region for i in range(n)]
            offsets = [i * region for i in range(n)]
            reps = max(3, (32 << 20) // total)
            for op in ("WRITE", "READ"):
                plane.transfer(op, info, addrs, offsets, [region] * n, 30)  # warm
                t = time.perf_counter()
                for _ in range(reps):
                    plane.transfer(op, info, addrs, offsets, [region] * n, 30)
                res.setdefault((total, op, path), []).append(total * reps / (time.perf_counter() - t) / 1e9)
print("| job | op | lane GB/s | NIXL GB/s | lane / NIXL | rounds (lane; NIXL) |")
print("|---|---|---|---|---|---|")
for total in (256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20):
    for op in ("READ", "WRITE"):
        lane, nixl = (sorted(res[(total, op, p)]) for p in ("lane", "nixl"))
        ml, mn = lane[len(lane) // 2], nixl[len(nixl) // 2]
        size = f"{total >> 10} KiB" if total < (1 << 20) else f"{total >> 20} MiB"
        print(f"| {size} | {op} | {ml:.2f} | {mn:.2f} | {ml / mn:.2f} | "
              f"{', '.join(f'{x:.2f}' for x in res[(total, op, 'lane')])}; "
              f"{', '.join(f'{x:.2f}' for x in res[(total, op, 'nixl')])} |")
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None,
                    help="write the table here (default: benchmarks/results/segment_lane_sweep/DATE-MACHINE.md)")
    args = ap.parse_args()
    info = Path(tempfile.mkdtemp(prefix="kvpool-lane-sweep-")) / "segment"
    with hosts.HostNetwork(["n", "c"]) as net:
        server = subprocess.Popen(net["n"].wrap([sys.executable, "-c", SERVER, net["n"].address, str(info)]))
        try:
            done = subprocess.run(net["c"].wrap([sys.executable, "-c", CLIENT, str(info), str(args.rounds)]),
                                  capture_output=True, text=True, env={**os.environ, "UCX_TLS": "tcp"}, timeout=1200)
        finally:
            server.terminate()
            server.wait(10)
    if done.returncode:
        sys.exit(f"client failed:\n{done.stderr[-3000:]}")
    table = "\n".join(line for line in done.stdout.splitlines() if line.startswith("|"))
    head = (f"Segment lane vs NIXL (UCX_TLS=tcp) across harness hosts, {args.rounds} rounds, load average "
            f"{os.getloadavg()[0]:.1f} at the end\n\n")
    print(head + table)
    results_io.publish("segment_lane_sweep", head + table + "\n", args.out)


if __name__ == "__main__":
    main()
