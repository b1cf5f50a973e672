"""The GPU path checked end to end in one go: vLLM-shaped CUDA KV caches in two processes, a real
master and node, saves from one process, loads into OTHER block ids of the other, every byte
verified, bandwidth against the machine's pinned host-to-device copy.

    python benchmarks/gpu_check.py --out DIR            # on a GPU machine (well inside 10 minutes)
    python benchmarks/gpu_check.py --device cpu --out DIR   # the same flow on CPU tensors (a dry run)

What it measures (results.json + results.md in DIR; without --out,
benchmarks/results/gpu_check/DATE-MACHINE.{json,md} and LATEST.md):
- save and load GB/s of 64-block objects (8B-class geometry: 32 layers, 8 KV heads x 128, bf16,
  16-token blocks, FlashAttention's [2, num_blocks, 16, 8, 128] layout: 4096 regions of 32 KiB per
  object), through the client and the connector's device code, against one plain pinned-host-to-
  device copy of the same bytes (the physical limit here);
- the time to load an 80K-token prefix (4992 blocks, ~10 GiB);
- the same-host copy methods side by side on the same regions: one cudaMemcpyBatchAsync, one
  cudaMemcpyAsync per region, a gather kernel reading the mapped host memory (SMs), and NIXL on the
  same host (if NIXL imports);
- whether a load overlaps a concurrent matmul stream: matmul TFLOP/s alone and during the load.

The GPU machine has no vLLM, NIXL, pyzmq or msgspec and no network: carry pyzmq and msgspec wheels
(and nixl + nixl-cu13 if they fit) in `.whl/`, see benchmarks/gpu_wheels.sh. Nothing here
imports vLLM: `kvpool.connector.device` is the connector's device code on its own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

GEOMETRIES = {  # layers, KV heads, head dim, block size, blocks per object, objects
    "8b": dict(layers=32, heads=8, head_dim=128, block=16, per_object=64, objects=78),  # 78 x 64 x 16 = 79,872 tokens
    "tiny": dict(layers=4, heads=2, head_dim=16, block=16, per_object=64, objects=6),
}


def make_kv(geom: dict, num_blocks: int, device: str, seed: int | None):
    """vLLM's FlashAttention-shaped caches, one tensor per layer; random bf16 bits from `seed`."""
    import torch

    caches = {}
    gen = torch.Generator(device=device)
    for layer in range(geom["layers"]):
        t = torch.zeros(2, num_blocks, geom["block"], geom["heads"], geom["head_dim"], dtype=torch.bfloat16,
                        device=device)  # fmt: skip
        if seed is not None:
            gen.manual_seed(seed * 1000 + layer)
            t.view(torch.int16).random_(-(1 << 15), 1 << 15, generator=gen)
        caches[f"model.layers.{layer}.self_attn.attn"] = t
    return caches


def object_blocks(geom: dict, reverse: bool) -> list[list[int]]:
    """Block ids of each object: 1.. in order for the writer, from the top down for the reader."""
    n = geom["per_object"] * geom["objects"]
    ids = list(range(1, n + 1))
    if reverse:
        ids = ids[::-1]
    return [ids[i : i + geom["per_object"]] for i in range(0, n, geom["per_object"])]


def regions(layout, blocks: list[int]) -> tuple[list[int], list[int]]:
    addrs = [a for b in blocks for a in layout.block_addrs(b)]
    return addrs, [layout.region_bytes] * len(addrs)


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


# ---- the two processes ------------------------------------------------------------------------


