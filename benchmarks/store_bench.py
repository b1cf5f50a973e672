"""Store benchmark: the pool through kvpool.Client, across processes, against memcpy.

    benchmarks/run.py store [--quick] [--out PREFIX]

Starts a `kvpool master` and storage nodes (separate processes), then client processes (this script
in `worker` mode) that measure, each on both data-plane paths (shm: mapped same-host segment;
nixl: UCX one-sided transfers):
- put and get bandwidth for 64 KiB .. 16 MiB objects (batches of put_from / get_into),
- scatter-gather gets: 1 MiB objects made of 16 regions of 64 KiB (a KV block spread over layers),
- 1, 2 and 4 concurrent client processes reading at once (aggregate bandwidth),
- a single-key lookup round trip (P50/P90/P99) and batch lookup keys/s,
and, in the same run, numpy memcpy for the same object sizes (the local limit).
Warm-up passes are excluded; each figure is the median of `--repeats` passes. Writes
benchmarks/results/store/DATE-MACHINE.{json,md,png} (the .md names the machine) and LATEST.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_io  # noqa: E402

KiB, MiB = 1024, 1024 * 1024
SIZES = [64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB]
PATHS = ["shm", "nixl"]


# ---- worker side (a client process) ----------------------------------------------------------


def _gbps(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e9


def _put_get(client, tag: str, size: int, total: int, repeats: int, regions: int = 1) -> dict:
    """Median put and get GB/s over `repeats` passes (one warm-up pass excluded)."""
    n = max(1, total // size)
    src = np.random.default_rng(1).integers(0, 256, n * size, dtype=np.uint8)
    dst = np.zeros_like(src)
    client.register(src)
    client.register(dst)
    region = size // regions
    # object i's region k sits at slot k*n + i: regions of one object are far apart
    def layout(buf):
        base = int(buf.ctypes.data)
        return [[base + (k * n + i) * region for k in range(regions)] for i in range(n)]

    src_addrs, dst_addrs, sizes = layout(src), layout(dst), [[region] * regions for _ in range(n)]
    puts, gets, memcpys = [], [], []
    for rep in range(repeats + 1):
        keys = [f"{tag}/{rep}/{i}" for i in range(n)]
        t = time.perf_counter()
        batch = max(4, min(64, 16 * MiB // size))  # ~16 MiB per call (a long prompt's blocks), >= 4 objects
        for b in range(0, n, batch):
            statuses = client.put_from(keys[b : b + batch], src_addrs[b : b + batch], sizes[b : b + batch])
            if any(s != 0 for s in statuses):
                raise RuntimeError(f"put of {tag} failed: {statuses}")
        put_s = time.perf_counter() - t
        # memcpy of the same objects between the same buffers, batch by batch right before each
        # get_into: on a shared machine only a same-moment comparison means anything
        dst[:] = 0
        memcpy_s = get_s = 0.0
        mirror = np.zeros_like(dst)  # pre-faulted and as large as dst: same cache footprint as the get
        for b in range(0, n, batch):
            t = time.perf_counter()
            for i in range(b, min(n, b + batch)):
                np.copyto(mirror[i * size : (i + 1) * size], src[i * size : (i + 1) * size])
            memcpy_s += time.perf_counter() - t
            t = time.perf_counter()
            count = client.get_into(keys[b : b + batch], dst_addrs[b : b + batch], sizes[b : b + batch])
            get_s += time.perf_counter() - t
            if count != len(keys[b : b + batch]):
                raise RuntimeError(f"get of {tag} read {count} of {len(keys[b : b + batch])}")
        if not np.array_equal(src, dst):
            raise RuntimeError(f"{tag}: read bytes differ from written bytes")
        client.remove(keys)
        if rep:  # rep 0 is the warm-up
            puts.append(_gbps(n * size, put_s))
            gets.append(_gbps(n * size, get_s))
            memcpys.append(_gbps(n * size, memcpy_s))
    return {
        "put_gbps": statistics.median(puts),
        "get_gbps": statistics.median(gets),
        "memcpy_gbps": statistics.median(memcpys),
        "get_over_memcpy": statistics.median(g / m for g, m in zip(gets, memcpys)),
        "best_get_gbps": max(gets),
        "best_get_over_memcpy": max(gets) / max(memcpys),  # peak vs peak: what each can do undisturbed
        "num_objects": n,
    }


def _lookup_latency(client, iterations: int) -> dict:
    client.put("lookup/0", b"x" * 4096)
    for _ in range(200):
        client.lookup_prefix(["lookup/0"])
    samples = []
    for _ in range(iterations):
        t = time.perf_counter()
        client.lookup_prefix(["lookup/0"])
        samples.append(time.perf_counter() - t)
    us = np.array(samples) * 1e6
    keys = [f"lookup/batch/{i}" for i in range(1000)]  # a complete chain: every key is a hit
    value = np.zeros(64, dtype=np.uint8)
    client.register(value)
    if client.put_from(keys, [[int(value.ctypes.data)]] * len(keys), [[64]] * len(keys)) != [0] * len(keys):
        raise RuntimeError("lookup chain put failed")
    if client.lookup_prefix(keys) != len(keys):
        raise RuntimeError("lookup chain incomplete")
    t = time.perf_counter()
    for _ in range(20):
        client.lookup_prefix(keys)
    batch_keys_per_s = 20 * len(keys) / (time.perf_counter() - t)
    return {
        "p50_us": float(np.percentile(us, 50)),
        "p90_us": float(np.percentile(us, 90)),
        "p99_us": float(np.percentile(us, 99)),
        "batch1000_keys_per_s": batch_keys_per_s,
    }


def _concurrent_get(client, tag: str, size: int, n: int, start_at: float, duration_s: float) -> dict:
    src = np.random.default_rng(2).integers(0, 256, n * size, dtype=np.uint8)
    dst = np.zeros_like(src)
    client.register(src)
    client.register(dst)
    keys = [f"{tag}/{i}" for i in range(n)]
    addrs = lambda buf: [[int(buf.ctypes.data) + i * size] for i in range(n)]  # noqa: E731
    if client.put_from(keys, addrs(src), [[size]] * n) != [0] * n:
        raise RuntimeError("concurrent put failed")
    client.get_into(keys, addrs(dst), [[size]] * n)  # warm-up
    time.sleep(max(0.0, start_at - time.time()))
    done_bytes, short_reads, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < duration_s:
        count = client.get_into(keys, addrs(dst), [[size]] * n)
        done_bytes += count * size  # only what was read completely within its lease counts
        short_reads += count != n
        if not np.array_equal(src[: count * size], dst[: count * size]):
            raise RuntimeError("concurrent get: bytes differ")
    elapsed = time.perf_counter() - t0
    client.remove(keys)
    return {"bytes": done_bytes, "elapsed_s": elapsed, "short_reads": short_reads}


def worker(spec: dict) -> dict:
    from kvpool.client import Client

    out: dict = {}
    with Client(spec["master"], spec.get("tenant", "bench"), timeout_s=30.0, path=spec["path"]) as client:
        if spec["kind"] == "sweep":
            out["objects"] = {
                str(s): _put_get(client, f"sweep/{s}", s, spec["total_bytes"], spec["repeats"])
                for s in spec["sizes"]
            }
            out["scatter_gather"] = _put_get(
                client, "sg", MiB, spec["total_bytes"], spec["repeats"], regions=16
            )
            out["scatter_gather"]["region_bytes"] = 64 * KiB
            out["lookup"] = _lookup_latency(client, spec["lookup_iterations"])
        else:
            out = _concurrent_get(client, spec["tag"], spec["size"], spec["num_objects"], spec["start_at"], spec["duration_s"])
    return out


# ---- driver side -------------------------------------------------------------------------------


def _run_workers(specs: list[dict], timeout_s: float = 900.0) -> list[dict]:
    argv = [sys.executable, __file__, "worker"]
    running = [subprocess.Popen([*argv, json.dumps(s)], stdout=subprocess.PIPE, text=True) for s in specs]
    results = []
    for p in running:
        stdout, _ = p.communicate(timeout=timeout_s)
        if p.returncode != 0:
            raise RuntimeError(f"worker exited {p.returncode}")
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    return results


def machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    mem_kib = next(int(ln.split()[1]) for ln in open("/proc/meminfo") if ln.startswith("MemTotal"))
    return {
        "host": platform.node(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kib / MiB, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "load_avg_at_start": os.getloadavg(),
    }


def run_benchmark(args: argparse.Namespace) -> dict:
    from rich.progress import Progress

    from kvpool.bench import procs

    workdir = procs.scratch_dir("kvpool-store-bench-")
    # A removed object keeps its space until its read lease ends, and each pass removes 64 MiB:
    # short leases and 3 GiB of nodes keep those zombies from forcing eviction of fresh objects.
    master = procs.start_master(workdir, "--lease-ttl-s", "2", "--max-lease-hold-s", "10")
    nodes = [procs.start_node(workdir, master.info["address"], args.node_memory, name=f"node{i}") for i in range(2)]
    address = master.info["address"]
    sizes = SIZES[:3] if args.quick else SIZES
    total = (16 if args.quick else 64) * MiB
    results: dict = {"machine": machine(), "config": vars(args) | {"sizes": sizes, "total_bytes_per_pass": total}}
    try:
        with Progress() as progress:
            task = progress.add_task("store benchmark", total=len(args.paths) * (1 + len(args.concurrency)))
            for path in args.paths:
                spec = {
                    "kind": "sweep", "master": address, "path": path, "sizes": sizes, "total_bytes": total,
                    "repeats": args.repeats, "lookup_iterations": 500 if args.quick else 3000,
                    "tenant": f"sweep-{path}",
                }
                results[path] = _run_workers([spec])[0]
                progress.advance(task)
                results[path]["concurrent"] = {}
                for k in args.concurrency:
                    start_at = time.time() + 3.0 + 0.5 * k  # every worker has put its objects by then
                    specs = [
                        {"kind": "concurrent", "master": address, "path": path, "tag": f"c{k}-{w}", "size": MiB,
                         "num_objects": 16, "start_at": start_at, "duration_s": args.duration_s,
                         "tenant": f"conc-{path}"}
                        for w in range(k)
                    ]
                    runs = _run_workers(specs)
                    agg = sum(r["bytes"] for r in runs) / max(r["elapsed_s"] for r in runs) / 1e9
                    results[path]["concurrent"][str(k)] = {
                        "aggregate_get_gbps": agg, "clients": k, "short_reads": sum(r["short_reads"] for r in runs)
                    }
                    progress.advance(task)
    finally:
        for proc in [*nodes, master]:
            proc.stop()
    return results


def write_report(results: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(results, indent=2))
    m = results["machine"]
    paths = [p for p in PATHS if p in results]
    sizes = results["config"]["sizes"]
    lines = [
        "# Store benchmark: kvpool.Client across processes vs memcpy",
        "",
        f"Machine: `{m['host']}`, {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, kernel {m['kernel']}, "
        f"Python {m['python']}; 1-minute load average {m['load_avg_at_start'][0]:.1f} at start and "
        f"{m.get('load_avg_at_end', [float('nan')])[0]:.1f} at the end (the machine is shared with other jobs: "
        "figures move by tens of percent between runs, and a load above the core count slows every "
        "cross-process round trip).",
        "",
        "Setup: one `kvpool master` and two `kvpool node` processes "
        f"({results['config']['node_memory']} each); client processes separate from them. Each pass writes "
        f"{results['config']['total_bytes_per_pass'] // MiB} MiB per object size with `put_from`, "
        "reads it back with `get_into` (one call per batch of 64 keys of 64 KiB or 256 KiB, 16 of 1 MiB, 4 of 4 and 16 MiB), verifies every byte, then removes it. Median of "
        f"{results['config']['repeats']} passes after one warm-up pass. memcpy: numpy copy of the same objects "
        "between the same buffers in the same client process, timed batch by batch right before each get_into "
        "(get / memcpy is the median of per-pass ratios; in brackets the fastest get pass over the fastest "
        "memcpy pass, what each does when the machine leaves it alone). `shm`: the client maps the node's segment (same host); `nixl`: UCX "
        "one-sided READ/WRITE.",
        "",
        "## Bandwidth (GB/s)",
        "",
        "| object | " + " | ".join(f"{p} memcpy | {p} put | {p} get | {p} get / memcpy, median (best / best)" for p in paths) + " |",
        "|---|" + "---|---|---|---|" * len(paths),
    ]
    for s in sizes:
        row = f"| {s // KiB} KiB |"
        for p in paths:
            o = results[p]["objects"][str(s)]
            row += (
                f" {o['memcpy_gbps']:.2f} | {o['put_gbps']:.2f} | {o['get_gbps']:.2f} |"
                f" {100 * o['get_over_memcpy']:.0f} % ({100 * o['best_get_over_memcpy']:.0f} %) |"
            )
        lines.append(row)
    lines += [
        "",
        "## Scatter-gather get: 1 MiB objects of 16 regions x 64 KiB",
        "",
        "| path | put GB/s | get GB/s | get regions/s | get / memcpy |",
        "|---|---|---|---|---|",
    ]
    for p in paths:
        sg = results[p]["scatter_gather"]
        lines.append(
            f"| {p} | {sg['put_gbps']:.2f} | {sg['get_gbps']:.2f} | {sg['get_gbps'] * 1e9 / (64 * KiB):,.0f} |"
            f" {100 * sg['get_over_memcpy']:.0f} % |"
        )
    lines += ["", "## Concurrent client processes, 1 MiB gets (aggregate GB/s)", "", "| path | " +
              " | ".join(f"{k} client(s)" for k in results[paths[0]]["concurrent"]) + " |",
              "|---|" + "---|" * len(results[paths[0]]["concurrent"])]
    for p in paths:
        lines.append(f"| {p} | " + " | ".join(f"{v['aggregate_get_gbps']:.2f}" for v in results[p]["concurrent"].values()) + " |")
    short = {p: sum(v["short_reads"] for v in results[p]["concurrent"].values()) for p in paths}
    lines += ["", "Each client loops get_into over its own 16 objects of 1 MiB for the duration; calls that read "
              f"fewer than all 16 within the lease (counted, not failed): {short}."]
    lines += ["", "## Lookup (control plane only; same for both paths)", "",
              "| path | single-key round trip P50 / P90 / P99 (us) | batch lookup, 1000-key chain, all hits: keys/s |", "|---|---|---|"]
    for p in paths:
        lk = results[p]["lookup"]
        lines.append(f"| {p} | {lk['p50_us']:.0f} / {lk['p90_us']:.0f} / {lk['p99_us']:.0f} | {lk['batch1000_keys_per_s']:,.0f} |")
    lines += ["", "## Goals", ""] + goals(results) + ["", f"Plot: `{out.name}.png`. Script: `benchmarks/store_bench.py`.", ""]
    Path(f"{out}.md").write_text("\n".join(lines))
    plot(results, Path(f"{out}.png"))


def goals(results: dict) -> list[str]:
    out = []
    big = [s for s in results["config"]["sizes"] if s >= MiB]
    for p in (p for p in PATHS if p in results):
        ratios = [results[p]["objects"][str(s)]["get_over_memcpy"] for s in big]
        worst = min(ratios) if ratios else float("nan")
        best = [results[p]["objects"][str(s)]["best_get_over_memcpy"] for s in big]
        verdict = "met" if worst >= 0.5 else "NOT met"
        out.append(
            f"- get >= 50 % of memcpy for objects >= 1 MiB, path {p}: median ratios "
            f"{', '.join(f'{100 * r:.0f} %' for r in ratios)} (worst {100 * worst:.0f} %) -> {verdict}; "
            f"best get / best memcpy {', '.join(f'{100 * r:.0f} %' for r in best)}"
        )
        p50 = results[p]["lookup"]["p50_us"]
        out.append(f"- lookup round trip < 200 us (P50), measured with path {p}'s client: {p50:.0f} us -> "
                   f"{'met' if p50 < 200 else 'NOT met'}")
    return out


def plot(results: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = results["config"]["sizes"]
    paths = [p for p in PATHS if p in results]
    x = [s / KiB for s in sizes]
    fig, ax = plt.subplots(figsize=(8, 5))
    for p, color in zip(paths, ("tab:blue", "tab:orange")):
        ax.plot(x, [results[p]["objects"][str(s)]["memcpy_gbps"] for s in sizes], "--", color=color, alpha=0.5,
                label=f"numpy memcpy (during {p} run)")
        ax.plot(x, [results[p]["objects"][str(s)]["get_gbps"] for s in sizes], "o-", color=color, label=f"get ({p})")
        ax.plot(x, [results[p]["objects"][str(s)]["put_gbps"] for s in sizes], "s:", color=color, label=f"put ({p})")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [f"{int(v)} KiB" if v < 1024 else f"{int(v / 1024)} MiB" for v in x])
    ax.set_xlabel("object size")
    ax.set_ylabel("GB/s")
    ax.set_title(f"kvpool.Client across processes vs memcpy ({results['machine']['cores']} cores, {results['machine']['host']})")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        print(json.dumps(worker(json.loads(argv[1]))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None,
                        help="output path without extension (default: benchmarks/results/store/DATE-MACHINE)")
    parser.add_argument("--quick", action="store_true", help="3 sizes, 16 MiB per pass: a smoke run in ~1 minute")
    parser.add_argument("--repeats", type=int, default=3, help="measured passes per figure, after one warm-up (default: 3)")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=PATHS, help="data-plane paths to measure (default: both)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4],
                        help="numbers of concurrent client processes for the aggregate get test (default: 1 2 4)")
    parser.add_argument("--duration-s", type=float, default=3.0, help="seconds each concurrent get test runs (default: 3)")
    parser.add_argument("--node-memory", default="1536MiB", help="segment size of each of the two nodes (default: 1536MiB)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.duration_s <= 0 or min(args.concurrency) < 1:
        parser.error("--repeats, --duration-s and --concurrency must be positive")
    results = run_benchmark(args)
    refresh = args.out is None
    out = args.out or results_io.result_files("store").prefix
    results["config"]["out"] = str(out)
    results["machine"]["load_avg_at_end"] = os.getloadavg()
    write_report(results, out)
    print(Path(f"{out}.md").read_text())
    if refresh:
        results_io.refresh_latest("store")
    return 0


if __name__ == "__main__":
    sys.exit(main())
