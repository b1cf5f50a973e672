"""A/B: plain gets that read where the value was last seen while GetValue travels, or the usual way.

    flock /tmp/kvpool-heavy.lock .venv/bin/python benchmarks/peers/ab_known_places.py \
        [--processes 4] [--paths kvpool-nixl,kvpool-same] [--out FILE]

What (client/known_places.py): a plain `get` of a value its client put or read lately sends its
GetValue and reads the value where it was without waiting for the answer; the usual get waits for
the answer, then reads. Starts the peers benchmark's kvpool pools (`kvpool-nixl`: master, node and
client on three hosts of the multi-host harness; `kvpool-same`: all on one host), then
`--processes` client processes per path, each with two Clients on the same pool, `known_places`
on and off, alternating ABBA over 12 rounds per value size (256 KiB, 1 MiB, 4 MiB): each round
puts 16 values (as case_plain does, one call per value) and gets them back, bytes compared.
Reported per process: the median get and put time per value on each client and the median of the
per-round ratios off / on (> 1: reading early is faster), and how many gets read early were kept.
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

SIZES_KIB = (256, 1024, 4096)
STORAGE = 1 << 30

CLIENT = r'''
import json, statistics, sys, time
import numpy as np
from kvpool.client import Client
spec = json.loads(sys.argv[1])
clients = {"on": Client(spec["master"], "peers", timeout_s=30.0, known_places=True),
           "off": Client(spec["master"], "peers", timeout_s=30.0, known_places=False)}
rng = np.random.default_rng(spec["seed"])
out = {}
for size_kib in spec["sizes_kib"]:
    size = size_kib << 10
    values = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(16)]
    times = {name: {"put": [], "get": []} for name in clients}
    for r in range(spec["rounds"] + 2):
        for name in (["on", "off"] if r % 2 == 0 else ["off", "on"]):
            c = clients[name]
            keys = [f"{spec['tag']}/{size_kib}/{name}/{r}/{i}" for i in range(16)]
            t = time.perf_counter()
            for k, v in zip(keys, values):
                c.put(k, v)
            put = (time.perf_counter() - t) / 16
            t = time.perf_counter()
            got = [c.get(k) for k in keys]
            get = (time.perf_counter() - t) / 16
            if got != values:
                raise SystemExit(f"{name}: plain get returned other bytes")
            c.remove(keys)
            del got
            if r >= 2:  # the first two rounds warm connections, allocations held ahead and pages
                times[name]["put"].append(put)
                times[name]["get"].append(get)
    out[size_kib] = {op: {"on_us": statistics.median(times["on"][op]) * 1e6,
                          "off_us": statistics.median(times["off"][op]) * 1e6,
                          "off_over_on": statistics.median(o / n for n, o in zip(times["on"][op], times["off"][op]))}
                     for op in ("get", "put")}
early = clients["on"]._metrics.early_reads
out["early_reads"] = {k: early[k]._value.get() for k in ("used", "read_again")}
for c in clients.values():
    c.close()
print(json.dumps(out))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=4, help="client processes per path (default 4)")
    ap.add_argument("--rounds", type=int, default=12, help="measured rounds per size and process (default 12)")
    ap.add_argument("--paths", default="kvpool-nixl,kvpool-same")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    why = hosts.why_unavailable()
    if why is not None:
        raise SystemExit(f"the multi-host harness cannot run here: {why}")
    paths = args.paths.split(",")
    workdir = procs.scratch_dir("kvpool-ab-known-places-")
    script = workdir / "ab_known_places_client.py"
    script.write_text(CLIENT)
    lines = [f"load average {os.getloadavg()[0]:.1f} at start; {args.processes} client processes per path, "
             f"{args.rounds} measured rounds of 16 plain puts then 16 gets per size, the two clients ABBA", ""]
    results: dict[str, list[dict]] = {}
    with hosts.HostNetwork(HOSTS) as net:
        pools = {}
        try:
            for path in paths:
                where = workdir / path
                where.mkdir()
                pools[path] = PEERS[path].start(net, where, STORAGE, sys.executable)
            for p in range(args.processes):
                for path in paths:
                    spec = {"master": pools[path].spec["master"], "tag": f"p{p}", "seed": p,
                            "rounds": args.rounds, "sizes_kib": list(SIZES_KIB)}
                    out = run_script(pools[path], script, spec)
                    results.setdefault(path, []).append(out)
                    line = f"{path} process {p}: early reads {out['early_reads']}; " + "; ".join(
                        f"{k} KiB get on {out[str(k)]['get']['on_us']:.0f} us, off {out[str(k)]['get']['off_us']:.0f} us, "
                        f"off/on {out[str(k)]['get']['off_over_on']:.3f}" for k in SIZES_KIB)
                    print(line, flush=True)
                    lines.append(line)
        finally:
            for pool in pools.values():
                pool.stop()
    lines += ["", f"load average {os.getloadavg()[0]:.1f} at the end", "",
              "| path | value | op | on, us per value | off, us per value | off / on per process, median [min - max] (> 1: on faster) |",
              "|---|---|---|---|---|---|"]
    for path, outs in results.items():
        for k in SIZES_KIB:
            for op in ("get", "put"):
                rows = [o[str(k)][op] for o in outs]
                lines.append(f"| {path} | {k} KiB | {op} | {statistics.median(r['on_us'] for r in rows):.0f} | "
                             f"{statistics.median(r['off_us'] for r in rows):.0f} | "
                             f"{median_range([r['off_over_on'] for r in rows])} |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
