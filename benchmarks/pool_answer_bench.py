"""How the router should learn what the pool holds for a prompt: two ways, side by side, per request.

(A) ask: the router computes the connector's keys itself (vLLM 0.32's block hashes: the default
    `sha256` over a pickled (parent, token tuple, extra keys), from the installed vLLM) and asks
    the master once per request, batched: one counting LookupPrefix (lease=False) round trip to a
    real `kvpool master` process holding those keys.
(B) follow: the master publishes stored/removed events, the router keeps a PoolIndex
    (router/pool_state.py, filled here from the same master's snapshot) and answers from it: its
    own chain hash over the prompt (computed for the backends' caches anyway) plus a set walk.
    B's cost on the master's side is what recording and publishing add to each put: measured
    in-process (MasterCore, no sockets; recording off vs on, one batch cut and encoded per request's
    puts) and through a real master process (a put round trip with and without a subscriber).

Warm-up requests are excluded. Writes benchmarks/results/pool_answer/DATE-MACHINE.{json,md}.

    benchmarks/run.py pool_answer [--prompt-tokens 80000] [--block-size 128] [--requests 300]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import zmq

from kvpool.bench import procs
from kvpool.core import protocol as p
from kvpool.master import MasterConfig, MasterCore
from kvpool.router.pool_state import PoolIndex
from kvpool.router.prefix_index import prompt_chain
from kvpool.rpc.zmq_channel import MasterChannel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_io  # noqa: E402

NAME = "pool_answer"
TENANT = "vllm-bench"
OBJECT_BYTES = 64 * 1024
SEGMENT_BYTES = 1 << 46  # metadata only: the master never touches this memory
NO_NODE_TIMEOUT = ("--node-ttl-s", "1000000")  # the segment mounted here never heartbeats


def percentiles_ms(samples_s: list[float]) -> dict[str, float]:
    xs = sorted(samples_s)
    pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3  # noqa: E731
    return {"p50_ms": pick(0.5), "p90_ms": pick(0.9), "p99_ms": pick(0.99), "max_ms": xs[-1] * 1e3, "n": len(xs)}


def vllm_hasher():
    """vLLM's own block hash (the connector's keys are its hex): sha256 over a pickle, chained."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    os.environ.setdefault("PYTHONHASHSEED", "0")
    kv_cache_utils.init_none_hash(sha256)

    def keys(tokens: list[int], block_size: int) -> list[str]:
        out, parent = [], None
        for start in range(0, len(tokens) - block_size + 1, block_size):
            parent = kv_cache_utils.hash_block_tokens(sha256, parent, tokens[start : start + block_size], None)
            out.append(bytes(parent).hex())
        return out

    import vllm

    return keys, vllm.__version__


def put_chain(call, keys: list[str]) -> None:
    parents = [None] + keys[:-1]
    for i in range(0, len(keys), 1000):
        batch = keys[i : i + 1000]
        started = call(p.PutStart(TENANT, batch, [OBJECT_BYTES] * len(batch), parents[i : i + 1000]))
        if started.statuses.count(p.PUT_ALLOCATED) != len(batch):
            raise RuntimeError(f"put failed: {started.message}")
        call(p.PutEnd(TENANT, batch, started.tokens, [0] * len(batch)))


