"""Time to first token with KVPoolConnector: recompute vs vLLM's local prefix-cache hit vs pool hit.

Each vLLM runs in a fresh process (in-process engine, VLLM_ENABLE_V1_MULTIPROCESSING=0), with the
tiny seeded Llama (bf16) from kvpool.bench.tiny_model, against a real `kvpool master` + `kvpool
node` on this machine:
- vanilla (no connector): each prompt computed (recompute), then sent again (local hit);
- writer (connector): the same, and its saves fill the pool;
- reader_async (connector, fresh process, empty local cache): each prompt loaded from the pool (pool
  hit), reported to vLLM as an asynchronous load (`load_async: true`);
- reader_sync: the same with `load_async: false` (the load runs in the step, before the forward; the
  connector's default on the CPU build);
- reader_sync_nochecksums: reader_sync with `checksums: false` (loads not verified), run in pairs with
  reader_sync, interleaved (A B A B, --checksum-pairs), to measure what verifying costs a pool hit.
TTFT = wall time of `generate(max_tokens=1)` for one prompt. Every process first serves a warm-up
prompt of each length (excluded). Prompts are random token ids, different in every repetition.
Writes benchmarks/results/connector_ttft/DATE-MACHINE.{json,md,png} and LATEST.md.

With `--model gemma3 | nemotron_h | qwen3_next` (kvpool.bench.tiny_hybrid, bf16) vLLM keeps its
hybrid KV cache manager on: the readers load asynchronously (how vLLM takes a failed load of a
hybrid model), and the writers' pool bytes per token are reported by KV-cache group kind, beside
a full-attention twin of the same width where the model has one. Writes
benchmarks/results/connector_ttft_hybrid/DATE-MACHINE-MODEL.{json,md,png} and LATEST.md.

    benchmarks/run.py connector_ttft [--lengths 2048 8192] [--reps 5]
    benchmarks/run.py connector_ttft_hybrid --model gemma3 [--lengths 2048 8192] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BLOCK_SIZE = 128  # vLLM's CPU default
# hybrid models from kvpool.bench.tiny_hybrid: name -> (writer, its full-attention twin's writer or
# None, vLLM settings the model needs on the CPU build: Mamba-2 prefills in chunks of one block)
HYBRID_MODELS = {
    "gemma3": ("write_tiny_gemma3", "write_tiny_gemma3_full", {}),
    "nemotron_h": ("write_tiny_nemotron_h", None, {"max_num_batched_tokens": BLOCK_SIZE}),
    "qwen3_next": ("write_tiny_qwen3_next", None, {}),
}


def child(spec_path: str, out_path: str) -> None:
    """One fresh vLLM process: run the phases of `spec`, write TTFTs."""
    from vllm import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    kv_transfer_config = None
    if spec["master"]:
        kv_transfer_config = {
            "kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"master_address": spec["master"], **spec.get("extra_config", {})},
        }  # fmt: skip
    max_len = max(spec["lengths"])
    llm = LLM(
        model=spec["model_dir"], skip_tokenizer_init=True, load_format="safetensors", block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=spec["kv_cache_bytes"], max_model_len=max_len + BLOCK_SIZE,
        max_num_batched_tokens=spec.get("max_num_batched_tokens", max_len + BLOCK_SIZE), enable_prefix_caching=True, seed=0,
        disable_log_stats=False,  # the pool byte counters (vllm:kvpool_saved_*_bytes)
        kv_transfer_config=kv_transfer_config,
    )  # fmt: skip
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def ttft(prompt: list[int]) -> tuple[float, int]:
        started = time.perf_counter()
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return time.perf_counter() - started, out.num_cached_tokens

    def drain() -> None:  # the writer's background saves land before the reader starts
        if spec["master"]:
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            get_kv_transfer_group()._worker.drain(60.0)
            for _ in range(3):
                llm.llm_engine.step()

    def pool_bytes() -> dict[str, float]:
        out: dict[str, float] = {}
        for metric in llm.get_metrics():
            if metric.name.startswith("vllm:kvpool_saved") and hasattr(metric, "value"):
                out[metric.name.removeprefix("vllm:kvpool_")] = out.get(metric.name, 0) + float(metric.value)
        return out

    for length in spec["lengths"]:  # warm-up: compile, first allocations, first pool round trips
        warm = [random.Random(-length).randrange(10, 7990) for _ in range(length)]
        ttft(warm)
        ttft(warm)
    drain()
    results: dict[str, list] = {}
    before = pool_bytes()
    for phase in spec["phases"]:
        for length in spec["lengths"]:
            for rep in range(spec["reps"]):
                prompt = make_prompt(length, rep)
                seconds, cached = ttft(prompt)
                results.setdefault(f"{phase}/{length}", []).append([seconds, cached])
        drain()
    after = pool_bytes()
    # what the measured prompts cost the pool (warm-up excluded), per token of their whole blocks
    tokens = spec["reps"] * sum(n // BLOCK_SIZE * BLOCK_SIZE for n in spec["lengths"])
    if spec["master"] and "recompute" in spec["phases"]:  # only a first pass over the prompts saves
        results["pool_bytes_per_token"] = {k: (after[k] - before.get(k, 0)) / tokens for k in after}
    Path(out_path).write_text(json.dumps(results))


def make_prompt(length: int, rep: int) -> list[int]:
    rng = random.Random(length * 1000 + rep)
    return [rng.randrange(10, 7990) for _ in range(length)]


def run_child(name: str, spec: dict, workdir: Path) -> dict:
    spec_path, out_path = workdir / f"{name}.spec.json", workdir / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "TMPDIR": str(workdir), "VLLM_RPC_BASE_PATH": str(workdir), "VLLM_CACHE_ROOT": str(workdir / "cache"),
           "VLLM_CPU_OMP_THREADS_BIND": "0"}  # fmt: skip
    if spec.get("src"):  # another checkout's kvpool (--baseline-src): its connector, same bench
        env["PYTHONPATH"] = os.pathsep.join([spec["src"], env.get("PYTHONPATH", "")])
    # One OpenMP thread on core 0 for every case: with other work on this 2-core machine, a
    # 2-thread team stalls at every barrier whenever one thread is descheduled (10x swings).
    done = subprocess.run([sys.executable, __file__, "--child", str(spec_path), str(out_path)],
                          env=env, capture_output=True, text=True)  # fmt: skip
    (workdir / f"{name}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{(done.stdout + done.stderr)[-4000:]}")
    return json.loads(out_path.read_text())


def summary(samples: list[list[float]]) -> dict:
    xs = sorted(s for s, _ in samples)
    return {"p50_s": statistics.median(xs), "min_s": xs[0], "max_s": xs[-1], "n": len(xs),
            "cached_tokens": sorted({c for _, c in samples})}  # fmt: skip


def machine() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), "?")
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    mem_kib = int(next(ln.split()[1] for ln in meminfo if ln.startswith("MemTotal")))
    return {"cpu": model, "cpus": os.cpu_count(), "memory_gib": round(mem_kib / 2**20, 1),
            "python": platform.python_version(), "load_avg_1m_start": os.getloadavg()[0]}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192], help="prompt lengths in tokens")
    parser.add_argument("--reps", type=int, default=7, help="prompts per length and case (default 7)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output path without extension (default: benchmarks/results/connector_ttft/DATE-MACHINE, "
                             "or connector_ttft_hybrid/DATE-MACHINE-MODEL for a hybrid model)")
    parser.add_argument("--checksum-pairs", type=int, default=2,
                        help="interleaved reader_sync runs with and without checksum verification (default 2)")
    parser.add_argument("--baseline-src", type=Path, default=None,
                        help="another checkout's src/ (e.g. `git worktree add /tmp/base REV`): its connector runs "
                             "reader_sync interleaved with this tree's, to show a change does not regress a pool hit")
    parser.add_argument("--model", choices=["llama", *HYBRID_MODELS], default="llama",
                        help="llama: the tiny full-attention Llama; a hybrid model (kvpool.bench.tiny_hybrid) also "
                             "runs its full-attention twin as a writer, to compare pool bytes per token")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import results_io

    bench_name = "connector_ttft" if args.model == "llama" else "connector_ttft_hybrid"
    refresh = args.out is None
    if refresh:
        args.out = results_io.result_files(bench_name, None if args.model == "llama" else args.model).prefix

    from rich.progress import Progress

    from kvpool.bench import procs
    from kvpool.bench.tiny_model import write_tiny_llama

    info = machine()
    scratch = Path(__file__).parents[1] / "scratch"  # ignored by git; a fresh clone has none yet
    scratch.mkdir(exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="connector-ttft-", dir=scratch))
    twin, hybrid, settings = None, args.model != "llama", {}
    if not hybrid:
        model = write_tiny_llama(workdir / "model")
        model_name = "tiny Llama (kvpool.bench.tiny_model), bf16"
    else:
        from kvpool.bench import tiny_hybrid

        make, make_twin, settings = HYBRID_MODELS[args.model]
        config = tiny_hybrid.TinyHybridConfig(dtype="bfloat16")
        model = getattr(tiny_hybrid, make)(workdir / "model", config)
        if make_twin is not None:
            twin = getattr(tiny_hybrid, make_twin)(workdir / "twin", config)
        model_name = (f"tiny {args.model} (kvpool.bench.tiny_hybrid), bf16, vLLM's hybrid KV cache manager on"
                      + "".join(f", {k}={v}" for k, v in settings.items()))
    kv_bytes_per_token = 4 * 2 * 2 * 64 * 2  # layers * (K,V) * kv heads * head dim * bf16 (the tiny models' width)
    total_tokens = sum(args.lengths) * (args.reps + 1)
    kv_cache_bytes = 2 * total_tokens * kv_bytes_per_token + (64 << 20)
    master = procs.start_master(workdir)
    node = procs.start_node(workdir, master.info["address"], f"{(total_tokens * kv_bytes_per_token >> 20) + 64}MiB")
    base = {"model_dir": str(model), "lengths": args.lengths, "reps": args.reps, "kv_cache_bytes": kv_cache_bytes,
            **settings}
    runs = [
        ("vanilla", {**base, "master": None, "phases": ["recompute", "local_hit"]}),
        ("writer", {**base, "master": master.info["address"], "phases": ["recompute", "local_hit"]}),
        ("reader_async", {**base, "master": master.info["address"], "phases": ["pool_hit"],
                          "extra_config": {"load_async": True}}),
    ]
    if twin is not None:  # same width, every layer full attention: what the pool would hold without HMA
        runs.append(("writer_full_attention_twin", {**base, "model_dir": str(twin), "master": master.info["address"],
                                                    "phases": ["recompute"]}))
    sync = {**base, "master": master.info["address"], "phases": ["pool_hit"]}
    for k in range(0 if hybrid else max(1, args.checksum_pairs)):  # hybrid models load asynchronously only  # interleaved: with, without, with, without
        suffix = "" if k == 0 else f"_{k}"
        runs.append((f"reader_sync{suffix}", {**sync, "extra_config": {"load_async": False, "checksums": True}}))
        if args.checksum_pairs > 0:
            runs.append((f"reader_sync_nochecksums{suffix}",
                         {**sync, "extra_config": {"load_async": False, "checksums": False}}))
        if args.baseline_src:
            runs.append((f"reader_sync_baseline{suffix}", {**sync, "src": str(args.baseline_src.resolve()),
                                                            "extra_config": {"load_async": False, "checksums": True}}))
    raw: dict[str, dict] = {}
    try:
        with Progress() as progress:
            task = progress.add_task("fresh vLLM processes", total=len(runs))
            for name, spec in runs:
                raw[name] = run_child(name, spec, workdir)
                progress.advance(task)
    finally:
        node.stop()
        master.stop()
    info["load_avg_1m_end"] = os.getloadavg()[0]
    merged = dict(raw)
    for base_name in ("reader_sync", "reader_sync_nochecksums", "reader_sync_baseline"):  # pairs pooled per case
        runs_of = [n for n in raw if n == base_name or (n.startswith(base_name + "_") and n[len(base_name) + 1:].isdigit())]
        merged[base_name] = {key: [s for n in runs_of for s in raw[n].get(key, [])] for key in raw[runs_of[0]]} if runs_of else {}
    cases = [("vanilla", "recompute"), ("vanilla", "local_hit"), ("writer", "recompute"), ("writer", "local_hit"),
             ("reader_async", "pool_hit")]
    if merged.get("reader_sync"):
        cases.append(("reader_sync", "pool_hit"))
    if merged.get("reader_sync_nochecksums"):
        cases.append(("reader_sync_nochecksums", "pool_hit"))
    if merged.get("reader_sync_baseline"):
        cases.append(("reader_sync_baseline", "pool_hit"))
    table = {
        f"{case} ({run})": {str(length): summary(merged[run][f"{case}/{length}"]) for length in args.lengths}
        for run, case in cases
    }  # fmt: skip
    if args.baseline_src:
        info["baseline"] = _describe_checkout(args.baseline_src)
    info["this_tree"] = _describe_checkout(Path(__file__).parents[1] / "src")
    result = {"machine": info, "block_size": BLOCK_SIZE, "model": model_name,
              "reps": args.reps, "ttft": table, "raw": raw, "date": time.strftime("%Y-%m-%d %H:%M")}  # fmt: skip
    if hybrid:
        result["pool_bytes_per_token"] = {run: raw[run].get("pool_bytes_per_token", {})
                                          for run in ("writer", "writer_full_attention_twin") if run in raw}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(result, indent=1))
    write_markdown(result, args.lengths, Path(f"{args.out}.md"))
    plot(result, args.lengths, Path(f"{args.out}.png"))
    print(Path(f"{args.out}.md").read_text())
    if refresh:
        results_io.refresh_latest(bench_name)
    return 0


def _describe_checkout(src: Path) -> str:
    done = subprocess.run(["git", "-C", str(src), "log", "-1", "--format=%h %s"], capture_output=True, text=True)
    return done.stdout.strip()[:80] or str(src)


def write_markdown(result: dict, lengths: list[int], path: Path) -> None:
    m, t = result["machine"], result["ttft"]
    lines = [
        "# Connector TTFT: recompute vs local prefix-cache hit vs pool hit", "",
        f"Generated by `benchmarks/connector_ttft_bench.py` on {result['date']}: {m['cpu']}, {m['cpus']} CPUs, "
        f"{m['memory_gib']} GiB, Python {m['python']}, vllm-cpu 0.32, {result['model']}, block size "
        f"{result['block_size']}. 1-minute load average {m['load_avg_1m_start']:.1f} at the start, "
        f"{m['load_avg_1m_end']:.1f} at the end: other work shared the CPUs, so figures are noisy (the minimum is "
        "the least disturbed estimate). vLLM runs one OpenMP thread pinned to core 0 in every case.", "",
        "Each case runs in a fresh process (in-process engine) after a warm-up prompt per length; TTFT is the "
        f"wall time of `generate(max_tokens=1)`, median (min-max) of {result['reps']} different prompts. Pool: one "
        "`kvpool master` + one `kvpool node` on the same machine (same-host shared-memory path).", "",
        "| case | " + " | ".join(f"{n} tokens" for n in lengths) + " |",
        "|---|" + "---|" * len(lengths),
    ]  # fmt: skip
    for case, by_len in t.items():
        cells = [f"{1000 * by_len[str(n)]['p50_s']:.1f} ms ({1000 * by_len[str(n)]['min_s']:.1f}-"
                 f"{1000 * by_len[str(n)]['max_s']:.1f}), cached {by_len[str(n)]['cached_tokens']}" for n in lengths]
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    if "pool_hit (reader_sync_nochecksums)" in t:
        lines += ["", "Checksum verification (reader_sync with / without, interleaved runs pooled):", ""]
        for n in lengths:
            on, off = t["pool_hit (reader_sync)"][str(n)], t["pool_hit (reader_sync_nochecksums)"][str(n)]
            lines.append(f"- {n} tokens: {1000 * (on['p50_s'] - off['p50_s']):+.1f} ms median "
                         f"({100 * (on['p50_s'] / off['p50_s'] - 1):+.1f} %), {100 * (on['min_s'] / off['min_s'] - 1):+.1f} % "
                         "min (goal: <= 5 % of a pool hit's TTFT, else off by default)")
    if "pool_hit (reader_sync_baseline)" in t:
        lines += ["", f"This tree ({m['this_tree']}) against the baseline ({m['baseline']}), reader_sync, "
                  "interleaved runs pooled:", ""]  # fmt: skip
        for n in lengths:
            new, old = t["pool_hit (reader_sync)"][str(n)], t["pool_hit (reader_sync_baseline)"][str(n)]
            lines.append(f"- {n} tokens: {1000 * (new['p50_s'] - old['p50_s']):+.1f} ms median "
                         f"({100 * (new['p50_s'] / old['p50_s'] - 1):+.1f} %), {100 * (new['min_s'] / old['min_s'] - 1):+.1f} % min")
    lines += ["", "Ratios (medians):", ""]
    for n in lengths:
        local, recompute = t["local_hit (vanilla)"][str(n)]["p50_s"], t["recompute (vanilla)"][str(n)]["p50_s"]
        local_min, recompute_min = t["local_hit (vanilla)"][str(n)]["min_s"], t["recompute (vanilla)"][str(n)]["min_s"]
        for reader in ("reader_async", "reader_sync"):
            if f"pool_hit ({reader})" not in t:
                continue
            pool, pool_min = (t[f"pool_hit ({reader})"][str(n)][k] for k in ("p50_s", "min_s"))
            lines.append(
                f"- {n} tokens, {reader}: pool hit / local hit = {pool / local:.2f}x median, "
                f"{pool_min / local_min:.2f}x min (goal <= 2x); recompute / pool hit = {recompute / pool:.1f}x median, "
                f"{recompute_min / pool_min:.1f}x min (goal >= 20x at 8K)"
            )
    if "pool_bytes_per_token" in result:
        hybrid, twin = (result["pool_bytes_per_token"].get(r, {}) for r in ("writer", "writer_full_attention_twin"))
        lines += ["", "Pool bytes per token of the measured prompts (whole blocks), by KV-cache group kind:", "",
                  "| writer | full attention | sliding window | state | all |", "|---|---|---|---|---|"]
        writers = [("this model, hybrid manager on", hybrid)] + ([("its full-attention twin (same width)", twin)]
                                                                 if twin else [])
        for name, b in writers:
            cells = [f"{b.get(k, 0):.0f}" for k in ("saved_full_bytes", "saved_window_bytes", "saved_state_bytes")]
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {b.get('saved_bytes', 0):.0f} |")
        if hybrid.get("saved_bytes") and twin.get("saved_bytes"):
            lines += ["", f"The twin stores {twin['saved_bytes'] / hybrid['saved_bytes']:.2f}x the bytes per token."]
    path.write_text("\n".join(lines) + "\n")


def plot(result: dict, lengths: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [c for c in ("recompute (vanilla)", "local_hit (vanilla)", "pool_hit (reader_async)", "pool_hit (reader_sync)")
             if c in result["ttft"]]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.2
    for i, case in enumerate(cases):
        stats = [result["ttft"][case][str(n)] for n in lengths]
        p50 = [1000 * s["p50_s"] for s in stats]
        err = [[1000 * (s["p50_s"] - s["min_s"]) for s in stats], [1000 * (s["max_s"] - s["p50_s"]) for s in stats]]
        ax.bar([x + (i - 1.5) * width for x in range(len(lengths))], p50, width, yerr=err, capsize=3, label=case)
    ax.set_xticks(range(len(lengths)), [f"{n} tokens" for n in lengths])
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (ms, log scale)")
    ax.set_title("TTFT: recompute vs local prefix cache vs kvpool hit (fresh process)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
