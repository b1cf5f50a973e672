"""py-spy profiles of the vLLM servers during a run (`run.py --profile`): where a request's time goes.

Each server (its API process and, through --subprocesses, its engine core) is sampled for the whole
replay into OUT/profiles/r<round>-<config>-<server>.txt (py-spy's collapsed stacks: one line per
distinct stack, `frame;frame;... count`). `summarize` turns one into the share of samples under
each function of interest (a function counts once per sample however deep it recurs), which is
what results.md quotes. Profiled runs are for finding time, not for the comparison: sampling costs
the machine a few percent, so they go to their own --out-dir.
"""

from __future__ import annotations

import gzip
import shutil
import signal
import subprocess
import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

RATE_HZ = 49  # off the engine's own periods


def py_spy() -> str | None:
    here = Path(sys.executable).with_name("py-spy")
    return str(here) if here.exists() else shutil.which("py-spy")


@contextmanager
def profiled(pids: dict[str, int], out_stem: Path):
    """Sample each named process (and its children) until the block ends; yields the output paths."""
    exe = py_spy()
    if exe is None:
        raise RuntimeError("py-spy is not installed (pip install py-spy)")
    out_stem.parent.mkdir(parents=True, exist_ok=True)
    samplers, paths = [], []
    for name, pid in pids.items():
        path = out_stem.with_name(f"{out_stem.name}-{name}.txt")
        argv = [exe, "record", "--pid", str(pid), "--subprocesses", "--nonblocking", "--rate", str(RATE_HZ),
                "--format", "raw", "--output", str(path)]  # fmt: skip
        samplers.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        paths.append(path)
    try:
        yield paths
    finally:
        for sampler in samplers:
            sampler.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        for sampler in samplers:
            try:
                sampler.wait(timeout=60)
            except subprocess.TimeoutExpired:
                sampler.kill()


def read_collapsed(path: Path) -> list[tuple[list[str], int]]:
    """py-spy's raw output, or it gzipped (.gz: how the committed profiles are kept)."""
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    stacks = []
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks.append((stack.split(";"), int(count)))
    return stacks


def summarize(stacks: list[tuple[list[str], int]], patterns: dict[str, tuple[str, ...]]) -> dict[str, float]:
    """Share of all samples whose stack has a frame matching any of each label's substrings."""
    total = sum(count for _, count in stacks) or 1
    hits: Counter = Counter()
    for frames, count in stacks:
        for label, needles in patterns.items():
            if any(n in frame for frame in frames for n in needles):
                hits[label] += count
    return {label: hits[label] / total for label in patterns}


# where a vLLM-CPU server's samples go; a sample counts under every label whose frame it holds
PATTERNS = {
    "kvpool connector, all": ("kvpool/connector/",),
    "  scheduler side (lookups, plans)": ("kvpool/connector/scheduler.py", "kvpool/connector/lookups.py"),
    "  worker: load (start_load_kv)": ("start_load_kv (kvpool",),
    "  worker: save (wait_for_save, save_kv_layer)": ("wait_for_save (kvpool", "save_kv_layer (kvpool"),
    "kvpool client + data plane": ("kvpool/client/", "kvpool/transfer/", "kvpool/rpc/"),
    "MooncakeStoreConnector, all": ("kv_connector/v1/mooncake/store/",),
    "  scheduler side (lookups)": ("mooncake/store/scheduler.py",),
    "  worker: transfer threads (loads and saves)": ("run (vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/worker.py",),
    "  worker: lookup server": ("process_request (vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/worker.py",),
    "  worker: step hooks (start_load_kv, wait_for_save, save_kv_layer)": (
        "start_load_kv (vllm/distributed/kv_transfer/kv_connector/v1/mooncake", "wait_for_save (vllm/distributed/kv_transfer/kv_connector/v1/mooncake",
        "save_kv_layer (vllm/distributed/kv_transfer/kv_connector/v1/mooncake"),
    "model forward": ("forward (vllm/model_executor/models/",),
    "  attention": ("vllm/v1/attention/", "vllm/attention/"),
    "vLLM scheduler": ("vllm/v1/core/sched/",),
    "engine core busy loop / step": ("step (vllm/v1/engine/core.py", "step_with_batch_queue (vllm/v1/engine/core.py"),
    "waiting (poll, select, queue get)": ("poll (", "select (", "_recv (", "wait (threading.py", "get (queue.py"),
}


def leaf_table(stacks: list[tuple[list[str], int]], top: int = 15) -> list[tuple[str, float]]:
    total = sum(count for _, count in stacks) or 1
    leaves: Counter = Counter()
    for frames, count in stacks:
        leaves[frames[-1]] += count
    return [(frame, count / total) for frame, count in leaves.most_common(top)]


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Summarize py-spy collapsed stacks from `run.py --profile` as "
                                 "markdown: share of samples per part of the server, and the top leaf frames.")
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--top", type=int, default=15, help="leaf frames listed")
    args = ap.parse_args(argv)
    for path in args.files:
        stacks = read_collapsed(path)
        samples = sum(c for _, c in stacks)
        print(f"\n### {path.name} ({samples} samples at {RATE_HZ} Hz, every thread of every process)\n")
        print("| part | share of samples |\n|---|---|")
        for label, share in summarize(stacks, PATTERNS).items():
            print(f"| {label} | {100 * share:.1f} % |")
        print("\n| leaf frame (self time) | share |\n|---|---|")
        for frame, share in leaf_table(stacks, args.top):
            print(f"| `{frame}` | {100 * share:.1f} % |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
