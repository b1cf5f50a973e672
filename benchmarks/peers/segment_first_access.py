"""First access to a large node segment over the same-host path, and what its mapping costs.

    benchmarks/run.py segment_first_access \
        [--sizes-gib 1,4,8,16] [--repeats 2] [--out benchmarks/results/peers/segment_first_access.json]

For each segment size: a "node" process creates the segment (transfer.shm.SharedSegmentFile, as
`kvpool node` does) and keeps it; then, `--repeats` times, a fresh "client" process maps it
(transfer.shm.PeerMapping, as a client's data plane does on its first transfer to that segment)
and copies 1 MiB out of it at a random offset, then 64 x 1 MiB spread over the whole segment.
Reported per size: the node's creation time (until the segment can be mounted) and the time until
its memory is populated, the client's map time, its first 1 MiB (map + copy:
what the first get costs), the 64 spread reads, the client's page-table memory (VmPTE of
/proc/self/status) after them, and the node's. Every byte read is compared with what the node wrote.

Memory: a segment is a memfd (shmem: RAM, not /dev/shm's capacity); a size larger than
MemAvailable minus 3 GiB is skipped and reported as such. Run it with PYTHONPATH pointing at
another source tree to measure that tree's code (before/after).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import results_io  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20

NODE = r"""
import json, sys, time, ctypes, os
from kvpool.transfer.shm import SharedSegmentFile
size = int(sys.argv[1])
t = time.perf_counter()
seg = SharedSegmentFile(size, "firstaccess")
created = time.perf_counter() - t
if hasattr(seg, "wait_populated"):  # populated in the background: wait, so clients see the same state
    seg.wait_populated()
populated = time.perf_counter() - t
step = 1 << 20
marks = bytes(range(256)) * 4096  # 1 MiB pattern
for off in range(0, size, 64 << 20):  # a recognisable MiB every 64 MiB
    ctypes.memmove(seg.base_addr + off, marks, min(step, size - off))
pte = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmPTE"))
print(json.dumps({"path": seg.path, "create_s": created, "populated_s": populated, "node_pte_kib": pte}), flush=True)
sys.stdin.readline()
seg.close()
"""

CLIENT = r"""
import json, sys, time, ctypes, random
import numpy as np
from kvpool.transfer.shm import PeerMapping
path, size = sys.argv[1], int(sys.argv[2])
expected = np.frombuffer(bytes(range(256)) * 4096, dtype=np.uint8)
dst = np.zeros(1 << 20, dtype=np.uint8)
dst[:] = 1
rng = random.Random(int(sys.argv[3]))
slots = size // (64 << 20)
t0 = time.perf_counter()
m = PeerMapping(path, size, "firstaccess")
mapped = time.perf_counter() - t0
first = rng.randrange(slots) * (64 << 20)
m.copy("READ", [dst.ctypes.data], [first], [1 << 20])
first_s = time.perf_counter() - t0
assert np.array_equal(dst, expected), "first read: wrong bytes"
offs = [rng.randrange(slots) * (64 << 20) for _ in range(64)]
t = time.perf_counter()
for off in offs:
    dst[:] = 0
    m.copy("READ", [dst.ctypes.data], [off], [1 << 20])
    assert np.array_equal(dst, expected), "spread read: wrong bytes"
spread_s = time.perf_counter() - t
pte = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmPTE"))
m.close()
print(json.dumps({"map_s": mapped, "first_1mib_s": first_s, "spread_64x1mib_s": spread_s, "client_pte_kib": pte}))
"""


def mem_available() -> int:
    return next(int(ln.split()[1]) * 1024 for ln in open("/proc/meminfo") if ln.startswith("MemAvailable"))


def measure(size: int, repeats: int) -> dict:
    node = subprocess.Popen([sys.executable, "-c", NODE, str(size)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        line = node.stdout.readline()
        if not line:
            raise RuntimeError(f"node process failed for {size} bytes (exit {node.wait()})")
        info = json.loads(line)
        clients = []
        for r in range(repeats):
            done = subprocess.run([sys.executable, "-c", CLIENT, info["path"], str(size), str(r)], capture_output=True,
                                  text=True, timeout=600)  # fmt: skip
            if done.returncode != 0:
                raise RuntimeError(f"client failed: {done.stderr[-2000:]}")
            clients.append(json.loads(done.stdout.strip().splitlines()[-1]))
    finally:
        if node.poll() is None:
            node.stdin.write("\n")
            node.stdin.flush()
            node.wait(60)
    out = {"size_gib": size / GiB, "node_create_s": info["create_s"], "node_populated_s": info["populated_s"],
           "node_pte_kib": info["node_pte_kib"],
           "clients": clients}  # fmt: skip
    for key in ("map_s", "first_1mib_s", "spread_64x1mib_s", "client_pte_kib"):
        out[key] = statistics.median(c[key] for c in clients)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-gib", default="1,4,8,16", help="comma-separated segment sizes in GiB")
    parser.add_argument("--repeats", type=int, default=2, help="client processes per size (median reported)")
    parser.add_argument("--label", default="", help="what code was measured (written into the results)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON results file (default: benchmarks/results/segment_first_access/DATE-MACHINE.json)")
    args = parser.parse_args()
    from rich.progress import Progress

    import kvpool.transfer.shm as shm

    results = {"label": args.label, "code": shm.__file__, "host": platform.node(), "cores": os.cpu_count(),
               "kernel": platform.release(), "load_avg_start": os.getloadavg(),
               "thp_shmem": Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text().strip(),
               "sizes": [], "skipped": []}  # fmt: skip
    sizes = [float(s) for s in args.sizes_gib.split(",")]
    with Progress() as progress:
        task = progress.add_task("segment sizes", total=len(sizes))
        for gib in sizes:
            size = int(gib * GiB)
            if size > mem_available() - 3 * GiB:
                results["skipped"].append(f"{gib:g} GiB: MemAvailable {mem_available() / GiB:.1f} GiB")
            else:
                row = measure(size, args.repeats)
                results["sizes"].append(row)
                progress.console.print(f"{gib:g} GiB: node create {row['node_create_s']:.2f} s (populated after "
                                       f"{row['node_populated_s']:.2f} s), client map "
                                       f"{row['map_s'] * 1e3:.1f} ms, first 1 MiB {row['first_1mib_s'] * 1e3:.1f} ms, "
                                       f"64 spread reads {row['spread_64x1mib_s'] * 1e3:.1f} ms, client VmPTE "
                                       f"{row['client_pte_kib'] / 1024:.1f} MiB, node VmPTE "
                                       f"{row['node_pte_kib'] / 1024:.1f} MiB")  # fmt: skip
            progress.advance(task)
    results["load_avg_end"] = os.getloadavg()
    results_io.publish("segment_first_access", json.dumps(results, indent=1), args.out, suffix=".json")
    print(json.dumps({k: v for k, v in results.items() if k != "sizes"}))


if __name__ == "__main__":
    main()
