"""Failover benchmark: what a master crash loses, how soon an HA pool serves again, what it costs a put.

(1) Crash right after a put. A `kvpool master` and two `kvpool node` processes; a client puts
`--objects` objects of 1 MiB (on nodes) and as many 4 KiB plain values (kept by the master itself),
waits T seconds (`--delays`), the master is SIGKILLed and started again on the same port; once both
nodes announced, a fresh client reads everything back and compares every byte. Side by side, in
rotated order for each T: the master as shipped and with `--confirm-timeout-s 0` (puts answered
before their nodes have them, as before the durable commits). Reported: the fraction served again
and the wrong objects (must be 0).

(2) Failover with etcd. etcd (Debian's etcd-server) and three `kvpool master --ha` processes with a
lease TTL of `--ttls`, two nodes and a writer that puts 96 KiB objects without pause; the leader is
SIGKILLed. Reported per run: time from the kill to a standby leading (its ready file), to the
writer's first put answered again, and, once both nodes announced to the new leader, the fraction
of objects answered "stored" before the kill that are served, with wrong bytes.

(3) What waiting for the node costs a put: put latency, same processes, 1 MiB objects and 4 KiB
plain values, interleaved batches with and without `--confirm-timeout-s 0`. Percentiles.

    benchmarks/run.py failover            # (1), (2), (3): about 4 minutes
    benchmarks/run.py failover --quick    # fewer delays, one TTL, fewer repeats

Writes benchmarks/results/failover/DATE-MACHINE.{json,md,png} and LATEST.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
sys.path.insert(0, str(SRC))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH")) if p)

import results_io  # noqa: E402
from kvpool.bench import procs  # noqa: E402
from kvpool.client import Client  # noqa: E402
from kvpool.core import protocol as p  # noqa: E402
from kvpool.core.errors import KVPoolError  # noqa: E402
from kvpool.rpc.zmq_channel import MasterChannel  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
FAST = ("--heartbeat-interval-s", "0.2", "--node-ttl-s", "3")


def value_of(key: str, size: int) -> bytes:
    seed = int.from_bytes(key.encode()[-8:].rjust(8, b"\0"), "little") ^ size
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def _stats(address: str) -> p.StatsReply | None:
    channel = MasterChannel(address, timeout_s=0.5)
    try:
        return channel.call(p.Stats())
    except KVPoolError:
        return None
    finally:
        channel.close()


def _wait(predicate, timeout_s: float, what: str) -> float:
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")
        time.sleep(0.05)
    return time.monotonic() - started


def _mounted(address: str, names: set[str]) -> bool:
    stats = _stats(address)
    return stats is not None and {n.node_id for n in stats.nodes if n.state == "alive"} >= names


def _read_back(address: str, keys: list[tuple[str, int]]) -> tuple[int, int]:
    served = wrong = 0
    with Client(address, timeout_s=2.0) as client:
        for key, size in keys:
            value = client.get(key)
            served += value is not None
            wrong += value is not None and value != value_of(key, size)
    return served, wrong


# ---- (1) a crash right after a put ----------------------------------------------------------------


def crash_after_put(work: Path, delay_s: float, confirm: bool, objects: int, run: int) -> dict:
    extra = () if confirm else ("--confirm-timeout-s", "0")  # default heartbeats: one a second
    tag = f"c{run}{'y' if confirm else 'n'}"
    master = procs.start_master(work, *extra, name=f"{tag}-master")
    address = master.info["address"]
    nodes = [procs.start_node(work, address, "64MiB", name=f"{tag}-n{i}") for i in range(2)]
    try:
        big = [(f"{tag}/big/{i}", MiB) for i in range(objects)]
        small = [(f"{tag}/small/{i}", 4 * KiB) for i in range(objects)]
        with Client(address, timeout_s=2.0) as client:
            for key, size in [*big, *small]:
                if client.put(key, value_of(key, size)) is not True:
                    raise RuntimeError(f"put of {key} failed")
        time.sleep(delay_s)
        master.kill()
        master = procs.start_master(work, *extra, "--port", address.rsplit(":", 1)[1], name=f"{tag}-again")
        _wait(lambda: _mounted(address, {n.name for n in nodes}), 30, "both nodes remounted")
        time.sleep(0.5)  # announcements done (the master takes a chunk per call)
        served_big, wrong_big = _read_back(address, big)
        served_small, wrong_small = _read_back(address, small)
        return {"delay_s": delay_s, "confirm": confirm, "objects": objects, "served_objects": served_big,
                "served_values": served_small, "wrong": wrong_big + wrong_small}
    finally:
        for proc in [*nodes, master]:
            proc.stop(grace_s=5.0)


# ---- (2) failover with etcd -----------------------------------------------------------------------


class Writer(threading.Thread):
    def __init__(self, address: str, size: int) -> None:
        super().__init__(daemon=True)
        self.address, self.size = address, size
        self.stop = threading.Event()
        self.stored: list[tuple[str, float]] = []

    def run(self) -> None:
        with Client(self.address, timeout_s=0.5) as client:
            i = 0
            while not self.stop.is_set():
                key = f"w/{i}"
                i += 1
                try:
                    if client.put(key, value_of(key, self.size)) is True:
                        self.stored.append((key, time.monotonic()))
                except KVPoolError:
                    time.sleep(0.02)


def ha_failover(work: Path, ttl_s: int, run: int) -> dict:
    tag = f"ha{ttl_s}-{run}"
    etcd = procs.start_etcd(work, name=f"{tag}-etcd")
    endpoint = etcd.info["endpoint"]
    address = f"etcd://{endpoint}/{tag}"
    masters = [procs.ManagedProcess(f"{tag}-m{i}", procs.kvpool_argv(
        "master", "--host", "127.0.0.1", "--port", "0", "--insecure", *FAST, "--ha", f"etcd://{endpoint}",
        "--ha-name", tag, "--ha-ttl-s", str(ttl_s)), work).start(30) for i in range(3)]

    def leaders():
        out = []
        for m in masters:
            try:
                if m.popen.poll() is None and json.loads(m.ready_file.read_text()).get("state") == "leader":
                    out.append(m)
            except (OSError, ValueError):
                pass
        return out

    nodes = []
    writer = None
    try:
        _wait(lambda: len(leaders()) == 1, 30, "a leader")
        first = leaders()[0]
        nodes = [procs.start_node(work, address, "64MiB", "--timeout-s", "0.5", name=f"{tag}-n{i}") for i in range(2)]
        writer = Writer(address, 96 * KiB)
        writer.start()
        _wait(lambda: len(writer.stored) >= 50, 30, "50 objects stored")
        first.kill()
        killed = time.monotonic()
        before = len(writer.stored)
        leader_s = _wait(lambda: any(m is not first for m in leaders()), 60, "a new leader")
        _wait(lambda: len(writer.stored) > before, 60, "a put answered again")
        resumed_s = writer.stored[before][1] - killed
        writer.stop.set()
        writer.join(10)
        leader = next(m for m in leaders() if m is not first)
        leader_address = json.loads(leader.ready_file.read_text())["address"]
        _wait(lambda: _mounted(leader_address, {n.name for n in nodes}), 30, "both nodes on the new leader")
        time.sleep(0.5)  # their announcements done
        committed = [(k, 96 * KiB) for k, t in writer.stored if t < killed]
        served, wrong = _read_back(address, committed)
        return {"ttl_s": ttl_s, "leader_s": leader_s, "writes_resumed_s": resumed_s, "committed": len(committed),
                "served": served, "wrong": wrong}
    finally:
        if writer is not None:
            writer.stop.set()
        for proc in [*nodes, *masters, etcd]:
            proc.stop(grace_s=5.0)


# ---- (3) what the wait costs a put ----------------------------------------------------------------


def put_latency(work: Path, repeats: int, batch: int) -> dict:
    pools = {}
    for confirm in (True, False):
        extra = () if confirm else ("--confirm-timeout-s", "0")
        name = "lat-y" if confirm else "lat-n"
        master = procs.start_master(work, *extra, name=f"{name}-master")
        node = procs.start_node(work, master.info["address"], "256MiB", name=f"{name}-node")
        pools[confirm] = (master, node, Client(master.info["address"], timeout_s=2.0))
    samples = {(c, kind): [] for c in (True, False) for kind in ("1MiB", "4KiB")}
    try:
        for r in range(repeats):
            for confirm in ((True, False) if r % 2 == 0 else (False, True)):
                client = pools[confirm][2]
                for kind, size in (("1MiB", MiB), ("4KiB", 4 * KiB)):
                    data = value_of(f"{kind}{size}", size)
                    keys = [f"r{r}/{kind}/{i}" for i in range(batch)]
                    for key in keys:
                        started = time.perf_counter()
                        client.put(key, data)
                        samples[(confirm, kind)].append(time.perf_counter() - started)
                    client.remove(keys)
    finally:
        for master, node, client in pools.values():
            client.close()
            node.stop(grace_s=5.0)
            master.stop(grace_s=5.0)
    out = {}
    for (confirm, kind), values in samples.items():
        us = np.array(values) * 1e6
        out[f"{'confirmed' if confirm else 'at once'} {kind}"] = {
            "n": len(us), "p50_us": float(np.percentile(us, 50)), "p90_us": float(np.percentile(us, 90)),
            "p99_us": float(np.percentile(us, 99))}
    return out


# ---- report ---------------------------------------------------------------------------------------


def report(results: dict, out: Path) -> None:
    m = results["machine"]
    lines = [f"# Failover: crashes right after puts, HA failover, the cost of confirmed commits ({results['date']})", "",
             f"Machine: {m['name']} ({m['cpu']}, {m['cores']} cores). Load average (1 min) before/after: "
             f"{results['load'][0]:.2f} / {results['load'][1]:.2f}. Command: `benchmarks/run.py failover "
             f"{' '.join(results['argv'])}`.", "",
             "## (1) Served again after a master SIGKILL T seconds after the last put was answered", "",
             f"{results['objects']} objects of 1 MiB (on nodes) and {results['objects']} plain values of 4 KiB "
             "(kept by the master itself), per run.", "",
             "| T (s) | master | 1 MiB objects served | 4 KiB values served | wrong |", "|---|---|---|---|---|"]
    for row in results["crash"]:
        label = "as shipped (confirmed commits)" if row["confirm"] else "`--confirm-timeout-s 0` (answered at once)"
        lines.append(f"| {row['delay_s']:g} | {label} | {row['served_objects']} / {row['objects']} | "
                     f"{row['served_values']} / {row['objects']} | {row['wrong']} |")
    lines += ["", "## (2) HA failover: three masters on etcd, the leader SIGKILLed under a writer", "",
              "| lease TTL (s) | run | new leader after (s) | writes resumed after (s) | committed before the kill | "
              "served after | wrong |", "|---|---|---|---|---|---|---|"]
    for i, row in enumerate(results["ha"]):
        lines.append(f"| {row['ttl_s']} | {i + 1} | {row['leader_s']:.2f} | {row['writes_resumed_s']:.2f} | "
                     f"{row['committed']} | {row['served']} | {row['wrong']} |")
    lines += ["", "## (3) Put latency: replies held until the node has the commit, against answered at once", "",
              "Interleaved batches, one client, same host (shared memory).", "",
              "| put | n | P50 (us) | P90 (us) | P99 (us) |", "|---|---|---|---|---|"]
    for name, row in results["latency"].items():
        lines.append(f"| {name} | {row['n']} | {row['p50_us']:.0f} | {row['p90_us']:.0f} | {row['p99_us']:.0f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for confirm, style in ((True, "o-"), (False, "s--")):
        rows = [r for r in results["crash"] if r["confirm"] == confirm]
        delays = sorted({r["delay_s"] for r in rows})
        frac = [np.mean([(r["served_objects"] + r["served_values"]) / (2 * r["objects"]) for r in rows
                         if r["delay_s"] == d]) for d in delays]
        ax.plot([max(d, 0.01) for d in delays], frac, style,
                label="confirmed commits" if confirm else "answered at once")
    ax.set_xscale("log")
    ax.set_xlabel("seconds from the last put's answer to the SIGKILL (0 shown at 0.01)")
    ax.set_ylabel("fraction served again")
    ax.set_ylim(-0.05, 1.05)
    ax.legend()
    ax.set_title(f"Master crash after puts ({m['name']})")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="delays 0 and 1 s, TTL 2 s once, fewer puts")
    parser.add_argument("--delays", default="0,0.05,0.2,0.5,1,2", help="seconds between the last put and the crash")
    parser.add_argument("--objects", type=int, default=20, help="objects (and plain values) put before each crash")
    parser.add_argument("--ttls", default="2,5", help="HA lease TTLs to measure")
    parser.add_argument("--ha-runs", type=int, default=3, help="failovers per TTL")
    parser.add_argument("--repeats", type=int, default=8, help="interleaved latency batches per side")
    parser.add_argument("--out", type=Path, default=None, help="path without extension (default: the results folder)")
    args = parser.parse_args()
    delays = [0.0, 1.0] if args.quick else [float(d) for d in args.delays.split(",")]
    ttls = [2] if args.quick else [int(t) for t in args.ttls.split(",")]
    ha_runs = 1 if args.quick else args.ha_runs
    work = Path(tempfile.mkdtemp(prefix="kvpool-failover-"))
    load_before = os.getloadavg()[0]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        crash = []
        for i, delay in enumerate(delays):
            for confirm in ((True, False) if i % 2 == 0 else (False, True)):
                row = crash_after_put(work, delay, confirm, args.objects, len(crash))
                crash.append(row)
                print(f"crash T={delay:g}s {'confirmed' if confirm else 'at once'}: {row['served_objects']}+"
                      f"{row['served_values']} of {2 * args.objects} served, {row['wrong']} wrong", flush=True)
        ha = []
        if shutil.which("etcd"):
            for ttl in ttls:
                for run in range(ha_runs):
                    row = ha_failover(work, ttl, run)
                    ha.append(row)
                    print(f"HA TTL {ttl}s: leader after {row['leader_s']:.2f}s, writes after "
                          f"{row['writes_resumed_s']:.2f}s, {row['served']}/{row['committed']} served, "
                          f"{row['wrong']} wrong", flush=True)
        else:
            print("etcd is not installed: HA failover not measured (apt-get install etcd-server)", flush=True)
        latency = put_latency(work, 2 if args.quick else args.repeats, 50)
        print(json.dumps(latency, indent=1), flush=True)
    except KeyboardInterrupt:
        procs.stop_all()
        sys.exit(130)
    machine = results_io.this_machine()
    results = {"date": time.strftime("%Y-%m-%d %H:%M"), "argv": sys.argv[1:], "load": [load_before, os.getloadavg()[0]],
               "machine": {"name": machine.name, "cpu": machine.cpu_model, "cores": machine.cores},
               "objects": args.objects, "crash": crash, "ha": ha, "latency": latency}
    out = args.out or results_io.result_files("failover").prefix
    out.parent.mkdir(parents=True, exist_ok=True)
    report(results, out)
    if args.out is None:
        results_io.refresh_latest("failover")
    shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {out}.md")


if __name__ == "__main__":
    main()
