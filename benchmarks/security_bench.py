"""What authentication costs, and what a flooding client costs the others.

    benchmarks/run.py security [--rounds 5] [--quick] [--out PREFIX]

Writes benchmarks/results/security/DATE-MACHINE.{json,md,png} and LATEST.md.

Two pools run side by side, each a `kvpool master` + one 256 MiB `kvpool node` on 127.0.0.1: one
`--insecure`, one `--auth DIR` (CURVE on the control plane, a tenant identity for the client). In
each round, in alternating order, the same client code measures the insecure one over plain ZMQ
and over its TCP lane, and the authenticated one over CURVE:
- single-key and 128-key lookup round trips (P50 / P99 over `--lookups` calls);
- put and get bandwidth of 1 MiB objects on the shared-memory path and on NIXL (UCX over TCP
  loopback), every byte compared with what was written (the data plane never goes through the
  master, so authentication should cost it nothing).
Then a flood: on the authenticated master, a second client in its own process sends 2,000-key
lookups as fast as it can while the measuring client's single-key lookups are timed; with the
master's default rate limit and with a tight one (a third master, `--rate-limit-keys-per-s 20000`).
Reported: medians over rounds of each figure, per-round ratios auth/insecure (median and range).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

from kvpool.bench import procs
from kvpool.client import Client
from kvpool.core import protocol as p
from kvpool.core.errors import RateLimitedError
from kvpool.rpc.zmq_channel import MasterChannel
from kvpool.rpc.credentials import AuthDir, resolve_credential

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_io  # noqa: E402

MiB = 1 << 20
NODE_MEMORY = "256MiB"


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def lookup_rtts_us(client: Client, keys: list[str], calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        started = time.perf_counter()
        client.lookup_prefix(keys)
        out.append((time.perf_counter() - started) * 1e6)
    return out


def bandwidth_gbs(client: Client, tag: str, num_objects: int) -> tuple[float, float]:
    """(put GB/s, get GB/s) of num_objects 1 MiB objects, bytes verified."""
    src = np.random.default_rng(len(tag)).integers(0, 255, num_objects * MiB, dtype=np.uint8)
    dst = np.zeros_like(src)
    client.register(src)
    client.register(dst)
    keys = [f"{tag}-{i}" for i in range(num_objects)]
    started = time.perf_counter()
    client.put_from(keys, [[src.ctypes.data + i * MiB] for i in range(num_objects)], [[MiB]] * num_objects)
    put_s = time.perf_counter() - started
    started = time.perf_counter()
    got = client.get_into(keys, [[dst.ctypes.data + i * MiB] for i in range(num_objects)], [[MiB]] * num_objects)
    get_s = time.perf_counter() - started
    if got != num_objects or not np.array_equal(src, dst):
        raise AssertionError(f"{tag}: read {got}/{num_objects} objects or wrong bytes")
    client.remove(keys)
    return num_objects * MiB / put_s / 1e9, num_objects * MiB / get_s / 1e9


def measure(address: str, credential: str | None, round_no: int, args, lane: bool = False) -> dict:
    figures = {}
    for path in ("shm", "nixl"):
        with Client(address, tenant="bench", credential=credential, path=path, timeout_s=30.0, lane=lane) as client:
            if path == "shm":
                client.put("warm", b"x")
                for n in (1, 128):
                    rtts = lookup_rtts_us(client, [f"miss-{i}" for i in range(n)], args.lookups)
                    figures[f"lookup{n}_p50_us"] = percentile(rtts, 50)
                    figures[f"lookup{n}_p99_us"] = percentile(rtts, 99)
            put, get = bandwidth_gbs(client, f"r{round_no}-{path}", args.objects)
            figures[f"{path}_put_gbs"], figures[f"{path}_get_gbs"] = put, get
    return figures


def flood(address: str, credential: str | None, seconds: float) -> None:
    """The flooding client (its own process): 2,000-key lookups back to back; prints what happened."""
    channel = MasterChannel(address, timeout_s=5.0, credential=resolve_credential(credential))
    keys = [f"flood-{i}" for i in range(2000)]
    answered = limited = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            channel.call(p.LookupPrefix("flood", keys))
            answered += 1
        except RateLimitedError:
            limited += 1
    channel.close()
    print(json.dumps({"answered": answered, "limited": limited}))


def under_flood(address: str, credential: str, args) -> dict:
    with Client(address, tenant="bench", credential=credential, timeout_s=30.0) as client:
        client.put("warm", b"x")
        flooder = subprocess.Popen([sys.executable, __file__, "--flood", address, "--credential", credential,
                                    "--seconds", str(args.flood_s)], stdout=subprocess.PIPE, text=True)
        time.sleep(1.0)  # the flooder is up and sending
        rtts = lookup_rtts_us(client, ["k"], args.lookups)
        out, _ = flooder.communicate(timeout=args.flood_s + 30)
    counts = json.loads(out.strip().splitlines()[-1])
    return {"p50_us": percentile(rtts, 50), "p99_us": percentile(rtts, 99), "max_us": max(rtts), **counts}


def echo_server(curve: tuple[str, str] | None, stop, ready) -> None:
    """A ROUTER that answers every message at once, with CURVE (server keys) or without."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    if curve is not None:
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = curve[0].encode(), curve[1].encode()
    ready.append(sock.bind_to_random_port("tcp://127.0.0.1"))
    while not stop.is_set():
        if sock.poll(100):
            sock.send_multipart(sock.recv_multipart())
    sock.close()


