"""Where the machine's CPU went during a replay: seconds per process and per thread, per configuration.

On this 2-core VM the servers' forwards are compute-bound, so every CPU-second a configuration
spends beside them (its cache process, the connector's threads, the master, the router) is a
second its forwards wait for a core. `snapshot` reads utime + stime of every thread of the
configuration's processes and their children from /proc; `usage` subtracts a snapshot taken
before the replay from one taken after it. Threads are named by Python's own thread names where
the process is Python (`py-spy dump` maps OS thread ids to them), else by the kernel's name
(OpenMP, ZMQ, UCX threads); numbered pool threads ("kvpool-save_0") are summed under one name.
Each thread's CPU affinity is kept too: the vLLM servers pin their forward to one core, and a
thread started from a pinned one inherits that core.
"""

from __future__ import annotations

import os
import re
import resource
import statistics
import subprocess
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from e2e_peers.profile import py_spy

TICKS_PER_S = os.sysconf("SC_CLK_TCK")
PROC = Path("/proc")
_POOL_SUFFIX = re.compile(r"[_-]\d+$")
_DUMP_THREAD = re.compile(r'^Thread (\d+) \([^)]*\): "(.*)"$', re.M)


@dataclass(frozen=True)
class ThreadTime:
    label: str  # the configuration's name for the root process ("vllm0", "master", "lmcache")
    process: str  # the process's kernel name (vLLM's engine core calls itself VLLM::EngineCore)
    thread: str  # Python's thread name, else the kernel's; pool numbers removed
    cpus: str  # the CPUs it may run on (Cpus_allowed_list)
    cpu_s: float


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:  # gone between listing and reading
        return None


def _stat_fields(text: str) -> tuple[str, list[str]]:
    """(comm, the fields after it) of a /proc stat line; comm may hold spaces and parentheses."""
    head, _, rest = text.rpartition(")")
    return head.split("(", 1)[1], rest.split()


def _cpu_s(fields: list[str]) -> float:
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S  # utime, stime (fields 14, 15 of stat)


