"""A/B of two kvpool builds across harness hosts: control-plane-bound operations (issue 14).

    flock /tmp/kvpool-heavy.lock .venv/bin/python benchmarks/peers/ab_builds.py BASE [NEW] \
        [--rounds 6] [--same-host] [--cases control,bulk,evict,plain] [--node-mib 512] [--out FILE]

BASE and NEW are git revisions (NEW defaults to the working tree, "WORKTREE"); each is exported
with `git archive` (the working tree: copied) into a scratch directory and run from there with
PYTHONPATH, so both builds' code runs side by side in one run. Each build gets its own master
(host m) and node (host n); client processes of either build on host c alternate, order reversed
every round (ABBA), against their own build's master and node (`--same-host`: master, node and
clients all on one host: the shared-memory path). Each client process measures, for `control`:
- plain put and get of 256 values of 64 KiB (one call per value, bytes compared);
- the single-key lookup round trip (2,000 calls; P50 / P99);
- a sequential agent-like loop (lookup of 9 keys, zero-copy get of 8 x 256 KiB, put of 2), 200
  loops: loops/s and P50 / P99 per loop;
for `plain`: plain put and get of 16 values of 1 MiB and of 4 MiB (node objects: over the master's
inline limit), GB/s and the get's P50 / P99 per value; for `bulk`: zero-copy put and get of 64 MiB in 1 MiB objects, of 128 MiB in 16 MiB objects and
of 64 MiB in objects of 32 x 64 KiB regions lying far apart (sg) (batches of 64 MiB at most, bytes
compared; the median of 3 passes after a first one); for `evict`: the pool filled with 256 KiB
objects worth 1.05x the node's memory (`--node-mib`), then the agent-like loop, 400 loops, where
every put runs on a full pool (the master's eviction on the path).
Prints one JSON line per process and a summary: medians over rounds, and the median of the
per-round ratios NEW / BASE (> 1: NEW better, inverted for latencies).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from kvpool.bench import hosts, procs

REPO = Path(__file__).resolve().parents[2]

CHILD = r'''
import json, os, sys, time
import numpy as np
from kvpool.client import Client

address, tag, cases = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
client = Client(address, "ab", timeout_s=30.0)
out = {}
rng = np.random.default_rng(3)


def agent_loop(client, tag, loops, name):
    """Lookup of 9 keys, zero-copy get of 8 x 256 KiB, put of 2 new ones: loops/s, P50 / P99 per loop."""
    chunk, prefix, tail, sessions = 256 << 10, 8, 2, 8
    slots = prefix + tail
    src = rng.integers(0, 256, sessions * slots * chunk, dtype=np.uint8)
    dst = np.zeros(prefix * chunk, dtype=np.uint8)
    client.register(src)
    client.register(dst)
    base, dbase = src.ctypes.data, dst.ctypes.data
    chains = [[f"{tag}/{name}/s{s}/c{i}" for i in range(prefix)] for s in range(sessions)]
    for s, chain in enumerate(chains):
        client.put_from(chain, [[base + (s * slots + i) * chunk] for i in range(prefix)], [[chunk]] * prefix)
    lat = np.empty(loops)
    started = time.perf_counter()
    for n in range(loops):
        s = n % sessions
        tail_keys = [f"{tag}/{name}/s{s}/t{n}/{j}" for j in range(tail)]
        t = time.perf_counter()
        assert client.lookup_prefix(chains[s] + [tail_keys[0]]) == prefix
        assert client.get_into(chains[s], [[dbase + i * chunk] for i in range(prefix)], [[chunk]] * prefix) == prefix
        client.put_from(tail_keys, [[base + (s * slots + prefix + j) * chunk] for j in range(tail)], [[chunk]] * tail)
        lat[n] = time.perf_counter() - t
        if n < sessions:
            assert np.array_equal(dst, src[s * slots * chunk:(s * slots + prefix) * chunk])
    return {f"{name}_loops_per_s": loops / (time.perf_counter() - started),
            f"{name}_p50_ms": float(np.percentile(lat, 50)) * 1e3, f"{name}_p99_ms": float(np.percentile(lat, 99)) * 1e3}


if "evict" in cases:
    # a full pool first: 256 KiB objects worth 1.05 x the node's memory, so the loop runs where eviction does
    fill_bytes = int(os.environ["AB_NODE_BYTES"]) * 21 // 20
    chunk, batch = 256 << 10, 256
    src = rng.integers(0, 256, chunk * batch, dtype=np.uint8)
    client.register(src)
    for b in range(fill_bytes // (chunk * batch)):
        client.put_from([f"{tag}/fill/{b}/{i}" for i in range(batch)], [[src.ctypes.data + i * chunk] for i in range(batch)],
                        [[chunk]] * batch)
    out.update(agent_loop(client, tag, 400, "evict"))
if "bulk" in cases:
    # sg: objects of 32 x 64 KiB regions, object i's region k at slot k * n + i (a paged KV cache)
    for name, size, total, regions in (("1m", 1 << 20, 64 << 20, 1), ("16m", 16 << 20, 128 << 20, 1),
                                       ("sg", 2 << 20, 64 << 20, 32)):
        n = total // size
        region = size // regions
        def where(buf, i):
            return [buf.ctypes.data + (k * n + i) * region for k in range(regions)]
        src = rng.integers(0, 256, total, dtype=np.uint8)
        dst = np.zeros_like(src)
        client.register(src)
        client.register(dst)
        batch = max(1, (64 << 20) // size)
        puts, gets = [], []
        for rep in range(4):
            keys = [f"{tag}/{name}/{rep}/{i}" for i in range(n)]
            t = time.perf_counter()
            for b in range(0, n, batch):
                ids = range(b, min(n, b + batch))
                assert client.put_from([keys[i] for i in ids], [where(src, i) for i in ids],
                                       [[region] * regions] * len(ids), parents=[None] * len(ids)) == [0] * len(ids)
            puts.append(total / (time.perf_counter() - t) / 1e9)
            dst[:] = 0
            t = time.perf_counter()
            for b in range(0, n, batch):
                ids = range(b, min(n, b + batch))
                got = client.get_into([keys[i] for i in ids], [where(dst, i) for i in ids], [[region] * regions] * len(ids))
                assert got == len(ids)
            gets.append(total / (time.perf_counter() - t) / 1e9)
            assert np.array_equal(src, dst)
            client.remove(keys)
        out[f"get_{name}_gbs"] = float(np.median(gets[1:]))
        out[f"put_{name}_gbs"] = float(np.median(puts[1:]))
if "plain" in cases:
    # plain bytes of node-sized values (over the master's inline limit): one call per value, as the
    # peers benchmark's sweep (16 values per size, 3 passes after a first): GB/s and get P50 / P99
    for name, size in (("1m", 1 << 20), ("4m", 4 << 20)):
        values = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(16)]
        puts, gets, get_lat = [], [], []
        for rep in range(4):
            keys = [f"{tag}/plain{name}/{rep}/{i}" for i in range(16)]
            t = time.perf_counter()
            for k, v in zip(keys, values):
                assert client.put(k, v) is True
            puts.append(16 * size / (time.perf_counter() - t) / 1e9)
            got = []
            t = time.perf_counter()
            for k in keys:
                t1 = time.perf_counter()
                got.append(client.get(k))
                if rep:
                    get_lat.append(time.perf_counter() - t1)
            gets.append(16 * size / (time.perf_counter() - t) / 1e9)
            assert got == values
            client.remove(keys)
        out[f"plain_put_{name}_gbs"] = float(np.median(puts[1:]))
        out[f"plain_get_{name}_gbs"] = float(np.median(gets[1:]))
        out[f"plain_get_{name}_p50_us"] = float(np.percentile(get_lat, 50)) * 1e6
        out[f"plain_get_{name}_p99_us"] = float(np.percentile(get_lat, 99)) * 1e6
if "control" not in cases:
    out["cpu_s"] = round(time.process_time(), 2)
    client.close()
    print(json.dumps(out))
    sys.exit(0)
values = [rng.integers(0, 256, 64 << 10, dtype=np.uint8).tobytes() for _ in range(256)]
keys = [f"{tag}/plain/{i}" for i in range(256)]
t = time.perf_counter()
for k, v in zip(keys, values):
    assert client.put(k, v) is True
out["plain_put_gbs"] = 256 * (64 << 10) / (time.perf_counter() - t) / 1e9
t = time.perf_counter()
got = [client.get(k) for k in keys]
out["plain_get_gbs"] = 256 * (64 << 10) / (time.perf_counter() - t) / 1e9
assert got == values
client.remove(keys)

client.put(f"{tag}/one", b"x" * (128 << 10))  # over 64 KiB: a node object (smaller ones stay in the master)
for _ in range(200):
    client.lookup_prefix([f"{tag}/one"])
samples = np.empty(2000)
for i in range(2000):
    t = time.perf_counter()
    client.lookup_prefix([f"{tag}/one"])
    samples[i] = time.perf_counter() - t
out["lookup_p50_us"], out["lookup_p99_us"] = (float(np.percentile(samples, q)) * 1e6 for q in (50, 99))

out.update(agent_loop(client, tag, 200, "agent"))
out["cpu_s"] = round(time.process_time(), 2)
client.close()
print(json.dumps(out))
'''

HIGHER_BETTER = {"get_1m_gbs": True, "put_1m_gbs": True, "get_16m_gbs": True, "put_16m_gbs": True,
                 "get_sg_gbs": True, "put_sg_gbs": True,
                 "plain_put_gbs": True, "plain_get_gbs": True, "lookup_p50_us": False, "lookup_p99_us": False,
                 "agent_loops_per_s": True, "agent_p50_ms": False, "agent_p99_ms": False,
                 **{f"plain_{op}_{n}_gbs": True for op in ("put", "get") for n in ("1m", "4m")},
                 **{f"plain_get_{n}_{q}_us": False for n in ("1m", "4m") for q in ("p50", "p99")},
                 "evict_loops_per_s": True, "evict_p50_ms": False, "evict_p99_ms": False, "cpu_s": False}


def export(rev: str, into: Path) -> Path:
    """The build's source tree (its src/ goes on PYTHONPATH)."""
    into.mkdir(parents=True)
    if rev == "WORKTREE":
        shutil.copytree(REPO / "src", into / "src")
    else:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "src"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into / "src"


