"""Disk tier benchmark: (1) the node's disk store against fio on the same directory, (2) hit rate of a
pool with DRAM only vs DRAM + disk, replaying synthetic agent sessions at a DRAM size that cannot hold
the working set.

(1) Bandwidth. For each object size, interleaved in rounds (medians reported): fio sequential write and
read with the same block size, one synchronous thread, O_DIRECT (`psync`, the same I/O pattern as the
node's single tier thread: the physical limit for it), fio with libaio at queue depth 32 (the device's
limit), then kvpool's DiskStore: `write_from` (copy out of memory, xxh3_64 check, one O_DIRECT write
of header + payload into a new file, rename) and `read_into` (one O_DIRECT read, checksum, copy into
memory) over distinct objects, and `write_from` with buffered I/O for comparison. Reads with buffered
I/O are not measured: they would come from the page cache. fio is installed with `apt-get install -y
fio` when missing (and it runs as root); without it the fio rows are left out.

(2) Hit rate. The master's real code (MasterCore, in process, virtual clock) and a simulated node that
writes back at the measured disk write rate (bounded queue, as the node) and promotes on request.
Every turn of every session looks its prompt's blocks up (a leased lookup), reads the hits, waits for
the promotions a disk-tier pool starts (a second lookup after the node's reads), and puts the blocks it
missed. Hit rate = prompt blocks served from the pool / prompt blocks. TTFT is modelled from the
measured rates (DRAM copy, disk read) and an assumed prefill rate, and is labelled so.

    benchmarks/run.py disk_tier [--quick] [--out PREFIX]

Writes benchmarks/results/disk_tier/DATE-MACHINE.{json,md} (`--quick`: DATE-MACHINE-quick) and LATEST.md.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import numpy as np
import xxhash
from rich.console import Console
from rich.progress import Progress

from kvpool.core import protocol as p
from kvpool.master import MasterConfig, MasterCore
from kvpool.node.disk_store import DiskStore
from kvpool.workload.synth import SynthConfig, synth_sessions

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_io  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
console = Console()


# ---- machine ----------------------------------------------------------------------------------


def machine(directory: Path) -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    fs = subprocess.run(["df", "-T", str(directory)], capture_output=True, text=True).stdout.splitlines()[-1].split()
    disk = subprocess.run(["lsblk", "-dno", "NAME,MODEL,SIZE,ROTA"], capture_output=True, text=True).stdout.strip()
    load = os.getloadavg()
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB, 1),
            "filesystem": f"{fs[0]} ({fs[1]})", "block_devices": disk, "loadavg_at_start": [round(x, 2) for x in load]}


# ---- (1) bandwidth ----------------------------------------------------------------------------


def ensure_fio() -> str | None:
    if shutil.which("fio"):
        return "present"
    if os.geteuid() == 0 and shutil.which("apt-get"):
        console.print("fio missing: apt-get install -y fio")
        done = subprocess.run(["apt-get", "install", "-y", "fio"], capture_output=True, text=True)
        if done.returncode != 0:
            subprocess.run(["apt-get", "update"], capture_output=True)
            subprocess.run(["apt-get", "install", "-y", "fio"], capture_output=True)
        if shutil.which("fio"):
            return "installed by this script (apt-get install -y fio)"
    return None


def fio(directory: Path, rw: str, bs: int, total: int, engine: str, depth: int) -> float:
    """Bytes per second of one fio job."""
    out = subprocess.run(
        ["fio", "--name=kvpool", f"--directory={directory}", f"--rw={rw}", f"--bs={bs}", f"--size={total}",
         "--direct=1", f"--ioengine={engine}", f"--iodepth={depth}", "--numjobs=1", "--output-format=json"],
        capture_output=True, text=True, check=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    return float(job["write" if "write" in rw else "read"]["bw_bytes"])


def store_rates(directory: Path, size: int, count: int, direct: bool, read: bool) -> tuple[float, float | None]:
    """(write B/s, read B/s or None) of DiskStore over `count` distinct objects of `size` bytes."""
    root = directory / f"store-{size}-{int(direct)}"
    shutil.rmtree(root, ignore_errors=True)
    store = DiskStore(root, count * (size + 8 * KiB) + 16 * MiB, direct=direct)
    store.open()
    src = mmap.mmap(-1, size)
    src[:] = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    addr = ctypes.addressof(ctypes.c_char.from_buffer(src))
    dst = mmap.mmap(-1, size)
    dst_addr = ctypes.addressof(ctypes.c_char.from_buffer(dst))
    checksum = xxhash.xxh3_64_intdigest(src) or 1
    started = time.perf_counter()
    for i in range(count):
        if not store.write_from("bench", f"k{i}", None, checksum, addr, size):
            raise RuntimeError("write_from refused its own bytes")
    write_bps = size * count / (time.perf_counter() - started)
    read_bps = None
    if read:
        started = time.perf_counter()
        for i in range(count):
            if not store.read_into("bench", f"k{i}", checksum, dst_addr):
                raise RuntimeError("read_into missed")
        read_bps = size * count / (time.perf_counter() - started)
        if dst[:] != src[:]:
            raise RuntimeError("read back other bytes")
    store.close()
    shutil.rmtree(root, ignore_errors=True)
    return write_bps, read_bps


def nixl_posix_rates(directory: Path, size: int, count: int) -> tuple[float, float] | None:
    """(write, read) B/s of NIXL's POSIX file backend: all `count` objects in one transfer, at
    offsets of one pre-sized O_DIRECT file (its best case: no per-object files, one batch)."""
    try:  # the build kvpool's transfer layer loaded: a second NIXL build in one process fails to import
        from kvpool.transfer.nixlio import nixl_agent, nixl_agent_config
    except ImportError:
        return None
    name = f"disk-bench-{os.getpid()}-{size}-{time.monotonic_ns()}"
    agent = nixl_agent(name, nixl_agent_config(backends=["POSIX"]))
    buf = mmap.mmap(-1, size * count)
    buf[:] = np.random.default_rng(size).integers(0, 256, size * count, dtype=np.uint8).tobytes()
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    path = directory / f"nixl-{size}.bin"
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o644)
    rates = []
    try:
        os.ftruncate(fd, size * count)
        dram = np.array([[addr + i * size, size, 0] for i in range(count)], dtype=np.int64)
        files = np.array([[i * size, size, fd] for i in range(count)], dtype=np.int64)
        agent.register_memory(agent.get_reg_descs(dram, "DRAM"))
        agent.register_memory(agent.get_reg_descs(files, "FILE"))
        for op in ("WRITE", "READ"):
            started = time.perf_counter()
            handle = agent.initialize_xfer(op, agent.get_xfer_descs(dram, "DRAM"), agent.get_xfer_descs(files, "FILE"),
                                           name)
            agent.transfer(handle)
            while (state := agent.check_xfer_state(handle)) not in ("DONE", "ERR"):
                pass
            if state != "DONE":
                raise RuntimeError(f"NIXL POSIX {op} ended in {state}")
            rates.append(size * count / (time.perf_counter() - started))
            agent.release_xfer_handle(handle)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return rates[0], rates[1]


def bandwidth(directory: Path, sizes: list[int], total: int, rounds: int, with_fio: bool) -> list[dict]:
    samples: dict[tuple[int, str], list[float]] = {}
    with Progress(console=console) as progress:
        task = progress.add_task("bandwidth", total=rounds * len(sizes))
        for _ in range(rounds):
            for size in sizes:
                count = max(8, total // size)
                span = count * size
                if with_fio:
                    fio_dir = directory / "fio"
                    fio_dir.mkdir(exist_ok=True)
                    samples.setdefault((size, "fio_psync_write"), []).append(fio(fio_dir, "write", size, span, "psync", 1))
                    samples.setdefault((size, "fio_psync_read"), []).append(fio(fio_dir, "read", size, span, "psync", 1))
                    samples.setdefault((size, "fio_libaio32_write"), []).append(fio(fio_dir, "write", size, span, "libaio", 32))
                    samples.setdefault((size, "fio_libaio32_read"), []).append(fio(fio_dir, "read", size, span, "libaio", 32))
                    shutil.rmtree(fio_dir, ignore_errors=True)
                w, r = store_rates(directory, size, count, direct=True, read=True)
                samples.setdefault((size, "kvpool_direct_write"), []).append(w)
                samples.setdefault((size, "kvpool_direct_read"), []).append(r)
                w, _ = store_rates(directory, size, count, direct=False, read=False)
                samples.setdefault((size, "kvpool_buffered_write"), []).append(w)
                nixl = nixl_posix_rates(directory, size, count)
                if nixl is not None:
                    samples.setdefault((size, "nixl_posix_write"), []).append(nixl[0])
                    samples.setdefault((size, "nixl_posix_read"), []).append(nixl[1])
                progress.advance(task)
    rows = []
    for size in sizes:
        row = {"object_bytes": size}
        for (s, name), values in samples.items():
            if s == size:
                row[name + "_MBps"] = round(statistics.median(values) / 1e6, 1)
        if with_fio:
            row["write_vs_fio_psync"] = round(row["kvpool_direct_write_MBps"] / row["fio_psync_write_MBps"], 3)
            row["read_vs_fio_psync"] = round(row["kvpool_direct_read_MBps"] / row["fio_psync_read_MBps"], 3)
        rows.append(row)
    return rows


# ---- (2) hit rate -----------------------------------------------------------------------------


class SimNode:
    """A node with a disk tier, as node/tier.py behaves, on a virtual clock: write-back at
    `write_bps` through a bounded queue, promotions done at the next poll."""

    def __init__(self, core: MasterCore, dram_bytes: int, disk_bytes: int, write_bps: float, max_queue: int = 4096):
        self.core = core
        msg = p.MountSegment("sim", "host", dram_bytes, 0, "agent", b"", disk_bytes=disk_bytes)
        self.segment_id = core.handle(msg, 0.0).segment_id
        self.has_disk = disk_bytes > 0
        self.applied = 0
        self.queue: deque[p.DirEntry] = deque()
        self.max_queue = max_queue
        self.write_bps = write_bps
        self.budget_bytes = 0.0
        self.last_s = 0.0
        self.report = p.TierReport(self.segment_id)
        self.promoted_bytes = 0
        self.writeback_dropped = 0

    def sync(self, now_s: float) -> None:
        self.budget_bytes = min(self.budget_bytes + (now_s - self.last_s) * self.write_bps, 64 * GiB)
        self.last_s = now_s
        for _ in range(20):
            reply = self.core.handle(p.Heartbeat("sim", [self.segment_id], [self.applied], [self.report]), now_s)
            written, promoted = [], []
            for delta in reply.deltas:
                for op in delta.ops[max(0, self.applied + 1 - delta.first_seq):]:
                    if not self.has_disk:
                        continue
                    if op.op == p.DIR_COMMIT and op.size and op.checksum:
                        if len(self.queue) < self.max_queue:
                            self.queue.append(op)
                        else:
                            self.writeback_dropped += 1
                    elif op.op == p.DIR_PROMOTE:
                        promoted.append(op.offset)
                        self.promoted_bytes += op.size
                self.applied = delta.first_seq + len(delta.ops) - 1
            while self.queue and self.budget_bytes >= self.queue[0].size:
                op = self.queue.popleft()
                self.budget_bytes -= op.size
                written.append(p.DiskEntry(op.tenant, op.key, op.size, op.checksum, op.parent))
            self.report = p.TierReport(self.segment_id, written, [], promoted, [])
            if not (written or promoted or any(d.more for d in reply.deltas)):
                break


def replay(sessions, object_bytes: int, dram_bytes: int, disk_bytes: int, write_bps: float, gap_s: float) -> dict:
    config = MasterConfig(alignment_bytes=4096, node_ttl_s=1e9, heartbeat_interval_s=1.0, put_timeout_s=1e9,
                          high_watermark=0.95, low_watermark=0.90, directory_max_ops=10_000_000)
    core = MasterCore(config, epoch=(1 << 32) | 1)
    node = SimNode(core, dram_bytes, disk_bytes, write_bps)
    events = []
    for i, session in enumerate(sessions):
        for turn in session.turns:
            events.append((i * gap_s + turn.start_offset_s, i, turn))
    events.sort(key=lambda e: e[0])
    blocks = dram_hits = disk_hits = 0
    per_turn = []
    checksum = 1
    for now_s, i, turn in events:
        keys = [f"{sessions[i].block_scope(j) or 'shared'}:{b}" for j, b in enumerate(turn.block_ids)]
        if not keys:
            continue
        node.sync(now_s)
        first = core.handle(p.LookupPrefix("t", keys), now_s)
        if first.lease_id:
            core.handle(p.ReleaseLeases("t", [first.lease_id]), now_s)
        hit = first.num_hit
        from_disk = 0
        promoting = first.num_promoting
        for step in range(1, 17):  # the reader waits while promotions go on (LookupReply.num_promoting)
            if not promoting:
                break
            node.sync(now_s + 0.001 * step)  # the node polls and reads; the reader looks up again
            again = core.handle(p.LookupPrefix("t", keys), now_s + 0.001 * step)
            if again.lease_id:
                core.handle(p.ReleaseLeases("t", [again.lease_id]), now_s + 0.001 * step)
            from_disk += max(0, again.num_hit - hit)
            hit = max(hit, again.num_hit)
            promoting = again.num_promoting
        blocks += len(keys)
        dram_hits += hit - from_disk
        disk_hits += from_disk
        missing = keys[hit:]
        if missing:
            parents = [keys[hit - 1] if hit else None, *missing[:-1]]
            started = core.handle(p.PutStart("t", missing, [object_bytes] * len(missing), parents), now_s)
            ok = [j for j, s in enumerate(started.statuses) if s == p.PUT_ALLOCATED]
            if ok:
                checksum += 1
                core.handle(p.PutEnd("t", [missing[j] for j in ok], [started.tokens[j] for j in ok],
                                     [checksum + j for j in ok]), now_s)
        per_turn.append((len(keys), hit - from_disk, from_disk))
        core.tick(now_s)
    tiers = core.stats(events[-1][0]).tiers
    return {"blocks": blocks, "dram_hits": dram_hits, "disk_hits": disk_hits,
            "hit_rate": round((dram_hits + disk_hits) / blocks, 4), "dram_hit_rate": round(dram_hits / blocks, 4),
            "disk_hit_rate": round(disk_hits / blocks, 4), "per_turn": per_turn,
            "writeback_dropped": node.writeback_dropped,
            "demotions": tiers[0].demotions if tiers else 0, "promotions": tiers[0].promotions if tiers else 0,
            "disk_evictions": tiers[0].disk_evictions if tiers else 0}


def modelled_ttft(per_turn, block_tokens: int, object_bytes: int, prefill_tps: float, dram_bps: float,
                  disk_bps: float) -> dict:
    ttft = [((n - d - k) * block_tokens) / prefill_tps + d * object_bytes / dram_bps + k * object_bytes / disk_bps
            for n, d, k in per_turn]
    q = np.percentile(ttft, [50, 90, 99])
    return {"mean_s": round(float(np.mean(ttft)), 3), "p50_s": round(float(q[0]), 3), "p90_s": round(float(q[1]), 3),
            "p99_s": round(float(q[2]), 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=None, help="where to put the disk files (default: a temp dir on /var/tmp)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output path without extension (default: benchmarks/results/disk_tier/DATE-MACHINE)")
    parser.add_argument("--quick", action="store_true", help="small sizes, one round (a smoke run)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=48)
    parser.add_argument("--prefill-tokens-per-s", type=float, default=8000.0,
                        help="assumed prefill rate for the modelled TTFT (an 8B model on one GPU is ~5-15K)")
    args = parser.parse_args()
    directory = args.dir or Path(tempfile.mkdtemp(prefix="kvpool-disk-bench-", dir="/var/tmp"))
    directory.mkdir(parents=True, exist_ok=True)
    refresh = args.out is None
    args.out = args.out or results_io.result_files("disk_tier", "quick" if args.quick else None).prefix
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {"machine": machine(directory), "directory": str(directory)}
    fio_state = ensure_fio()
    result["fio"] = fio_state or "not available: fio rows left out"
    if fio_state:
        result["fio_version"] = subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip()
    sizes = [256 * KiB, 1 * MiB, 4 * MiB] if args.quick else [64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB]
    total = 64 * MiB if args.quick else 512 * MiB
    rows = bandwidth(directory, sizes, total, 1 if args.quick else args.rounds, fio_state is not None)
    result["bandwidth"] = rows
    for row in rows:
        console.print(row)

    one_mib = next(r for r in rows if r["object_bytes"] == 1 * MiB)
    disk_read_bps = one_mib["kvpool_direct_read_MBps"] * 1e6
    disk_write_bps = one_mib["kvpool_direct_write_MBps"] * 1e6
    block_tokens = 64
    kv_bytes_per_token = 16 * KiB  # a ~1B-parameter model's KV in fp16: one 64-token block is 1 MiB
    object_bytes = block_tokens * kv_bytes_per_token
    sessions = synth_sessions(SynthConfig(profile="codex", num_sessions=8 if args.quick else args.sessions,
                                          block_size=block_tokens, seed=1))
    unique = {f"{s.block_scope(j) or 'shared'}:{b}" for s in sessions for t in s.turns for j, b in enumerate(t.block_ids)}
    working_set = len(unique) * object_bytes
    result["replay"] = {"profile": "codex (kvpool.workload.synth, seed 1)", "sessions": len(sessions),
                        "turns": sum(len(s.turns) for s in sessions), "block_tokens": block_tokens,
                        "object_bytes": object_bytes, "unique_blocks": len(unique), "working_set_bytes": working_set,
                        "session_start_gap_s": 20.0, "disk_write_Bps_simulated": disk_write_bps,
                        "ttft_model": {"prefill_tokens_per_s (assumed)": args.prefill_tokens_per_s,
                                       "dram_copy_Bps (assumed)": 10e9, "disk_read_Bps (measured, 1 MiB)": disk_read_bps},
                        "runs": []}
    for fraction in (0.1, 0.25):
        dram = int(working_set * fraction) // 4096 * 4096
        for disk in (0, working_set):
            label = f"DRAM {fraction:.0%} of working set" + (" + disk 100%" if disk else " only")
            with console.status(label):
                run = replay(sessions, object_bytes, dram, disk, disk_write_bps, 20.0)
            run["ttft_modelled"] = modelled_ttft(run.pop("per_turn"), block_tokens, object_bytes,
                                                 args.prefill_tokens_per_s, 10e9, disk_read_bps)
            run.update({"label": label, "dram_bytes": dram, "disk_bytes": disk})
            result["replay"]["runs"].append(run)
            console.print(label, {k: run[k] for k in ("hit_rate", "dram_hit_rate", "disk_hit_rate", "ttft_modelled")})
    Path(f"{args.out}.json").write_text(json.dumps(result, indent=2) + "\n")
    Path(f"{args.out}.md").write_text(report(result))
    console.print(f"wrote {args.out}.json and .md")
    if refresh:
        results_io.refresh_latest("disk_tier")
    if args.dir is None:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


def report(r: dict) -> str:
    m = r["machine"]
    lines = ["# Disk tier benchmark", "",
             f"Machine: {m['host']}, {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, kernel {m['kernel']}; "
             f"files on {m['filesystem']}; block devices: `{m['block_devices']}`; load at start {m['loadavg_at_start']} "
             "(a shared VM: figures are medians of interleaved rounds). "
             f"fio: {r['fio']}{' (' + r['fio_version'] + ')' if 'fio_version' in r else ''}.", "",
             "## Bandwidth (MB/s, medians)", ""]
    rows = r["bandwidth"]
    cols = [c for c in rows[0] if c != "object_bytes"]
    lines.append("| object | " + " | ".join(cols) + " |")
    lines.append("|---|" + "---|" * len(cols))
    for row in rows:
        size = row["object_bytes"]
        label = f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"
        lines.append(f"| {label} | " + " | ".join(str(row.get(c, "")) for c in cols) + " |")
    rp = r["replay"]
    lines += ["", "## Hit rate, DRAM only vs DRAM + disk", "",
              f"{rp['sessions']} sessions, {rp['turns']} turns ({rp['profile']}), sessions starting every "
              f"{rp['session_start_gap_s']} s; {rp['block_tokens']}-token blocks of {rp['object_bytes'] // MiB} MiB; "
              f"working set {rp['unique_blocks']} blocks ({rp['working_set_bytes'] / GiB:.1f} GiB). Master code as "
              "served (MasterCore); the node simulated with write-back at the measured 1 MiB write rate. TTFT is "
              f"a model: misses prefilled at {rp['ttft_model']['prefill_tokens_per_s (assumed)']:.0f} tokens/s "
              "(assumed), DRAM hits copied at 10 GB/s (assumed), disk hits read at the measured 1 MiB rate.", "",
              "| pool | hit rate | from DRAM | from disk | demotions | promotions | TTFT mean | P50 | P90 | P99 |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for run in rp["runs"]:
        t = run["ttft_modelled"]
        lines.append(f"| {run['label']} | {run['hit_rate']:.1%} | {run['dram_hit_rate']:.1%} | {run['disk_hit_rate']:.1%} "
                     f"| {run['demotions']} | {run['promotions']} | {t['mean_s']} s | {t['p50_s']} s | {t['p90_s']} s "
                     f"| {t['p99_s']} s |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