def run_writer(args) -> dict:
    from kvpool.client import Client
    from kvpool.connector import device as kvdev

    geom = GEOMETRIES[args.geometry]
    num_blocks = geom["per_object"] * geom["objects"] + 1
    caches = make_kv(geom, num_blocks, args.device, seed=1)
    sync(args.device)
    layout = kvdev.describe_kv_caches(caches, num_blocks)
    out = {"object_bytes": layout.block_bytes * geom["per_object"], "regions_per_object":
           layout.regions_per_block * geom["per_object"], "put_s": []}  # fmt: skip
    with Client(args.master, "gpu-check", timeout_s=60) as client:
        kvdev.register_kv_memory(client, caches)
        for j, blocks in enumerate(object_blocks(geom, reverse=False)):
            addrs, sizes = regions(layout, blocks)
            fence = kvdev.kv_writes_fence(kvdev.kv_device(caches))  # as the connector's save does
            started = time.perf_counter()
            fence.wait()
            statuses = client.put_from([f"obj{j}"], [addrs], [sizes], [f"obj{j - 1}" if j else None])
            out["put_s"].append(time.perf_counter() - started)
            if statuses != [0]:
                raise SystemExit(f"put of object {j} answered {statuses}")
    return out


def run_reader(args) -> dict:
    import torch

    from kvpool.client import Client
    from kvpool.connector import device as kvdev

    geom = GEOMETRIES[args.geometry]
    num_blocks = geom["per_object"] * geom["objects"] + 1
    expected = make_kv(geom, num_blocks, args.device, seed=1)  # what the writer held
    got = make_kv(geom, num_blocks, args.device, seed=None)
    layout = kvdev.describe_kv_caches(got, num_blocks)
    keys = [f"obj{j}" for j in range(geom["objects"])]
    src_blocks, dst_blocks = object_blocks(geom, reverse=False), object_blocks(geom, reverse=True)
    out: dict = {}
    with Client(args.master, "gpu-check", timeout_s=60, path=args.path) as client:
        kvdev.register_kv_memory(client, got)
        addrs, sizes = zip(*(regions(layout, b) for b in dst_blocks))
        client.get_into(keys[:1], [addrs[0]], [sizes[0]])  # first touch: routes, page-locking
        per_object = []
        for j in range(len(keys)):
            started = time.perf_counter()
            n = client.get_into([keys[j]], [addrs[j]], [sizes[j]])
            per_object.append(time.perf_counter() - started)
            if n != 1:
                raise SystemExit(f"object {j} was not loaded")
        out["get_s"] = per_object
        for t in got.values():
            t.zero_()
        sync(args.device)
        overlap = MatmulLoad(args.device) if args.device == "cuda" else None
        if overlap is not None:
            overlap.start()
        started = time.perf_counter()
        n = client.get_into(keys, list(addrs), list(sizes))  # the whole 80K-token prefix at once
        out["prefix_load_s"] = time.perf_counter() - started
        if overlap is not None:
            out["matmul"] = overlap.stop()
        out["prefix_objects_loaded"] = n
    sync(args.device)
    bad = 0
    for name in got:
        for src, dst in zip(src_blocks, dst_blocks):
            # bitwise (random bits make NaNs, and NaN != NaN)
            bad += int(not torch.equal(expected[name].view(torch.int16)[:, src], got[name].view(torch.int16)[:, dst]))
    out["objects_x_layers_wrong"] = bad
    out["bytes_verified"] = layout.block_bytes * sum(len(b) for b in dst_blocks)
    if args.device == "cuda":
        out["methods"] = copy_methods(layout, got, dst_blocks[0])
    return out


class MatmulLoad:
    """bf16 matmuls on their own stream in a thread: TFLOP/s alone first, then while loading."""

    def __init__(self, device: str, n: int = 8192) -> None:
        import threading

        import torch

        self.torch, self.n = torch, n
        self.a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        self.stream = torch.cuda.Stream()
        self.alone = self._rate(20)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._done = 0
        self._t = 0.0

    def _rate(self, count: int) -> float:
        torch = self.torch
        with torch.cuda.stream(self.stream):
            torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(count):
                self.a @ self.a
            self.stream.synchronize()
        return 2 * self.n**3 * count / (time.perf_counter() - started) / 1e12

    def _loop(self) -> None:
        started = time.perf_counter()
        while not self._stop.is_set():
            with self.torch.cuda.stream(self.stream):
                for _ in range(4):
                    self.a @ self.a
                self.stream.synchronize()
            self._done += 4
        self._t = time.perf_counter() - started

    def start(self) -> None:
        self._thread.start()
        time.sleep(0.05)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        during = 2 * self.n**3 * self._done / self._t / 1e12 if self._t else 0.0
        return {"tflops_alone": round(self.alone, 1), "tflops_during_load": round(during, 1),
                "slowdown": round(1 - during / self.alone, 3) if self.alone else None}  # fmt: skip


