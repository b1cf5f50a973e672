"""A/B: a large same-host put's checksums taken each right after its object's copy, or on another
thread beside the copy (fixes.md 36).

    flock /tmp/kvpool-heavy.lock .venv/bin/python benchmarks/peers/ab_put_checksum_during_copy.py [PROCESSES]

Starts the peers benchmark's `kvpool-same` pool (master, node and client on one host of the
multi-host harness), then PROCESSES (default 3) client processes; each puts 64 MiB with put_from
30 times per layout (1 MiB objects, 16 MiB objects, objects of 32 x 64 KiB regions), alternating
put by put the two ways (`Client._checksummed_during_copy` switched off for "beside"), the first
puts read back and compared. Reported: per process and layout the median put time each way and the
median of the per-pair ratios beside / during (> 1: during faster); then their medians.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvpool.bench import hosts, procs  # noqa: E402
from servers import HOSTS, PEERS, run_script  # noqa: E402

CLIENT = r'''
import json, statistics, sys, time
import numpy as np
from kvpool.client import Client, client as cm
spec = json.loads(sys.argv[1])
MiB, KiB = 1 << 20, 1 << 10
total = 64 * MiB
c = Client(spec["master"], "peers", timeout_s=30.0)
src = np.random.default_rng(spec["seed"]).integers(0, 256, total, dtype=np.uint8)
dst = np.zeros(total, np.uint8)
c.register(src); c.register(dst)
real = cm.Client._checksummed_during_copy
out = {}
for name, (size, regions) in {"1 MiB": (MiB, 1), "16 MiB": (16 * MiB, 1), "sg 32x64K": (32 * 64 * KiB, 32)}.items():
    n, region = total // size, size // regions
    addrs = [[src.ctypes.data + i * size + j * region for j in range(regions)] for i in range(n)]
    daddrs = [[dst.ctypes.data + i * size + j * region for j in range(regions)] for i in range(n)]
    sizes = [[region] * regions for _ in range(n)]
    t = {"beside": [], "during": []}
    for r in range(32):
        for way in (("beside", "during") if r % 2 == 0 else ("during", "beside")):
            cm.Client._checksummed_during_copy = real if way == "during" else (lambda self, *a: False)
            keys = [f"{spec['tag']}/{name}/{way}/{r}/{i}" for i in range(n)]
            a = time.perf_counter(); st = c.put_from(keys, addrs, sizes); e = time.perf_counter()
            assert all(s == 0 for s in st), st
            if r < 2:
                dst[:] = 0
                assert c.get_into(keys, daddrs, sizes) == n and np.array_equal(src, dst)
            c.remove(keys)
            if r >= 2: t[way].append(e - a)
    out[name] = {"beside_ms": statistics.median(t["beside"]) * 1e3, "during_ms": statistics.median(t["during"]) * 1e3,
                 "beside_over_during": statistics.median(b / d for b, d in zip(t["beside"], t["during"]))}
print(json.dumps(out))
'''


def main() -> None:
    why = hosts.why_unavailable()
    if why is not None:
        raise SystemExit(f"the multi-host harness cannot run here: {why}")
    processes = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    workdir = procs.scratch_dir("kvpool-ab-put-during-")
    script = workdir / "ab_put_during_client.py"
    script.write_text(CLIENT)
    outs = []
    with hosts.HostNetwork(HOSTS) as net:
        pool = PEERS["kvpool-same"].start(net, workdir, 1 << 30, sys.executable)
        try:
            for p in range(processes):
                out = run_script(pool, script, {**pool.spec, "tag": f"p{p}", "seed": p})
                outs.append(out)
                print(p, {k: {kk: round(vv, 3) for kk, vv in v.items()} for k, v in out.items()}, flush=True)
        finally:
            pool.stop()
    for k in outs[0]:
        ratios = [o[k]["beside_over_during"] for o in outs]
        print(f"{k}: beside {statistics.median(o[k]['beside_ms'] for o in outs):.2f} ms, during "
              f"{statistics.median(o[k]['during_ms'] for o in outs):.2f} ms, beside/during "
              f"{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]")


if __name__ == "__main__":
    main()
