"""A client process for the integration tests: puts or gets a chain of keys whose contents are a
deterministic function of the key, so another process can verify every byte. Prints one JSON line.

    python pool_worker.py put|get --master ADDR --prefix P --num-keys N --size-bytes S
        [--tenant T] [--num-replicas R] [--regions K] [--path auto|shm|nixl]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import numpy as np


def pattern(key: str, size_bytes: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, size_bytes, dtype=np.uint8)


def wait_until(predicate, timeout_s: float, what: str):
    """predicate()'s first truthy value, polled every 50 ms; AssertionError naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout_s} s")
        time.sleep(0.05)


def chain_keys(prefix: str, num_keys: int) -> list[str]:
    return [f"{prefix}/{i}" for i in range(num_keys)]


def scattered_regions(base_addr: int, num_keys: int, size_bytes: int, num_regions: int):
    """Object i's k-th region lives in slot (k * num_keys + i): regions of one object are far apart
    and in a different order from the objects, as a KV block's layers are in a paged KV cache."""
    region_bytes = size_bytes // num_regions
    addrs = [[base_addr + (k * num_keys + i) * region_bytes for k in range(num_regions)] for i in range(num_keys)]
    sizes = [[region_bytes] * num_regions for _ in range(num_keys)]
    return addrs, sizes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("op", choices=["put", "get"])
    parser.add_argument("--master", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--num-keys", type=int, required=True)
    parser.add_argument("--size-bytes", type=int, required=True)
    parser.add_argument("--tenant", default="default")
    parser.add_argument("--num-replicas", type=int, default=1)
    parser.add_argument("--regions", type=int, default=1)
    parser.add_argument("--path", default="auto")
    args = parser.parse_args()

    from kvpool.client import Client

    keys = chain_keys(args.prefix, args.num_keys)
    expected = [pattern(k, args.size_bytes) for k in keys]
    buffer = np.zeros(args.num_keys * args.size_bytes, dtype=np.uint8)
    region_bytes = args.size_bytes // args.regions
    with Client(args.master, args.tenant, timeout_s=10.0, path=args.path, num_replicas=args.num_replicas) as client:
        client.register(buffer)
        addrs, sizes = scattered_regions(int(buffer.ctypes.data), args.num_keys, args.size_bytes, args.regions)
        started = time.monotonic()
        if args.op == "put":
            for i, value in enumerate(expected):
                for k, addr in enumerate(addrs[i]):
                    offset = addr - int(buffer.ctypes.data)
                    buffer[offset : offset + region_bytes] = value[k * region_bytes : (k + 1) * region_bytes]
            statuses = client.put_from(keys, addrs, sizes)
            print(json.dumps({"statuses": statuses, "elapsed_s": time.monotonic() - started}))
            return
        count = client.get_into(keys, addrs, sizes)
        mismatched = []
        for i in range(count):
            got = np.concatenate(
                [buffer[a - int(buffer.ctypes.data) : a - int(buffer.ctypes.data) + region_bytes] for a in addrs[i]]
            )
            if not np.array_equal(got, expected[i]):
                mismatched.append(keys[i])
        print(json.dumps({"count": count, "mismatched": mismatched, "elapsed_s": time.monotonic() - started}))


if __name__ == "__main__":
    main()
