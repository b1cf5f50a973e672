"""The 4-client agent loop on one host, phase by phase, with the client's populate chunk varied (issue 14).

    flock /tmp/kvpool-heavy.lock .venv/bin/python benchmarks/peers/agent_phases.py \
        [--chunks-kib 2048,256] [--rounds 3] [--loops 300] [--out FILE]

Per round and chunk size (interleaved, order as given): a fresh `kvpool master` and `kvpool node`
(1 GiB) on this host, then 4 client processes started together, each running the peers
benchmark's agent loop (lookup of 9 keys, zero-copy get of 8 x 256 KiB, put of 2 new 256 KiB
objects; 8 sessions) `--loops` times over the same-host shared-memory path, with
`kvpool.transfer.shm._CHUNK` (how much of the segment a client maps per first touch) set to the
chunk size. Reported per run: loops, P50 / P99 per loop and per phase (lookup, get, put), and
per round the ratios of the first chunk size's figures to each other's (> 1: the other is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvpool.bench import procs

HERE = Path(__file__).resolve().parent

CLIENT = r'''
import json, sys, time
sys.path.insert(0, sys.argv[5])
import clients
import kvpool.transfer.shm as shm
address, worker, start, loops = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
shm._CHUNK = int(sys.argv[6])
store = clients.KvpoolAdapter({"master": address, "tenant": "peers"})
chunk, prefix, tail, sessions = 256 << 10, 8, 2, 8
slots = prefix + tail
src, dst, chains = clients.agent_sessions(store, f"w{worker}", worker, chunk, prefix, tail, sessions)
base, dbase = int(src.ctypes.data), int(dst.ctypes.data)
targets, sizes = [[dbase + i * chunk] for i in range(prefix)], [[chunk]] * prefix
while time.time() < start:
    time.sleep(0.001)
rows, written = [], []
for n in range(loops):
    s = n % sessions
    new = [f"w{worker}/s{s}/t{n}/{j}" for j in range(tail)]
    t0 = time.perf_counter()
    if store.exists_batch(chains[s] + new[:1]) != prefix:
        raise SystemExit("lookup missed")
    t1 = time.perf_counter()
    if store.get_into(chains[s], targets, sizes) != prefix:
        raise SystemExit("get missed")
    t2 = time.perf_counter()
    store.put_from(new, [[base + (s * slots + prefix + j) * chunk] for j in range(tail)], [[chunk]] * tail)
    rows.append([t1 - t0, t2 - t1, time.perf_counter() - t2])
    written += new
    if n < sessions and not (dst == src[s * slots * chunk:(s * slots + prefix) * chunk]).all():
        raise SystemExit("bytes differ")
store.remove(written)
store.close()
print(json.dumps(rows))
'''


def one_run(chunk_bytes: int, loops: int, workdir: Path) -> dict:
    master = procs.ManagedProcess("master", procs.kvpool_argv("master", "--insecure", "--port", "0", "--lease-ttl-s", "2"),
                                  workdir).start(30)
    node = None
    try:
        node = procs.ManagedProcess("node", procs.kvpool_argv("node", "--master", master.info["address"], "--memory",
                                                              "1GiB"), workdir).start(60)
        start = time.time() + 3.0
        workers = [subprocess.Popen([sys.executable, "-c", CLIENT, master.info["address"], str(w), str(start), str(loops),
                                     str(HERE), str(chunk_bytes)], stdout=subprocess.PIPE, text=True) for w in range(4)]
        outs = [w.communicate(timeout=600)[0] for w in workers]
        if any(w.returncode for w in workers):
            raise RuntimeError("a client failed")
    finally:
        if node is not None:
            node.stop()
        master.stop()
    rows = np.array([r for out in outs for r in json.loads(out)]) * 1e3
    loop = rows.sum(1)
    result = {"loops": len(rows), "p50_ms": float(np.percentile(loop, 50)), "p99_ms": float(np.percentile(loop, 99))}
    for j, phase in enumerate(("lookup", "get", "put")):
        result[f"{phase}_p50_ms"] = float(np.percentile(rows[:, j], 50))
        result[f"{phase}_p99_ms"] = float(np.percentile(rows[:, j], 99))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks-kib", default="2048,256", help="client populate chunk sizes, KiB (default 2048,256)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--loops", type=int, default=300, help="loops per client (default 300)")
    ap.add_argument("--out", type=Path, default=None, help="write the runs and the summary here")
    args = ap.parse_args()
    chunks = [int(c) << 10 for c in args.chunks_kib.split(",")]
    runs: dict[int, list[dict]] = {c: [] for c in chunks}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for c in chunks:
                runs[c].append(one_run(c, args.loops, Path(tmp)))
                print(r, f"chunk {c >> 10} KiB", json.dumps({k: round(v, 3) for k, v in runs[c][-1].items()}), flush=True)
    first = chunks[0]
    lines = [f"4 clients, agent loop on one host, {args.rounds} rounds x {args.loops} loops per client; load average "
             f"{os.getloadavg()[0]:.1f} at the end", "",
             "| metric | " + " | ".join(f"{c >> 10} KiB (median)" for c in chunks) + " | " +
             " | ".join(f"{first >> 10} / {c >> 10} KiB per round, median [min - max]" for c in chunks[1:]) + " |",
             "|---|" + "---|" * (2 * len(chunks) - 1)]
    for metric in ("p50_ms", "p99_ms", "lookup_p50_ms", "get_p50_ms", "put_p50_ms", "put_p99_ms"):
        cells = [f"{np.median([x[metric] for x in runs[c]]):.2f}" for c in chunks]
        for c in chunks[1:]:
            ratios = [a[metric] / b[metric] for a, b in zip(runs[first], runs[c])]
            cells.append(f"{np.median(ratios):.2f} [{min(ratios):.2f} - {max(ratios):.2f}]")
        lines.append(f"| {metric} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    if args.out:
        args.out.write_text(json.dumps({str(c): v for c, v in runs.items()}, indent=1) + "\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