def copy_methods(layout, got: dict, blocks: list[int]) -> dict:
    """One object's regions from a pinned host buffer into GPU blocks, by each same-host method,
    and one plain pinned->device copy of the same bytes (the limit)."""
    import torch

    from kvpool.transfer import cuda_copy

    dst, sizes = regions(layout, blocks)
    total = sum(sizes)
    host = torch.empty(total, dtype=torch.uint8).pin_memory()
    srcs = [host.data_ptr() + i * layout.region_bytes for i in range(len(dst))]
    dev = torch.empty(total, dtype=torch.uint8, device="cuda")
    cuda = cuda_copy.runtime()
    device = torch.cuda.current_device()

    def best(fn, reps: int = 10) -> float:
        fn()
        times = []
        for _ in range(reps):
            torch.cuda.synchronize()
            started = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        return total / sorted(times)[len(times) // 2] / 1e9

    out = {"pinned_h2d_one_copy_gbps": best(lambda: dev.copy_(host, non_blocking=True)),
           "regions": len(dst), "region_bytes": layout.region_bytes, "cuda_runtime": cuda.version}  # fmt: skip
    out["memcpy_per_region_gbps"] = best(lambda: cuda.copy(device, dst, srcs, sizes, batched=False))
    if cuda.batched:
        out["memcpy_batch_gbps"] = best(lambda: cuda.copy(device, dst, srcs, sizes, batched=True))
    # gather kernel: the GPU reads the pinned host memory itself (UVA), one indexed copy per layer part
    region = layout.region_bytes
    host_on_gpu = torch.as_tensor(_Uva(host.data_ptr(), total), device="cuda").view(-1, region)
    parts = [p for layer in layout.parts for p in layer]
    ids = torch.tensor(blocks, device="cuda")
    views = [torch.as_tensor(_Uva(base, stride * layout.num_blocks), device="cuda").view(layout.num_blocks, -1)[:, :region]
             for base, stride in parts]  # fmt: skip
    rows = torch.arange(len(dst), device="cuda").view(len(blocks), len(parts))

    def gather() -> None:
        for k, view in enumerate(views):
            view[ids] = host_on_gpu[rows[:, k]]

    out["gather_kernel_gbps"] = best(gather)
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}


class _Uva:
    """A raw pointer as a CUDA array (pinned host memory is device-addressable under UVA)."""

    def __init__(self, ptr: int, size: int) -> None:
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False), "version": 3}


# ---- the orchestrator --------------------------------------------------------------------------


