"""Where a benchmark's results go, and the machine they name.

Rules:
- A run of benchmark NAME writes benchmarks/results/NAME/DATE-MACHINE[-VARIANT].{json,md,png}:
  DATE is today's UTC date (YYYY-MM-DD), MACHINE names the CPU (and GPU) the run took place on,
  e.g. `2cpu-epyc`, VARIANT tells apart runs of one day that measure different things (a model,
  a pool size). A run of several files per configuration writes a folder of that name instead.
- After writing, the benchmark calls `refresh_latest(NAME)`: LATEST.md says what was measured, on
  which machine, shows the newest date's tables and links every dated result in the folder.
- `$KVPOOL_RESULTS_DIR` replaces benchmarks/results (ab.py points each side's runs at its own
  scratch folder so the committed results stay as they are).
Only this module decides result paths; scripts take `result_files(NAME)` and write there.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import registry

BENCHMARKS_DIR = Path(__file__).resolve().parent
# DATE-MACHINE[-VARIANT]; a machine's GPU part is a GPU model (h100, a100, l40s, gb200, rtx4090)
DATED = re.compile(r"^(\d{4}-\d{2}-\d{2})-([0-9]+cpu-[a-z0-9]+(?:-(?:[ahlbvtp]|gb|gh|rtx)\d{1,4}[a-z]?)?|unknown)"
                   r"(?:-(.+))?$")
_GPU_MODEL = re.compile(r"(?:[AHLBVTP]|GB|GH)\d{1,4}[A-Za-z]?")


def results_root() -> Path:
    return Path(os.environ.get("KVPOOL_RESULTS_DIR") or BENCHMARKS_DIR / "results")


def today() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


# ---- the machine --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Machine:
    cpu_model: str
    cores: int
    memory_gib: float
    kernel: str
    gpu: str | None  # the first GPU's name, None without one

    @property
    def name(self) -> str:
        """`2cpu-epyc`, `16cpu-xeon-h100`: core count, CPU family, GPU model if any."""
        name = f"{self.cores}cpu-{cpu_family(self.cpu_model)}"
        if self.gpu:
            name += "-" + gpu_short_name(self.gpu)
        return name

    def describe(self) -> str:
        text = f"{self.cpu_model}, {self.cores} cores, {self.memory_gib:g} GiB memory, Linux {self.kernel}"
        return text + (f", {self.gpu}" if self.gpu else ", no GPU")

    def as_dict(self) -> dict:
        return {"name": self.name, "cpu_model": self.cpu_model, "cores": self.cores, "memory_gib": self.memory_gib,
                "kernel": self.kernel, "gpu": self.gpu}  # fmt: skip


def cpu_family(cpu_model: str) -> str:
    """The CPU's family word: `AMD EPYC 7763 64-Core Processor` -> `epyc`."""
    words = [w.lower() for w in re.findall(r"[A-Za-z][A-Za-z0-9]*", cpu_model)]
    for family in ("epyc", "xeon", "ryzen", "threadripper", "opteron", "atom", "celeron", "pentium", "neoverse", "graviton"):
        if family in words:
            return family
    if "core" in words:
        return "core"
    skip = {"amd", "intel", "r", "tm", "cpu", "processor", "genuine", "authentic", "genuineintel", "authenticamd", "apple"}
    rest = [w for w in words if w not in skip]
    return rest[0] if rest else "unknown"


def gpu_short_name(gpu: str) -> str:
    """`NVIDIA H100 80GB HBM3` -> `h100`; `NVIDIA GeForce RTX 4090` -> `rtx4090`."""
    words = gpu.replace("NVIDIA", "").split()
    for i, word in enumerate(words):
        if _GPU_MODEL.fullmatch(word):
            return word.lower()
        if word.isdigit() and i > 0 and words[i - 1].upper() == "RTX":
            return f"rtx{word}"
    return "gpu"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return 0.0


def _gpu() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    names = [line.strip() for line in out.splitlines() if line.strip()]
    return names[0] if names else None


def this_machine() -> Machine:
    return Machine(_cpu_model(), os.cpu_count() or 1, _memory_gib(), platform.release(), _gpu())


# ---- the files ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResultFiles:
    folder: Path
    stem: str  # DATE-MACHINE[-VARIANT]

    @property
    def json(self) -> Path:
        return self.folder / f"{self.stem}.json"

    @property
    def md(self) -> Path:
        return self.folder / f"{self.stem}.md"

    @property
    def png(self) -> Path:
        return self.folder / f"{self.stem}.png"

    @property
    def prefix(self) -> Path:
        """The dated path without an extension, for scripts that add their own."""
        return self.folder / self.stem

    @property
    def run_folder(self) -> Path:
        """For a run that writes many files: a folder named like the dated files."""
        return self.folder / self.stem

    def with_suffix(self, suffix: str) -> Path:
        return self.folder / f"{self.stem}{suffix}"


def result_files(name: str, variant: str | None = None, machine: Machine | None = None) -> ResultFiles:
    """The paths a run of benchmark `name` writes today (nothing is created: writers make the folder)."""
    registry.get(name)
    stem = f"{today()}-{(machine or this_machine()).name}"
    if variant:
        stem += "-" + re.sub(r"[^A-Za-z0-9_]+", "-", variant).strip("-")
    return ResultFiles(results_root() / name, stem)


