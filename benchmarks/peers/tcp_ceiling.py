"""What TCP itself carries between two harness hosts: the limit under every cross-host row.

    benchmarks/run.py tcp_ceiling [--rounds 5] [--out FILE]

iperf3 (C, Debian's package, installed when missing) between two hosts of the multi-host harness
(kvpool.bench.hosts), data flowing server -> client as in a get (`-R`): one stream, two streams,
and one stream with sendfile (`-Z`, no copy on the sending side), 4 s each, the three interleaved
per round. The harness's link is a veth pair (MTU 9000): no wire, so this is what the kernel's TCP
and the two copies it makes cost on this machine's cores. Prints GB/s per round and the medians.
The peers benchmark's `raw-tcp` peer (raw_tcp.py) is the same ceiling seen from Python with a
request per batch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvpool.bench import hosts

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import results_io  # noqa: E402

VARIANTS = {"1 stream": [], "2 streams": ["-P", "2"], "1 stream, sendfile": ["-Z"]}


def ensure_iperf3() -> str:
    path = shutil.which("iperf3")
    if path is None:
        subprocess.run(["apt-get", "install", "-y", "-q", "iperf3"], check=True, capture_output=True,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})  # fmt: skip
        path = shutil.which("iperf3")
    if path is None:
        sys.exit("iperf3 is not installed and apt-get could not install it")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=int, default=4, help="each measurement's length")
    ap.add_argument("--out", type=Path, default=None,
                    help="write the table here (default: benchmarks/results/tcp_ceiling/DATE-MACHINE.md)")
    args = ap.parse_args()
    iperf3 = ensure_iperf3()
    results: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with hosts.HostNetwork(["srv", "cli"]) as net:
        server = subprocess.Popen(net["srv"].wrap([iperf3, "-s", "-p", "7100"]), stdout=subprocess.DEVNULL)
        try:
            time.sleep(1.0)
            for r in range(args.rounds):
                names = list(VARIANTS)
                for name in names[r % len(names):] + names[: r % len(names)]:
                    argv = [iperf3, "-c", net["srv"].address, "-p", "7100", "-R", "-J", "-t", str(args.seconds),
                            *VARIANTS[name]]  # fmt: skip
                    done = subprocess.run(net["cli"].wrap(argv), capture_output=True, text=True, timeout=60)
                    if done.returncode != 0:
                        sys.exit(f"iperf3 failed: {done.stdout[-1000:]}{done.stderr[-1000:]}")
                    gbps = json.loads(done.stdout)["end"]["sum_received"]["bits_per_second"] / 8e9
                    results[name].append(gbps)
                    print(f"round {r + 1} {name}: {gbps:.2f} GB/s", flush=True)
        finally:
            server.kill()
            server.wait(10)
    lines = [f"TCP between two harness hosts (veth, MTU {net.mtu}), iperf3 -R, {args.seconds} s per figure, "
             f"{args.rounds} interleaved rounds; load average {os.getloadavg()[0]:.1f} at the end", "",
             "| variant | median GB/s | min - max | rounds |", "|---|---|---|---|"]  # fmt: skip
    for name, values in results.items():
        lines.append(f"| {name} | {statistics.median(values):.2f} | {min(values):.2f} - {max(values):.2f} | "
                     + ", ".join(f"{v:.2f}" for v in values) + " |")
    print("\n".join(lines))
    results_io.publish("tcp_ceiling", "\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
