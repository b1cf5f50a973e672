"""Checksum candidates for pool objects, side by side: crc32c (google-crc32c) vs xxHash.

What is measured, all on one core, candidates interleaved (the order rotates every round, one
warm-up round is dropped), P50/P90 over rounds and per-round ratios against xxh3_64:
- large: one region of 1, 16 and 64 MiB, one-shot hash; "cold" walks a 256 MiB arena so every
  call reads memory not touched since 256 MiB ago (over the L3), "hot" rehashes one 1 MiB buffer.
- scatter-gather: objects of 8/32/128 regions of 2/16/64 KiB laid out like a paged KV cache (one
  "layer" slab per region index, object j = block j of every slab), hashed region by region with
  each candidate's streaming API (crc32c: extend; xxHash: update), a batch of objects per sample.
  Also the shipped kvpool.client.checksum.checksum_objects over the same batch.
- buffer makers: the Python cost of turning (addr, size) into a zero-copy buffer (ctypes array
  type per size, cached or not, a memoryview slice of the address space, numpy from address) and,
  for reference, a copy (ctypes.string_at).
- GIL: whether a pure-Python thread keeps running while another hashes (1.0: the hash releases
  the GIL; ~0.5: the two threads take turns).

    benchmarks/run.py checksum            # ~40 s
    benchmarks/run.py checksum --quick    # ~15 s, fewer rounds

Writes benchmarks/results/checksum/DATE-MACHINE.{json,md,png} and LATEST.md.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))  # a fresh clone runs without `pip install -e .`
sys.path.insert(0, str(HERE))

try:
    import google_crc32c
except ImportError:  # a benchmark-only dependency: the pool itself uses xxhash alone
    sys.exit("checksum_bench needs google-crc32c: pip install google-crc32c==1.9.0")
import results_io  # noqa: E402
import xxhash  # noqa: E402

from kvpool.client import checksum as shipped  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
LARGE_SIZES = (1 * MiB, 16 * MiB, 64 * MiB)
SG_REGIONS = (8, 32, 128)
SG_REGION_BYTES = (2 * KiB, 16 * KiB, 64 * KiB)
GIL_SIZES = (64 * KiB, 256 * KiB, 1 * MiB, 16 * MiB)
BASELINE = "xxh3_64"
SHIPPED = "kvpool checksum_objects"
PREBUILT = "xxh3_64, buffers made beforehand"
SPACE_SLICES = "xxh3_64, memoryview slices of address space"
# a read-only memoryview of the whole address space: SPACE[addr : addr + n] is a zero-copy view of
# [addr, addr + n). A rejected alternative to ctypes arrays, measured here; never indexed raw.
SPACE = memoryview((ctypes.c_char * sys.maxsize).from_address(0)).cast("B").toreadonly()

# ---- candidates: one-shot over a buffer, and streaming over regions ------------------------------

_buffer_at: dict[int, Callable[[int], ctypes.Array]] = {}


def buffer_at(size: int) -> Callable[[int], ctypes.Array]:
    fn = _buffer_at.get(size)
    if fn is None:
        fn = _buffer_at[size] = (ctypes.c_char * size).from_address
    return fn


def crc32c_regions(addrs: list[int], sizes: list[int]) -> int:
    # google_crc32c.extend, not Checksum().update: a plain function, ~4x cheaper to call
    extend = google_crc32c.extend
    crc = 0
    first = sizes[0]
    if sizes.count(first) == len(sizes):
        at = buffer_at(first)
        for addr in addrs:
            crc = extend(crc, at(addr))
    else:
        for addr, size in zip(addrs, sizes):
            crc = extend(crc, buffer_at(size)(addr))
    return crc


def xxhash_regions(new_hasher) -> Callable[[list[int], list[int]], int]:
    def regions(addrs: list[int], sizes: list[int]) -> int:
        hasher = new_hasher()
        update = hasher.update
        first = sizes[0]
        if sizes.count(first) == len(sizes):
            at = buffer_at(first)
            for addr in addrs:
                update(at(addr))
        else:
            for addr, size in zip(addrs, sizes):
                update(buffer_at(size)(addr))
        return hasher.intdigest()

    return regions


@dataclass(frozen=True)
class Candidate:
    name: str
    bits: int
    one_shot: Callable[[object], int]
    regions: Callable[[list[int], list[int]], int]


CANDIDATES = (
    Candidate("crc32c", 32, google_crc32c.value, crc32c_regions),
    Candidate("xxh3_64", 64, xxhash.xxh3_64_intdigest, xxhash_regions(xxhash.xxh3_64)),
    Candidate("xxh3_128", 128, xxhash.xxh3_128_intdigest, xxhash_regions(xxhash.xxh3_128)),
    Candidate("xxh64", 64, xxhash.xxh64_intdigest, xxhash_regions(xxhash.xxh64)),
)

# ---- machine ------------------------------------------------------------------------------------


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def cpu_flags() -> list[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return [f for f in ("sse4_2", "pclmulqdq", "avx2", "avx512f", "vpclmulqdq") if f in flags]
    return []


def cache_size(level: int) -> str | None:
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        if (index / "level").read_text().strip() == str(level) and (index / "type").read_text().strip() != "Instruction":
            return (index / "size").read_text().strip()
    return None


def machine() -> dict:
    return {
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cores": os.cpu_count(),
        "l2": cache_size(2),
        "l3": cache_size(3),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "numpy": np.__version__,
        "xxhash": importlib.metadata.version("xxhash"),
        "libxxhash": xxhash.XXHASH_VERSION,
        "google_crc32c": importlib.metadata.version("google-crc32c"),
        "google_crc32c_implementation": google_crc32c.implementation,
    }


# ---- timing -------------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def interleaved(variants: dict[str, Callable[[int], None]], rounds: int) -> dict[str, list[float]]:
    """Seconds per sample for each variant; fn(k) runs the k-th sample. Round r runs the variants in
    an order rotated by r; round 0 is a warm-up."""
    names = list(variants)
    out: dict[str, list[float]] = {n: [] for n in names}
    k = 0
    for r in range(rounds + 1):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter_ns()
            variants[name](k)
            dt = (time.perf_counter_ns() - t0) / 1e9
            k += 1
            if r:
                out[name].append(dt)
    return out


def ratios(samples: dict[str, list[float]], baseline: str) -> dict[str, float]:
    """P50 over rounds of (variant time / baseline time) in the same round."""
    return {
        name: statistics.median(v / b for v, b in zip(values, samples[baseline]))
        for name, values in samples.items()
        if name != baseline
    }


# ---- measurements -------------------------------------------------------------------------------


def bench_large(arena: np.ndarray, rounds: int) -> list[dict]:
    base, arena_bytes = int(arena.ctypes.data), arena.nbytes
    rows = []
    cases = [(size, "cold") for size in LARGE_SIZES] + [(1 * MiB, "hot")]
    for size, memory in cases:
        calls = max(1, (32 * MiB) // size)  # >= 32 MiB hashed per sample
        slots = arena_bytes // size
        at = buffer_at(size)

        def variant(c: Candidate) -> Callable[[int], None]:
            fn = c.one_shot
            if memory == "hot":
                buf = at(base)
                return lambda k: [fn(buf) for _ in range(calls)]
            return lambda k: [fn(at(base + ((k * calls + i) % slots) * size)) for i in range(calls)]

        samples = interleaved({c.name: variant(c) for c in CANDIDATES}, rounds)
        rel = ratios(samples, BASELINE)
        for c in CANDIDATES:
            per_call = [s / calls for s in samples[c.name]]
            rows.append(
                {
                    "candidate": c.name,
                    "size_bytes": size,
                    "memory": memory,
                    "p50_gbps": size / statistics.median(per_call) / 1e9,
                    "p90_gbps": size / pct(per_call, 0.9) / 1e9,
                    "p50_ms_per_gb": statistics.median(per_call) / size * 1e9 * 1e3,
                    "time_vs_xxh3_64": rel.get(c.name, 1.0),
                }
            )
    return rows


def kv_layout(base: int, arena_bytes: int, num_regions: int, region_bytes: int, start: int, count: int):
    """Objects start..start+count-1 of a paged KV cache: slab i (arena / num_regions bytes) holds
    region i of every object, object j's region at offset j * region_bytes in the slab."""
    slab = arena_bytes // num_regions
    per_slab = slab // region_bytes
    addrs, sizes = [], []
    for j in range(start, start + count):
        off = (j % per_slab) * region_bytes
        addrs.append([base + i * slab + off for i in range(num_regions)])
        sizes.append([region_bytes] * num_regions)
    return addrs, sizes, per_slab


