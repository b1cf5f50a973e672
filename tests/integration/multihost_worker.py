"""A client process for test_multihost.py, run inside one of the harness's hosts. Objects are
independent keys (no parent) whose bytes are a function of the key, so any process can verify them.
Prints one JSON line.

    python multihost_worker.py put|get --master ADDR --num-keys N --size-bytes S [--regions K]
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from pool_worker import pattern, scattered_regions  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("op", choices=["put", "get"])
    parser.add_argument("--master", required=True)
    parser.add_argument("--num-keys", type=int, required=True)
    parser.add_argument("--size-bytes", type=int, required=True)
    parser.add_argument("--regions", type=int, default=1)
    parser.add_argument("--path", default="auto")
    args = parser.parse_args()

    from kvpool.client import Client
    from kvpool.transfer import host_id

    keys = [f"mh/{i}" for i in range(args.num_keys)]
    expected = [pattern(k, args.size_bytes) for k in keys]
    buffer = np.zeros(args.num_keys * args.size_bytes, dtype=np.uint8)
    base = int(buffer.ctypes.data)
    region_bytes = args.size_bytes // args.regions
    addrs, sizes = scattered_regions(base, args.num_keys, args.size_bytes, args.regions)

    def gather(i: int) -> np.ndarray:
        return np.concatenate([buffer[a - base : a - base + region_bytes] for a in addrs[i]])

    out: dict = {"host_id": host_id()}
    with Client(args.master, "multihost", timeout_s=10.0, path=args.path) as client:
        client.register(buffer)
        if args.op == "put":
            for i, value in enumerate(expected):
                for k, addr in enumerate(addrs[i]):
                    buffer[addr - base : addr - base + region_bytes] = value[k * region_bytes : (k + 1) * region_bytes]
            out["statuses"] = client.put_from(keys, addrs, sizes)  # no parents: each key its own chain
        else:
            count = client.get_into(keys, addrs, sizes)  # all at once: the leading hits
            out["batch_count"] = count
            out["batch_wrong"] = [keys[i] for i in range(count) if not np.array_equal(gather(i), expected[i])]
            # one key per call: every object is a hit or a miss of its own
            outcome = []
            for i, key in enumerate(keys):
                buffer[:] = 0xEE
                count = client.get_into([key], [addrs[i]], [sizes[i]])
                outcome.append("miss" if count == 0 else ("ok" if np.array_equal(gather(i), expected[i]) else "wrong"))
            out["outcome"] = outcome
        out["paths"] = sorted(set(client.plane.paths().values()))
        out["jobs"] = client.plane.jobs_by_path
        lane = getattr(client._channel, "_sock", None)  # the master's lane: TCP across hosts, Unix on its host
        out["master_lane"] = None if lane is None else ("unix" if lane.family == socket.AF_UNIX else "tcp")
        out["nodes"] = {n.node_id: {"host_id": n.host_id, "num_objects": n.num_objects, "state": n.state}
                        for n in client.stats().nodes}  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main()
