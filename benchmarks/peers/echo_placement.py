"""A bare Python TCP ping-pong across two harness hosts, with both ends on one vCPU or on two.

    benchmarks/run.py echo_placement [--rounds 2] [--out FILE]

Why: the single-key lookup round trip of every peer (kvpool's master, Mooncake's, Redis) swung by
up to 2x between runs of `run.py` on the 2-core VM. A round trip is two wake-ups; where the two
processes sit decides what a wake-up costs: on one vCPU the sender's send wakes the receiver on
the same CPU (a context switch), on two it has to wake the other vCPU (an IPI to a halted vCPU,
a VM exit on this VM). The scheduler places the processes as it likes, so a benchmark's round
trip depends on placement more than on any store's code. This measures the floor both ways:
a server (one blocking `recv`/`send` loop, or the kvpool master's shape: zmq.Poller over the
socket's fd and a ZMQ socket) on host s, a client on host c, `taskset` pinning each, 64-byte
messages, 20,000 round trips (the first 2,000 dropped). Prints P50 / P99 per placement and round.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from kvpool.bench import hosts

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import results_io  # noqa: E402

SERVER = r'''
import socket, sys, zmq
mode = sys.argv[2]
srv = socket.create_server((sys.argv[1], 7777))
conn, _ = srv.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
if mode == "blocking":
    while data := conn.recv(65536):
        conn.send(data)
else:  # the master's loop: one poller over ZMQ sockets and the lane's plain fds
    z = zmq.Context().socket(zmq.ROUTER)
    z.bind("tcp://127.0.0.1:7778")
    conn.setblocking(False)
    poller = zmq.Poller()
    poller.register(z, zmq.POLLIN)
    poller.register(conn.fileno(), zmq.POLLIN)
    while True:
        if conn.fileno() in dict(poller.poll(1000)):
            data = conn.recv(65536)
            if not data:
                break
            conn.send(data)
'''

CLIENT = r'''
import socket, sys, time
c = socket.create_connection((sys.argv[1], 7777))
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
lat = []
for _ in range(20000):
    t = time.perf_counter()
    c.send(b"x" * 64)
    c.recv(65536)
    lat.append(time.perf_counter() - t)
lat = sorted(lat[2000:])
print(f"{lat[len(lat) // 2] * 1e6:.1f} {lat[int(len(lat) * 0.99)] * 1e6:.1f}")
'''

PLACEMENTS = (("one vCPU", "0", "0"), ("two vCPUs", "0", "1"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None,
                    help="write the table here (default: benchmarks/results/echo_placement/DATE-MACHINE.md)")
    args = ap.parse_args()
    if (os.cpu_count() or 1) < 2:
        sys.exit("needs two CPUs")
    rows = []
    with hosts.HostNetwork(["s", "c"]) as net:
        for r in range(args.rounds):
            for mode in ("blocking", "poller"):
                for name, server_cpu, client_cpu in PLACEMENTS:
                    server = subprocess.Popen(net["s"].wrap(["taskset", "-c", server_cpu, sys.executable, "-c", SERVER,
                                                             net["s"].address, mode]))  # fmt: skip
                    try:
                        time.sleep(1.0)
                        done = subprocess.run(net["c"].wrap(["taskset", "-c", client_cpu, sys.executable, "-c", CLIENT,
                                                             net["s"].address]), capture_output=True, text=True, timeout=120)  # fmt: skip
                    finally:
                        server.kill()
                        server.wait()
                    if done.returncode:
                        sys.exit(f"client failed:\n{done.stderr[-2000:]}")
                    p50, p99 = done.stdout.split()
                    rows.append(f"| {r + 1} | {mode} | {name} (server {server_cpu}, client {client_cpu}) | {p50} | {p99} |")
                    print(rows[-1], flush=True)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    text = "\n".join([
        f"TCP ping-pong across two harness hosts, by placement; {cpu}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f} at the end", "",
        "| round | server loop | placement | P50 us | P99 us |", "|---|---|---|---|---|", *rows, ""])  # fmt: skip
    print(text)
    results_io.publish("echo_placement", text, args.out)


if __name__ == "__main__":
    main()