def child(role: str, args, master: str, path: str = "auto") -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result = Path(f.name)
    argv = [sys.executable, __file__, "--role", role, "--master", master, "--device", args.device,
            "--geometry", args.geometry, "--path", path, "--result", str(result)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(argv, env=env, timeout=args.timeout_s, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": f"{role} exited {proc.returncode}: {proc.stderr[-3000:]}"}
    return json.loads(result.read_text())


def summarize(geom: dict, w: dict, reads: dict) -> dict:
    def gbps(nbytes: int, times: list[float]) -> dict:
        steady = sorted(times[1:] or times)
        return {"p50_gbps": round(nbytes / steady[len(steady) // 2] / 1e9, 2),
                "worst_gbps": round(nbytes / steady[-1] / 1e9, 2), "first_s": round(times[0], 3)}  # fmt: skip

    size = w["object_bytes"]
    out = {"geometry": geom, "object_bytes": size, "regions_per_object": w["regions_per_object"],
           "save": gbps(size, w["put_s"])}  # fmt: skip
    for path, r in reads.items():
        if "error" in r:
            out[f"load_{path}"] = r
            continue
        out[f"load_{path}"] = {**gbps(size, r["get_s"]), "prefix_tokens": geom["block"] * geom["per_object"] * geom["objects"],
                               "prefix_load_s": round(r["prefix_load_s"], 3),
                               "prefix_gbps": round(size * geom["objects"] / r["prefix_load_s"] / 1e9, 2),
                               "objects_x_layers_wrong": r["objects_x_layers_wrong"],
                               "bytes_verified": r["bytes_verified"], **({"matmul": r["matmul"]} if "matmul" in r else {}),
                               **({"methods": r["methods"]} if "methods" in r else {})}  # fmt: skip
    limit = next((r.get("methods", {}).get("pinned_h2d_one_copy_gbps") for r in reads.values() if "methods" in r), None)
    if limit:
        out["pinned_limit_gbps"] = limit
        out["save_fraction_of_limit"] = round(out["save"]["p50_gbps"] / limit, 3)
        if "p50_gbps" in out.get("load_auto", {}):
            out["load_fraction_of_limit"] = round(out["load_auto"]["p50_gbps"] / limit, 3)
    return out


def markdown(summary: dict, machine: str) -> str:
    lines = [f"# gpu_check on {machine}", "", "```json", json.dumps(summary, indent=2), "```", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default=None,
                        help="KV geometry (default: 8b on a GPU, tiny on CPU)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for results.{json,md} (default: benchmarks/results/gpu_check/DATE-MACHINE.*)")
    parser.add_argument("--timeout-s", type=float, default=240.0, help="per child process")
    parser.add_argument("--role", choices=["writer", "reader"], help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parser.add_argument("--path", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.geometry = args.geometry or ("8b" if args.device == "cuda" else "tiny")
    if args.role:
        result = run_writer(args) if args.role == "writer" else run_reader(args)
        Path(args.result).write_text(json.dumps(result))
        return 0

    from kvpool.bench import procs

    geom = GEOMETRIES[args.geometry]
    object_bytes = 2 * geom["layers"] * geom["block"] * geom["heads"] * geom["head_dim"] * 2 * geom["per_object"]
    node_memory = f"{(object_bytes * geom['objects'] * 5 // 4 >> 20) + 64}MiB"  # room for all, and a margin
    workdir = Path(tempfile.mkdtemp(prefix="kvpool-gpu-check-"))
    started = time.time()
    try:
        master = procs.start_master(workdir)
        procs.start_node(workdir, master.info["address"], node_memory, timeout_s=120)
        print(f"master and a {node_memory} node up in {time.time() - started:.1f} s", flush=True)
        w = child("writer", args, master.info["address"])
        if "error" in w:
            print(w["error"])
            return 1
        print(f"writer done at {time.time() - started:.1f} s", flush=True)
        reads = {"auto": child("reader", args, master.info["address"])}
        print(f"reader (same-host path) done at {time.time() - started:.1f} s", flush=True)
        try:
            import kvpool.transfer.nixlio  # noqa: F401  NIXL present: same host through NIXL too

            reads["nixl"] = child("reader", args, master.info["address"], path="nixl")
        except ImportError as e:
            reads["nixl"] = {"error": f"NIXL not importable here: {e}"}
    finally:
        procs.stop_all()
    summary = summarize(geom, w, reads)
    summary["device"] = args.device
    if args.device == "cuda":
        import torch

        summary["gpu"] = torch.cuda.get_device_name()
    summary["wall_s"] = round(time.time() - started, 1)
    if args.out is not None:
        json_path, md_path = args.out / "results.json", args.out / "results.md"
    else:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import results_io

        files = results_io.result_files("gpu_check", None if args.device == "cuda" else "dry-run")
        json_path, md_path = files.json, files.md
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(summary, indent=2))
    md_path.write_text(markdown(summary, summary.get("gpu", "CPU (dry run)")))
    if args.out is None:
        results_io.refresh_latest("gpu_check")
    print(json.dumps(summary, indent=2))
    wrong = sum(r.get("objects_x_layers_wrong", 0) for r in reads.values())
    return 1 if wrong or any("error" in r for k, r in reads.items() if k == "auto") else 0


if __name__ == "__main__":
    sys.exit(main())