def prompts(n: int, num_tokens: int, seed: int) -> list[list[int]]:
    """Distinct prompts; every request of the run asks about one of them (all held)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1, 150_000) for _ in range(num_tokens)] for _ in range(n)]


def measure_requests(args, workdir: Path) -> dict:
    keys_of, vllm_version = vllm_hasher()
    bs = args.block_size
    texts = prompts(args.prompts, args.prompt_tokens, seed=1)
    master = procs.start_master(workdir, *NO_NODE_TIMEOUT)
    channel = MasterChannel(master.info["address"], timeout_s=60)
    try:
        call = channel.call
        call(p.MountSegment("bench-node", "host", SEGMENT_BYTES, 0, "agent", b""))
        all_keys = [keys_of(t, bs) for t in texts]
        for keys in all_keys:
            put_chain(call, keys)
        # (B)'s index: the master's snapshot, and the mapping the backends' KV events would teach
        index = PoolIndex()
        for t, keys in zip(texts, all_keys):
            index.learn([bytes.fromhex(k) for k in keys], prompt_chain(t, bs))
        offer = call(p.PoolEventsQuery(TENANT))
        index.reset(offer)
        num_blocks = len(all_keys[0])

        # each request is answered both ways, one after the other: both see the same machine
        # wall time, and the thread's CPU time for the parts that compute (the machine may be shared:
        # CPU time leaves out what the OS gave other processes meanwhile)
        hash_s, lookup_s, ask_s, chain_s, walk_s, follow_s = [], [], [], [], [], []
        hash_cpu, chain_cpu, walk_cpu = [], [], []
        clock, cpu = time.perf_counter, time.thread_time
        for i in range(args.warmup + args.requests):
            t = texts[i % len(texts)]
            c0, t0 = cpu(), clock()
            keys = keys_of(t, bs)
            t1, c1 = clock(), cpu()
            reply = call(p.LookupPrefix(TENANT, keys, False))
            c2, t2 = cpu(), clock()
            chain = prompt_chain(t, bs)
            t3, c3 = clock(), cpu()
            held = index.prefix_blocks(chain)
            t4, c4 = clock(), cpu()
            if reply.num_hit != num_blocks or held != num_blocks:
                raise RuntimeError(f"expected {num_blocks} blocks held, (A) found {reply.num_hit}, (B) {held}")
            if i >= args.warmup:
                hash_s.append(t1 - t0)
                lookup_s.append(t2 - t1)
                ask_s.append(t2 - t0)
                chain_s.append(t3 - t2)
                walk_s.append(t4 - t3)
                follow_s.append(t4 - t2)
                hash_cpu.append(c1 - c0)
                chain_cpu.append(c3 - c2)
                walk_cpu.append(c4 - c3)
        return {
            "vllm_version": vllm_version, "num_blocks": num_blocks, "snapshot_keys": sum(len(e.keys) for e in offer.held),
            "ask": {"total": percentiles_ms(ask_s), "vllm_hashes": percentiles_ms(hash_s),
                    "lookup_round_trip": percentiles_ms(lookup_s)},
            "follow": {"total": percentiles_ms(follow_s), "router_chain": percentiles_ms(chain_s),
                       "index_walk": percentiles_ms(walk_s)},
            "cpu": {"vllm_hashes": percentiles_ms(hash_cpu), "router_chain": percentiles_ms(chain_cpu),
                    "index_walk": percentiles_ms(walk_cpu)},
        }  # fmt: skip
    finally:
        channel.close()
        master.stop(grace_s=5.0)


def measure_recording_work(args) -> dict:
    """What recording adds to each object put, alone: the index's stored() call, its share of
    cutting one batch per chain, and of encoding it (the service's send is not included)."""
    from kvpool.master.pool_events import PoolEvents

    encode = msgspec.msgpack.Encoder().encode
    chain = args.put_chain
    keys = [f"{i:032x}" for i in range(args.put_objects // chain * chain)]
    per_object = []
    for _ in range(args.put_rounds):
        events = PoolEvents()
        events.start()
        t0 = time.perf_counter()
        for s in range(0, len(keys), chain):
            for key in keys[s : s + chain]:
                if events.recording:
                    events.stored(TENANT, key)
            encode(events.take(1))
        per_object.append((time.perf_counter() - t0) / len(keys))
    off = PoolEvents()
    t0 = time.perf_counter()
    for key in keys:
        if off.recording:
            off.stored(TENANT, key)
    off_s = (time.perf_counter() - t0) / len(keys)
    return {"objects": len(keys), "chain": chain, "rounds": args.put_rounds,
            "on_ns_per_object": statistics.median(per_object) * 1e9, "off_ns_per_object": off_s * 1e9}


def measure_put_overhead_in_process(args) -> dict:
    """ns per object of put_start + put_end (chains of `chain` objects, one batch cut and encoded
    per chain when recording), recording off vs on, rounds interleaved."""
    encode = msgspec.msgpack.Encoder().encode
    chain = args.put_chain
    per_round = args.put_objects // chain * chain
    results = {False: [], True: []}
    for round_no in range(args.put_rounds):
        for recording in (False, True):
            core = MasterCore(MasterConfig(node_ttl_s=1e9, heartbeat_interval_s=1.0, high_watermark=1.0,
                                           low_watermark=0.99))  # fmt: skip
            core.handle(p.MountSegment("n", "h", SEGMENT_BYTES, 0, "a", b""), 0.0)
            if recording:
                core.index.events.start()
            events = core.index.events
            keys = [f"{round_no:02d}{recording:d}{i:030x}" for i in range(per_round)]
            t0 = time.perf_counter()
            for s in range(0, per_round, chain):
                batch = keys[s : s + chain]
                started = core.handle(p.PutStart(TENANT, batch, [OBJECT_BYTES] * chain, [None] + batch[:-1]), 1.0)
                core.handle(p.PutEnd(TENANT, batch, started.tokens, [0] * chain), 1.0)
                if events.changes:
                    encode(events.take(core.epoch))
            results[recording].append((time.perf_counter() - t0) / per_round)
    off, on = statistics.median(results[False]), statistics.median(results[True])
    return {"objects_per_round": per_round, "chain": chain, "rounds": args.put_rounds,
            "off_ns_per_object": off * 1e9, "on_ns_per_object": on * 1e9, "overhead_ns_per_object": (on - off) * 1e9,
            "overhead_pct": 100 * (on - off) / off}  # fmt: skip


def measure_put_overhead_service(args, workdir: Path) -> dict:
    """A real master process: put round trips (one chain of `chain` objects) with nobody following,
    then with one subscriber (recording and publishing on)."""
    master = procs.start_master(workdir / "svc", *NO_NODE_TIMEOUT)
    channel = MasterChannel(master.info["address"], timeout_s=60)
    ctx = zmq.Context.instance()
    sub = None
    try:
        call = channel.call
        call(p.MountSegment("bench-node", "host", SEGMENT_BYTES, 0, "agent", b""))
        chain = args.put_chain
        out = {}
        received = 0  # batches the subscriber got: one per put round trip that ended objects
        for phase in ("nobody_follows", "one_subscriber"):
            if phase == "one_subscriber":
                offer = call(p.PoolEventsQuery(TENANT, with_keys=False))
                sub = ctx.socket(zmq.SUB)
                sub.setsockopt(zmq.SUBSCRIBE, p.POOL_EVENTS_TOPIC)
                sub.setsockopt(zmq.RCVHWM, 0)
                sub.connect(offer.address)
                time.sleep(0.3)
                call(p.PoolEventsQuery(TENANT, with_keys=False))
            samples = []
            cpu_before = 0.0
            for i in range(args.warmup + args.service_puts):
                if i == args.warmup:
                    cpu_before = cpu_s(master.pid)
                keys = [f"{phase[:3]}{i:08d}{k:024x}" for k in range(chain)]
                t0 = time.perf_counter()
                started = call(p.PutStart(TENANT, keys, [OBJECT_BYTES] * chain, [None] + keys[:-1]))
                call(p.PutEnd(TENANT, keys, started.tokens, [0] * chain))
                if i >= args.warmup:
                    samples.append(time.perf_counter() - t0)
                if sub is not None:
                    while sub.poll(0):
                        sub.recv_multipart()
                        received += 1
            out[phase] = {**percentiles_ms(samples),
                          "master_cpu_us_per_put": 1e6 * (cpu_s(master.pid) - cpu_before) / args.service_puts}
        return {"chain": chain, **out, "batches_seen": received}
    finally:
        if sub is not None:
            sub.close(linger=0)
        channel.close()
        master.stop(grace_s=5.0)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def write_report(results: dict, out_prefix: Path) -> None:
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out_prefix}.json").write_text(json.dumps(results, indent=2) + "\n")
    r = results["requests"]
    ask, follow = r["ask"], r["follow"]
    ip, sv = results["put_in_process"], results["put_service"]
    row = lambda name, d: f"| {name} | {d['p50_ms']:.3f} | {d['p90_ms']:.3f} | {d['p99_ms']:.3f} | {d['max_ms']:.3f} | {d['n']} |"  # noqa: E731
    lines = [
        "## Pool answer: ask the master per request, or follow its events",
        "",
        f"Generated by `benchmarks/pool_answer_bench.py` on {results['date']} on `{results['machine']['name']}` "
        f"({results['machine']['describe']}); Python {results['python']}, vLLM {r['vllm_version']}. "
        "Router side, master and client are processes on one machine (ZMQ over TCP on 127.0.0.1); "
        f"1-minute load average {results['load_before']:.1f} at the start, {results['load_after']:.1f} at the end.",
        "",
        f"Prompt: {results['args']['prompt_tokens']} tokens = {r['num_blocks']} blocks of {results['args']['block_size']}; "
        f"{results['args']['prompts']} distinct prompts, all held by the pool ({r['snapshot_keys']} keys); "
        f"warm-up requests excluded.",
        "",
        "### Per request (ms)",
        "",
        "| path | P50 | P90 | P99 | max | n |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        row("(A) ask: vLLM hashes + one LookupPrefix(lease=False)", ask["total"]),
        row("(A) of which: vLLM 0.32 sha256 block hashes", ask["vllm_hashes"]),
        row("(A) of which: the lookup round trip", ask["lookup_round_trip"]),
        row("(B) follow: router chain + PoolIndex walk", follow["total"]),
        row("(B) of which: the router's chain (computed anyway for the backends' caches)", follow["router_chain"]),
        row("(B) of which: the PoolIndex walk", follow["index_walk"]),
        "",
        "The router thread's CPU time for the parts that compute (ms; what is left when the OS gives other "
        "processes the core meanwhile):",
        "",
        "| part | P50 | P90 | P99 | max | n |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        row("(A) vLLM 0.32 sha256 block hashes", r["cpu"]["vllm_hashes"]),
        row("(B) the router's chain", r["cpu"]["router_chain"]),
        row("(B) the PoolIndex walk", r["cpu"]["index_walk"]),
        "",
        "### What following costs the master per put",
        "",
        f"The work recording adds, alone (the index's `stored` call, and per chain of {results['recording_work']['chain']} "
        "objects one batch cut and msgpack-encoded), median of "
        f"{results['recording_work']['rounds']} rounds of {results['recording_work']['objects']} objects:",
        "",
        "| recording | ns per object |",
        "| --- | ---: |",
        f"| off (nobody follows: a flag test) | {results['recording_work']['off_ns_per_object']:.0f} |",
        f"| on | {results['recording_work']['on_ns_per_object']:.0f} |",
        "",
        f"The same within whole puts, in process (MasterCore, no sockets), put_start + put_end of chains of {ip['chain']} objects, "
        f"{ip['objects_per_round']} objects per round, median of {ip['rounds']} interleaved rounds; when recording, "
        "one batch is cut and msgpack-encoded per chain:",
        "",
        "| recording | ns per object |",
        "| --- | ---: |",
        f"| off (nobody follows) | {ip['off_ns_per_object']:.0f} |",
        f"| on | {ip['on_ns_per_object']:.0f} |",
        f"| overhead | {ip['overhead_ns_per_object']:.0f} ({ip['overhead_pct']:.1f} %) |",
        "",
        f"Through a real master process: one put round trip (PutStart + PutEnd of {sv['chain']} objects) in ms, and "
        "the master process's CPU time per put (/proc, user + system, 10 ms ticks):",
        "",
        "| master | P50 | P90 | P99 | max | n | master CPU us per put |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        row("nobody follows", sv["nobody_follows"]) + f" {sv['nobody_follows']['master_cpu_us_per_put']:.0f} |",
        row("one subscriber (recording, publishing)", sv["one_subscriber"])
        + f" {sv['one_subscriber']['master_cpu_us_per_put']:.0f} |",
        "",
        "### Verdict",
        "",
        results["verdict"],
        "",
    ]
    Path(f"{out_prefix}.md").write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=80_000)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=8, help="distinct prompts the requests cycle through")
    parser.add_argument("--requests", type=int, default=500, help="requests timed, each answered both ways")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--put-objects", type=int, default=100_000, help="objects per in-process round")
    parser.add_argument("--put-rounds", type=int, default=5)
    parser.add_argument("--put-chain", type=int, default=16, help="objects per put (a request's new blocks)")
    parser.add_argument("--service-puts", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=None, help="output prefix (default: the results folder)")
    args = parser.parse_args()
    machine = results_io.this_machine()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="pool-answer-") as tmp:
        requests = measure_requests(args, Path(tmp))
        put_in_process = measure_put_overhead_in_process(args)
        recording = measure_recording_work(args)
        put_service = measure_put_overhead_service(args, Path(tmp))
    ask = requests["ask"]["total"]
    walk, chain = requests["follow"]["index_walk"], requests["follow"]["router_chain"]
    walk_cpu = requests["cpu"]["index_walk"]
    hashes, trip = requests["ask"]["vllm_hashes"], requests["ask"]["lookup_round_trip"]
    verdict = (
        f"Following is cheaper. (B)'s answer, the PoolIndex walk over the prompt's chain, takes {walk['p50_ms']:.3f} ms "
        f"at P50 and {walk['p99_ms']:.3f} ms at P99 ({walk_cpu['p50_ms']:.3f} / {walk_cpu['p99_ms']:.3f} ms of CPU; "
        "goal: < 1 ms); the chain it walks is the router's own, computed "
        f"for the backends' caches whether or not the pool is followed ({chain['p50_ms']:.2f} ms at P50). (A) adds "
        f"vLLM's hashes, which only it needs ({hashes['p50_ms']:.2f} ms), and a round trip ({trip['p50_ms']:.2f} / "
        f"{trip['p99_ms']:.2f} ms) that also gives the master a {requests['num_blocks']}-key lookup per request: "
        f"{ask['p50_ms']:.2f} / {ask['p99_ms']:.2f} ms in all. Following costs the master "
        f"{recording['on_ns_per_object']:.0f} ns of work per object put while someone follows "
        f"({100 * recording['on_ns_per_object'] / put_in_process['off_ns_per_object']:.1f} % of a put in process), "
        f"{recording['off_ns_per_object']:.0f} ns (a flag test) while nobody does. "
        "Kept: (B), `kvpool router --pooled --master`."
    )
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "machine": {**machine.as_dict(), "describe": machine.describe()},
        "python": platform.python_version(), "args": {k: v for k, v in vars(args).items() if k != "out"},
        "load_before": load_before, "load_after": os.getloadavg()[0],
        "requests": requests, "put_in_process": put_in_process, "recording_work": recording, "put_service": put_service, "verdict": verdict,
    }  # fmt: skip
    write_report(results, args.out or results_io.result_files(NAME).prefix)
    print(verdict)
    if args.out is None:
        results_io.refresh_latest(NAME)


if __name__ == "__main__":
    main()
