"""The client side of the peers benchmark: the cases and the worker main (the stores' adapters: adapters.py).

    python benchmarks/peers/clients.py SPEC_JSON      (started by run.py, inside the client host)

Every adapter offers the same operations, each in the store's own best way for that job:
zero-copy batch put/get between registered memory and the store (Redis has none: its client
copies into and out of Python bytes, which is part of what Redis costs), a batch existence check
(kvpool: one prefix lookup; Mooncake: batch_is_exist; Redis: a pipeline of EXISTS), a single-key
existence round trip, and plain bytes get/put. Every byte read is compared with what was
written; a case whose bytes differ fails the worker. Prints one JSON line.
"""

from __future__ import annotations

import json
import mmap
import statistics
import sys
import time

import numpy as np

from adapters import ADAPTERS, KiB, MiB

# Buffers stay alive (and registered) until the process ends: a freed buffer's address comes back
# for the next case, and Mooncake refuses to register a range overlapping a registered one.
_KEEP: list[np.ndarray] = []
PLAIN_SWEEP = [4 * KiB, 64 * KiB, 1 * MiB, 4 * MiB]  # value sizes of the plain get/put sweep


def registered_buffer(store, nbytes: int) -> np.ndarray:
    """A zeroed byte buffer the store can move to and from without a copy: the adapter's own
    `buffer()` where the store hands out its memory (Mooncake IPC), else page-aligned memory
    registered (`aligned_zeros`)."""
    own = getattr(store, "buffer", None)
    if own is not None:
        buf = own(nbytes)
        buf[:] = 0
    else:
        buf = aligned_zeros(nbytes)
        store.register(buf)
    _KEEP.append(buf)
    return buf


def aligned_zeros(nbytes: int) -> np.ndarray:
    """Zeroed, page-aligned memory (an anonymous mapping) as a numpy byte array. What an engine's
    buffers are (a torch tensor is 64-byte aligned at least, a pinned or mapped KV cache
    page-aligned) and what Mooncake IPC's own pool gives; numpy's large arrays sit 16 bytes past a
    page boundary (malloc's header), where glibc copies 64 KiB regions at half speed
    (benchmarks/results/peers/2026-12-06-2cpu-epyc-aligned-buffers-{before,after}.md). Every store
    without memory of its own gets this."""
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)