def curve_echo(args) -> dict:
    """What CURVE itself costs a round trip: one process, two echo servers (CURVE and plain) on TCP
    loopback, 200-call batches alternating between them; per-batch P50 ratios."""
    import threading

    server_public, server_secret = (k.decode() for k in zmq.curve_keypair())
    client_public, client_secret = zmq.curve_keypair()
    stop = threading.Event()
    socks = {}
    threads = []
    for name, curve in (("plain", None), ("curve", (server_public, server_secret))):
        ready: list[int] = []
        thread = threading.Thread(target=echo_server, args=(curve, stop, ready), daemon=True)
        thread.start()
        threads.append(thread)
        while not ready:
            time.sleep(0.01)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.linger = 0
        if curve is not None:
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
                server_public.encode(), client_public, client_secret)
        sock.connect(f"tcp://127.0.0.1:{ready[0]}")
        socks[name] = sock
    payload = b"x" * 120  # about a one-key lookup request
    p50s: dict[str, list[float]] = {"plain": [], "curve": []}
    for batch in range(2 * args.echo_batches):
        name = ("plain", "curve")[batch % 2]
        sock, rtts = socks[name], []
        for _ in range(200):
            started = time.perf_counter()
            sock.send(payload)
            sock.recv()
            rtts.append((time.perf_counter() - started) * 1e6)
        if batch >= 2:  # the first batch of each warms the connection (handshake)
            p50s[name].append(percentile(rtts, 50))
    stop.set()
    for sock in socks.values():
        sock.close()
    for thread in threads:
        thread.join()
    ratios = sorted(c / p for c, p in zip(p50s["curve"], p50s["plain"]))
    return {"plain_p50_us": statistics.median(p50s["plain"]), "curve_p50_us": statistics.median(p50s["curve"]),
            "ratio_median": statistics.median(ratios), "ratio_min": ratios[0], "ratio_max": ratios[-1],
            "batches": len(ratios)}