def bench_scatter_gather(arena: np.ndarray, rounds: int) -> list[dict]:
    base, arena_bytes = int(arena.ctypes.data), arena.nbytes
    rows = []
    for num_regions in SG_REGIONS:
        for region_bytes in SG_REGION_BYTES:
            object_bytes = num_regions * region_bytes
            batch = max(2, (16 * MiB) // object_bytes)
            _, _, per_slab = kv_layout(base, arena_bytes, num_regions, region_bytes, 0, 1)
            num_batches = max(1, per_slab // batch)
            batches = [kv_layout(base, arena_bytes, num_regions, region_bytes, b * batch, batch)[:2] for b in range(num_batches)]

            def variant(fn: Callable[[list[int], list[int]], int]) -> Callable[[int], None]:
                def run(k: int) -> None:
                    addrs, sizes = batches[k % num_batches]
                    for a, s in zip(addrs, sizes):
                        fn(a, s)

                return run

            def shipped_batch(k: int) -> None:
                addrs, sizes = batches[k % num_batches]
                shipped.checksum_objects(addrs, sizes)

            # the same xxh3_64 loop over buffers made beforehand: hashing without the Python cost of
            # making buffers (what is left of it is the update call and the loop)
            prebuilt = [[[buffer_at(s)(a) for a, s in zip(al, sl)] for al, sl in zip(*b)] for b in batches]

            def xxh3_prebuilt(k: int) -> None:
                for bufs in prebuilt[k % num_batches]:
                    hasher = xxhash.xxh3_64()
                    for buf in bufs:
                        hasher.update(buf)
                    hasher.intdigest()

            def xxh3_space(k: int) -> None:
                addrs, sizes = batches[k % num_batches]
                for al, sl in zip(addrs, sizes):
                    hasher = xxhash.xxh3_64()
                    for a, s in zip(al, sl):
                        hasher.update(SPACE[a : a + s])
                    hasher.intdigest()

            variants = {c.name: variant(c.regions) for c in CANDIDATES}
            variants[SHIPPED] = shipped_batch
            variants[PREBUILT] = xxh3_prebuilt
            variants[SPACE_SLICES] = xxh3_space
            samples = interleaved(variants, rounds)
            rel = ratios(samples, BASELINE)
            for name, values in samples.items():
                per_object = [v / batch for v in values]
                p50 = statistics.median(per_object)
                rows.append(
                    {
                        "variant": name,
                        "num_regions": num_regions,
                        "region_bytes": region_bytes,
                        "object_bytes": object_bytes,
                        "batch": batch,
                        "p50_us_per_object": p50 * 1e6,
                        "p90_us_per_object": pct(per_object, 0.9) * 1e6,
                        "ns_per_region": p50 / num_regions * 1e9,
                        "gbps": object_bytes / p50 / 1e9,
                        "ms_per_gb": p50 / object_bytes * 1e12,
                        "time_vs_xxh3_64": rel.get(name, 1.0),
                    }
                )
    return rows


def bench_buffer_makers(arena: np.ndarray, rounds: int) -> list[dict]:
    """Per-region cost of (addr, size) -> buffer, 32 regions of 16 KiB per sample, no hashing."""
    base, size, n = int(arena.ctypes.data), 16 * KiB, 32
    addrs = [base + i * MiB for i in range(n)]
    cached = buffer_at(size)
    u8p = ctypes.POINTER(ctypes.c_uint8)
    repeat = 200
    makers: dict[str, Callable[[int], object]] = {
        "ctypes array type cached per size": lambda a: cached(a),  # its bound from_address, as the module keeps
        "ctypes array type made per call": lambda a: (ctypes.c_char * size).from_address(a),
        "memoryview slice of address space": lambda a: SPACE[a : a + size],
        "numpy from address (ctypeslib)": lambda a: np.ctypeslib.as_array(ctypes.cast(a, u8p), (size,)),
        "copy, not zero-copy (string_at)": lambda a: ctypes.string_at(a, size),
    }

    def variant(make: Callable[[int], object]) -> Callable[[int], None]:
        def run(k: int) -> None:
            for _ in range(repeat):
                for a in addrs:
                    make(a)  # dropped at once, as in a hash loop

        return run

    samples = interleaved({name: variant(m) for name, m in makers.items()}, rounds)
    return [
        {"maker": name, "region_bytes": size, "p50_ns_per_region": statistics.median(v) / (repeat * n) * 1e9}
        for name, v in samples.items()
    ]


def bench_gil(arena: np.ndarray, repeats: int) -> list[dict]:
    """Counter-thread progress while another thread hashes, relative to its progress alone."""
    base = int(arena.ctypes.data)

    def counter_rate(work: Callable[[], None]) -> float:
        stop, out = threading.Event(), []

        def count() -> None:
            n = 0
            while not stop.is_set():
                n += 1
            out.append(n)

        thread = threading.Thread(target=count)
        t0 = time.perf_counter()
        thread.start()
        work()
        stop.set()
        thread.join()
        return out[0] / (time.perf_counter() - t0)

    rows = []
    for size in GIL_SIZES:
        buf = buffer_at(size)(base)
        calls = max(4, (512 * MiB) // size)
        for c in CANDIDATES[:2]:
            fn = c.one_shot
            shares = []
            for _ in range(repeats):
                alone = counter_rate(lambda: time.sleep(0.1))
                shares.append(counter_rate(lambda: [fn(buf) for _ in range(calls)]) / alone)
            rows.append({"candidate": c.name, "size_bytes": size, "counter_share": statistics.median(shares)})
    return rows


def check_streaming(arena: np.ndarray) -> None:
    """Every candidate's streaming result over regions equals its one-shot over the bytes."""
    base = int(arena.ctypes.data)
    addrs, sizes = [base + 7, base + 5000, base + 100000], [4093, 16 * KiB, 1]
    joined = b"".join(ctypes.string_at(a, s) for a, s in zip(addrs, sizes))
    for c in CANDIDATES:
        if c.regions(addrs, sizes) != c.one_shot(joined):
            raise RuntimeError(f"{c.name}: streaming over regions differs from one-shot")
    if shipped.checksum_regions(addrs, sizes) != (xxhash.xxh3_64_intdigest(joined) or 1):
        raise RuntimeError("kvpool.client.checksum disagrees with xxh3_64")


# ---- report -------------------------------------------------------------------------------------


def fmt_size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def verdict(result: dict) -> dict:
    large = {(r["candidate"], r["size_bytes"], r["memory"]): r for r in result["large"]}
    sg = [r for r in result["scatter_gather"] if r["variant"] == "crc32c"]
    cold64 = (large[("crc32c", 64 * MiB, "cold")], large[("xxh3_64", 64 * MiB, "cold")])
    hot = (large[("crc32c", 1 * MiB, "hot")], large[("xxh3_64", 1 * MiB, "hot")])
    sg_ratios = [r["time_vs_xxh3_64"] for r in sg]
    faster = "xxh3_64" if cold64[1]["p50_gbps"] > cold64[0]["p50_gbps"] and statistics.median(sg_ratios) > 1 else "crc32c"
    return {
        "chosen": shipped.ALGORITHM,
        "faster_measured": faster,
        "agrees": faster == shipped.ALGORITHM,
        "cold_64mib_gbps": {"crc32c": cold64[0]["p50_gbps"], "xxh3_64": cold64[1]["p50_gbps"]},
        "hot_1mib_gbps": {"crc32c": hot[0]["p50_gbps"], "xxh3_64": hot[1]["p50_gbps"]},
        "sg_crc32c_over_xxh3_64": {"min": min(sg_ratios), "median": statistics.median(sg_ratios), "max": max(sg_ratios)},
    }


def write_md(result: dict, path: Path) -> None:
    m, v = result["machine"], result["verdict"]
    L: list[str] = []
    L.append("# Checksum candidates for pool objects: crc32c vs xxHash\n")
    L.append(f"Made by `benchmarks/checksum_bench.py{' --quick' if result['config']['quick'] else ''}` "
             f"on {time.strftime('%Y-%m-%d %H:%M', time.localtime(result['started_at']))}.\n")
    L.append("## Machine\n")
    L.append(f"- CPU: {m['cpu_model']}, {m['cores']} cores, L2 {m['l2']}, L3 {m['l3']}, flags {' '.join(m['cpu_flags'])}")
    la0, la1 = result["loadavg_start"], result["loadavg_end"]
    L.append(f"- load average (1/5/15 min): start {la0[0]:.2f}/{la0[1]:.2f}/{la0[2]:.2f}, end {la1[0]:.2f}/{la1[1]:.2f}/{la1[2]:.2f}")
    L.append(f"- Python {m['python']} ({m['platform']}), numpy {m['numpy']}")
    L.append(f"- xxhash {m['xxhash']} (libxxhash {m['libxxhash']}), google-crc32c {m['google_crc32c']} "
             f"(implementation: `{m['google_crc32c_implementation']}`)\n")
    L.append("## Verdict\n")
    c, x = v["cold_64mib_gbps"]["crc32c"], v["cold_64mib_gbps"]["xxh3_64"]
    hc, hx = v["hot_1mib_gbps"]["crc32c"], v["hot_1mib_gbps"]["xxh3_64"]
    sgr = v["sg_crc32c_over_xxh3_64"]
    L.append(f"**Chosen: `{v['chosen']}`** (`kvpool.client.checksum.ALGORITHM`); measured faster in this run: "
             f"`{v['faster_measured']}`{'' if v['agrees'] else ' -- this run DISAGREES with the shipped choice'}.\n")
    L.append(f"- One large region, cold memory (64 MiB): xxh3_64 {x:.1f} GB/s vs crc32c {c:.1f} GB/s ({x / c:.2f}x); "
             f"in cache (1 MiB): {hx:.1f} vs {hc:.1f} GB/s ({hx / hc:.2f}x).")
    L.append(f"- Scatter-gather objects: crc32c takes {sgr['min']:.2f}-{sgr['max']:.2f}x the time of xxh3_64 "
             f"(median {sgr['median']:.2f}x) over the 9 shapes.")
    gil = {(r["candidate"], r["size_bytes"]): r["counter_share"] for r in result["gil"]}
    big = [s for s in GIL_SIZES if s >= 256 * KiB]
    gx, gc_ = [gil[("xxh3_64", s)] for s in big], [gil[("crc32c", s)] for s in big]
    L.append(f"- GIL: while xxh3_64 hashes buffers of {fmt_size(big[0])}-{fmt_size(big[-1])} another Python thread keeps "
             f"{min(gx):.2f}-{max(gx):.2f} of its speed, {min(gc_):.2f}-{max(gc_):.2f} under crc32c (0.5: the two take turns): "
             "xxHash releases the GIL on large buffers, crc32c never does.")
    L.append("- google-crc32c accepts only read-only buffers without a release hook: bytes and ctypes arrays, "
             "not bytearray, memoryview or numpy arrays. xxHash takes any C-contiguous buffer.")
    L.append("- 64 bits: a random corruption goes unnoticed with odds 2^-64 rather than 2^-32. xxh3_128 is as fast "
             "but twice the bits to carry for no need; xxh64 is about half the speed.\n")
    shipped_rows = [r for r in result["scatter_gather"] if r["variant"] == SHIPPED]
    chosen_cold = [r for r in result["large"] if r["candidate"] == v["chosen"] and r["memory"] == "cold"]
    L.append(f"### Checksum cost per GB (`{v['chosen']}`)\n")
    L.append("| object | ms per GB |\n|---|---:|")
    for r in chosen_cold:
        L.append(f"| one region of {fmt_size(r['size_bytes'])} (cold) | {r['p50_ms_per_gb']:.1f} |")
    for r in shipped_rows:
        L.append(f"| {r['num_regions']} x {fmt_size(r['region_bytes'])} via checksum_objects | {r['ms_per_gb']:.1f} |")
    L.append("")
    L.append("## One large region (one-shot hash)\n")
    L.append("| size | memory | candidate | P50 GB/s | P90 GB/s | ms per GB | time vs xxh3_64 (P50 of per-round ratios) |")
    L.append("|---|---|---|---:|---:|---:|---:|")
    for r in result["large"]:
        L.append(f"| {fmt_size(r['size_bytes'])} | {r['memory']} | {r['candidate']} | {r['p50_gbps']:.1f} | "
                 f"{r['p90_gbps']:.1f} | {r['p50_ms_per_gb']:.1f} | {r['time_vs_xxh3_64']:.2f} |")
    L.append("\n## Scatter-gather objects (streaming over regions)\n")
    L.append("Per object, including the Python cost of making each region's buffer (ctypes array type cached per size).\n")
    L.append("| regions x size | object | variant | P50 us/object | P90 us/object | ns/region | GB/s | time vs xxh3_64 |")
    L.append("|---|---:|---|---:|---:|---:|---:|---:|")
    for r in result["scatter_gather"]:
        L.append(f"| {r['num_regions']} x {fmt_size(r['region_bytes'])} | {fmt_size(r['object_bytes'])} | {r['variant']} | "
                 f"{r['p50_us_per_object']:.2f} | {r['p90_us_per_object']:.2f} | {r['ns_per_region']:.0f} | "
                 f"{r['gbps']:.1f} | {r['time_vs_xxh3_64']:.2f} |")
    L.append("\n### Where the time per region goes (xxh3_64)\n")
    L.append("`made beforehand`: the same loop over ctypes buffers built before timing, so the difference is the "
             "Python cost of making each region's buffer. `address-space slices`: buffers as slices of one "
             "memoryview over the whole address space instead of ctypes arrays (rejected).\n")
    L.append("| regions x size | xxh3_64 ns/region | buffers made beforehand | buffer-making cost | kvpool checksum_objects | address-space slices |")
    L.append("|---|---:|---:|---:|---:|---:|")
    sg = {(r["variant"], r["num_regions"], r["region_bytes"]): r for r in result["scatter_gather"]}
    for n in SG_REGIONS:
        for size in SG_REGION_BYTES:
            x, pre = sg[(BASELINE, n, size)]["ns_per_region"], sg[(PREBUILT, n, size)]["ns_per_region"]
            L.append(f"| {n} x {fmt_size(size)} | {x:.0f} | {pre:.0f} | {x - pre:.0f} | "
                     f"{sg[(SHIPPED, n, size)]['ns_per_region']:.0f} | {sg[(SPACE_SLICES, n, size)]['ns_per_region']:.0f} |")
    L.append("\n## (addr, size) -> buffer, per region (16 KiB regions, no hashing)\n")
    L.append("Each made through a lambda (one Python call, in every row alike) and dropped at once, as in a hash loop.\n")
    L.append("| maker | P50 ns/region |\n|---|---:|")
    for r in result["buffer_makers"]:
        L.append(f"| {r['maker']} | {r['p50_ns_per_region']:.0f} |")
    L.append("\n## GIL: a Python thread's speed while another thread hashes (1.0 = GIL released)\n")
    L.append("| buffer | crc32c | xxh3_64 |\n|---|---:|---:|")
    for size in GIL_SIZES:
        L.append(f"| {fmt_size(size)} | {gil[('crc32c', size)]:.2f} | {gil[('xxh3_64', size)]:.2f} |")
    L.append("\n## Method\n")
    cfg = result["config"]
    L.append(f"- {cfg['rounds']} rounds per case after one warm-up round; in each round every variant takes one sample, "
             "in an order rotated by one each round; P50/P90 over rounds; ratios are per round, then the P50.")
    L.append(f"- Cold memory: a {cfg['arena_bytes'] // MiB} MiB arena of random bytes (over the L3); each sample reads "
             "the next slice, so nothing it reads was touched within the last arena's worth of traffic. "
             "Large-region samples hash >= 32 MiB, scatter-gather samples a batch of objects totalling ~16 MiB.")
    L.append("- Scatter-gather layout as a vLLM paged KV cache: one slab per region index, object j = block j of every slab.")
    L.append("- One core, one thread (the GIL test excepted); the machine is shared, hence the load averages above.")
    path.write_text("\n".join(L) + "\n")


def write_png(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [c.name for c in CANDIDATES]
    colors = dict(zip(names + [SHIPPED], ["#d62728", "#1f77b4", "#17becf", "#9467bd", "#2ca02c"]))
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.2), gridspec_kw={"width_ratios": [1, 2.2, 1]})

    ax = axes[0]
    cases = [(s, "cold") for s in LARGE_SIZES] + [(1 * MiB, "hot")]
    by = {(r["candidate"], r["size_bytes"], r["memory"]): r["p50_gbps"] for r in result["large"]}
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        ax.bar([k + i * width for k in range(len(cases))], [by[(n, s, m)] for s, m in cases], width, label=n, color=colors[n])
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(cases))], [f"{fmt_size(s)}\n{m}" for s, m in cases])
    ax.set_ylabel("GB/s (P50)")
    ax.set_title("One region, one-shot hash")
    ax.legend(fontsize=8)

    ax = axes[1]
    variants = names + [SHIPPED]
    shapes = [(n, s) for n in SG_REGIONS for s in SG_REGION_BYTES]
    sg = {(r["variant"], r["num_regions"], r["region_bytes"]): r["p50_us_per_object"] for r in result["scatter_gather"]}
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        ax.bar([k + i * width for k in range(len(shapes))], [sg[(v, n, s)] for n, s in shapes], width, label=v, color=colors[v])
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(shapes))], [f"{n} x\n{fmt_size(s)}" for n, s in shapes], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("us per object (P50, log)")
    ax.set_title("Scatter-gather objects (regions x region size), cold memory")
    ax.legend(fontsize=8)

    ax = axes[2]
    makers = result["buffer_makers"]
    ax.barh([r["maker"] for r in makers], [r["p50_ns_per_region"] for r in makers], color="#7f7f7f")
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("ns per region (P50, log)")
    ax.set_title("(addr, size) -> buffer, 16 KiB")
    ax.tick_params(axis="y", labelsize=7)

    m = result["machine"]
    fig.suptitle(f"Checksums: chosen {result['verdict']['chosen']} | {m['cpu_model']}, {m['cores']} cores | "
                 f"xxhash {m['xxhash']}, google-crc32c {m['google_crc32c']} ({m['google_crc32c_implementation']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Writes benchmarks/results/checksum/DATE-MACHINE.{json,md,png} and LATEST.md. "
        "Run it on a quiet machine: the load average at start and end is recorded.",
    )
    parser.add_argument("--quick", action="store_true", help="fewer rounds and a 128 MiB arena (~15 s), for a smoke run")
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds per case (default 61, --quick 9)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output path without extension (default: the dated results files)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (9 if args.quick else 61)
    if rounds < 1:
        parser.error("--rounds must be >= 1")
    arena_bytes = (128 if args.quick else 256) * MiB

    started_at, load_start = time.time(), os.getloadavg()
    print(f"arena {arena_bytes // MiB} MiB, {rounds} rounds", flush=True)
    arena = np.random.default_rng(0).integers(0, 256, arena_bytes, dtype=np.uint8)
    check_streaming(arena)
    gc.disable()  # no collection pauses inside samples; nothing here makes reference cycles
    try:
        result: dict = {"machine": machine(), "started_at": started_at, "loadavg_start": load_start}
        result["config"] = {"quick": args.quick, "rounds": rounds, "arena_bytes": arena_bytes}
        for key, fn in (("large", bench_large), ("scatter_gather", bench_scatter_gather), ("buffer_makers", bench_buffer_makers)):
            t0 = time.perf_counter()
            result[key] = fn(arena, rounds)
            print(f"{key}: {time.perf_counter() - t0:.1f} s", flush=True)
        result["gil"] = bench_gil(arena, 5)
    finally:
        gc.enable()
    result["loadavg_end"] = os.getloadavg()
    result["duration_s"] = time.time() - started_at
    result["verdict"] = verdict(result)

    refresh = args.out is None
    if refresh:
        files = results_io.result_files("checksum")
        args.out = files.folder / files.stem
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    write_md(result, args.out.with_suffix(".md"))
    write_png(result, args.out.with_suffix(".png"))
    v = result["verdict"]
    print(f"chosen {v['chosen']} (measured faster: {v['faster_measured']}); cold 64 MiB GB/s {v['cold_64mib_gbps']}; "
          f"wrote {args.out.with_suffix('.md')} in {result['duration_s']:.0f} s")
    if refresh:
        results_io.refresh_latest("checksum")


if __name__ == "__main__":
    main()
