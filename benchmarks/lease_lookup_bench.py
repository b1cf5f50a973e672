"""Leased batch lookups, before and after the compact LookupReply, side by side in one run.

"Before" is a master started from an older source tree (`--baseline-src`, a `git archive` of the
commit before the change: one msgspec Replica struct per hit on the wire); "after" is this tree
(packed int64 triples in one bytes field, plus a lease id). Both masters run at once, loaded with
the same objects; measurements alternate between them round by round (the order flips every
round), so machine load hits both alike, and the report gives per-round after/before ratios.

Client-visible round trips over ZMQ/TCP on 127.0.0.1, each variant decoding what it gets:
- before: the old reply decoded into Replica structs (what the old client used);
- after: the new reply decoded, locations viewed with numpy.frombuffer (no per-hit objects);
- after+split: plus per-hit Replica lists (what Client.get_into builds for its transfer plan);
- after+release-rt: plus a synchronous ReleaseLeases round trip per lookup;
- after+release-ff: plus a fire-and-forget ReleaseLeases (what the client does).
Also, per version in a child process: the master alone (request decode + MasterCore.handle + reply
encode, no sockets), and index memory per object (tracemalloc). And master RSS per object.

    git worktree add /tmp/lease-baseline REV
    benchmarks/run.py lease_lookup --baseline-src /tmp/lease-baseline/src

Writes benchmarks/results/lease_lookup/DATE-MACHINE.{json,md} and LATEST.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import msgspec
import numpy as np
import zmq

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import results_io  # noqa: E402

OBJECT_BYTES = 64 * 1024
SEGMENT_BYTES = 1 << 46
PUT_BATCH = 1000


class OldReplica(msgspec.Struct, array_like=True, frozen=True, gc=False):
    segment_id: int
    offset: int
    size: int


class OldLookupReply(msgspec.Struct, tag="lookup", frozen=True):
    """The LookupReply wire format before the change (baseline commit)."""

    num_hit: int
    replicas: list[list[OldReplica]]
    lease_ttl_s: float


def make_keys(n: int, salt: str = "") -> list[str]:
    import hashlib

    return [hashlib.blake2b(f"{salt}{i}".encode(), digest_size=16).hexdigest() for i in range(n)]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


# ---- requests both source trees understand ----------------------------------------------------


def put_end_request(p, tenant: str, keys: list[str], started):
    """PutEnd naming the put's write tokens (this tree); the baseline's PutEnd has no such fields
    (and a baseline master ignores them: msgspec skips unknown fields)."""
    if "tokens" not in p.PutEnd.__struct_fields__:
        return p.PutEnd(tenant, keys)
    return p.PutEnd(tenant, keys, list(started.tokens) or [0] * len(keys), [0] * len(keys))


def acknowledge_directory(p, call, node_id: str, segment_id: int, applied_seq: int) -> int:
    """Heartbeat as a node does, acknowledging the master's directory ops until none are left
    (this tree logs one per committed object and keeps it until acknowledged; the baseline sends
    none). Returns the last op applied."""
    while True:
        if "directory_seqs" in p.Heartbeat.__struct_fields__:
            reply = call(p.Heartbeat(node_id, [segment_id], [applied_seq]))
        else:
            reply = call(p.Heartbeat(node_id, [segment_id]))
        deltas = getattr(reply, "deltas", [])
        if not deltas:
            return applied_seq
        for delta in deltas:
            applied_seq = delta.first_seq + len(delta.ops) - 1


# ---- in-process worker (runs under either source tree) -----------------------------------------


def inproc_worker(objects: int, batch: int, seconds: float) -> dict:
    from kvpool.core import protocol as p
    from kvpool.master import MasterConfig, MasterCore

    keys = make_keys(objects, salt="ip")
    gc.collect()
    tracemalloc.start()
    before, _ = tracemalloc.get_traced_memory()
    core = MasterCore(MasterConfig(node_ttl_s=1e9, heartbeat_interval_s=1.0, lease_ttl_s=5.0))
    call = lambda request: core.handle(request, 1.0)  # noqa: E731
    segment_id = core.handle(p.MountSegment("n", "h", SEGMENT_BYTES, 0, "a", b""), 0.0).segment_id
    applied_seq = 0
    for i in range(0, objects, PUT_BATCH):
        chunk = keys[i : i + PUT_BATCH]
        started = call(p.PutStart("b", chunk, [OBJECT_BYTES] * len(chunk), [None] + chunk[:-1]))
        call(put_end_request(p, "b", chunk, started))
        applied_seq = acknowledge_directory(p, call, "n", segment_id, applied_seq)
    gc.collect()
    after, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    payloads = [p.request_encoder.encode(p.LookupPrefix("b", keys[s : s + batch], True))
                for s in range(0, objects - batch, batch)][:50]
    decode, encode, handle = p.request_decoder.decode, p.reply_encoder.encode, core.handle
    now = 2.0
    for payload in payloads[:3]:
        encode(handle(decode(payload), now))
    calls = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        now += 1e-4  # a real clock moves; leases then expire like in a running master (tick below)
        reply = handle(decode(payloads[calls % len(payloads)]), now)
        encode(reply)
        calls += 1
        if calls % 64 == 0:
            core.tick(now)
    elapsed = time.perf_counter() - t0
    if reply.num_hit != batch:
        raise RuntimeError(f"expected {batch} hits, got {reply.num_hit}")
    return {"keys_per_s": calls * batch / elapsed, "tracemalloc_bytes_per_object": (after - before) / objects}


# ---- the client-side loop (raw DEALER: both reply formats, same socket code) -------------------


class Raw:
    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.next_id = 1

    def send(self, payload: bytes) -> bytes:
        rid = self.next_id.to_bytes(8, "little")
        self.next_id += 1
        self.sock.send_multipart([rid, payload])
        return rid

    def call(self, payload: bytes) -> bytes:
        rid = self.send(payload)
        while True:
            if not self.sock.poll(30_000):
                raise RuntimeError("master did not answer")
            # [request id, reply] from the baseline; [request id, epoch, reply] from this tree
            frames = self.sock.recv_multipart()
            if frames[0] == rid:
                return frames[-1]  # earlier fire-and-forget replies are dropped here, as MasterChannel does


def run_variant(raw: Raw, variant: str, payloads: list[bytes], batch: int, seconds: float) -> float:
    from kvpool.client import plan
    from kvpool.core import protocol as p

    old_decode = msgspec.msgpack.Decoder(OldLookupReply).decode
    new_decode = p.reply_decoder.decode
    encode = p.request_encoder.encode
    hits = calls = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        body = raw.call(payloads[calls % len(payloads)])
        calls += 1
        if variant == "before":
            reply = old_decode(body)
            hits += len(reply.replicas)
            continue
        reply = new_decode(body)
        locations = np.frombuffer(reply.replica_locations, "<i8").reshape(-1, 3)
        hits += len(locations)
        if variant == "after+split":
            plan.split_replicas(reply.replica_locations, reply.replica_counts, reply.num_hit)
        elif variant == "after+release-rt":
            raw.call(encode(p.ReleaseLeases("b", [reply.lease_id])))
        elif variant == "after+release-ff":
            raw.send(encode(p.ReleaseLeases("b", [reply.lease_id])))
    elapsed = time.perf_counter() - t0
    if hits != calls * batch:
        raise RuntimeError(f"{variant}: expected {calls * batch} hits, got {hits}")
    return hits / elapsed


def load_master(raw: Raw, keys: list[str]) -> None:
    """Mount and fill a master of either tree over a raw socket (this tree's MasterChannel expects
    an epoch frame the baseline does not send); directory ops acknowledged once a second, as a
    node's heartbeat would."""
    from kvpool.core import protocol as p

    def call(request):
        reply = p.reply_decoder.decode(raw.call(p.request_encoder.encode(request)))
        if isinstance(reply, p.ErrorReply):
            raise RuntimeError(f"{type(request).__name__}: {reply.message}")
        return reply

    segment_id = call(p.MountSegment("bench-node", "h", SEGMENT_BYTES, 0, "agent", b"", None)).segment_id
    applied_seq = 0
    last_heartbeat = time.monotonic()
    for i in range(0, len(keys), PUT_BATCH):
        chunk = keys[i : i + PUT_BATCH]
        reply = call(p.PutStart("b", chunk, [OBJECT_BYTES] * len(chunk), [None] + chunk[:-1]))
        if reply.statuses.count(p.PUT_ALLOCATED) != len(chunk):
            raise RuntimeError(reply.message)
        ended = call(put_end_request(p, "b", chunk, reply))
        if getattr(ended, "refused", None):
            raise RuntimeError(f"put_end refused {len(ended.refused)} of {len(chunk)} keys")
        if time.monotonic() - last_heartbeat >= 1.0:
            applied_seq = acknowledge_directory(p, call, "bench-node", segment_id, applied_seq)
            last_heartbeat = time.monotonic()
    acknowledge_directory(p, call, "bench-node", segment_id, applied_seq)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-src", type=Path, required=True, help="src/ of the tree before the change")
    parser.add_argument("--baseline-commit", default="", help="recorded in the report")
    parser.add_argument("--objects", type=int, default=1_000_000, help="objects loaded into each master")
    parser.add_argument("--inproc-objects", type=int, default=200_000, help="objects for the in-process runs")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per batch size")
    parser.add_argument("--seconds", type=float, default=1.0, help="duration of one measurement")
    parser.add_argument("--batches", default="1000,10000", help="keys per lookup, comma-separated")
    parser.add_argument("--out", type=Path, default=None,
                        help="output path without extension (default: benchmarks/results/lease_lookup/DATE-MACHINE)")
    parser.add_argument("--inproc-worker", nargs=3, metavar=("OBJECTS", "BATCH", "SECONDS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inproc_worker:
        objects, batch, seconds = args.inproc_worker
        print(json.dumps(inproc_worker(int(objects), int(batch), float(seconds))))
        return

    from rich.progress import Progress

    from kvpool.bench import procs
    from kvpool.core import protocol as p

    baseline = args.baseline_src.resolve()
    env_for = {"before": {"PYTHONPATH": str(baseline)}, "after": {"PYTHONPATH": str(HERE.parent / "src")}}
    batches = [int(b) for b in args.batches.split(",")]
    variants = ["before", "after", "after+split", "after+release-rt", "after+release-ff"]
    load_start = os.getloadavg()[0]
    workdir = Path(tempfile.mkdtemp(prefix="kvpool-lease-bench-"))
    masters = {}
    ctx = zmq.Context()
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "baseline_commit": args.baseline_commit,
                     "objects": args.objects, "rounds": args.rounds, "seconds": args.seconds}
    try:
        for version in ("before", "after"):
            argv = procs.kvpool_argv("master", "--insecure", "--host", "127.0.0.1", "--port", "0", "--node-ttl-s", "1000000",
                                     "--put-timeout-s", "1000000", "--log-level", "WARNING")
            masters[version] = procs.ManagedProcess(version, argv, workdir, env=env_for[version]).start(30.0)
        keys = make_keys(args.objects)
        memory = {}
        with Progress() as progress:
            raws = {v: Raw(ctx, m.info["address"]) for v, m in masters.items()}
            for version, master in masters.items():
                rss0 = rss_bytes(master.pid)
                task = progress.add_task(f"load {version}", total=1)
                load_master(raws[version], keys)
                progress.advance(task)
                time.sleep(0.3)
                memory[version] = (rss_bytes(master.pid) - rss0) / args.objects
            rows = {(b, v): [] for b in batches for v in variants}
            task = progress.add_task("interleaved lookups", total=args.rounds * len(batches) * len(variants))
            for batch in batches:
                payloads = [p.request_encoder.encode(p.LookupPrefix("b", keys[s : s + batch], True))
                            for s in range(0, args.objects - batch, batch)][:100]
                for v in variants:  # warm-up
                    run_variant(raws["before" if v == "before" else "after"], v, payloads, batch, 0.2)
                for r in range(args.rounds):
                    order = variants if r % 2 == 0 else variants[::-1]
                    for v in order:
                        raw = raws["before" if v == "before" else "after"]
                        rows[(batch, v)].append(run_variant(raw, v, payloads, batch, args.seconds))
                        progress.advance(task)
            inproc = {"before": [], "after": []}
            task = progress.add_task("in-process master", total=2 * 3)
            for r in range(3):
                for version in (("before", "after") if r % 2 == 0 else ("after", "before")):
                    out = subprocess.run(
                        [sys.executable, __file__, "--baseline-src", str(baseline), "--inproc-worker",
                         str(args.inproc_objects), "10000", str(args.seconds)],
                        env={**os.environ, **env_for[version]}, capture_output=True, text=True, check=True,
                    )
                    inproc[version].append(json.loads(out.stdout.strip().splitlines()[-1]))
                    progress.advance(task)
    finally:
        ctx.destroy(linger=0)
        for master in masters.values():
            master.stop()
    results["load_average_1min"] = [load_start, os.getloadavg()[0]]
    results["rss_bytes_per_object"] = memory
    results["lookups"] = [{"batch": b, "variant": v, "keys_per_s": rows[(b, v)]} for b in batches for v in variants]
    results["inproc"] = inproc
    write(results, args.out or results_io.result_files("lease_lookup").prefix, batches, variants)
    if args.out is None:
        results_io.refresh_latest("lease_lookup")


def write(results: dict, out: Path, batches: list[int], variants: list[str]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(results, indent=2))
    by = {(r["batch"], r["variant"]): r["keys_per_s"] for r in results["lookups"]}
    med = statistics.median
    lines = [
        f"# Compact leased lookups and lease release ({results['date']}, `benchmarks/lease_lookup_bench.py`)",
        "",
        f"Before = commit {results['baseline_commit'] or '(see JSON)'} (one Replica struct per hit); after = packed "
        "int64 triples in one bytes field + lease id. Both masters ran at once with "
        f"{results['objects']:,} objects each; {results['rounds']} rounds of {results['seconds']:.0f} s per "
        "variant, the order flipping every round. 1-minute load average "
        f"{results['load_average_1min'][0]:.1f} at the start, {results['load_average_1min'][1]:.1f} at the end "
        "(2 CPUs shared with other work): absolute figures are noisy, the ratios less so.",
        "",
        "| batch | variant | median keys/s | min | max | median ratio to before | per-round ratios |",
        "|---|---|---|---|---|---|---|",
    ]
    for b in batches:
        base = by[(b, "before")]
        for v in variants:
            xs = by[(b, v)]
            ratios = [x / y for x, y in zip(xs, base)]
            lines.append(f"| {b:,} | {v} | {med(xs):,.0f} | {min(xs):,.0f} | {max(xs):,.0f} | "
                         f"{med(ratios):.2f}x | {' '.join(f'{r:.2f}' for r in ratios)} |")
    ip = results["inproc"]
    ip_ratio = [a["keys_per_s"] / b["keys_per_s"] for a, b in zip(ip["after"], ip["before"])]
    mem = results["rss_bytes_per_object"]
    lines += [
        "",
        "Master alone, in-process (request decode + `MasterCore.handle` + reply encode, 10K-key leased "
        f"lookups, 3 alternating child processes per version): before "
        f"{med([r['keys_per_s'] for r in ip['before']]):,.0f} keys/s, after "
        f"{med([r['keys_per_s'] for r in ip['after']]):,.0f} keys/s (ratios {' '.join(f'{r:.2f}' for r in ip_ratio)}).",
        "",
        f"Master memory per object: RSS {mem['before']:.0f} B before, {mem['after']:.0f} B after "
        f"({results['objects']:,} objects); tracemalloc of the index "
        f"{med([r['tracemalloc_bytes_per_object'] for r in ip['before']]):.0f} B before, "
        f"{med([r['tracemalloc_bytes_per_object'] for r in ip['after']]):.0f} B after.",
        "",
        "Variants: `after` decodes the reply and views locations with numpy.frombuffer; `after+split` also "
        "builds per-hit Replica lists as Client.get_into does; `after+release-rt` adds a synchronous "
        "ReleaseLeases round trip per lookup; `after+release-ff` sends it without waiting (the client's "
        "choice), the reply being dropped by the next call.",
    ]
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
