"""The registry of competitors for the peers benchmark: how each one's servers start, on which
hosts of the multi-host harness (kvpool.bench.hosts), and what its client processes are told.

A peer is a name -> Peer entry; `Peer.start(net, workdir)` starts its storage and metadata
processes and returns a Running with the client's host and spec, or raises PeerUnavailable with
the reason (the benchmark reports it and goes on without that peer). Each peer gets one storage
process of `storage_bytes` (kvpool: one node; Mooncake: one standalone segment owner; Redis: one
server), so no store gets more memory or more storage processes than another.

Rules: servers are ManagedProcesses (SIGTERM, then SIGKILL of the group), started inside their
hosts; fixed ports are safe because every host has its own network namespace.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvpool.bench import hosts, procs

MiB = 1024 * 1024
HOSTS = ["kvsame", "kvmaster", "kvnode", "mcmaster", "mcstore", "mcipc", "redis", "rawtcp", "client"]


# `run.py --pin`: the CPUs every peer's servers and every client process are pinned to (taskset),
# the same for all peers, so single round trips compare like for like (a wake-up on another vCPU
# costs ~30 us each way here: benchmarks/results/echo_placement/). None: the kernel places them.
PIN: dict[str, str | None] = {"servers": None, "client": None}


def pinned(argv: list[str], cpus: str | None = None) -> list[str]:
    """`argv` under taskset to `cpus` (default: the servers' pin), or as it is when unpinned."""
    cpus = PIN["servers"] if cpus is None else cpus
    return ["taskset", "-c", cpus, *argv] if cpus else list(argv)


class PeerUnavailable(RuntimeError):
    pass


@dataclass
class Running:
    client_host: hosts.Host
    spec: dict  # given to clients.py (plus the case list)
    python: str  # the interpreter that runs this peer's clients
    processes: list[procs.ManagedProcess] = field(default_factory=list)

    def stop(self) -> None:
        for proc in reversed(self.processes):
            proc.stop(grace_s=5.0)


@dataclass(frozen=True)
class Peer:
    name: str
    label: str  # column title in the report
    path: str  # "same-host" or "cross-host"
    start: Callable[[hosts.HostNetwork, Path, int, str], Running]  # (net, workdir, storage_bytes, python)
    needs: tuple[str, ...] = ()  # "mooncake", "redis": installed on demand by run.py


def wait_port(host: hosts.Host, address: str, port: int, proc: procs.ManagedProcess, timeout_s: float = 30.0) -> None:
    """Poll a TCP port from inside `host`'s network (the harness's hosts are not reachable from here)."""
    probe = ("import socket,sys\ntry:\n socket.create_connection((sys.argv[1], int(sys.argv[2])), 1).close()\n"
             "except OSError:\n sys.exit(1)")  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive():
            raise PeerUnavailable(f"{proc.name} exited before it listened:\n{proc.tail_log()}")
        argv = ["ip", "netns", "exec", host.netns, sys.executable, "-c", probe, address, str(port)]
        if subprocess.run(argv, capture_output=True).returncode == 0:
            return
        time.sleep(0.2)
    raise PeerUnavailable(f"{proc.name} not listening on {address}:{port} after {timeout_s:.0f} s:\n{proc.tail_log()}")


def _kvpool(master_host: str, node_host: str, client_host: str, master_args: tuple[str, ...] = (), **client_options):
    def start(net: hosts.HostNetwork, workdir: Path, storage_bytes: int, python: str) -> Running:
        running = Running(net[client_host], {}, python)
        try:
            m = net[master_host]
            # A removed object keeps its space until its read lease ends: short leases (store_bench.py)
            argv = procs.kvpool_argv("master", "--insecure", "--host", m.address, "--port", "0", "--lease-ttl-s", "2",
                                     "--max-lease-hold-s", "10", *master_args)  # fmt: skip
            tag = "-".join([master_host, *client_options, *(a.strip("-") for a in master_args)])
            master = procs.ManagedProcess(f"{tag}-master", m.wrap(pinned(argv)), workdir)
            running.processes.append(master.start(30))
            argv = procs.kvpool_argv("node", "--master", master.info["address"], "--memory", str(storage_bytes),
                                     "--node-id", f"{tag}-node")  # fmt: skip
            node = procs.ManagedProcess(f"{tag}-node", net[node_host].wrap(pinned(argv)), workdir)
            running.processes.append(node.start(60))
        except (RuntimeError, TimeoutError) as e:
            running.stop()
            raise PeerUnavailable(str(e)) from e
        running.spec = {"adapter": "kvpool", "master": master.info["address"], "tenant": "peers", **client_options}
        return running

    return start


MOONCAKE_STORE = """
import signal, sys, time, json
from mooncake.store import MooncakeDistributedStore
ip, metadata_url, master, size, ready = sys.argv[1:6]
store = MooncakeDistributedStore()
for attempt in range(50):
    rc = store.setup(ip, metadata_url, int(size), 16 << 20, "tcp", "", master)
    if rc == 0:
        break
    time.sleep(0.2)
else:
    sys.exit(f"mooncake setup returned {rc}")
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
open(ready, "w").write(json.dumps({"ok": True}))
while not stop:
    time.sleep(0.2)
store.close()
"""


def _start_listening(host: hosts.Host, name: str, argv: list[str], ports: tuple[int, ...], workdir: Path,
                     running: Running) -> procs.ManagedProcess:
    """Start a server in `host` (it joins `running`) and wait until it listens on `ports`."""
    proc = procs.ManagedProcess(name, host.wrap(pinned(argv)), workdir)
    running.processes.append(proc.start(ready_file_arg=False))
    for port in ports:
        wait_port(host, host.address, port, proc)
    return proc


def _mooncake_bin(python: str, name: str) -> Path:
    path = Path(python).parent / name
    if not path.exists():
        raise PeerUnavailable(f"no {name} next to {python}")
    return path


def _start_mooncake_master(m: hosts.Host, workdir: Path, python: str, running: Running, name: str) -> tuple[str, str]:
    """A mooncake_master with its HTTP metadata server on host `m`: (metadata URL, master address)."""
    argv = [str(_mooncake_bin(python, "mooncake_master")), f"--rpc_address={m.address}", "--rpc_port=50051",
            "--enable_http_metadata_server=true", f"--http_metadata_server_host={m.address}",
            "--http_metadata_server_port=8080", "--default_kv_lease_ttl=1000"]  # fmt: skip
    _start_listening(m, name, argv, (50051, 8080), workdir, running)
    return f"http://{m.address}:8080/metadata", f"{m.address}:50051"


def _mooncake_tcp(net: hosts.HostNetwork, workdir: Path, storage_bytes: int, python: str) -> Running:
    m, s = net["mcmaster"], net["mcstore"]
    running = Running(net["client"], {}, python)
    try:
        metadata_url, master_addr = _start_mooncake_master(m, workdir, python, running, "mooncake-master")
        ready = workdir / "mooncake-store.ready.json"
        argv = [python, "-c", MOONCAKE_STORE, s.address, metadata_url, master_addr, str(storage_bytes), str(ready)]
        store = procs.ManagedProcess("mooncake-store", s.wrap(pinned(argv)), workdir)
        running.processes.append(store.start(ready_file_arg=False))
        deadline = time.monotonic() + 60
        while not ready.exists():
            if not store.alive() or time.monotonic() > deadline:
                raise PeerUnavailable(f"mooncake store did not start:\n{store.tail_log()}")
            time.sleep(0.1)
    except (RuntimeError, TimeoutError) as e:
        running.stop()
        raise PeerUnavailable(str(e)) from e
    running.spec = {"adapter": "mooncake", "local_ip": net["client"].address, "metadata_url": metadata_url,
                    "master": master_addr, "protocol": "tcp"}  # fmt: skip
    return running


def _mooncake_ipc(net: hosts.HostNetwork, workdir: Path, storage_bytes: int, python: str) -> Running:
    """Mooncake's same-host mode: master, the segment-owning `mooncake_client` (one service thread,
    its default) and the benchmark's clients (setup_dummy over IPC) all on host mcipc."""
    h = net["mcipc"]
    running = Running(h, {}, python)
    try:
        metadata_url, master_addr = _start_mooncake_master(h, workdir, python, running, "mooncake-ipc-master")
        argv = [str(_mooncake_bin(python, "mooncake_client")), f"--host={h.address}", "--port=50052",
                f"--global_segment_size={storage_bytes}", f"--master_server_address={master_addr}",
                f"--metadata_server={metadata_url}", "--protocol=tcp"]  # fmt: skip
        _start_listening(h, "mooncake-ipc-client", argv, (50052,), workdir, running)
    except (RuntimeError, TimeoutError) as e:
        running.stop()
        raise PeerUnavailable(str(e)) from e
    running.spec = {"adapter": "mooncake-ipc", "real_client": f"{h.address}:50052"}
    return running


def _one_server(net: hosts.HostNetwork, host: str, name: str, argv: list[str], port: int, workdir: Path,
                python: str, spec: dict) -> Running:
    """A peer that is one listening process on `host` (clients on the client host)."""
    running = Running(net["client"], {}, python)
    try:
        _start_listening(net[host], name, argv, (port,), workdir, running)
    except (RuntimeError, TimeoutError) as e:
        running.stop()
        raise PeerUnavailable(str(e)) from e
    running.spec = spec
    return running


def _redis(net: hosts.HostNetwork, workdir: Path, storage_bytes: int, python: str) -> Running:
    server = shutil.which("redis-server")
    if server is None:
        raise PeerUnavailable("redis-server is not installed")
    address = net["redis"].address
    argv = [server, "--bind", address, "--port", "6379", "--save", "", "--appendonly", "no",
            "--protected-mode", "no", "--maxmemory", str(storage_bytes), "--maxmemory-policy", "noeviction",
            "--dir", str(workdir)]  # fmt: skip
    return _one_server(net, "redis", "redis", argv, 6379, workdir, python,
                       {"adapter": "redis", "host": address, "port": 6379})


def _raw_tcp(connections: int, port: int):
    def start(net: hosts.HostNetwork, workdir: Path, storage_bytes: int, python: str) -> Running:
        argv = [python, str(Path(__file__).with_name("raw_tcp.py")), "--port", str(port), "--memory", str(storage_bytes)]
        return _one_server(net, "rawtcp", f"raw-tcp-{port}", argv, port, workdir, python,
                           {"adapter": "raw-tcp", "host": net["rawtcp"].address, "port": port,
                            "connections": connections})
    return start


PEERS: dict[str, Peer] = {
    p.name: p
    for p in [
        Peer("kvpool-same", "kvpool same-host", "same-host", _kvpool("kvsame", "kvsame", "kvsame")),
        Peer("kvpool-nixl", "kvpool cross-host (NIXL + segment lane)", "cross-host",
             _kvpool("kvmaster", "kvnode", "client")),
        # every transfer by NIXL, none over the nodes' segment lanes (A/B for the lane)
        Peer("kvpool-nixl-only", "kvpool cross-host, NIXL only (before the segment lane)", "cross-host",
             _kvpool("kvmaster", "kvnode", "client", path="nixl")),
        # the client with NIXL's progress thread on, as it once ran (A/B for running without it)
        Peer("kvpool-nixl-pt", "kvpool NIXL cross-host, progress thread (before)", "cross-host",
             _kvpool("kvmaster", "kvnode", "client", nixl_progress_thread=True)),
        # lane calls block for their reply at once, as before c688096 (A/B for the spin)
        Peer("kvpool-nixl-nospin", "kvpool cross-host, lane calls without the spin (before)", "cross-host",
             _kvpool("kvmaster", "kvnode", "client", lane_spin_us=0)),
        # segment lane jobs block at once, without the spin (A/B for the segment lane's spin)
        Peer("kvpool-nixl-lane-block", "kvpool cross-host, segment lane jobs without the spin (before)", "cross-host",
             _kvpool("kvmaster", "kvnode", "client", segment_lane_spin_us=0)),
        # a put's PutEnd after its write, without landing (A/B for client/landing.py)
        Peer("kvpool-same-endafter", "kvpool same-host, PutEnd after the write (before)", "same-host",
             _kvpool("kvsame", "kvsame", "kvsame", landing=False)),
        Peer("kvpool-nixl-endafter", "kvpool cross-host, PutEnd after the write (before)", "cross-host",
             _kvpool("kvmaster", "kvnode", "client", landing=False)),
        # no checksums written or verified (what the reader's xxh3 pass costs)
        Peer("kvpool-nixl-nocheck", "kvpool cross-host, no checksums", "cross-host",
             _kvpool("kvmaster", "kvnode", "client", checksums=False)),
        # master round trips over ZMQ instead of the lane (A/B for the lane)
        Peer("kvpool-nixl-zmq", "kvpool NIXL cross-host, ZMQ control (before)", "cross-host",
             _kvpool("kvmaster", "kvnode", "client", lane=False)),
        # values of 16-64 KiB on the node, not held by the master (A/B for the master's inline limit)
        Peer("kvpool-nixl-inline16k", "kvpool cross-host, master holds values up to 16 KiB", "cross-host",
             _kvpool("kvmaster", "kvnode", "client", master_args=("--max-inline", "16KiB"))),
        Peer("mooncake-tcp", "Mooncake TCP cross-host", "cross-host", _mooncake_tcp, needs=("mooncake",)),
        Peer("mooncake-ipc", "Mooncake IPC same-host", "same-host", _mooncake_ipc, needs=("mooncake",)),
        Peer("redis", "Redis cross-host", "cross-host", _redis, needs=("redis",)),
        # the ceiling, not a competitor: one TCP round trip per batch, no metadata server, no checks
        Peer("raw-tcp", "TCP ceiling (raw_tcp.py) cross-host", "cross-host", _raw_tcp(1, 7000)),
        # ... with each batch of two or more objects in two halves on two connections at once, as
        # kvpool's lane splits a large job (plane.py): the most two TCP streams carry from Python
        Peer("raw-tcp2", "TCP ceiling, two connections (raw_tcp.py) cross-host", "cross-host", _raw_tcp(2, 7001)),
    ]
}


def client_script(name: str, code: str) -> tuple[Path, Path]:
    """(a fresh work dir, `code` written there as `name`_client.py) for a script that runs its own
    client code on the harness's hosts; exits with the reason where the harness cannot run."""
    why = hosts.why_unavailable()
    if why is not None:
        raise SystemExit(f"the multi-host harness cannot run here: {why}")
    workdir = procs.scratch_dir(f"kvpool-{name.replace('_', '-')}-")
    script = workdir / f"{name}_client.py"
    script.write_text(code)
    return workdir, script


def median_range(values: list[float], digits: int = 3) -> str:
    """`median [min - max]`, how the A/B scripts report per-round ratios."""
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f} - {max(values):.{digits}f}]"


def run_script(running: Running, script: Path, spec: dict, env: dict | None = None, timeout_s: float = 600.0) -> dict:
    """A benchmark's own client script (argv[1]: the spec as JSON; its last stdout line: JSON) in its
    own process on the peer's client host, unpinned; that JSON, or SystemExit with its stderr."""
    import os

    argv = running.client_host.wrap([running.python, str(script), json.dumps(spec)])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env={**os.environ, **(env or {})})
    if done.returncode != 0:
        raise SystemExit(f"client {script.name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_client(running: Running, spec: dict, env: dict | None = None, timeout_s: float = 600.0) -> dict:
    """clients.py in its own process on the peer's client host; its JSON, or RuntimeError."""
    argv = running.client_host.wrap(pinned([running.python, str(Path(__file__).with_name("clients.py")), json.dumps(spec)],
                                                 PIN["client"]))
    import os

    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env={**os.environ, **(env or {})})
    if done.returncode != 0:
        raise RuntimeError(f"client exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
