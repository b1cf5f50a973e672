"""A/B: a node's segment on transparent huge pages or on 4 KiB pages, across hosts and on one.

    flock /tmp/kvpool-heavy.lock .venv/bin/python benchmarks/peers/ab_shmem_huge.py [--rounds 4] [--out FILE]

Why: a node's segment is a memfd (transfer/shm.py) and asks for huge pages with MADV_HUGEPAGE,
which the kernel honours for shmem only where /sys/kernel/mm/transparent_hugepage/shmem_enabled
allows it (`advise`, `within_size`, `always`); it is `never` by default on many distributions,
this VM's included. A perf profile of back-to-back 64 MiB cross-host gets put the node's send copy
at ~1.5x the CPU per byte of the two-connection TCP ceiling (raw_tcp.py), whose buffer numpy puts on
huge pages. This measures what the setting is worth to kvpool itself.

How: needs root (it writes the setting, and restores it at the end, also on Ctrl-C). Starts two
pools of each path on the multi-host harness: `huge` (master + node started with shmem_enabled =
advise, the node's population checked to have taken huge pages) and `small` (started with never),
each with its own master and node, a `kvpool-nixl` pair (master, node, client on three hosts) and
a `kvpool-same` pair (all on one host). Then `--rounds` client processes per path, each with one
Client per pool, alternating pool by pool (ABBA) over 24 rounds of a 64 MiB put_from and get_into
in 1 MiB objects (bytes compared). Reported per process: the median get and put time on each pool
and the median of the per-round ratios small / huge (> 1: huge pages faster).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from kvpool.bench import hosts, procs  # noqa: E402
from servers import HOSTS, PEERS, emit, median_range, run_script  # noqa: E402

SETTING = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
STORAGE = 1 << 30

CLIENT = r'''
import json, statistics, sys, time
import numpy as np
from kvpool.client import Client
spec = json.loads(sys.argv[1])
MiB = 1 << 20
total, size = 64 * MiB, MiB
n = total // size
clients = {name: Client(master, "peers", timeout_s=30.0) for name, master in spec["masters"].items()}
src = np.random.default_rng(5).integers(0, 256, total, dtype=np.uint8)
dst = np.zeros(total, np.uint8)
for c in clients.values():
    c.register(src)
    c.register(dst)
addrs = [[src.ctypes.data + i * size] for i in range(n)]
daddrs = [[dst.ctypes.data + i * size] for i in range(n)]
sizes = [[size]] * n
times = {name: {"put": [], "get": []} for name in clients}
names = list(clients)
for r in range(spec["rounds"]):
    for name in (names if r % 2 == 0 else names[::-1]):
        c = clients[name]
        keys = [f"{spec['tag']}/{r}/{i}" for i in range(n)]
        t = time.perf_counter()
        statuses = c.put_from(keys, addrs, sizes, parents=[None] * n)
        put = time.perf_counter() - t
        if any(s != 0 for s in statuses):
            raise SystemExit(f"put statuses {sorted(set(statuses))}")
        dst[:] = 0
        t = time.perf_counter()
        got = c.get_into(keys, daddrs, sizes)
        get = time.perf_counter() - t
        if got != n or not np.array_equal(src, dst):
            raise SystemExit(f"{name}: read {got} of {n} objects, or other bytes")
        c.remove(keys)
        if r >= 2:  # the first two rounds warm connections and pages
            times[name]["put"].append(put)
            times[name]["get"].append(get)
out = {}
for op in ("put", "get"):
    ratios = [s / h for h, s in zip(times["huge"][op], times["small"][op])]
    out[op] = {"huge_ms": statistics.median(times["huge"][op]) * 1e3, "small_ms": statistics.median(times["small"][op]) * 1e3,
               "small_over_huge": statistics.median(ratios)}
print(json.dumps(out))
'''


def current_setting() -> str:
    match = re.search(r"\[(\w+)\]", SETTING.read_text())
    if match is None:
        raise SystemExit(f"cannot read the setting in {SETTING}")
    return match.group(1)


def shmem_huge_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("ShmemHugePages:"):
            return int(line.split()[1])
    return 0


def start_pools(net, workdir: Path, setting: str, python: str) -> dict:
    """Both paths' pools started under `setting`, once their nodes have populated their segments."""
    SETTING.write_text(setting)
    before = shmem_huge_kib()
    pools = {}
    for peer in ("kvpool-nixl", "kvpool-same"):
        where = workdir / f"{setting}-{peer}"
        where.mkdir()
        pools[peer] = PEERS[peer].start(net, where, STORAGE, python)
    deadline = time.monotonic() + 60
    # a node populates its segment from a background thread: wait until the pages are taken
    while setting != "never" and shmem_huge_kib() - before < 2 * STORAGE // 1024 * 9 // 10:
        if time.monotonic() > deadline:
            raise SystemExit(f"the nodes took {shmem_huge_kib() - before} KiB of shmem huge pages, not 2 GiB")
        time.sleep(0.2)
    time.sleep(3.0 if setting == "never" else 0.5)  # 4 KiB pages: no counter to wait on; ~2 s per GiB
    return pools


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4, help="client processes per path (default 4)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    why = hosts.why_unavailable()
    if why is not None:
        raise SystemExit(f"the multi-host harness cannot run here: {why}")
    try:
        original = current_setting()
        SETTING.write_text(original)
    except OSError as e:
        raise SystemExit(f"needs root and {SETTING}: {e}") from None
    workdir = procs.scratch_dir("kvpool-ab-shmem-huge-")
    script = workdir / "ab_shmem_huge_client.py"
    script.write_text(CLIENT)
    lines = [f"shmem_enabled here: {original}; load average {os.getloadavg()[0]:.1f} at start",
             "64 MiB put_from + get_into in 1 MiB objects, 22 measured rounds per process, pools alternating ABBA", ""]
    results: dict[str, list[dict]] = {}
    running = []
    with hosts.HostNetwork(HOSTS) as net:
        try:
            huge = start_pools(net, workdir, "advise", sys.executable)
            running += huge.values()
            small = start_pools(net, workdir, "never", sys.executable)
            running += small.values()
            SETTING.write_text(original)
            for r in range(args.rounds):
                for peer in ("kvpool-nixl", "kvpool-same"):
                    spec = {"masters": {"huge": huge[peer].spec["master"], "small": small[peer].spec["master"]},
                            "tag": f"r{r}", "rounds": 24}
                    out = run_script(huge[peer], script, spec)
                    results.setdefault(peer, []).append(out)
                    line = f"{peer} process {r}: " + ", ".join(
                        f"{op} huge {v['huge_ms']:.1f} ms, small {v['small_ms']:.1f} ms, small/huge {v['small_over_huge']:.3f}"
                        for op, v in out.items())
                    print(line, flush=True)
                    lines.append(line)
        finally:
            SETTING.write_text(original)
            for pool in running:
                pool.stop()
    lines += ["", "| path | op | huge ms | small ms | small / huge per process, median [min - max] (> 1: huge pages faster) |",
              "|---|---|---|---|---|"]
    for peer, outs in results.items():
        for op in ("put", "get"):
            ratios = [o[op]["small_over_huge"] for o in outs]
            lines.append(f"| {peer} | {op} | {statistics.median(o[op]['huge_ms'] for o in outs):.1f} | "
                         f"{statistics.median(o[op]['small_ms'] for o in outs):.1f} | "
                         f"{median_range(ratios)} |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
