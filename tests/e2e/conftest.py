"""vLLM fixtures for the connector's end-to-end tests: the tiny seeded Llama (float32, so KV loaded
from the pool can be compared with recomputed KV by logprobs) and a runner that starts vLLM with
KVPoolConnector in a fresh process (tests/e2e/connector_run.py), forked from a process that imported
vLLM once (tests/e2e/runner_forks.py)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvpool.bench.tiny_model import TinyLlamaConfig, write_tiny_llama

FORK_SERVER = Path(__file__).parent / "runner_forks.py"
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


class ForkedRun:
    """One run forked by the fork server: poll / wait / kill like a subprocess.Popen."""

    def __init__(self, server: RunnerForks, pid: int) -> None:
        self.server, self.pid = server, pid

    def poll(self) -> int | None:
        return self.server.returncodes.get(self.pid)

    def wait(self, timeout_s: float | None = None) -> int:
        with self.server.changed:
            if not self.server.changed.wait_for(lambda: self.pid in self.server.returncodes, timeout_s):
                raise subprocess.TimeoutExpired(f"run {self.pid}", timeout_s)
            return self.server.returncodes[self.pid]

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class RunnerForks:
    """The test side of tests/e2e/runner_forks.py: starts it on first use and forks runs from it."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.returncodes: dict[int, int] = {}
        self.changed = threading.Condition()
        self.pids: queue.Queue = queue.Queue()
        self.lock = threading.Lock()

    def _start(self) -> None:
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, str(FORK_SERVER)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log)  # fmt: skip
        threading.Thread(target=self._read, name="runner-forks", daemon=True).start()
        ready = self.pids.get(timeout=300)
        if ready is None:
            raise AssertionError(f"the fork server did not start:\n{self.log_path.read_text()[-4000:]}")

    def _read(self) -> None:
        for line in self.proc.stdout:
            message = json.loads(line)
            if "exited" in message:
                with self.changed:
                    self.returncodes[message["exited"]] = message["returncode"]
                    self.changed.notify_all()
            else:
                self.pids.put(message.get("pid", message.get("ready")))
        self.pids.put(None)

    def run(self, spec_path: Path, out_path: Path, log_path: Path, env: dict[str, str]) -> ForkedRun:
        with self.lock:
            if self.proc is None:
                self._start()
            request = {"spec": str(spec_path), "out": str(out_path), "log": str(log_path), "env": env}
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            pid = self.pids.get(timeout=60)
        if pid is None:
            raise AssertionError(f"the fork server died:\n{self.log_path.read_text()[-4000:]}")
        return ForkedRun(self, pid)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="session")
def runner_forks(tmp_path_factory, _inductor_cache):
    forks = RunnerForks(tmp_path_factory.mktemp("runner-forks") / "server.log")
    yield forks
    forks.close()


@pytest.fixture
def run_vllm(tmp_path, tiny_model_f32, vllm_cache_root, runner_forks):
    """run_vllm(name, master, phases, **spec) -> the runner's JSON (a fresh process each call, forked
    from the fork server: vLLM imported, nothing started)."""

    started: list[ForkedRun] = []

    def start(name: str, master: str | None, phases: list[dict], **spec):
        """Start the run in the background; returns wait(timeout_s) -> the runner's JSON."""
        spec_path, out_path, log_path = (tmp_path / f"{name}.{ext}" for ext in ("spec.json", "out.json", "log"))
        env = vllm_env(tmp_path, vllm_cache_root)
        for key in spec.pop("unset_env", ()):
            env.pop(key, None)
        env.update(spec.pop("set_env", {}))
        spec_path.write_text(json.dumps(
            {"model_dir": str(tiny_model_f32), "master": master, "block_size": BLOCK_SIZE, "phases": phases, **spec}
        ))  # fmt: skip
        proc = runner_forks.run(spec_path, out_path, log_path, env)
        started.append(proc)

        def wait(timeout_s: float = 300.0) -> dict:
            returncode = proc.wait(timeout_s)
            if returncode != 0:
                raise AssertionError(f"vLLM run {name} exited {returncode}:\n{log_path.read_text()[-6000:]}")
            return json.loads(out_path.read_text())

        wait.pid = proc.pid
        return wait

    def run(name: str, master: str | None, phases: list[dict], timeout_s: float = 300.0, **spec) -> dict:
        return start(name, master, phases, **spec)(timeout_s)

    run.start = start
    yield run
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
