"""The 4-client agent loop on one host, phase by phase, with the client's populate chunk varied.

    benchmarks/run.py agent_phases \
        [--chunks-kib 2048,256] [--rounds 3] [--loops 300] [--calls] [--out FILE]

Per round and chunk size (interleaved, order as given): a fresh `kvpool master` and `kvpool node`
(1 GiB) on this host, then 4 client processes started together, each running the peers
benchmark's agent loop (lookup of 9 keys, zero-copy get of 8 x 256 KiB, put of 2 new 256 KiB
objects; 8 sessions) `--loops` times over the same-host shared-memory path, with
`kvpool.transfer.shm._CHUNK` (how much of the segment a client maps per first touch) set to the
chunk size. Reported per run: loops, P50 / P99 per loop and per phase (lookup, get, put), and
per round the ratios of the first chunk size's figures to each other's (> 1: the other is faster).
`--calls`: also each run's calls, timed inside the processes: the clients' master round trips by
request type, transfer rounds, checksums and segment-chunk mapping (`_populate`), and the master's
own handling of each request type (`MasterCore.handle`, and all of a request's work in
`MasterService._answer`), P50 / P90 / P99 in microseconds (a kept run:
benchmarks/results/agent_phases/2026-12-06-unknown-calls.txt).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import results_io  # noqa: E402

HERE = Path(__file__).resolve().parent

CLIENT = r'''
import json, sys, time
sys.path.insert(0, sys.argv[5])
import adapters, clients
import kvpool.transfer.shm as shm
address, worker, start, loops = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
shm._CHUNK = int(sys.argv[6])
calls = {}
if sys.argv[7] == "1":  # --calls: the client's steps timed (by request type for master round trips)
    from call_timer import timed
    from kvpool.client.master_link import MasterLink
    from kvpool.client.puts import Puts
    from kvpool.client.reads import Reads
    from kvpool.client.rounds import Transfers
    timed(MasterLink, "call", lambda a: "client: " + type(a[1]).__name__, calls)
    timed(Transfers, "run_round", lambda a: f"client: transfer round {a[1]}", calls)
    timed(Puts, "checksums", "client: put checksums", calls)
    timed(Reads, "_verified", "client: get checksums", calls)
    timed(shm.PeerMapping, "_populate", "client: segment chunks mapped (_populate)", calls)
store = adapters.KvpoolAdapter({"master": address, "tenant": "peers"})
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
print(json.dumps({"rows": rows, "calls": calls}))
'''

# `kvpool master` with its request handling timed per request type, written as JSON at exit (--calls)
TIMED_MASTER = r'''
import atexit, json, sys
sys.path.insert(0, sys.argv[1])
from call_timer import timed
from kvpool.master import core, service
out, times = sys.argv[2], {}
timed(core.MasterCore, "handle", lambda a: "master: " + type(a[1]).__name__, times)
timed(service.MasterService, "_answer", "master: any request, all its work (_answer)", times)
atexit.register(lambda: open(out, "w").write(json.dumps(times)))
sys.argv = ["kvpool", *sys.argv[3:]]
from kvpool.cli import main
sys.exit(main())
'''


def one_run(chunk_bytes: int, loops: int, workdir: Path, calls: bool = False) -> dict:
    master_times = workdir / "master_times.json"
    master_times.unlink(missing_ok=True)
    argv = ["master", "--insecure", "--port", "0", "--lease-ttl-s", "2"]
    argv = [sys.executable, "-c", TIMED_MASTER, str(HERE), str(master_times), *argv] if calls else procs.kvpool_argv(*argv)
    master = procs.ManagedProcess("master", argv, workdir).start(30)
    node = None
    try:
        node = procs.ManagedProcess("node", procs.kvpool_argv("node", "--master", master.info["address"], "--memory",
                                                              "1GiB"), workdir).start(60)
        start = time.time() + 3.0
        workers = [subprocess.Popen([sys.executable, "-c", CLIENT, master.info["address"], str(w), str(start), str(loops),
                                     str(HERE), str(chunk_bytes), "1" if calls else "0"], stdout=subprocess.PIPE, text=True)
                   for w in range(4)]
        outs = [w.communicate(timeout=600)[0] for w in workers]
        if any(w.returncode for w in workers):
            raise RuntimeError("a client failed")
    finally:
        if node is not None:
            node.stop()
        master.stop()
    loaded = [json.loads(out) for out in outs]
    rows = np.array([r for o in loaded for r in o["rows"]]) * 1e3
    loop = rows.sum(1)
    result = {"loops": len(rows), "p50_ms": float(np.percentile(loop, 50)), "p99_ms": float(np.percentile(loop, 99))}
    for j, phase in enumerate(("lookup", "get", "put")):
        result[f"{phase}_p50_ms"] = float(np.percentile(rows[:, j], 50))
        result[f"{phase}_p99_ms"] = float(np.percentile(rows[:, j], 99))
    if calls:
        timed: dict[str, list[float]] = {}
        if master_times.exists():
            timed = json.loads(master_times.read_text())
        else:
            print("    (the master wrote no timings: it did not exit cleanly; its rows are missing)", flush=True)
        for o in loaded:
            for name, samples in o["calls"].items():
                timed.setdefault(name, []).extend(samples)
        result["calls_us"] = {name: [len(v), *(round(float(np.percentile(np.array(v) * 1e6, q)), 1) for q in (50, 90, 99))]
                              for name, v in sorted(timed.items())}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks-kib", default="2048,256", help="client populate chunk sizes, KiB (default 2048,256)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--loops", type=int, default=300, help="loops per client (default 300)")
    ap.add_argument("--calls", action="store_true", help="also time the calls inside clients and master (see above)")
    ap.add_argument("--out", type=Path, default=None,
                    help="write the summary here (default: benchmarks/results/agent_phases/DATE-MACHINE.md, "
                         "the runs beside it as .json)")
    args = ap.parse_args()
    chunks = [int(c) << 10 for c in args.chunks_kib.split(",")]
    runs: dict[int, list[dict]] = {c: [] for c in chunks}
    call_lines: list[str] = []  # --calls
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for c in chunks:
                runs[c].append(one_run(c, args.loops, Path(tmp), args.calls))
                timed = runs[c][-1].pop("calls_us", {})
                print(r, f"chunk {c >> 10} KiB", json.dumps({k: round(v, 3) for k, v in runs[c][-1].items()}), flush=True)
                for name, (n, p50, p90, p99) in timed.items():
                    call_lines.append(f"round {r}, chunk {c >> 10} KiB, {name}: {n} calls, P50 {p50} us, P90 {p90} us, "
                                      f"P99 {p99} us")
                    print("    " + call_lines[-1], flush=True)
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
    calls = "\n\n" + "\n".join(call_lines) if call_lines else ""
    md = results_io.publish("agent_phases", "\n".join(lines) + calls + "\n", args.out)
    md.with_suffix(".json").write_text(json.dumps({str(c): v for c, v in runs.items()}, indent=1) + "\n")


if __name__ == "__main__":
    main()
