"""A/B: plain gets of values the reader never saw, reading the node's tag while GetValue travels, or not.

    flock /tmp/kvpool-heavy.lock .venv/bin/python benchmarks/peers/ab_tag_reads.py \
        [--processes 4] [--rounds 12] [--out FILE]

What (transfer/lane_tags.py, client/known_places.py): a plain `get` of a value this client has no
place for sends GetValue and, without waiting for the answer, reads what the value's node holds
under the key's tag (where its writer wrote it); the usual get waits for the answer, then reads.
Starts the peers benchmark's `kvpool-nixl` pool (master, node and client on three hosts of the
multi-host harness), then `--processes` client processes, each with one writer Client and two
reader Clients (`read_by_tag` on and off), alternating ABBA over `--rounds` rounds per value size
(64 KiB: held by the master, 256 KiB, 1 MiB, 4 MiB): each round the writer puts 16 new values (one
call per value, as case_plain does) and each reader gets them, bytes compared: every get is of a
value its reader never saw. Reported per process: the median get time per value of each reader and
the median of the per-round ratios off / on (> 1: reading by tag is faster), and the readers'
tag-read outcomes.
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

SIZES_KIB = (64, 256, 1024, 4096)
STORAGE = 1 << 30
PATH = "kvpool-nixl"

CLIENT = r'''
import json, statistics, sys, time
import numpy as np
from kvpool.client import Client
spec = json.loads(sys.argv[1])
writer = Client(spec["master"], "peers", timeout_s=30.0)
readers = {"on": Client(spec["master"], "peers", timeout_s=30.0, read_by_tag=True),
           "off": Client(spec["master"], "peers", timeout_s=30.0, read_by_tag=False)}
rng = np.random.default_rng(spec["seed"])
out = {}
for size_kib in spec["sizes_kib"]:
    size = size_kib << 10
    values = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(16)]
    times = {name: [] for name in readers}
    for r in range(spec["rounds"] + 2):
        keys = [f"{spec['tag']}/{size_kib}/{r}/{i}" for i in range(16)]
        for k, v in zip(keys, values):
            writer.put(k, v)
        for name in (["on", "off"] if r % 2 == 0 else ["off", "on"]):
            c = readers[name]
            t = time.perf_counter()
            got = [c.get(k) for k in keys]
            took = (time.perf_counter() - t) / 16
            if got != values:
                raise SystemExit(f"{name}: plain get returned other bytes")
            del got
            if r >= 2:  # the first two rounds warm connections, the readers' segment caches and pages
                times[name].append(took)
        writer.remove(keys)
    out[size_kib] = {"on_us": statistics.median(times["on"]) * 1e6, "off_us": statistics.median(times["off"]) * 1e6,
                     "off_over_on": statistics.median(o / n for n, o in zip(times["on"], times["off"]))}
tags = readers["on"]._metrics.tag_reads
out["tag_reads"] = {k: tags[k]._value.get() for k in ("used", "read_again", "unknown", "failed")}
for c in (writer, *readers.values()):
    c.close()
print(json.dumps(out))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=4, help="client processes (default 4)")
    ap.add_argument("--rounds", type=int, default=12, help="measured rounds per size and process (default 12)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    why = hosts.why_unavailable()
    if why is not None:
        raise SystemExit(f"the multi-host harness cannot run here: {why}")
    workdir = procs.scratch_dir("kvpool-ab-tag-reads-")
    script = workdir / "ab_tag_reads_client.py"
    script.write_text(CLIENT)
    lines = [f"load average {os.getloadavg()[0]:.1f} at start; {args.processes} client processes, {args.rounds} "
             "measured rounds per size: a writer puts 16 new values, then each reader gets them, the readers ABBA", ""]
    outs: list[dict] = []
    with hosts.HostNetwork(HOSTS) as net:
        where = workdir / PATH
        where.mkdir()
        pool = PEERS[PATH].start(net, where, STORAGE, sys.executable)
        try:
            for p in range(args.processes):
                spec = {"master": pool.spec["master"], "tag": f"p{p}", "seed": p, "rounds": args.rounds,
                        "sizes_kib": list(SIZES_KIB)}
                out = run_script(pool, script, spec)
                outs.append(out)
                line = f"process {p}: tag reads {out['tag_reads']}; " + "; ".join(
                    f"{k} KiB get on {out[str(k)]['on_us']:.0f} us, off {out[str(k)]['off_us']:.0f} us, "
                    f"off/on {out[str(k)]['off_over_on']:.3f}" for k in SIZES_KIB)
                print(line, flush=True)
                lines.append(line)
        finally:
            pool.stop()
    lines += ["", f"load average {os.getloadavg()[0]:.1f} at the end", "",
              "| value | by tag, us per get | usual, us per get | usual / by tag per process, median [min - max] (> 1: by tag faster) |",
              "|---|---|---|---|"]
    for k in SIZES_KIB:
        rows = [o[str(k)] for o in outs]
        lines.append(f"| {k} KiB | {statistics.median(r['on_us'] for r in rows):.0f} | "
                     f"{statistics.median(r['off_us'] for r in rows):.0f} | "
                     f"{median_range([r['off_over_on'] for r in rows])} |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