def start_pool(workdir: Path, *master_args: str, node_credential: str | None = None):
    master = procs.start_master(workdir, *master_args, name="master")
    extra = ("--credential", node_credential) if node_credential else ()
    node = procs.start_node(workdir, master.info["address"], NODE_MEMORY, *extra, name="node")
    return master, node


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lookups", type=int, default=3000, help="timed lookups per figure")
    parser.add_argument("--objects", type=int, default=64, help="1 MiB objects per bandwidth figure")
    parser.add_argument("--flood-s", type=float, default=8.0, help="how long the flooder runs per flood figure")
    parser.add_argument("--echo-batches", type=int, default=40, help="200-call batches per side of the CURVE echo")
    parser.add_argument("--quick", action="store_true", help="1 round, fewer calls (a smoke run)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output path without extension (default: benchmarks/results/security/DATE-MACHINE)")
    parser.add_argument("--flood", metavar="ADDR", help=argparse.SUPPRESS)
    parser.add_argument("--credential", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=5.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.flood:
        flood(args.flood, args.credential, args.seconds)
        return 0
    if args.quick:
        args.rounds, args.lookups, args.objects, args.flood_s, args.echo_batches = 1, 500, 16, 4.0, 5
    from rich.progress import Progress

    work = Path(tempfile.mkdtemp(prefix="kvpool-security-bench-"))
    auth = AuthDir(work / "auth")
    auth.init(("node",))
    tenant = str(auth.add("tenant:bench"))
    node_cred = str(auth.path / "node.cred")
    pools = {}
    try:
        pools["insecure"] = start_pool(work / "insecure")
        pools["auth"] = start_pool(work / "auth-pool", "--auth", str(auth.path), node_credential=node_cred)
        pools["auth_tight"] = start_pool(work / "tight", "--auth", str(auth.path), "--rate-limit-keys-per-s", "20000",
                                         "--rate-limit-burst-keys", "20000", node_credential=node_cred)
        rounds: list[dict] = []
        with Progress() as progress:
            task = progress.add_task("rounds", total=args.rounds)
            for r in range(args.rounds):
                order = ["insecure", "insecure_lane", "auth"]
                order = order if r % 2 == 0 else order[::-1]
                row = {}
                for name in order:
                    pool = pools["insecure" if name == "insecure_lane" else name]
                    row[name] = measure(pool[0].info["address"], None if name.startswith("insecure") else tenant, r, args,
                                        lane=name == "insecure_lane")
                for name in (["auth", "auth_tight"] if r % 2 == 0 else ["auth_tight", "auth"]):
                    row[f"flood_{name}"] = under_flood(pools[name][0].info["address"], tenant, args)
                rounds.append(row)
                progress.advance(task)
    finally:
        for master, node in pools.values():
            node.stop(grace_s=5.0)
            master.stop(grace_s=5.0)
    echo = curve_echo(args)
    out = args.out or results_io.result_files("security").prefix
    report(rounds, echo, args, out)
    if args.out is None:
        results_io.refresh_latest("security")
    return 0


def report(rounds: list[dict], echo: dict, args, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    med = lambda name, key: statistics.median(r[name][key] for r in rounds)  # noqa: E731
    ratio = lambda key: sorted(r["auth"][key] / r["insecure"][key] for r in rounds)  # noqa: E731
    machine = f"{results_io.this_machine().describe()}, {platform.platform()}"
    lines = [
        "# Security: cost of CURVE authentication, and a flood's cost to a polite client",
        "",
        f"Machine: {machine}. Load: whatever else ran on it (a shared VM).",
        f"`benchmarks/security_bench.py` ({args.rounds} rounds, {args.lookups} lookups per figure, {args.objects} x 1 MiB "
        "objects per bandwidth figure; medians over rounds; ratio = auth / insecure per round, median [min-max]).",
        "",
        "insecure: plain ZMQ (the same transport as CURVE, so the ratio is what authentication and encryption",
        "cost); insecure + lane: the plain TCP lane an insecure master offers for round trips, which an",
        "authenticated master does not offer.",
        "",
        "| figure | insecure | insecure + lane | CURVE auth | ratio auth / insecure |",
        "|---|---|---|---|---|",
    ]
    for key, label in [("lookup1_p50_us", "1-key lookup P50, us"), ("lookup1_p99_us", "1-key lookup P99, us"),
                       ("lookup128_p50_us", "128-key lookup P50, us"), ("lookup128_p99_us", "128-key lookup P99, us"),
                       ("shm_put_gbs", "put 1 MiB, shared memory, GB/s"), ("shm_get_gbs", "get 1 MiB, shared memory, GB/s"),
                       ("nixl_put_gbs", "put 1 MiB, NIXL, GB/s"), ("nixl_get_gbs", "get 1 MiB, NIXL, GB/s")]:
        rs = ratio(key)
        lines.append(f"| {label} | {med('insecure', key):.3g} | {med('insecure_lane', key):.3g} | {med('auth', key):.3g} | "
                     f"{statistics.median(rs):.3f} [{rs[0]:.3f}-{rs[-1]:.3f}] |")
    lines += ["", f"CURVE alone (one process, ZMQ echo over TCP loopback, {echo['batches']} interleaved 200-call batches per "
              f"side): P50 {echo['plain_p50_us']:.0f} us plain, {echo['curve_p50_us']:.0f} us CURVE; per-batch ratio "
              f"{echo['ratio_median']:.3f} [{echo['ratio_min']:.3f}-{echo['ratio_max']:.3f}]."]
    lines += ["", "Polite client's 1-key lookups while another client floods the master with 2,000-key lookups:", "",
              "| master | P50 us | P99 us | max us | flooder answered | flooder refused |", "|---|---|---|---|---|---|"]
    for name, label in [("flood_auth", "auth, default limit (2 M keys/s)"),
                        ("flood_auth_tight", "auth, --rate-limit-keys-per-s 20000")]:
        lines.append(f"| {label} | {med(name, 'p50_us'):.0f} | {med(name, 'p99_us'):.0f} | {med(name, 'max_us'):.0f} | "
                     f"{med(name, 'answered'):.0f} | {med(name, 'limited'):.0f} |")
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    Path(f"{out}.json").write_text(json.dumps({"machine": machine, "rounds": rounds, "curve_echo": echo},
                                                           indent=1))
    plot(rounds, Path(f"{out}.png"))
    print("\n".join(lines))


def plot(rounds: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = ["1-key P50", "1-key P99", "128-key P50", "128-key P99"]
    keys = ["lookup1_p50_us", "lookup1_p99_us", "lookup128_p50_us", "lookup128_p99_us"]
    x = np.arange(len(keys))
    for i, name in enumerate(["insecure", "insecure_lane", "auth"]):
        ax.bar(x + i * 0.25, [statistics.median(r[name][k] for r in rounds) for k in keys], 0.25, label=name.replace("_", " + "))
    flood_x = len(keys)
    for i, name in enumerate(["flood_auth", "flood_auth_tight"]):
        ax.bar(flood_x + i * 0.25, statistics.median(r[name]["p99_us"] for r in rounds), 0.25,
               label=f"{name.replace('flood_', 'P99 under flood, ')}")
    ax.set_xticks(list(x + 0.25) + [flood_x + 0.12], labels + ["1-key P99, flood"])
    ax.set_ylabel("microseconds")
    ax.set_title("Lookup round trips: insecure vs CURVE, and under a flood")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
