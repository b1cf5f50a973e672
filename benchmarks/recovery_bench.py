"""Recovery benchmark: how fast a SIGKILLed and restarted master serves the cache again.

For each N (`--sizes`), a fresh `kvpool master` and two `kvpool node` processes on this machine:
1. put N objects of `--object-bytes` with Client.put_from, in batches of whole chains of `--chain`
   keys (parents given explicitly: the previous key, None at a chain head) from one registered
   numpy buffer; every object's bytes are its index and chain id as uint32, tiled, so every byte
   read later can be checked. Put throughput is recorded.
2. wait for the nodes' directories to hold every commit (3 heartbeat intervals, then their
   kvpool_node_directory_objects gauges), SIGKILL the master and start a new one on the same port
   at t0. The restart itself (t0 until the new master's ready file) is reported separately.
3. from t0, every `--poll-s` a fresh Client asks exists() for a fixed random sample of
   `--sample` committed keys and stats() for recovered_objects: time to the first hit, to 99 % and
   to 100 % of the sample, and until recovered_objects reaches N.
4. a fresh Client reads ALL N objects back with get_into, one chain per call (lookups are prefix
   lookups: a call returns the chain's leading hits; after a miss the rest of the chain is read
   from its next existing key), and compares every byte: objects served again, objects with wrong
   bytes (must be 0), and reads the client dropped on a checksum mismatch.
Goal: >= 99 % of committed objects served again within 10 s of the restart at 100K objects, and 0
wrong bytes at every size.

    benchmarks/run.py recovery              # 10K, 100K, 1M objects (~5 min)
    benchmarks/run.py recovery --quick      # 10K only (~30 s)

Writes benchmarks/results/recovery/DATE-MACHINE.{json,md,png} and LATEST.md. Ctrl-C stops every process it started.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
sys.path.insert(0, str(SRC))  # a fresh clone runs without `pip install -e .`
# the services are started as `python -m kvpool`: they need to find the package too
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH")) if p)

import results_io  # noqa: E402
from kvpool.bench import procs  # noqa: E402
from kvpool.client import PUT_ALLOCATED, Client  # noqa: E402
from kvpool.core.errors import KVPoolError  # noqa: E402

MiB = 1 << 20
TENANT = "default"
GOAL_OBJECTS = 100_000
GOAL_SERVED = 0.99
GOAL_WITHIN_S = 10.0
NUM_NODES = 2
_ANNOUNCED = re.compile(r"announced (\d+) objects to the master \((\d+) rejected\) in ([\d.]+) s")


# ---- workload ------------------------------------------------------------------------------------


def make_keys(n: int, salt: str) -> list[str]:
    """32-hex-character keys, like a chained 128-bit block hash."""
    return [hashlib.blake2b(f"{salt}/{i}".encode(), digest_size=16).hexdigest() for i in range(n)]


def fill_expected(out: np.ndarray, first_index: int, chain: int) -> None:
    """Object i's bytes: (i, i // chain) as uint32, tiled. `out` is (objects, words) uint32."""
    index = np.arange(first_index, first_index + out.shape[0], dtype=np.uint32)
    out[:, 0::2] = index[:, None]
    out[:, 1::2] = (index // chain)[:, None]


def node_memory_bytes(n: int, object_bytes: int) -> int:
    """Each node's segment: its half of the objects with 30 % headroom, plus 64 MiB; 64-byte aligned."""
    return (int(n * object_bytes * 1.3 / NUM_NODES) + 64 * MiB) // 64 * 64


# ---- observing the processes ---------------------------------------------------------------------


def node_metrics(node: procs.ManagedProcess) -> dict[str, float]:
    """The node's Prometheus gauges and counters we look at, by name (and outcome label)."""
    from prometheus_client.parser import text_string_to_metric_families

    port = json.loads(node.ready_file.read_text())["metrics_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("kvpool_node_") and not sample.name.endswith("_created"):
                label = sample.labels.get("outcome")
                out[sample.name + (f"[{label}]" if label else "")] = sample.value
    return out


def wait_directories(nodes: list[procs.ManagedProcess], committed: int, timeout_s: float) -> tuple[float, list[int]]:
    """Seconds until the nodes' directories list `committed` objects together, and their sizes."""
    started = time.perf_counter()
    while True:
        sizes = [int(node_metrics(n).get("kvpool_node_directory_objects", 0)) for n in nodes]
        if sum(sizes) >= committed or time.perf_counter() - started > timeout_s:
            return time.perf_counter() - started, sizes
        time.sleep(0.1)


def announcements(node: procs.ManagedProcess) -> list[dict]:
    """The node's log lines saying what it announced to a new master, and how long that took."""
    found = []
    for line in node.log_file.read_text(errors="replace").splitlines():
        match = _ANNOUNCED.search(line)
        if match:
            found.append({"accepted": int(match[1]), "rejected": int(match[2]), "seconds": float(match[3])})
    return found


def warnings_in(log_file: Path, limit: int = 20) -> list[str]:
    lines = [ln for ln in log_file.read_text(errors="replace").splitlines() if "WARNING" in ln or "ERROR" in ln]
    return lines[:limit] + ([f"... {len(lines) - limit} more"] if len(lines) > limit else [])


# ---- the phases ----------------------------------------------------------------------------------


def put_all(client: Client, keys: list[str], args, progress: Progress) -> tuple[dict, np.ndarray]:
    """Put every object; returns the put figures and which indices were stored."""
    n, words, chain = len(keys), args.object_bytes // 4, args.chain
    batch = max(chain, args.batch_keys // chain * chain)  # whole chains per call
    buf = np.empty((batch, words), dtype=np.uint32)
    client.register(buf)
    base = buf.ctypes.data
    addrs = [[base + i * args.object_bytes] for i in range(batch)]
    sizes = [[args.object_bytes]] * batch
    stored = np.zeros(n, dtype=bool)
    outcomes: dict[int, int] = {}
    task = progress.add_task(f"N={n:,}: put", total=n)
    started = time.perf_counter()
    for first in range(0, n, batch):
        count = min(batch, n - first)
        fill_expected(buf[:count], first, chain)
        batch_keys = keys[first : first + count]
        parents = [None if (first + i) % chain == 0 else keys[first + i - 1] for i in range(count)]
        statuses = client.put_from(batch_keys, addrs[:count], sizes[:count], parents)
        for i, status in enumerate(statuses):
            outcomes[status] = outcomes.get(status, 0) + 1
            stored[first + i] = status == PUT_ALLOCATED
        progress.advance(task, count)
    elapsed_s = time.perf_counter() - started
    progress.remove_task(task)
    return {"objects": n, "batch_keys": batch, "seconds": elapsed_s, "objects_per_s": n / elapsed_s,
            "mib_per_s": n * args.object_bytes / MiB / elapsed_s,
            "statuses": {str(k): v for k, v in sorted(outcomes.items())}}, stored


def poll_recovery(address: str, sample: list[str], expected: int, t0: float, args, progress: Progress) -> list[dict]:
    """From t0, every poll_s: a fresh Client's exists(sample) and stats(). Ends once the whole
    sample hits and recovered_objects reached `expected` with no node recovering, once nothing
    changed for settle_s after the nodes finished, or at the recovery timeout."""
    polls: list[dict] = []
    task = progress.add_task(f"recovery of {expected:,} objects: sample hits", total=len(sample))
    next_s = time.perf_counter()
    last_change_s, last_state = time.perf_counter(), None
    while True:
        called = time.perf_counter()
        row: dict = {"t_s": None, "t_stats_s": None, "hits": 0, "recovered": None, "num_objects": None,
                     "nodes": {}, "error": None}
        try:
            with Client(address, timeout_s=args.call_timeout_s) as fresh:
                hits = sum(fresh.exists(sample))
                row["exists_call_s"] = time.perf_counter() - called
                row["t_s"] = time.perf_counter() - t0
                row["hits"] = hits
                stats = fresh.stats()
                row["t_stats_s"] = time.perf_counter() - t0  # later than t_s when the master is busy
                row["recovered"] = stats.recovered_objects
                row["num_objects"] = stats.num_objects
                row["nodes"] = {s.node_id: {"state": s.state, "objects": s.num_objects,
                                            "heartbeat_age_s": round(s.last_heartbeat_age_s, 3)} for s in stats.nodes}
        except KVPoolError as e:
            row["t_s"] = time.perf_counter() - t0
            row["error"] = f"{type(e).__name__}: {e}"
        row["call_s"] = time.perf_counter() - called
        polls.append(row)
        progress.update(task, completed=row["hits"],
                        description=f"recovery: sample hits, {row['recovered'] or 0:,}/{expected:,} recovered")
        now = time.perf_counter()
        state = (row["hits"], row["recovered"], tuple(sorted((k, v["state"]) for k, v in row["nodes"].items())))
        if state != last_state:
            last_state, last_change_s = state, now
        nodes_done = len(row["nodes"]) == NUM_NODES and all(v["state"] != "recovering" for v in row["nodes"].values())
        if nodes_done and row["hits"] == len(sample) and (row["recovered"] or 0) >= expected:
            break
        if nodes_done and now - last_change_s > args.settle_s:
            break
        if now - t0 > args.recovery_timeout_s:
            break
        next_s = max(next_s + args.poll_s, now)
        time.sleep(max(0.0, next_s - time.perf_counter()))
    progress.remove_task(task)
    return polls


def read_back(address: str, keys: list[str], stored: np.ndarray, args, progress: Progress) -> dict:
    """Read every object with get_into, chain by chain, and compare every byte."""
    n, words, chain = len(keys), args.object_bytes // 4, args.chain
    served = leading = wrong = calls = 0
    served_mask = np.zeros(n, dtype=bool)
    task = progress.add_task(f"N={n:,}: read back and compare", total=n)
    started = time.perf_counter()
    with Client(address, timeout_s=args.call_timeout_s) as fresh:
        mismatches_before = fresh._metrics.checksum_mismatches._value.get()
        out = np.empty((chain, words), dtype=np.uint32)
        expected = np.empty((chain, words), dtype=np.uint32)
        fresh.register(out)
        base = out.ctypes.data
        addrs = [[base + i * args.object_bytes] for i in range(chain)]
        sizes = [[args.object_bytes]] * chain
        for first in range(0, n, chain):
            count = min(chain, n - first)
            chain_keys = keys[first : first + count]
            fill_expected(expected[:count], first, chain)
            position = 0
            while position < count:
                todo = count - position
                out[:todo] = 0xFFFFFFFF  # never a valid word here: stale bytes cannot pass for a read
                got = fresh.get_into(chain_keys[position:], addrs[:todo], sizes[:todo])
                calls += 1
                if got:
                    same = (out[:got] == expected[position : position + got]).all(axis=1)
                    wrong += int(got - same.sum())
                    served += got
                    served_mask[first + position : first + position + got] = True
                    if position == 0:
                        leading += got
                position += got
                if position < count:  # a miss: go on from the chain's next key the master has
                    present = fresh.exists(chain_keys[position + 1 :])
                    calls += 1
                    position = position + 1 + (present.index(True) if True in present else len(present))
            progress.advance(task, count)
        mismatches = fresh._metrics.checksum_mismatches._value.get() - mismatches_before
    elapsed_s = time.perf_counter() - started
    progress.remove_task(task)
    committed = int(stored.sum())
    return {
        "committed": committed,
        "served": served,
        "served_fraction": served / committed if committed else 0.0,
        "served_as_chain_prefix": leading,
        "served_not_committed": int((served_mask & ~stored).sum()),
        "wrong_objects": wrong,
        "checksum_mismatches": int(mismatches),
        "calls": calls,
        "seconds": elapsed_s,
    }


def first_time(polls: list[dict], predicate, clock: str = "t_s") -> float | None:
    """When the first poll satisfying `predicate` was answered: `t_s` for exists(), `t_stats_s` for stats()."""
    return next((row[clock] for row in polls if predicate(row)), None)


def run_size(n: int, args, workdir: Path, progress: Progress) -> dict:
    wd = workdir / f"n{n}"
    hb = str(args.heartbeat_s)
    load_start = os.getloadavg()
    memory_bytes = node_memory_bytes(n, args.object_bytes)
    master_args = ("--heartbeat-interval-s", hb, "--log-level", "INFO")
    master = procs.start_master(wd, *master_args)
    address = master.info["address"]
    port = address.rsplit(":", 1)[1]
    started: list[procs.ManagedProcess] = [master]
    try:
        nodes = []
        for j in range(NUM_NODES):
            nodes.append(procs.start_node(wd, address, str(memory_bytes), "--metrics-port", "0", name=f"node{j}"))
            started.append(nodes[-1])
        keys = make_keys(n, salt=f"recovery-{n}")
        with Client(address, timeout_s=args.call_timeout_s) as writer:
            put, stored = put_all(writer, keys, args, progress)
            before = writer.stats()
        committed = int(stored.sum())

        time.sleep(3 * args.heartbeat_s)
        sync_wait_s, directory_sizes = wait_directories(nodes, committed, timeout_s=60.0)
        node_before = [node_metrics(node) for node in nodes]

        master.kill()
        started.remove(master)
        t0_wall = time.time()
        t0 = time.perf_counter()
        master = procs.start_master(wd, *master_args, "--port", port, name="master-restarted")
        started.append(master)
        restart_returned_s = time.perf_counter() - t0
        restart_s = master.ready_file.stat().st_mtime - t0_wall

        rng = np.random.default_rng(args.seed)
        committed_indices = np.flatnonzero(stored)
        picks = rng.choice(committed_indices, size=min(args.sample, committed), replace=False)
        sample = [keys[i] for i in sorted(picks)]
        polls = poll_recovery(address, sample, committed, t0, args, progress)
        read = read_back(address, keys, stored, args, progress)
        recovered_at_s = time.perf_counter() - t0
        node_after = [node_metrics(node) for node in nodes]
        with Client(address, timeout_s=args.call_timeout_s) as fresh:
            after = fresh.stats()
    finally:
        for proc in started:
            proc.stop(grace_s=5.0)

    size = len(sample)
    answered = [row for row in polls if row["error"] is None]
    t99 = first_time(polls, lambda r: r["hits"] >= GOAL_SERVED * size)
    heartbeat_delta = {
        node.name: {k.split("[")[1][:-1]: node_after[j].get(k, 0) - node_before[j].get(k, 0)
                    for k in node_after[j] if k.startswith("kvpool_node_heartbeats_total[")}
        for j, node in enumerate(nodes)
    }
    return {
        "objects": n,
        "object_bytes": args.object_bytes,
        "chain": args.chain,
        "node_memory_bytes": memory_bytes,
        "load_average_start": list(load_start),
        "load_average_end": list(os.getloadavg()),
        "put": put,
        "master_before": {"num_objects": before.num_objects, "used_bytes": before.used_bytes,
                          "epoch": f"{before.epoch:016x}"},
        "directory_sync": {"extra_wait_s": sync_wait_s, "directory_objects": directory_sizes,
                           "slept_s": 3 * args.heartbeat_s},
        "restart": {"ready_file_s": restart_s, "start_master_returned_s": restart_returned_s},
        "sample": {
            "size": size,
            "first_hit_s": first_time(polls, lambda r: r["hits"] > 0),
            "p99_s": t99,
            "all_s": first_time(polls, lambda r: r["hits"] == size),
            "final_hits": polls[-1]["hits"],
        },
        "recovered": {
            "all_s": first_time(polls, lambda r: (r["recovered"] or 0) >= committed, "t_stats_s"),
            "nodes_done_s": first_time(polls, lambda r: len(r["nodes"]) == NUM_NODES
                                       and all(v["state"] != "recovering" for v in r["nodes"].values()), "t_stats_s"),
            "final": after.recovered_objects,
            "fraction": after.recovered_objects / committed if committed else 0.0,
            "rejected_announcements": after.rejected_announcements,
            "num_objects_after": after.num_objects,
            "epoch": f"{after.epoch:016x}",
        },
        "polls": {
            "count": len(polls),
            "failed": len(polls) - len(answered),
            "median_gap_s": float(np.median(np.diff([0.0] + [r["t_s"] for r in polls]))),
            "max_exists_call_s": max((r.get("exists_call_s", 0.0) for r in answered), default=None),
            "max_call_s": max(r["call_s"] for r in polls),
            "max_heartbeat_age_s": max((v["heartbeat_age_s"] for r in answered for v in r["nodes"].values()),
                                       default=None),
            "suspect_polls": sum(any(v["state"] == "suspect" for v in r["nodes"].values()) for r in answered),
            "rows": polls,
        },
        "read_back": read,
        "within_goal_s_served": t99 is not None and t99 <= GOAL_WITHIN_S and read["served_fraction"] >= GOAL_SERVED,
        "announcements": {node.name: announcements(node) for node in nodes},
        "heartbeats_since_kill": heartbeat_delta,
        "warnings": {proc.name: warnings_in(proc.log_file) for proc in [master, *nodes]},
    }


# ---- report --------------------------------------------------------------------------------------


def machine() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), "?")
    mem_kib = next(int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines()
                   if ln.startswith("MemTotal"))
    def git(*argv: str) -> str:
        return subprocess.run(["git", "-C", str(HERE.parent), *argv], capture_output=True, text=True).stdout.strip()

    return {"git_commit": git("rev-parse", "--short", "HEAD") or "?",
            "src_modified": bool(git("status", "--porcelain", "src")),
            "cpu_model": model, "cores": os.cpu_count(), "memory_gib": round(mem_kib / 2**20, 1),
            "python": platform.python_version(), "platform": platform.platform()}


def _s(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f} s"


def reading(results: dict) -> list[str]:
    """Plain sentences from the figures: what held, what did not, where the time went."""
    lines = []
    for r in results["runs"]:
        n = r["objects"]
        announce = [a for runs in r["announcements"].values() for a in runs]
        slowest = max((a["seconds"] for a in announce), default=None)
        served = r["read_back"]
        text = (f"- **{n:,} objects**: the new master answered {_s(r['restart']['ready_file_s'])} after its start; "
                f"the first sampled key hit at {_s(r['sample']['first_hit_s'])}, 99 % at {_s(r['sample']['p99_s'])}, "
                f"all at {_s(r['sample']['all_s'])}. ")
        if slowest is not None:
            text += f"The slowest node announcement took {slowest:.2f} s (node log). "
        text += (f"{served['served_fraction']:.2%} of committed objects were served again, "
                 f"{served['wrong_objects']} with wrong bytes, {served['checksum_mismatches']} checksum misses.")
        lost = served["committed"] - served["served"]
        if lost:
            text += f" {lost:,} committed objects were not served again."
        polls = r["polls"]
        text += (f" Polls came every {1000 * polls['median_gap_s']:.0f} ms (median; asked for "
                 f"{1000 * results['config']['poll_s']:.0f} ms), which bounds how exactly these times are known.")
        unanswered = {name: h.get("unavailable", 0) for name, h in r["heartbeats_since_kill"].items()}
        if any(unanswered.values()):
            text += (" Heartbeats that got no answer after the kill (each costs the node its full call deadline "
                     "before it tries again): " + ", ".join(f"{k} {v:.0f}" for k, v in unanswered.items() if v) + ".")
        if polls["failed"]:
            text += f" {polls['failed']} polls got no answer within {results['config']['call_timeout_s']:g} s."
        text += (f" Slowest exists() of {r['sample']['size']} keys during recovery: "
                 f"{1000 * (polls['max_exists_call_s'] or 0):.0f} ms; largest heartbeat age the master reported: "
                 f"{polls['max_heartbeat_age_s'] or 0:.2f} s"
                 + (f" ({polls['suspect_polls']} polls saw a node suspect)" if polls["suspect_polls"] else "") + ".")
        lines.append(text)
    lines.append(f"- A node learns of the new master only from its next heartbeat reply (interval "
                 f"{results['config']['heartbeat_s']:g} s), so the first hit lands up to one interval after the "
                 "restart whatever N is; past that, the time is the announcement's.")
    goal = next((r for r in results["runs"] if r["objects"] == GOAL_OBJECTS), None)
    if goal is None:
        lines.append(f"- The goal size ({GOAL_OBJECTS:,} objects) was not run.")
    else:
        met = goal["within_goal_s_served"] and goal["read_back"]["wrong_objects"] == 0
        lines.append(f"- Goal at {GOAL_OBJECTS:,} objects (>= 99 % served again within {GOAL_WITHIN_S:g} s, "
                     f"0 wrong bytes): **{'met' if met else 'NOT met'}**.")
    return lines


def write_report(results: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(results, indent=1))
    m, cfg, runs = results["machine"], results["config"], results["runs"]
    lines = [
        "# Recovery benchmark: master SIGKILL and restart",
        "",
        f"Generated by `benchmarks/recovery_bench.py` on {results['date']} "
        f"({results['total_s']:.0f} s in all) at commit {results['machine'].get('git_commit', '?')}"
        f"{' with uncommitted changes under src/' if results['machine'].get('src_modified') else ''}.",
        "",
        f"Machine: {m['cpu_model']}, {m['cores']} cores, {m['memory_gib']} GiB memory; Python {m['python']} "
        f"({m['platform']}). 1-minute load average {results['load_average_1min'][0]:.2f} at the start, "
        f"{results['load_average_1min'][1]:.2f} at the end. The master, both nodes and the benchmark "
        "client share the cores with whatever else ran; other engineers' work ran on this machine too.",
        "",
        "## Method",
        "",
        f"For each N: a fresh `kvpool master` (heartbeat interval {cfg['heartbeat_s']:g} s, other settings "
        f"default) and {NUM_NODES} `kvpool node` processes on 127.0.0.1 (each segment N x {cfg['object_bytes']} B "
        "x 1.3 / 2 + 64 MiB, so nothing is evicted). One client puts N objects of "
        f"{cfg['object_bytes']} B with `put_from`, {runs[0]['put']['batch_keys'] if runs else cfg['batch_keys']} "
        "keys per call (whole chains of "
        f"{cfg['chain']} keys, parents given) from one registered buffer; object i holds (i, i // {cfg['chain']}) "
        "as uint32, tiled. After 3 heartbeat intervals (and until the nodes' `kvpool_node_directory_objects` add "
        "up to N) the master is SIGKILLed and a new one started on the same port at t0; its restart time is t0 "
        "until its ready file. From t0, every "
        f"{1000 * cfg['poll_s']:.0f} ms a fresh Client asks `exists()` for a fixed random sample of "
        f"{cfg['sample']} committed keys and `stats()` (recovered_objects, node states). Then a fresh Client "
        "reads every object back with `get_into`, one chain per call (lookups are prefix lookups; after a miss "
        "it goes on from the chain's next existing key), and compares every byte with what was written. "
        "Times to 99 % / 100 % are the first poll whose reply showed it (50 ms resolution, plus the poll's own "
        "round trip).",
        "",
        f"Goal: >= {GOAL_SERVED:.0%} of committed objects served again within {GOAL_WITHIN_S:g} s at "
        f"{GOAL_OBJECTS:,} objects, and 0 objects with wrong bytes at every size.",
        "",
        "## Results (one column per N)",
        "",
        "| | " + " | ".join(f"{r['objects']:,} objects" for r in runs) + " |",
        "|---|" + "---|" * len(runs),
    ]
    rows = [
        ("put throughput", lambda r: f"{r['put']['objects_per_s']:,.0f} objects/s ({r['put']['mib_per_s']:.0f} MiB/s)"),
        ("put statuses (1 = stored)", lambda r: ", ".join(f"{k}: {v:,}" for k, v in r["put"]["statuses"].items())),
        ("extra wait for node directories", lambda r: f"{r['directory_sync']['extra_wait_s']:.2f} s ("
         + " + ".join(f"{x:,}" for x in r["directory_sync"]["directory_objects"]) + ")"),
        ("master restart (t0 to ready file)", lambda r: _s(r["restart"]["ready_file_s"])),
        ("sample: first hit", lambda r: _s(r["sample"]["first_hit_s"])),
        ("sample: >= 99 % hit", lambda r: _s(r["sample"]["p99_s"])),
        ("sample: 100 % hit", lambda r: _s(r["sample"]["all_s"])),
        ("recovered_objects = N at", lambda r: _s(r["recovered"]["all_s"])),
        ("both nodes done recovering at", lambda r: _s(r["recovered"]["nodes_done_s"])),
        ("node announcement (node log)", lambda r: ", ".join(
            f"{a['seconds']:.2f} s" for runs_ in r["announcements"].values() for a in runs_) or "none logged"),
        ("recovered objects / N", lambda r: f"{r['recovered']['final']:,} / {r['read_back']['committed']:,} "
                                            f"({r['recovered']['fraction']:.2%})"),
        ("rejected announcements", lambda r: f"{r['recovered']['rejected_announcements']:,}"),
        ("served again (read back)",
         lambda r: f"{r['read_back']['served']:,} ({r['read_back']['served_fraction']:.2%})"),
        ("... as chain prefixes", lambda r: f"{r['read_back']['served_as_chain_prefix']:,}"),
        ("objects with wrong bytes", lambda r: f"{r['read_back']['wrong_objects']}"),
        ("checksum mismatches (client metric)", lambda r: f"{r['read_back']['checksum_mismatches']}"),
        ("read back (all N, one chain per call)", lambda r: f"{r['read_back']['seconds']:.1f} s, "
                                                            f"{r['read_back']['calls']:,} calls"),
        ("polls (failed), median gap", lambda r: f"{r['polls']['count']} ({r['polls']['failed']}), "
                                                 f"{1000 * r['polls']['median_gap_s']:.0f} ms"),
        ("slowest exists() while recovering", lambda r: f"{1000 * (r['polls']['max_exists_call_s'] or 0):.0f} ms"),
        ("largest heartbeat age seen", lambda r: f"{r['polls']['max_heartbeat_age_s'] or 0:.2f} s"),
        ("node heartbeats since the kill", lambda r: "; ".join(
            f"{name}: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(h.items()) if v)
            for name, h in r["heartbeats_since_kill"].items())),
        ("load average (1 min) start / end",
         lambda r: f"{r['load_average_start'][0]:.2f} / {r['load_average_end'][0]:.2f}"),
    ]
    for name, cell in rows:
        lines.append(f"| {name} | " + " | ".join(cell(r) for r in runs) + " |")
    lines += ["", f"![recovery]({out.name}.png)", "", "## Reading", "", *reading(results), ""]
    warned = [(r["objects"], name, w) for r in runs for name, ws in r["warnings"].items() for w in ws]
    if warned:
        lines += ["## Warnings in the service logs", "", "```"]
        lines += [f"N={n:,} {name}: {w[:220]}" for n, name, w in warned[:40]]
        lines += ["```", ""]
    Path(f"{out}.md").write_text("\n".join(lines))
    plot(results, Path(f"{out}.png"))


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    longest = 0.0
    for r in results["runs"]:
        rows = [row for row in r["polls"]["rows"] if row["t_s"] is not None]
        t = [0.0] + [row["t_s"] for row in rows]
        longest = max(longest, t[-1])
        a.step(t, [0.0] + [row["hits"] / r["sample"]["size"] for row in rows], where="post",
               label=f"{r['objects']:,} objects")
        stats_rows = [row for row in rows if row["t_stats_s"] is not None]
        b.step([0.0] + [row["t_stats_s"] for row in stats_rows],
               [0.0] + [(row["recovered"] or 0) / r["read_back"]["committed"] for row in stats_rows], where="post",
               label=f"{r['objects']:,} objects")
    for ax in (a, b):
        ax.axhline(GOAL_SERVED, color="grey", linestyle=":", linewidth=1)
        ax.axvline(GOAL_WITHIN_S, color="grey", linestyle="--", linewidth=1, label=f"goal: 99 % by {GOAL_WITHIN_S:g} s")
        ax.set_xlabel("seconds since the master restart (t0)")
        ax.set_xlim(0, max(longest * 1.05, GOAL_WITHIN_S * 1.1))
        ax.set_ylim(-0.02, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    a.set_ylabel("fraction of the sample that exists")
    a.set_title(f"sampled keys ({results['config']['sample']}) found again")
    b.set_ylabel("recovered_objects / committed")
    b.set_title("objects announced to the new master")
    fig.suptitle(f"master SIGKILL + restart, {NUM_NODES} nodes, heartbeat {results['config']['heartbeat_s']:g} s",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every option's default."""


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000], metavar="N",
                        help="objects per run, one fresh master + nodes each")
    parser.add_argument("--quick", action="store_true", help="10,000 objects only")
    parser.add_argument("--object-bytes", type=int, default=1024,
                        help="bytes per object, a multiple of 8")
    parser.add_argument("--chain", type=int, default=64, help="keys per chain")
    parser.add_argument("--batch-keys", type=int, default=5000,
                        help="keys per put_from call, rounded down to whole chains")
    parser.add_argument("--sample", type=int, default=2000, help="keys polled with exists() after the restart")
    parser.add_argument("--poll-s", type=float, default=0.05, help="poll interval after the restart")
    parser.add_argument("--heartbeat-s", type=float, default=1.0, help="the master's heartbeat interval")
    parser.add_argument("--call-timeout-s", type=float, default=10.0, help="client deadline per master call")
    parser.add_argument("--settle-s", type=float, default=5.0,
                        help="stop polling when nothing changed this long after the nodes finished")
    parser.add_argument("--recovery-timeout-s", type=float, default=120.0,
                        help="stop polling this long after the restart whatever happened")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sample")
    parser.add_argument("--out", type=Path, default=None,
                        help="output path without extension (default: benchmarks/results/recovery/DATE-MACHINE)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="scratch folder for ready files and service logs; None: a new temporary one")
    parser.add_argument("--keep-workdir", action="store_true", help="keep the scratch folder (logs) afterwards")
    args = parser.parse_args()
    if args.quick:
        args.sizes = [10_000]
    if args.object_bytes < 8 or args.object_bytes % 8:
        parser.error(f"--object-bytes must be a positive multiple of 8, got {args.object_bytes}")
    if args.chain < 1 or args.sample < 1 or any(n < 1 for n in args.sizes):
        parser.error("--chain, --sample and --sizes must be positive")

    # SIGTERM ends the run like Ctrl-C (and SIGINT does even when a shell started us with it
    # ignored, as it does background jobs): the finally blocks stop every process started
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _interrupt)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvpool-recovery-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    runs = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn())
    try:
        with Progress(*columns) as progress:
            for n in args.sizes:
                runs.append(run_size(n, args, workdir, progress))
                r = runs[-1]
                progress.console.print(
                    f"N={n:,}: put {r['put']['objects_per_s']:,.0f}/s, restart {_s(r['restart']['ready_file_s'])}, "
                    f"sample 99 % {_s(r['sample']['p99_s'])} / 100 % {_s(r['sample']['all_s'])}, served "
                    f"{r['read_back']['served_fraction']:.2%}, wrong {r['read_back']['wrong_objects']}, "
                    f"checksum misses {r['read_back']['checksum_mismatches']}")
    except KeyboardInterrupt:
        procs.stop_all()
        print(f"interrupted; every process stopped. Logs in {workdir}", file=sys.stderr)
        sys.exit(130)
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "total_s": time.perf_counter() - started,
        "load_average_1min": [load_before, os.getloadavg()[0]],
        "machine": machine(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "runs": runs,
    }
    out = args.out or results_io.result_files("recovery").prefix
    write_report(results, out)
    if args.out is None:
        results_io.refresh_latest("recovery")
    if args.keep_workdir or args.workdir is not None:
        print(f"service logs kept in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"wrote {out}.md")


if __name__ == "__main__":
    main()
