"""py-spy profiles of the vLLM servers during a run (`run.py --profile`): where a request's time goes.

Each server (its API process and, through --subprocesses, its engine core) is sampled for the whole
replay into OUT/profiles/r<round>-<config>-<server>.txt (py-spy's collapsed stacks: one line per
distinct stack, `frame;frame;... count`). `summarize` turns one into the share of samples under
each function of interest (a function counts once per sample however deep it recurs), which is
what results.md quotes. Profiled runs are for finding time, not for the comparison: sampling costs
the machine a few percent, so they go to their own --out-dir.
"""

from __future__ import annotations

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
    stacks = []
    for line in path.read_text().splitlines():
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
