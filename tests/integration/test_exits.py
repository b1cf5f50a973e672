"""Clean exits: a process that used the NIXL path exits 0 on SIGTERM (UCX torn down in order, also
with a transfer still fenced at the reaper), and a node started with --exit-with-parent leaves
with its parent, even a SIGKILLed one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

from kvpool.bench import procs

CLIENT = textwrap.dedent("""
    import signal, sys, threading
    import numpy as np
    from kvpool.client import Client
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with Client(sys.argv[1], path="nixl", timeout_s=float(sys.argv[2])) as client:
        buf = np.arange(1 << 20, dtype=np.uint8)
        client.register(buf)
        print("statuses", client.put_from([sys.argv[3]], [[buf.ctypes.data]], [[1 << 20]]), flush=True)
        print("ready", flush=True)
        stop.wait(60)
    print("bye", flush=True)
""")


def _client(address: str, key: str, timeout_s: float, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CLIENT, address, str(timeout_s), key], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, **(env or {})})


def _until_ready(proc: subprocess.Popen) -> list[str]:
    lines = []
    for line in proc.stdout:
        lines.append(line.strip())
        if line.strip() == "ready":
            return lines
    raise AssertionError(f"client exited early: {lines}")


def test_a_nixl_client_exits_0_on_sigterm(make_pool):
    pool = make_pool(num_nodes=1)
    proc = _client(pool.address, "k", 5.0)
    assert _until_ready(proc)[0] == "statuses [0]"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0 and proc.stdout.read().strip() == "bye"


def test_a_nixl_client_with_a_fenced_transfer_still_exits_0(tmp_path):
    env = {"UCX_TLS": "tcp"}  # a transfer to a stopped node then stays in flight (see test_integrity)
    master = procs.start_master(tmp_path)
    node = procs.start_node(tmp_path, master.info["address"], "8MiB", name="node", env=env)
    os.kill(node.pid, signal.SIGSTOP)
    try:
        proc = _client(master.info["address"], "stuck", 0.5, env)
        assert _until_ready(proc)[0] == "statuses [3]"  # PUT_FAILED: fenced at the reaper
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        os.kill(node.pid, signal.SIGCONT)
        node.stop(grace_s=5.0)
        master.stop(grace_s=5.0)


def test_a_node_with_exit_with_parent_leaves_with_its_parent(make_pool, tmp_path):
    pool = make_pool(num_nodes=0)
    ready = tmp_path / "child.ready.json"
    parent = subprocess.Popen([
        sys.executable, "-c",
        "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); time.sleep(60)",
        *procs.kvpool_argv("node", "--master", pool.address, "--memory", "4MiB", "--node-id", "child",
                           "--exit-with-parent", "--ready-file", str(ready)),
    ])  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert time.monotonic() < deadline, "the node did not mount"
            time.sleep(0.05)
        node_pid = json.loads(ready.read_text())["pid"]
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while _alive(node_pid):
            assert time.monotonic() < deadline, "the node outlived its parent"
            time.sleep(0.05)
    finally:
        if parent.poll() is None:
            parent.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