def random_buffer(store, nbytes: int, seed: int) -> np.ndarray:
    buf = registered_buffer(store, nbytes)
    buf[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return buf


# ---- cases ----------------------------------------------------------------------------------------


def _layout(buf: np.ndarray, n: int, regions: int, region_bytes: int):
    """Object i's region k at slot k*n + i: an object's regions lie far apart (a paged KV cache)."""
    base = int(buf.ctypes.data)
    addrs = [[base + (k * n + i) * region_bytes for k in range(regions)] for i in range(n)]
    return addrs, [[region_bytes] * regions for _ in range(n)]


def _gather(buf: np.ndarray, addrs_i: list[int], region_bytes: int) -> np.ndarray:
    base = int(buf.ctypes.data)
    return np.concatenate([buf[a - base : a - base + region_bytes] for a in addrs_i])


def _verify(src, dst, n_read: int, n: int, what: str) -> None:
    if n_read != n:
        raise RuntimeError(f"{what}: read {n_read} of {n} objects")
    if not np.array_equal(src, dst):
        raise RuntimeError(f"{what}: read bytes differ from written bytes")


def case_bandwidth(store, tag: str, size: int, total: int, passes: int, regions: int = 1) -> dict:
    """Zero-copy put and get GB/s of `total` bytes in objects of `size` bytes, `regions` regions
    each; the median of `passes` passes, fresh keys per pass, every byte verified."""
    n = max(1, total // size)
    region_bytes = size // regions
    src = random_buffer(store, n * size, abs(hash(tag)) % 2**32)
    dst = registered_buffer(store, n * size)
    src_addrs, sizes = _layout(src, n, regions, region_bytes)
    dst_addrs, _ = _layout(dst, n, regions, region_bytes)
    batch = max(1, min(n, 64 * MiB // size, 64))
    puts, gets = [], []
    for p in range(passes):
        keys = [f"{tag}/{p}/{i}" for i in range(n)]
        t = time.perf_counter()
        for b in range(0, n, batch):
            store.put_from(keys[b : b + batch], src_addrs[b : b + batch], sizes[b : b + batch])
        puts.append(n * size / (time.perf_counter() - t) / 1e9)
        dst[:] = 0
        got, t = 0, time.perf_counter()
        for b in range(0, n, batch):
            got += store.get_into(keys[b : b + batch], dst_addrs[b : b + batch], sizes[b : b + batch])
        gets.append(n * size / (time.perf_counter() - t) / 1e9)
        _verify(src, dst, got, n, f"{tag} pass {p}")
        store.remove(keys)
    return {"put_gbps": statistics.median(puts), "get_gbps": statistics.median(gets), "num_objects": n,
            "regions": regions, "passes": passes}  # fmt: skip


def case_lookups(store, tag: str, iterations: int) -> dict:
    keys = [f"{tag}/chain/{i}" for i in range(1000)]
    value = random_buffer(store, 1000 * 64, 5)
    addrs, sizes = _layout(value, 1000, 1, 64)
    store.put_from(keys, addrs, sizes)
    if store.exists_batch(keys) != 1000:
        raise RuntimeError("lookup chain incomplete")
    for _ in range(3):
        store.exists_batch(keys)
    t, reps = time.perf_counter(), 10
    for _ in range(reps):
        if store.exists_batch(keys) != 1000:
            raise RuntimeError("lookup chain lost keys")
    batch_keys_per_s = reps * 1000 / (time.perf_counter() - t)
    for _ in range(200):
        store.exists_one(keys[0])
    samples = np.empty(iterations)
    for i in range(iterations):
        t = time.perf_counter()
        store.exists_one(keys[0])
        samples[i] = time.perf_counter() - t
    store.remove(keys)
    us = samples * 1e6
    return {"chain1000_keys_per_s": batch_keys_per_s, "rtt_p50_us": float(np.percentile(us, 50)),
            "rtt_p99_us": float(np.percentile(us, 99)), "iterations": iterations}  # fmt: skip


def case_plain(store, tag: str, size: int, count: int, passes: int, reader=None) -> dict:
    """Plain bytes put/get, one call per value (what an application without registered memory does).
    With `reader` (a second client of the same store, in this process), each pass's values are
    also got by it: a reader that never saw them (kvpool's writer knows where it put them,
    client/known_places.py; another client does not)."""
    rng = np.random.default_rng(9)
    values = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(count)]
    gets, puts, reads = [], [], []
    for p in range(passes):
        keys = [f"{tag}/{p}/{i}" for i in range(count)]
        t = time.perf_counter()
        for k, v in zip(keys, values):
            store.put_bytes(k, v)
        puts.append(count * size / (time.perf_counter() - t) / 1e9)
        gets.append(_timed_gets(store, keys, values, f"{tag}: plain get"))
        if reader is not None:
            reads.append(_timed_gets(reader, keys, values, f"{tag}: plain get by another client"))
        store.remove(keys)
    out = {"put_gbps": statistics.median(puts), "get_gbps": statistics.median(gets), "value_bytes": size}
    if reads:
        out["reader_get_gbps"] = statistics.median(reads)
    return out


def _timed_gets(store, keys: list[str], values: list[bytes], what: str) -> float:
    """GB/s of getting `keys` one call each, the results kept until all are in (then compared)."""
    t = time.perf_counter()
    got = [store.get_bytes(k) for k in keys]
    gbps = len(keys) * len(values[0]) / (time.perf_counter() - t) / 1e9
    if got != values:
        raise RuntimeError(f"{what} returned other bytes")
    return gbps


def second_client(spec: dict):
    """Another client of the peer's store in this process (plain_sweep's reader), or None where
    the peer's client library allows one per process only."""
    try:
        return ADAPTERS[spec["adapter"]](spec)
    except Exception as e:  # noqa: BLE001 - reported in the client's stderr, the rows left empty
        print(f"no second client for {spec['adapter']}: {e}", file=sys.stderr)
        return None


def agent_sessions(store, tag: str, seed: int, chunk: int, prefix: int, tail: int, sessions: int):
    """The agent loop's memory, shared by its clients here and in agent_phases.py: a source buffer
    with room for every session's prefix and tail chunks (`prefix + tail` slots per session), a
    registered destination for one prefix, and each session's prefix chain, put once.
    Returns (src, dst, chains)."""
    slots = prefix + tail
    src = random_buffer(store, sessions * slots * chunk, seed)
    dst = registered_buffer(store, prefix * chunk)
    base = int(src.ctypes.data)
    chains = [[f"{tag}/s{s}/c{i}" for i in range(prefix)] for s in range(sessions)]
    for s, keys in enumerate(chains):
        store.put_from(keys, [[base + (s * slots + i) * chunk] for i in range(prefix)], [[chunk]] * prefix)
    return src, dst, chains


def case_agent(store, tag: str, loops: int, start_at: float, chunk: int = 256 * KiB, prefix: int = 8,
               tail: int = 2, sessions: int = 8) -> dict:
    """One of several concurrent clients running an agent-like loop: each loop looks up a session's
    chain (prefix + 1 keys: the prefix hits, the next misses), gets the prefix zero-copy, and puts
    a tail of new chunks; sessions are taken in turn, so each loop's prefix was written earlier by
    this client. Starts at the wall-clock `start_at` (all clients together); bytes verified."""
    slots = prefix + tail
    src, dst, chains = agent_sessions(store, tag, abs(hash(tag)) % 2**32, chunk, prefix, tail, sessions)
    base, dbase = int(src.ctypes.data), int(dst.ctypes.data)
    dst_addrs, sizes = [[dbase + i * chunk] for i in range(prefix)], [[chunk]] * prefix
    while time.time() < start_at:
        time.sleep(0.001)
    phases, written = np.empty((loops, 3)), []  # per loop: lookup, get, put (s)
    t_start = time.perf_counter()
    for n in range(loops):
        s = n % sessions
        tail_keys = [f"{tag}/s{s}/t{n}/{j}" for j in range(tail)]
        t0 = time.perf_counter()
        if store.exists_batch(chains[s] + [tail_keys[0]]) != prefix:
            raise RuntimeError("agent loop: prefix lookup missed")
        t1 = time.perf_counter()
        if store.get_into(chains[s], dst_addrs, sizes) != prefix:
            raise RuntimeError("agent loop: prefix get missed")
        t2 = time.perf_counter()
        store.put_from(tail_keys, [[base + (s * slots + prefix + j) * chunk] for j in range(tail)], [[chunk]] * tail)
        phases[n] = (t1 - t0, t2 - t1, time.perf_counter() - t2)
        written.extend(tail_keys)
        if n < sessions and not np.array_equal(dst, src[s * slots * chunk : (s * slots + prefix) * chunk]):
            raise RuntimeError("agent loop: prefix bytes differ")
    elapsed = time.perf_counter() - t_start
    store.remove(written)
    for keys in chains:
        store.remove(keys)
    return {"loops": loops, "elapsed_s": elapsed, "latencies_s": phases.sum(1).tolist(), "phases_s": phases.tolist()}


def run(spec: dict) -> dict:
    store = ADAPTERS[spec["adapter"]](spec)
    q = spec.get("quick", False)
    tag = spec["tag"]
    out: dict = {}
    try:
        for case in spec["cases"]:
            if case == "fill":  # write the storage process's memory once: Mooncake and Redis do not pre-fault
                out[case] = case_bandwidth(store, f"{tag}/fill", 16 * MiB, spec["fill_bytes"], 1)
            elif case == "get_1m":
                out[case] = case_bandwidth(store, f"{tag}/1m", MiB, (16 if q else 64) * MiB, 3)
            elif case == "bw_16m":
                out[case] = case_bandwidth(store, f"{tag}/16m", 16 * MiB, (32 if q else 128) * MiB, 3)
            elif case == "sg":
                out[case] = case_bandwidth(store, f"{tag}/sg", 32 * 64 * KiB, (16 if q else 64) * MiB, 3, regions=32)
            elif case == "lookup":
                out[case] = case_lookups(store, f"{tag}/lk", 300 if q else 2000)
            elif case == "plain_64k":
                out[case] = case_plain(store, f"{tag}/plain", 64 * KiB, 64 if q else 256, 3)
            elif case == "plain_sweep":  # plain values of several sizes, ~32 MiB (2 MiB --quick) per size and pass
                reader = second_client(spec)
                try:
                    out[case] = {str(size): case_plain(store, f"{tag}/sweep{size}", size,
                                                       max(16, min(2048, (2 if q else 32) * MiB // size)), 3, reader)
                                 for size in PLAIN_SWEEP}  # fmt: skip
                finally:
                    if reader is not None:
                        reader.close()
            elif case == "agent_worker":
                out[case] = case_agent(store, f"{tag}/agent{spec['worker']}", 50 if q else 200, spec["start_at"])
            else:
                raise ValueError(f"unknown case {case!r}")
        out["route"] = store.route()
    finally:
        store.close()
    return out


if __name__ == "__main__":
    result = run(json.loads(sys.argv[1]))
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
