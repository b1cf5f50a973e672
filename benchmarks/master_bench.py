"""Master benchmark: a client process against a real `kvpool master` process on this machine.

Measures, in one run:
- put_start + put_end throughput (batches of chained keys, as a KV connector stores a prompt);
- batch lookup_prefix keys/s for batches of 1K-10K keys, all hits, with and without a lease;
- single-key lookup round-trip latency P50/P90/P99/max (the client's MasterChannel, as used);
- master memory per object at N objects: RSS delta of the master process, and tracemalloc of the
  same index built in-process (MasterCore, no sockets).
Warm-up calls are excluded. Writes benchmarks/results/master/DATE-MACHINE.{json,md,png} and LATEST.md.

    benchmarks/run.py master [--objects 1000000] [--out PREFIX]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import subprocess
import tempfile
import sys
import time
import tracemalloc
from pathlib import Path

from rich.progress import Progress

from kvpool.bench import procs
from kvpool.core import protocol as p
from kvpool.master import MasterConfig, MasterCore
from kvpool.rpc.zmq_channel import MasterChannel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_io  # noqa: E402

OBJECT_BYTES = 64 * 1024
SEGMENT_BYTES = 1 << 46  # metadata only: the master never touches this memory
PUT_BATCH = 1000
HEARTBEAT_INTERVAL_S = 1.0  # as the master is started below, and as a node heartbeats


def make_keys(n: int, salt: str = "") -> list[str]:
    """32-hex-character keys, like a chained 128-bit block hash."""
    return [hashlib.blake2b(f"{salt}{i}".encode(), digest_size=16).hexdigest() for i in range(n)]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def percentiles(samples_s: list[float]) -> dict[str, float]:
    xs = sorted(samples_s)
    pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))] * 1e6  # noqa: E731
    return {"p50_us": pick(0.5), "p90_us": pick(0.9), "p99_us": pick(0.99), "max_us": xs[-1] * 1e6, "n": len(xs)}


class DirectoryAcks:
    """Plays the node's part in the directory protocol: heartbeats acknowledge the directory ops
    the master logs per put (master/directory.py), as a `kvpool node` does every heartbeat
    interval. Without it the master would keep one unacknowledged op per object loaded, which no
    running pool does, and the memory figures would include them."""

    def __init__(self, call, node_id: str, segment_id: int) -> None:
        self._call = call  # request -> reply
        self._node_id = node_id
        self._segment_id = segment_id
        self.applied_seq = 0

    def heartbeat(self) -> None:
        """Heartbeat until the master has nothing more to send (a node asks again after a full reply)."""
        while True:
            reply = self._call(p.Heartbeat(self._node_id, [self._segment_id], [self.applied_seq]))
            if not reply.deltas:
                return
            for delta in reply.deltas:
                self.applied_seq = delta.first_seq + len(delta.ops) - 1


def put_batch(call, tenant: str, batch: list[str]) -> None:
    """One chain of objects: put_start, then put_end with the tokens it returned (no checksums)."""
    parents = [None] + batch[:-1]
    reply = call(p.PutStart(tenant, batch, [OBJECT_BYTES] * len(batch), parents))
    if reply.statuses.count(p.PUT_ALLOCATED) != len(batch):
        raise RuntimeError(f"put failed: {reply.message}")
    ended = call(p.PutEnd(tenant, batch, reply.tokens, [0] * len(batch)))
    if ended.ended != len(batch):
        raise RuntimeError(f"put_end refused {len(ended.refused)} of {len(batch)} keys")


def load(channel: MasterChannel, keys: list[str], acks: DirectoryAcks, progress: Progress) -> dict:
    task = progress.add_task("put_start + put_end", total=len(keys))
    call = lambda request: channel.call(request, timeout_s=60)  # noqa: E731
    t0 = last_heartbeat = time.perf_counter()
    for i in range(0, len(keys), PUT_BATCH):
        batch = keys[i : i + PUT_BATCH]
        put_batch(call, "bench", batch)  # each batch is one chain
        if time.perf_counter() - last_heartbeat >= HEARTBEAT_INTERVAL_S:
            acks.heartbeat()  # part of the master's load while puts stream in, so timed with them
            last_heartbeat = time.perf_counter()
        progress.advance(task, len(batch))
    acks.heartbeat()
    elapsed_s = time.perf_counter() - t0
    return {"objects": len(keys), "batch": PUT_BATCH, "seconds": elapsed_s, "objects_per_s": len(keys) / elapsed_s}


def batch_lookups(channel: MasterChannel, keys: list[str], batch: int, lease: bool, seconds: float) -> dict:
    starts = list(range(0, len(keys) - batch, batch))[:200]
    for s in starts[:3]:  # warm-up
        channel.call(p.LookupPrefix("bench", keys[s : s + batch], lease))
    calls = hit = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        s = starts[calls % len(starts)]
        reply = channel.call(p.LookupPrefix("bench", keys[s : s + batch], lease), timeout_s=30)
        hit += reply.num_hit
        calls += 1
    elapsed_s = time.perf_counter() - t0
    if hit != calls * batch:
        raise RuntimeError(f"expected all hits, got {hit} of {calls * batch}")
    return {"batch": batch, "lease": lease, "calls": calls, "keys_per_s": hit / elapsed_s,
            "call_ms": 1000 * elapsed_s / calls}


def single_lookups(channel: MasterChannel, keys: list[str], n: int, lease: bool) -> dict:
    for k in keys[:200]:
        channel.call(p.LookupPrefix("bench", [k], lease))
    samples = []
    for i in range(n):
        k = keys[(i * 7919) % len(keys)]
        t0 = time.perf_counter()
        channel.call(p.LookupPrefix("bench", [k], lease))
        samples.append(time.perf_counter() - t0)
    return {"lease": lease, **percentiles(samples)}


def tracemalloc_per_object(n: int) -> float:
    """Bytes per object of the index itself, built in-process (keys included, as the master holds them)."""
    keys = make_keys(n, salt="tm")
    gc.collect()
    tracemalloc.start()
    before, _ = tracemalloc.get_traced_memory()
    core = MasterCore(MasterConfig(node_ttl_s=1e9, heartbeat_interval_s=1.0))
    call = lambda request: core.handle(request, 1.0)  # noqa: E731
    acks = DirectoryAcks(call, "n", core.handle(p.MountSegment("n", "h", SEGMENT_BYTES, 0, "a", b""), 0.0).segment_id)
    for i in range(0, n, PUT_BATCH):
        put_batch(call, "bench", keys[i : i + PUT_BATCH])
        acks.heartbeat()
    del keys  # only what the index keeps stays counted
    gc.collect()
    after, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return (after - before) / n


def machine() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()[:10]
    return {"lscpu_head": lscpu, "python": platform.python_version(), "platform": platform.platform()}


def write_report(results: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(results, indent=2))
    lines = [
        "# Master benchmark",
        "",
        f"Generated by `benchmarks/master_bench.py` on {results['date']}. Client and master are separate",
        "processes on one machine (ZMQ over TCP on 127.0.0.1). Other work shared the 2 CPUs: 1-minute load "
        f"average {results['load_average_1min'][0]:.1f} at the start, {results['load_average_1min'][1]:.1f} at the end "
        "(the client and master alone make 2). Figures move by 2x with that load; compare runs with care.",
        "",
        "```",
        *results["machine"]["lscpu_head"],
        "```",
        "",
        f"Keys: 32 hex characters; objects {OBJECT_BYTES // 1024} KiB (metadata only); "
        f"{results['objects']:,} objects loaded.",
        "",
        "## Goals",
        "",
        "| metric | goal | measured |",
        "|---|---|---|",
    ]
    for name, goal, value in results["goals"]:
        lines.append(f"| {name} | {goal} | {value} |")
    lines += ["", "## Batch lookup_prefix (all hits)", "", "| batch | lease | keys/s | ms per call |", "|---|---|---|---|"]
    for r in results["batch_lookup"]:
        lines.append(f"| {r['batch']:,} | {r['lease']} | {r['keys_per_s']:,.0f} | {r['call_ms']:.2f} |")
    lines += ["", "## Single-key lookup round trip", "", "| lease | P50 us | P90 us | P99 us | max us | n |",
              "|---|---|---|---|---|---|"]
    for r in results["single_lookup"]:
        lines.append(f"| {r['lease']} | {r['p50_us']:.0f} | {r['p90_us']:.0f} | {r['p99_us']:.0f} | "
                     f"{r['max_us']:.0f} | {r['n']} |")
    put = results["put"]
    mem = results["memory"]
    lines += [
        "",
        "## Puts and memory",
        "",
        f"- put_start + put_end, batches of {put['batch']} chained keys: {put['objects_per_s']:,.0f} objects/s "
        f"({put['objects']:,} objects in {put['seconds']:.1f} s).",
        f"- Master RSS: {mem['rss_before_bytes'] / 2**20:.0f} MiB before, {mem['rss_after_bytes'] / 2**20:.0f} MiB "
        f"after {results['objects']:,} objects: {mem['rss_bytes_per_object']:.0f} bytes/object.",
        f"- tracemalloc of the same index in-process ({mem['tracemalloc_objects']:,} objects): "
        f"{mem['tracemalloc_bytes_per_object']:.0f} bytes/object.",
        "",
        f"![lookups]({out.name}.png)",
        "",
        "Notes: while loading, the client acknowledges the master's directory ops once a second, as a node's",
        "heartbeat does (the master logs one op per committed object until its node has it).",
        "A leased reply carries every hit's replica locations packed in one bytes field (24 bytes per",
        "replica), and the figures are client-visible round trips (the client here decodes the reply but",
        "does not unpack the locations). Time the master alone by driving `MasterCore.handle` in-process.",
    ]
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    plot(results, Path(f"{out}.png"))


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for lease in (False, True):
        rows = [r for r in results["batch_lookup"] if r["lease"] == lease]
        a.plot([r["batch"] for r in rows], [r["keys_per_s"] / 1e6 for r in rows], marker="o",
               label="leased (replicas returned)" if lease else "counting (no lease)")
    a.axhline(1.0, color="grey", linestyle="--", label="goal 1M keys/s")
    a.set_xscale("log")
    a.set_xlabel("keys per lookup_prefix call")
    a.set_ylabel("million keys/s")
    a.set_title("batch lookup throughput")
    a.legend()
    labels = [f"lease={r['lease']}" for r in results["single_lookup"]]
    for q, off in (("p50_us", -0.25), ("p90_us", 0.0), ("p99_us", 0.25)):
        b.bar([i + off for i in range(len(labels))], [r[q] for r in results["single_lookup"]], width=0.25, label=q[:3])
    b.axhline(200, color="grey", linestyle="--", label="goal 200 us")
    b.set_xticks(range(len(labels)), labels)
    b.set_ylabel("microseconds")
    b.set_title("single-key lookup round trip")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objects", type=int, default=1_000_000, help="objects loaded into the master")
    parser.add_argument("--tracemalloc-objects", type=int, default=200_000, help="objects for the in-process measure")
    parser.add_argument("--seconds", type=float, default=2.0, help="duration of each batch-lookup measurement")
    parser.add_argument("--single", type=int, default=5000, help="single-key lookups timed per mode")
    parser.add_argument("--out", type=Path, default=None,
                        help="output path without extension (default: benchmarks/results/master/DATE-MACHINE)")
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    workdir = Path(tempfile.mkdtemp(prefix="kvpool-master-bench-"))
    master = procs.start_master(workdir, "--node-ttl-s", "1000000", "--heartbeat-interval-s", "1",
                                "--put-timeout-s", "1000000", "--log-level", "WARNING")
    channel = MasterChannel(master.info["address"], timeout_s=30.0)
    try:
        mounted = channel.call(p.MountSegment("bench-node", "h", SEGMENT_BYTES, 0, "agent", b"", None))
        acks = DirectoryAcks(lambda request: channel.call(request, timeout_s=60), "bench-node", mounted.segment_id)
        keys = make_keys(args.objects)
        gc.collect()
        time.sleep(0.5)
        rss_before = rss_bytes(master.pid)
        with Progress() as progress:
            put = load(channel, keys, acks, progress)
            time.sleep(0.5)
            rss_after = rss_bytes(master.pid)
            task = progress.add_task("lookups", total=8)
            batch = []
            for size in (1000, 4000, 10000):
                for lease in (False, True):
                    batch.append(batch_lookups(channel, keys, size, lease, args.seconds))
                    progress.advance(task)
            single = [single_lookups(channel, keys, args.single, lease) for lease in (False, True)]
            progress.advance(task, 2)
        stats = channel.call(p.Stats())
    finally:
        channel.close()
        master.stop()
    tm = tracemalloc_per_object(args.tracemalloc_objects)
    best_batch = max(r["keys_per_s"] for r in batch)
    leased_10k = next(r["keys_per_s"] for r in batch if r["batch"] == 10000 and r["lease"])
    rss_per_object = (rss_after - rss_before) / args.objects
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "load_average_1min": [load_before, os.getloadavg()[0]],
        "machine": machine(),
        "objects": args.objects,
        "put": put,
        "batch_lookup": batch,
        "single_lookup": single,
        "memory": {
            "rss_before_bytes": rss_before,
            "rss_after_bytes": rss_after,
            "rss_bytes_per_object": rss_per_object,
            "tracemalloc_objects": args.tracemalloc_objects,
            "tracemalloc_bytes_per_object": tm,
        },
        "master_stats": {"num_objects": stats.num_objects, "used_bytes": stats.used_bytes},
        "goals": [
            ["batch lookup keys/s (best batch size)", ">= 1,000,000", f"{best_batch:,.0f}"],
            ["batch lookup keys/s (10K keys, leased)", ">= 1,000,000", f"{leased_10k:,.0f}"],
            ["single lookup round trip P50 (leased)", "< 200 us", f"{single[1]['p50_us']:.0f} us"],
            ["single lookup round trip P99 (leased)", "< 200 us", f"{single[1]['p99_us']:.0f} us"],
            ["master memory per object (RSS)", "< 500 bytes", f"{rss_per_object:.0f} bytes"],
        ],
    }
    write_report(results, args.out or results_io.result_files("master").prefix)
    print(json.dumps(results["goals"], indent=1))
    if args.out is None:
        results_io.refresh_latest("master")


if __name__ == "__main__":
    main()
