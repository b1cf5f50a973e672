"""Where a plain `get` / `put` of one value spends its time, phase by phase, across hosts.

    benchmarks/run.py plain_phases \
        [--size-kib 1024] [--count 200] [--out FILE]

Starts the peers benchmark's `kvpool-nixl` peer (master, node and client on three hosts of the
multi-host harness), then one client process that puts and gets `--count` values of `--size-kib`
one call at a time (as `case_plain` does, results kept until the pass ends) with the client's
internal steps wrapped in timers (the client's parts' methods, patched on their classes): the
master round trips (`MasterLink.call`, by request type; a PutEnd sent while the bytes travel as
its send, the wait for its reply after the write and the PutLanded, client/landing.py), the
staging copy, the checksums, the transfer round (`Transfers.run_round`), a GetValue with the
read beside it (`EarlyReads.read_early` / `read_by_tag`), the lease release and the result
bytes; then a second client that never saw them gets each too (phases prefixed "another
client:"); then 300 pings, the bare master round trip, and 300 more each after 0.7 ms asleep (as
long as a 1 MiB write: what waking an idle master and client adds to a round trip).
Reported: per phase the median and P90 per call in microseconds, and the whole call's, so a
change that should cut one phase can be seen to cut it. Bytes are compared with what was put.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from kvpool.bench import hosts  # noqa: E402
from servers import HOSTS, PEERS, client_script, run_script  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import results_io  # noqa: E402

CLIENT = r'''
import collections, json, sys, time
import numpy as np
spec = json.loads(sys.argv[1])
from kvpool.client import Client, fresh_memory, plain_values
from kvpool.client.known_places import EarlyReads
from kvpool.client.landing import Landings
from kvpool.client.master_link import MasterLink
from kvpool.client.puts import Puts
from kvpool.client.reads import Reads
from kvpool.client.rounds import Transfers
phases = collections.defaultdict(list)
stage = [""]

sys.path.insert(0, spec["here"])
import call_timer

def timed(owner, name, label=None):  # each phase's calls under the stage's prefix ("another client: ")
    call_timer.timed(owner, name, lambda a: stage[0] + (label(a) if callable(label) else (label or name)), phases)

timed(MasterLink, "call", lambda a: type(a[1]).__name__)
timed(MasterLink, "release", "release (lease)")
timed(Puts, "checksums", "checksums (put batch)")
timed(Transfers, "run_round", lambda a: f"run_round {a[1]}")
timed(Transfers, "carried_unregistered")
timed(Reads, "_verified")
timed(plain_values, "copy_bytes")
timed(plain_values, "checksum_regions")
timed(plain_values, "_bytes_of")
timed(plain_values.PlainValues, "_find_value")
timed(EarlyReads, "read_early", "read_early (GetValue, the known place read meanwhile)")
timed(EarlyReads, "read_by_tag", "read_by_tag (GetValue, the tag read meanwhile)")
timed(Landings, "send", "PutEnd sent (landing)")  # Landings.begin sends through it too
timed(Landings, "finish", "PutEnd reply taken after the write (landing)")
timed(Landings, "land", "PutLanded sent (one way)")
timed(fresh_memory, "new_bytes")
timed(fresh_memory, "prefault")
c = Client(spec["master"], spec["tenant"], timeout_s=30.0)
cold = Client(spec["master"], spec["tenant"], timeout_s=30.0)  # never put nor saw the values
size, count = spec["size"], spec["count"]
rng = np.random.default_rng(3)
values = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(16)]
out = {}
for label in ("warm", "measured"):
    phases.clear()
    calls = {"put": [], "get": [], "get by another client": []}
    for start in range(0, count, 16):
        keys = [f"{label}/{start + i}" for i in range(16)]
        for k, v in zip(keys, values):
            t = time.perf_counter(); c.put(k, v); calls["put"].append(time.perf_counter() - t)
        got = []
        for k in keys:
            t = time.perf_counter(); got.append(c.get(k)); calls["get"].append(time.perf_counter() - t)
        stage[0] = "another client: "
        for k in keys:
            t = time.perf_counter(); got.append(cold.get(k)); calls["get by another client"].append(time.perf_counter() - t)
        stage[0] = ""
        if got != values + values:
            raise SystemExit("plain get returned other bytes")
        c.remove(keys)
    pings = []
    for _ in range(300):
        t = time.perf_counter(); c.ping(); pings.append(time.perf_counter() - t)
    calls["ping"] = pings
    idle = []
    for _ in range(300):  # the master idle as long as a 1 MiB write takes: its wake-up in the round trip
        time.sleep(0.0007)
        t = time.perf_counter(); c.ping(); idle.append(time.perf_counter() - t)
    calls["ping after 0.7 ms idle"] = idle
    out = {"calls": calls, "phases": dict(phases)}
c.close()
cold.close()
print(json.dumps(out))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-kib", type=int, default=1024)
    ap.add_argument("--count", type=int, default=192, help="values put and got per pass, a multiple of 16 (default 192)")
    ap.add_argument("--out", type=Path, default=None,
                    help="write the table here (default: benchmarks/results/plain_phases/DATE-MACHINE.md)")
    args = ap.parse_args()
    import numpy as np

    workdir, script = client_script("plain_phases", CLIENT)
    with hosts.HostNetwork(HOSTS) as net:
        running = PEERS["kvpool-nixl"].start(net, workdir, 1024 << 20, sys.executable)
        try:
            out = run_script(running, script, {**running.spec, "size": args.size_kib << 10, "count": args.count,
                                               "here": str(HERE)})
        finally:
            running.stop()
    lines = [f"plain values of {args.size_kib} KiB across hosts, {args.count} puts and gets one at a time; "
             "per call, microseconds", "", "| phase | calls | P50 | P90 |", "|---|---|---|---|"]
    for name, samples in [*out["calls"].items(), *sorted(out["phases"].items())]:
        us = np.array(samples) * 1e6
        lines.append(f"| {name} | {len(us)} | {np.percentile(us, 50):.0f} | {np.percentile(us, 90):.0f} |")
    print("\n".join(lines))
    results_io.publish("plain_phases", "\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