def measure(net: hosts.HostNetwork, args: argparse.Namespace, builds: dict[str, str], envs: dict[str, dict],
            scratch: Path) -> tuple[dict[str, list[dict]], list[float]]:
    """Each build's master and node, then the ABBA rounds of client processes: (runs, load averages)."""
    host_of = {role: net["m"] if args.same_host else net[role] for role in ("m", "n", "c")}
    runs: dict[str, list[dict]] = {name: [] for name in builds}
    loads = [os.getloadavg()[0]]
    started: list[procs.ManagedProcess] = []
    try:
        masters = {}
        for name in builds:
            argv = procs.kvpool_argv("master", "--insecure", "--host", net["m"].address, "--port", "0")
            master = procs.ManagedProcess(f"{name}-master", host_of["m"].wrap(argv), scratch, env=envs[name])
            started.append(master.start(30))
            argv = procs.kvpool_argv("node", "--master", master.info["address"], "--memory", str(args.node_bytes))
            node = procs.ManagedProcess(f"{name}-node", host_of["n"].wrap(argv), scratch, env=envs[name])
            started.append(node.start(60))
            masters[name] = master.info["address"]
        for r in range(args.rounds):
            for name in list(builds) if r % 2 == 0 else list(builds)[::-1]:
                argv = host_of["c"].wrap([sys.executable, "-c", CHILD, masters[name], f"{name}{r}", args.cases])
                res = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=envs[name])
                if res.returncode:
                    print(name, "failed:", res.stderr[-1500:], flush=True)
                    continue
                runs[name].append({"round": r, **json.loads(res.stdout.splitlines()[-1])})
                loads.append(os.getloadavg()[0])
                print(r, name, json.dumps(runs[name][-1]), f"load {loads[-1]:.1f}", flush=True)
    finally:  # SIGTERM while the hosts still exist (removing them SIGKILLs what is left)
        for proc in reversed(started):
            proc.stop()
    return runs, loads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", help="git revision of the build to compare against")
    ap.add_argument("new", nargs="?", default="WORKTREE", help="git revision, or WORKTREE (default)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--same-host", action="store_true", help="master, nodes and clients on one host (shared memory)")
    ap.add_argument("--cases", default="control", help="comma-separated: control, bulk, evict, plain (default: control)")
    ap.add_argument("--node-mib", type=int, default=512, help="each build's node memory in MiB (default 512)")
    ap.add_argument("--out", type=Path, default=None, help="write every process's JSON and the summary here")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="kvpool-ab-builds-"))
    builds = {"base": args.base, "new": args.new}
    args.node_bytes = args.node_mib << 20
    envs = {name: {**os.environ, "PYTHONPATH": str(export(rev, scratch / name)), "AB_NODE_BYTES": str(args.node_bytes)}
            for name, rev in builds.items()}
    try:
        with hosts.HostNetwork(["m"] if args.same_host else ["m", "n", "c"]) as net:
            runs, loads = measure(net, args, builds, envs, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    where = "one host (shared memory)" if args.same_host else "master, node and client on three hosts"
    lines = [f"base {args.base}, new {args.new}; {where}; cases {args.cases}; {args.rounds} rounds (ABBA), load average {min(loads):.1f}-{max(loads):.1f}",
             "", "| metric | base | new | per-round ratio, median [min - max] (> 1: new better) |", "|---|---|---|---|"]
    for metric, higher in HIGHER_BETTER.items():
        base = {r["round"]: r[metric] for r in runs["base"] if metric in r}
        new = {r["round"]: r[metric] for r in runs["new"] if metric in r}
        common = sorted(set(base) & set(new))
        if not common:
            continue
        ratios = [(new[r] / base[r]) if higher else (base[r] / new[r]) for r in common]
        lines.append(f"| {metric} | {statistics.median(base.values()):.3f} | {statistics.median(new.values()):.3f} | "
                     f"{statistics.median(ratios):.2f} [{min(ratios):.2f} - {max(ratios):.2f}] |")
    print("\n".join(lines))
    if args.out:
        args.out.write_text(json.dumps({"builds": builds, "runs": runs, "loads": loads}, indent=1) + "\n\n"
                            + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