def publish(name: str, text: str, out: Path | None = None, suffix: str = ".md", variant: str | None = None) -> Path:
    """Write a one-file result: to `out` when given, else to today's dated file, refreshing LATEST.md."""
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        return out
    path = result_files(name, variant).with_suffix(suffix)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    refresh_latest(name)
    return path


# ---- LATEST.md ----------------------------------------------------------------------------------


def dated_entries(folder: Path) -> list[Path]:
    """The folder's dated results (files and run folders), oldest first."""
    entries = [p for p in folder.iterdir() if DATED.match(p.name.split(".", 1)[0] if p.is_file() else p.name)]
    return sorted(entries, key=lambda p: p.name)


def newest(name: str, variant: str | None = None, suffix: str = "") -> Path | None:
    """The newest dated result of `name` with this variant (a run folder, or a file with `suffix`);
    runs of one variant on one day told apart by a time of day count as that variant."""
    folder = results_root() / name
    if not folder.is_dir():
        return None
    found = [e for e in dated_entries(folder)
             if (e.is_dir() if not suffix else e.name.endswith(suffix)) and _variant_base(e) == variant]  # fmt: skip
    return found[-1] if found else None


def _variant(entry: Path) -> str | None:
    match = DATED.match(entry.name.split(".", 1)[0] if entry.is_file() else entry.name)
    return match.group(3) if match else None


def _date_machine(entry: Path) -> tuple[str, str]:
    match = DATED.match(entry.name.split(".", 1)[0] if entry.is_file() else entry.name)
    assert match is not None  # dated_entries only returns matching names
    return match.group(1), match.group(2)


def _demote(markdown: str) -> str:
    """A dated report's headings one level down (not `#` lines in code blocks): LATEST.md keeps one title."""
    lines, in_code = [], False
    for line in markdown.splitlines():
        in_code ^= line.startswith("```")
        lines.append("#" + line if line.startswith("#") and not in_code else line)
    return "\n".join(lines)


_TIME_SUFFIX = re.compile(r"-\d{4}(?:-\d+)?$")  # several runs of one variant on one day: DATE-MACHINE[-VARIANT]-HHMM
EMBED_AT_MOST = 4


def _report_of(entry: Path) -> Path | None:
    if entry.is_file():
        return entry if entry.suffix == ".md" else None
    for name in ("NOTES.md", "results.md", "README.md"):
        if (entry / name).exists():
            return entry / name
    return next(iter(sorted(entry.glob("*.md"))), None)


def _variant_base(entry: Path) -> str | None:
    """The entry's variant without a time of day: `lazy-nixl` for ...-lazy-nixl-1435, None for ...-1407."""
    variant = _variant(entry)
    if variant is None:
        return None
    return _TIME_SUFFIX.sub("", "-" + variant).lstrip("-") or None


def _newest_per_variant(entries: list[Path]) -> list[Path]:
    """Of the newest date's reports, the last of each variant (a variant run twice that day: the later)."""
    newest_date = _date_machine(entries[-1])[0]
    latest: dict[str, Path] = {}
    for entry in entries:
        report = _report_of(entry)
        if report is None or _date_machine(entry)[0] != newest_date:
            continue
        latest[_variant_base(entry) or ""] = entry  # entries are sorted: a later time replaces an earlier one
    return list(latest.values())


def refresh_latest(name: str, root: Path | None = None) -> Path:
    """Write results/NAME/LATEST.md from the folder's dated results; returns its path."""
    bench = registry.get(name)
    folder = (root or results_root()) / name
    entries = dated_entries(folder) if folder.is_dir() else []
    lines = [f"# {name}: latest results", "", f"{bench.description}.", "",
             f"Run: `benchmarks/run.py {name} --help` ({bench.kind}; `{bench.target}`). How the numbers are taken: "
             "[method](../../method.md); the machines: [machines](../../machines.md).", ""]  # fmt: skip
    if not entries:
        lines += ["No results yet."]
    else:
        newest = _newest_per_variant(entries)
        if len(newest) > EMBED_AT_MOST:  # many variants that day: show the plain run, link the rest
            plain = [e for e in newest if _variant_base(e) is None]
            shown = plain[-1:] or newest[-1:]
        else:
            shown = newest
        newest_date = _date_machine(entries[-1])[0]
        machines = sorted({_date_machine(e)[1] for e in entries if _date_machine(e)[0] == newest_date})
        lines += [f"Newest: {newest_date} on {', '.join(f'`{m}`' for m in machines)}.", ""]
        for entry in shown:
            report = _report_of(entry)
            assert report is not None  # _newest_per_variant keeps entries with a report
            link = str(report.relative_to(folder))
            lines += [f"## [{link}]({link})", "", _demote(report.read_text().strip()), ""]
        others = [e for e in newest if e not in shown]
        if others:
            lines += [f"Also on {newest_date}: " + ", ".join(f"[{e.name}]({e.name})" for e in others) + ".", ""]
        lines += ["## Every dated result", ""]
        by_stem: dict[str, list[Path]] = {}
        for entry in entries:
            by_stem.setdefault(entry.name.split(".", 1)[0] if entry.is_file() else entry.name, []).append(entry)
        for stem in sorted(by_stem, reverse=True):
            links = ", ".join(f"[{e.suffix[1:] if e.is_file() else 'folder'}]({e.name}{'/' if e.is_dir() else ''})"
                              for e in by_stem[stem])  # fmt: skip
            date, machine = _date_machine(by_stem[stem][0])
            lines.append(f"- {stem}: {links} ({date}, `{machine}`)")
    path = folder / "LATEST.md"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines).rstrip() + "\n")
    return path
