"""vLLM fixtures for the connector's end-to-end tests: the tiny seeded Llama (float32, so KV loaded
from the pool can be compared with recomputed KV by logprobs) and a runner that starts vLLM with
KVPoolConnector in a fresh process (tests/e2e/connector_run.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.bench.tiny_model import TinyLlamaConfig, write_tiny_llama

RUNNER = Path(__file__).parent / "connector_run.py"
BLOCK_SIZE = 32  # the CPU attention backend needs a multiple of 32; tests assume this value


@pytest.fixture(scope="session")
def tiny_model_f32(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-f32"), TinyLlamaConfig(dtype="float32"))


def _shared_root(tmp_path_factory) -> Path:
    """The run's temporary root, one for all of pytest-xdist's workers (each has its own basetemp)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def vllm_cache_root(tmp_path_factory) -> Path:
    """vLLM's cache (model-class info) shared by every vLLM of the run, the runner's (vllm_env) and
    the servers' (procs.start_vllm_server(cache_root=...)): with a fresh one each vLLM inspects the
    model class in a subprocess that imports vLLM again (~9 s here)."""
    return _shared_root(tmp_path_factory) / "vllm-cache"


@pytest.fixture(scope="session", autouse=True)
def _inductor_cache(tmp_path_factory):
    """One torch inductor cache for every vLLM of the run, the servers' included (they inherit this
    process's environment): even eager vLLM compiles a few CPU kernels on its first request (~10 s
    here), and a server's default cache lies under its own TMPDIR, so each would compile them again."""
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(_shared_root(tmp_path_factory) / "inductor-cache")
    yield
    if before is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR")
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


def vllm_env(workdir: Path, cache_root: Path) -> dict[str, str]:
    scratch = workdir / "vllm-scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    return {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
        "TMPDIR": str(scratch), "VLLM_RPC_BASE_PATH": str(scratch),
        "VLLM_CACHE_ROOT": str(cache_root), "HF_HOME": str(scratch / "hf"),
    }  # fmt: skip


@pytest.fixture
def run_vllm(tmp_path, tiny_model_f32, vllm_cache_root):
    """run_vllm(name, master, phases, **spec) -> the runner's JSON (fresh process each call)."""

    started: list[subprocess.Popen] = []

    def start(name: str, master: str | None, phases: list[dict], **spec):
        """Start the run in the background; returns wait(timeout_s) -> the runner's JSON."""
        spec_path, out_path, log_path = (tmp_path / f"{name}.{ext}" for ext in ("spec.json", "out.json", "log"))
        spec_path.write_text(json.dumps(
            {"model_dir": str(tiny_model_f32), "master": master, "block_size": BLOCK_SIZE, "phases": phases, **spec}
        ))  # fmt: skip
        env = vllm_env(tmp_path, vllm_cache_root)
        for name in spec.pop("unset_env", ()):
            env.pop(name, None)
        env.update(spec.pop("set_env", {}))
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, str(RUNNER), str(spec_path), str(out_path)],
                                    env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        started.append(proc)

        def wait(timeout_s: float = 300.0) -> dict:
            returncode = proc.wait(timeout_s)
            if returncode != 0:
                raise AssertionError(f"vLLM run {name} exited {returncode}:\n{log_path.read_text()[-6000:]}")
            return json.loads(out_path.read_text())

        return wait

    def run(name: str, master: str | None, phases: list[dict], timeout_s: float = 300.0, **spec) -> dict:
        return start(name, master, phases, **spec)(timeout_s)

    run.start = start
    yield run
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