def descendants(pid: int) -> list[int]:
    """pid and every process below it, from /proc's parent links."""
    children = defaultdict(list)
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (text := _read(entry / "stat")) is not None:
            children[int(_stat_fields(text)[1][1])].append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def python_thread_names(pid: int) -> dict[int, str]:
    """OS thread id -> Python thread name, from `py-spy dump`; empty if the process is not Python."""
    exe = py_spy()
    if exe is None:
        return {}
    try:
        done = subprocess.run([exe, "dump", "--pid", str(pid), "--nonblocking"], capture_output=True, text=True,
                              timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return {int(tid): name for tid, name in _DUMP_THREAD.findall(done.stdout)}


def _cpus_allowed(task: Path) -> str:
    for line in (_read(task / "status") or "").splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    return "?"


def snapshot(roots: dict[str, int], names: bool = False) -> dict[tuple, ThreadTime]:
    """Every thread's CPU seconds so far under each labelled root process, keyed by (pid, tid);
    (pid, 0) holds the threads that already exited (the process total minus its live threads).
    `names`: resolve Python thread names (a py-spy dump per process, ~0.1 s each) and read each
    thread's affinity; without, the timeline's per-second samples stay cheap."""
    out: dict[tuple, ThreadTime] = {}
    for label, root in roots.items():
        for pid in descendants(root):
            text = _read(PROC / str(pid) / "stat")
            if text is None:
                continue
            process, fields = _stat_fields(text)
            py_names = python_thread_names(pid) if names else {}
            live = 0.0
            for task in (PROC / str(pid) / "task").iterdir():
                if (t := _read(task / "stat")) is None:
                    continue
                comm, tfields = _stat_fields(t)
                tid, cpu_s = int(task.name), _cpu_s(tfields)
                live += cpu_s
                name = _POOL_SUFFIX.sub("", py_names.get(tid, comm)) or comm
                out[(pid, tid)] = ThreadTime(label, process, name, _cpus_allowed(task) if names else "", cpu_s)
            out[(pid, 0)] = ThreadTime(label, process, "(exited threads)", "", max(0.0, _cpu_s(fields) - live))
    return out


def usage(before: dict[tuple, ThreadTime], after: dict[tuple, ThreadTime]) -> list[dict]:
    """CPU seconds spent between two snapshots, summed per (label, process, thread name, cpus),
    largest first; names and affinities come from `after` (threads alive at the end)."""
    sums: dict[tuple, float] = defaultdict(float)
    for key, t in after.items():
        spent = t.cpu_s - (before[key].cpu_s if key in before else 0.0)
        if spent > 0:
            sums[(t.label, t.process, t.thread, t.cpus)] += spent
    rows = [{"label": k[0], "process": k[1], "thread": k[2], "cpus": k[3], "cpu_s": round(v, 2)}
            for k, v in sums.items()]  # fmt: skip
    return sorted(rows, key=lambda r: -r["cpu_s"])


def self_usage(before: resource.struct_rusage, label: str) -> dict:
    """This process's own CPU seconds since `before` (its threads only, not its children)."""
    now = resource.getrusage(resource.RUSAGE_SELF)
    spent = now.ru_utime + now.ru_stime - before.ru_utime - before.ru_stime
    return {"label": label, "process": "python", "thread": "(all)", "cpus": "", "cpu_s": round(spent, 2)}


def _group(row: dict) -> str:
    return f"{row['label']} / {row['process']} / {row['thread']}"


def report_lines(saved: list[dict], top: int = 12) -> list[str]:
    """Markdown: per configuration, the median CPU seconds over its rounds of its busiest threads
    (and of everything it ran), beside the replay's wall time x the machine's cores."""
    by_config: dict[str, list[dict]] = defaultdict(list)
    for run in saved:
        if run.get("cpu") and not run.get("error"):
            by_config[run["config"]].append(run)
    if not by_config:
        return []
    lines = ["## CPU time during the replay (`cpu_time.py`)", "",
             "CPU seconds per process and thread from /proc, median over rounds; `cpus`: where the thread may run "
             "(the servers pin their forward to one core each; threads they start inherit it).", ""]  # fmt: skip
    for config, runs in sorted(by_config.items()):
        total = statistics.median(sum(r["cpu_s"] for r in run["cpu"]) for run in runs)
        wall = statistics.median(run.get("replay_wall_s") or 0.0 for run in runs)
        cores = os.cpu_count() or 1
        lines += [f"**{runs[0]['label']}** ({len(runs)} runs): {total:.0f} CPU-s in a {wall:.0f} s replay "
                  f"({100 * total / max(1e-9, wall * cores):.0f} % of {cores} cores)", "",
                  "| process / thread | cpus | CPU s | share |", "|---|---|---|---|"]  # fmt: skip
        per_group: dict[str, list[float]] = defaultdict(list)
        cpus: dict[str, str] = {}
        for run in runs:
            for row in run["cpu"]:
                per_group[_group(row)].append(row["cpu_s"])
                cpus[_group(row)] = row["cpus"]
        medians = {g: statistics.median(v + [0.0] * (len(runs) - len(v))) for g, v in per_group.items()}
        for group, value in sorted(medians.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"| {group} | {cpus[group]} | {value:.1f} | {100 * value / max(1e-9, total):.1f} % |")
        lines.append("")
    return lines


class Timeline:
    """Samples the roots' threads every `period_s` on a thread of its own while in a `with` block:
    `samples` holds (seconds since start, {"label / process / thread": CPU seconds in the period}),
    kernel thread names only (no py-spy), so a slow request can be read against what ran meanwhile."""

    def __init__(self, roots: dict[str, int], period_s: float = 1.0) -> None:
        self.roots, self.period_s = roots, period_s
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-timeline", daemon=True)

    def __enter__(self) -> Timeline:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        t0 = time.monotonic()
        before = snapshot(self.roots)
        while not self._stop.wait(self.period_s):
            after = snapshot(self.roots)
            self.samples.append((round(time.monotonic() - t0, 2), {_group(r): r["cpu_s"] for r in usage(before, after)}))
            before = after


def plot_timelines(saved: list[dict], path: Path, top: int = 5) -> Path | None:
    """One panel per run that has a timeline: CPU cores used per second by its busiest threads
    (stacked, a 3-sample moving average), the slowest request's wait to its first token shaded."""
    runs = [r for r in saved if r.get("cpu_timeline") and not r.get("error")]
    if not runs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 2.6 * len(runs)), sharex=True, squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        samples = run["cpu_timeline"]
        times = [t for t, _ in samples]
        periods = [b - a for a, b in zip([0.0, *times[:-1]], times)]
        totals: dict[str, float] = defaultdict(float)
        for _, spent in samples:
            for k, v in spent.items():
                totals[k] += v
        groups = sorted(totals, key=lambda k: -totals[k])[:top]
        series = [_smoothed([spent.get(g, 0.0) for _, spent in samples], periods) for g in groups]
        rest = _smoothed([sum(v for k, v in spent.items() if k not in groups) for _, spent in samples], periods)
        ax.stackplot(times, *series, rest, labels=[*groups, "everything else"], step="pre")
        slowest = _slowest_request(run)
        if slowest is not None:
            ax.axvspan(slowest[0], slowest[0] + slowest[1], color="grey", alpha=0.15, label="slowest request waiting")
        ax.set_ylabel("cores")
        ax.set_ylim(0, 1.2 * (os.cpu_count() or 1))  # a starved sampler's period can read above the machine
        ax.set_title(f"round {run['round'] + 1}, {run['label']}", fontsize=9)
        ax.legend(fontsize=6, loc="upper left", ncol=2)
    axes[-1, 0].set_xlabel("seconds into the replay")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _smoothed(cpu_s: list[float], periods: list[float], window: int = 3) -> list[float]:
    """Cores used, over `window` samples around each: the sampler shares the replay client's GIL,
    so one period may read late and the next early; their sum is exact."""
    out = []
    for i in range(len(cpu_s)):
        lo, hi = max(0, i - window // 2), min(len(cpu_s), i + window // 2 + 1)
        out.append(sum(cpu_s[lo:hi]) / max(1e-3, sum(periods[lo:hi])))
    return out


def _slowest_request(run: dict) -> tuple[float, float] | None:
    block = run.get("requests")
    if not block or not block.get("rows"):
        return None
    at = {c: i for i, c in enumerate(block["columns"])}
    done = [r for r in block["rows"] if r[at["ttft_s"]] is not None]
    if not done:
        return None
    worst = max(done, key=lambda r: r[at["ttft_s"]])
    return worst[at["start_s"]], worst[at["ttft_s"]]
