"""A/B of the client's pool-hit path between this checkout and another (no vLLM: just kvpool).

    git worktree add /tmp/base REV
    benchmarks/run.py client_ab --baseline-src /tmp/base/src [--rounds 8]

One `kvpool master` + `kvpool node` (this tree); a writer puts objects shaped like the connector's
(the CPU layout: one region per block and layer); then reader processes of the two trees alternate
(A B A B ...), each timing `get_into` of a connector-sized load (16 objects x 4 layers, the 2K-token
pool hit of connector_ttft_bench) and a `lookup_prefix`, bytes verified. Reports medians and the
ratio per round pair, so a change's cost on the hot path is seen without vLLM's noise.
Writes benchmarks/results/client_ab/DATE-MACHINE.{json,md} and LATEST.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS, OBJECTS, REGION = 4, 16, 128 * 2 * 2 * 64 * 2  # block size 128, (K,V) x 2 heads x 64 dims, bf16


def reader(master: str, reps: int) -> dict:
    import numpy as np

    from kvpool.client import Client

    keys = [f"k{i}" for i in range(OBJECTS)]
    buf = np.zeros(OBJECTS * LAYERS * REGION, dtype=np.uint8)
    addrs = [[buf.ctypes.data + (i * LAYERS + layer) * REGION for layer in range(LAYERS)] for i in range(OBJECTS)]
    sizes = [[REGION] * LAYERS for _ in range(OBJECTS)]
    with Client(master, "ab") as client:
        client.register(buf)
        client.get_into(keys, addrs, sizes)  # warm: routes, mapping
        get_s, lookup_s = [], []
        for _ in range(reps):
            buf[:] = 0
            started = time.perf_counter()
            n = client.get_into(keys, addrs, sizes)
            get_s.append(time.perf_counter() - started)
            assert n == OBJECTS, n
            started = time.perf_counter()
            client.lookup_prefix(keys)
            lookup_s.append(time.perf_counter() - started)
        expected = np.random.default_rng(0).integers(0, 256, buf.size, dtype=np.uint8)
        assert np.array_equal(buf, expected), "wrong bytes"
    return {"get_s": get_s, "lookup_s": lookup_s}


def writer(master: str) -> None:
    import numpy as np

    from kvpool.client import Client

    data = np.random.default_rng(0).integers(0, 256, OBJECTS * LAYERS * REGION, dtype=np.uint8)
    addrs = [[data.ctypes.data + (i * LAYERS + layer) * REGION for layer in range(LAYERS)] for i in range(OBJECTS)]
    with Client(master, "ab") as client:
        client.register(data)
        client.put_from([f"k{i}" for i in range(OBJECTS)], addrs, [[REGION] * LAYERS] * OBJECTS)


def child(role: str, master: str, src: Path, reps: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    env = {**os.environ, "PYTHONPATH": str(src)}
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import client_ab_bench as b; "
            f"r = b.{role}({master!r}{', ' + str(reps) if role == 'reader' else ''}); "
            f"open({str(out)!r}, 'w').write(json.dumps(r))")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)
    return json.loads(out.read_text() or "null")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-src", type=Path, required=True, help="the other checkout's src/")
    parser.add_argument("--rounds", type=int, default=8, help="A/B reader pairs (default 8)")
    parser.add_argument("--reps", type=int, default=50, help="loads per reader process (default 50)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output path without extension (default: benchmarks/results/client_ab/DATE-MACHINE)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import results_io

    from kvpool.bench import procs

    this, base = ROOT / "src", args.baseline_src.resolve()
    workdir = Path(tempfile.mkdtemp(prefix="kvpool-client-ab-"))
    runs: dict[str, list[dict]] = {"this": [], "baseline": []}
    try:
        master = procs.start_master(workdir)
        procs.start_node(workdir, master.info["address"], "64MiB")
        child("writer", master.info["address"], this, 0)
        for _ in range(args.rounds):
            runs["this"].append(child("reader", master.info["address"], this, args.reps))
            runs["baseline"].append(child("reader", master.info["address"], base, args.reps))
    finally:
        procs.stop_all()

    def med(name: str, key: str) -> list[float]:
        return [statistics.median(r[key]) for r in runs[name]]

    result = {"machine": f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}", "rounds": args.rounds,
              "reps": args.reps, "this": str(this), "baseline": str(base)}  # fmt: skip
    lines = ["# Client pool-hit path: this tree vs a baseline (A/B, interleaved processes)", "",
             f"{OBJECTS} objects x {LAYERS} regions of {REGION} B (a 2K-token connector load), same-host path; "
             f"{args.rounds} reader pairs x {args.reps} loads; {result['machine']}.", "",
             "| | this tree | baseline | this / baseline (median of pair ratios) |", "|---|---|---|---|"]  # fmt: skip
    for key, label in (("get_s", "get_into, median us"), ("lookup_s", "lookup_prefix, median us")):
        a, b = med("this", key), med("baseline", key)
        ratio = statistics.median(x / y for x, y in zip(a, b))
        result[key] = {"this_us": [round(x * 1e6, 1) for x in a], "baseline_us": [round(x * 1e6, 1) for x in b],
                       "ratio": round(ratio, 3)}  # fmt: skip
        lines.append(f"| {label} | {statistics.median(a) * 1e6:.0f} | {statistics.median(b) * 1e6:.0f} | {ratio:.3f} |")
    out = args.out or results_io.result_files("client_ab").prefix
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(result, indent=1))
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if args.out is None:
        results_io.refresh_latest("client_ab")
    return 0


if __name__ == "__main__":
    sys.exit(main())
