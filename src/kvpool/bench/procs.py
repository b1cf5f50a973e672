"""Start and stop kvpool and vLLM processes for tests, benchmarks and the demo.

Rules:
- Every service started here is told `--ready-file PATH`; it writes a JSON object there once it
  serves (address, ports, pid). We poll that file, so ports can be chosen by the OS (port 0).
- Every process is started in its own session and tracked; `stop()` sends SIGTERM, then SIGKILL
  after a grace period, to the whole process group. `stop_all()` runs at interpreter exit.
- Output goes to a log file next to the ready file, shown in errors when a start fails.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpool.bench.hosts import Host

_LIVE: list["ManagedProcess"] = []


@dataclass
class ManagedProcess:
    name: str
    argv: list[str]
    workdir: Path
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen | None = None
    info: dict = field(default_factory=dict)  # the ready file's JSON
    cleanup_paths: list[Path] = field(default_factory=list)  # removed once the process is gone

    @property
    def ready_file(self) -> Path:
        return self.workdir / f"{self.name}.ready.json"

    @property
    def log_file(self) -> Path:
        return self.workdir / f"{self.name}.log"

    @property
    def pid(self) -> int:
        if self.popen is None:
            raise RuntimeError(f"{self.name} was not started")
        return self.popen.pid

    def start(self, timeout_s: float = 60.0, ready_file_arg: bool = True) -> "ManagedProcess":
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.ready_file.unlink(missing_ok=True)
        argv = list(self.argv) + (["--ready-file", str(self.ready_file)] if ready_file_arg else [])
        log = open(self.log_file, "ab")
        self.popen = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
            start_new_session=True,
        )
        log.close()
        _LIVE.append(self)
        if ready_file_arg:
            self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ready_file.exists():
                try:
                    self.info = json.loads(self.ready_file.read_text())
                    return self.info
                except json.JSONDecodeError:
                    pass  # being written
            if self.popen is not None and self.popen.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.popen.returncode} before it was ready:\n{self.tail_log()}"
                )
            time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"{self.name} not ready after {timeout_s:.0f} s:\n{self.tail_log()}")

    def tail_log(self, num_lines: int = 40) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-num_lines:])
        except FileNotFoundError:
            return "(no log)"

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def _signal_group(self, sig: int) -> None:
        if self.popen is None:
            return
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        """SIGKILL the whole process group, as a crash would."""
        self._signal_group(signal.SIGKILL)
        if self.popen is not None:
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._forget()

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM, wait up to `grace_s`, then SIGKILL. Returns the exit code."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.popen.wait(timeout=10)
        # children left in the group (vLLM's workers) go too
        self._signal_group(signal.SIGKILL)
        self._forget()
        return self.popen.returncode

    def _forget(self) -> None:
        if self in _LIVE:
            _LIVE.remove(self)
        for path in self.cleanup_paths:
            shutil.rmtree(path, ignore_errors=True)


def kvpool_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvpool", *args]


def start_master(workdir: Path, *extra: str, name: str = "master", timeout_s: float = 30.0) -> ManagedProcess:
    """A `kvpool master` on 127.0.0.1 with OS-chosen ports. `info["address"]` is its ZMQ endpoint.
    Insecure (a local test or benchmark) unless `extra` names `--auth DIR`."""
    secure = () if "--auth" in extra else ("--insecure",)
    argv = kvpool_argv("master", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", *secure, *extra)
    return ManagedProcess(name, argv, workdir).start(timeout_s)


def start_node(
    workdir: Path, master_address: str, memory: str = "64MiB", *extra: str, name: str = "node", timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
) -> ManagedProcess:
    """A `kvpool node` that has mounted its segment on the master when this returns."""
    argv = kvpool_argv("node", "--master", master_address, "--memory", memory, "--node-id", name, *extra)
    return ManagedProcess(name, argv, workdir, env=env or {}).start(timeout_s)


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS just handed out for `host` (for servers that cannot take port 0 themselves)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_etcd(workdir: Path, name: str = "etcd", port: int | None = None, timeout_s: float = 30.0) -> ManagedProcess:
    """One etcd member (Debian's etcd-server) on 127.0.0.1; `info["endpoint"]` is HOST:PORT. Its data
    stays in workdir/name.data, so a restart on the same port keeps keys and leases."""
    import shutil

    if shutil.which("etcd") is None:
        raise RuntimeError("etcd is not installed (Debian: apt-get install etcd-server; `make install` does it as root)")
    port = port or free_port()
    peer = free_port()
    url, peer_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{peer}"
    argv = ["etcd", "--name", name, "--data-dir", str(workdir / f"{name}.data"), "--listen-client-urls", url,
            "--advertise-client-urls", url, "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"{name}={peer_url}", "--log-level", "warn"]
    proc = ManagedProcess(name, argv, workdir).start(ready_file_arg=False)
    deadline = time.monotonic() + timeout_s
    while not _http_ok(f"{url}/health", None):
        if proc.popen.poll() is not None or time.monotonic() > deadline:
            proc.stop()
            raise RuntimeError(f"etcd did not start: see {proc.log_file}")
        time.sleep(0.1)
    proc.info = {"endpoint": f"127.0.0.1:{port}", "pid": proc.pid}
    return proc


def _http_ok(url: str, host: "Host | None") -> bool:
    import urllib.error
    import urllib.request

    if host is not None:  # this process cannot reach another host's network: ask from inside it
        probe = host.wrap(["curl", "-sf", "-o", "/dev/null", "--max-time", "2", url])
        return subprocess.run(probe, capture_output=True).returncode == 0
    try:
        with urllib.request.urlopen(url, timeout=2.0) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_http_ok(proc: ManagedProcess, url: str, timeout_s: float, host: "Host | None" = None) -> None:
    """Poll `url` (from inside `host` when given) until it answers 200; fail early with the log if
    the process dies."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive():
            code = proc.popen.returncode if proc.popen is not None else None
            raise RuntimeError(f"{proc.name} exited with {code} before it was ready:\n{proc.tail_log()}")
        if _http_ok(url, host):
            return
        time.sleep(0.25)
    proc.kill()
    raise TimeoutError(f"{proc.name} not ready after {timeout_s:.0f} s:\n{proc.tail_log()}")


def start_vllm_server(
    workdir: Path,
    model_dir: Path | str,
    *,
    name: str = "vllm",
    kv_cache_memory_bytes: int = 256 * 2**20,
    max_model_len: int = 16384,
    kv_transfer_config: dict | None = None,
    cpu_bind: str | None = None,
    extra_args: tuple[str, ...] = (),
    extra_env: dict[str, str] | None = None,
    cache_root: Path | None = None,
    enforce_eager: bool = True,
    worker_in_engine: bool = True,
    kv_events: bool = False,
    tokenizer: Path | str | None = None,
    wait: bool = True,
    timeout_s: float = 240.0,
    python: Path | str | None = None,
    host: "Host | None" = None,
) -> ManagedProcess:
    """A vLLM OpenAI server on 127.0.0.1 (or inside `host`, a kvpool.bench.hosts.Host, on its
    address) and a free port: token-id prompts only
    (--skip-tokenizer-init) unless `tokenizer` (a directory with tokenizer.json and a chat template)
    is given, then text and chat requests too.

    With `kv_events`, the server publishes its KV cache events (BlockStored / BlockRemoved) on a
    ZMQ socket it binds at `info["kv_events"]` (an ipc:// path: local only) for `kvpool router`.

    CPU settings from shared/notes/vllm-cpu.md: explicit KV memory, scratch dirs for sockets and
    caches, offline hub. `cpu_bind` pins the worker's OpenMP threads (VLLM_CPU_OMP_THREADS_BIND),
    so two servers on one machine do not fight over cores. `info` gets {"url", "port", "pid"}.
    With `wait=False`, call `wait_http_ok(proc, proc.info["url"] + "/health", ...)` later.
    `python` runs the server with another interpreter (a peer's own virtual environment).
    `cache_root` (default `workdir/vllm-cache`, shared by the servers of one workdir) keeps vLLM's
    compiled graphs, so a second server of the same model starts faster. `enforce_eager` skips
    torch.compile: for the tiny model on CPU it measured no faster (8K-token prefill 0.93 vs 0.91 s)
    but costs 20-80 s at start-up. `worker_in_engine` runs a one-rank server's worker inside vLLM's
    engine-core process (VLLM_ENABLE_V1_MULTIPROCESSING=0, which the CPU platform reads as "keep
    the uniprocess executor"; the API server still runs the engine in its own process): one Python
    process fewer to import vLLM at start-up, and no engine-worker queue that spins between steps
    (on 2 cores, start-up 52 -> 38 s and idle CPU 0.12 -> 0.04 cores, docs/performance/tests.md).
    """
    port = free_port()  # chosen here; inside a fresh host's network namespace every port is free
    address = "127.0.0.1" if host is None else host.address
    scratch = Path(workdir) / f"{name}.scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    # vLLM binds IPC sockets under TMPDIR; a socket path must stay under 108 bytes
    sockets = Path(tempfile.mkdtemp(prefix="kvpool-vllm-"))
    argv = [
        str(python or sys.executable), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", "tiny",
        "--host", address, "--port", str(port),
        *(["--tokenizer", str(tokenizer)] if tokenizer is not None else ["--skip-tokenizer-init"]),
        "--load-format", "safetensors",
        "--kv-cache-memory-bytes", str(kv_cache_memory_bytes),
        "--max-model-len", str(max_model_len),
        "--enable-prefix-caching", "--enable-prompt-tokens-details",
        "--disable-uvicorn-access-log",
        *(["--enforce-eager"] if enforce_eager else []),
        *(["--kv-transfer-config", json.dumps(kv_transfer_config)] if kv_transfer_config else []),
        *(["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                             "endpoint": f"ipc://{sockets}/kv-events"})] if kv_events else []),
        *extra_args,
    ]  # fmt: skip
    env = {
        "TMPDIR": str(sockets), "VLLM_RPC_BASE_PATH": str(sockets),
        "VLLM_CACHE_ROOT": str(cache_root or Path(workdir) / "vllm-cache"), "HF_HOME": str(scratch / "hf"),
        "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1",
        **({"VLLM_CPU_OMP_THREADS_BIND": cpu_bind} if cpu_bind is not None else {}),
        **({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if worker_in_engine else {}),
        **(extra_env or {}),
    }  # fmt: skip
    if host is not None:
        argv = host.wrap(argv)
    proc = ManagedProcess(name, argv, Path(workdir), env=env, cleanup_paths=[sockets]).start(ready_file_arg=False)
    proc.info = {"url": f"http://{address}:{port}", "port": port, "pid": proc.pid,
                 **({"kv_events": f"ipc://{sockets}/kv-events"} if kv_events else {})}  # fmt: skip
    if wait:
        wait_http_ok(proc, proc.info["url"] + "/health", timeout_s, host)
    return proc


def nixl_env(host: str = "127.0.0.1") -> dict[str, str]:
    """The environment of a vLLM server running NixlConnector: each instance on one machine needs its
    own side-channel port (where peers fetch its NIXL metadata)."""
    return {"VLLM_NIXL_SIDE_CHANNEL_HOST": host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port(host))}


def start_router(workdir: Path, backends: list[str], *extra: str, name: str = "router", timeout_s: float = 30.0) -> ManagedProcess:
    """A `kvpool router` on 127.0.0.1 and an OS-chosen port (round-robin unless `extra` says
    `--policy ...`); `info["url"]` is its base URL. P/D mode: no `backends`, and `extra` names
    `--prefill URL ... --decode URL ...`."""
    argv = kvpool_argv("router", "--host", "127.0.0.1", "--port", "0", *[a for b in backends for a in ("--backend", b)], *extra)
    return ManagedProcess(name, argv, workdir).start(timeout_s)


def stop_all() -> None:
    for proc in list(_LIVE):
        proc.stop(grace_s=5.0)


def scratch_dir(prefix: str = "kvpool-") -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))


atexit.register(stop_all)
