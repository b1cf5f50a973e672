"""The pool across separate hosts: a master on host `master`, storage nodes on `node1` and
`node2`, clients on `client`, each host a network + PID + mount namespace of its own
(kvpool.bench.hosts), so no same-host shortcut exists and the bytes take the cluster's path:
NIXL over UCX's TCP transport between hosts, or (path auto, no RDMA here) the nodes' segment
lanes for jobs of up to 4 MiB. Every byte read is compared."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.bench import hosts, procs
from kvpool.client import PUT_ALLOCATED

WORKER = Path(__file__).parent / "multihost_worker.py"
KiB = 1024
NUM_KEYS, SIZE_BYTES, REGIONS = 48, 256 * KiB, 4


@pytest.fixture
def cluster(tmp_path):
    reason = hosts.why_unavailable()
    if reason is not None:
        pytest.skip(f"multi-host harness unavailable: {reason}")
    net = hosts.HostNetwork(["master", "node1", "node2", "client"])
    try:
        net.create()
    except hosts.HostsUnavailable as e:
        pytest.skip(f"cannot make network namespaces here: {e}")
    started: list[procs.ManagedProcess] = []
    try:
        master_host = net["master"]
        argv = procs.kvpool_argv("master", "--insecure", "--host", master_host.address, "--port", "0", "--node-ttl-s", "3")
        master = procs.ManagedProcess("master", master_host.wrap(argv), tmp_path)
        started.append(master.start(30))
        nodes = {}
        for name in ("node1", "node2"):
            argv = procs.kvpool_argv("node", "--master", master.info["address"], "--memory", "64MiB", "--node-id", name)
            nodes[name] = procs.ManagedProcess(name, net[name].wrap(argv), tmp_path)
            started.append(nodes[name].start(60))
        yield net, master, nodes
    finally:
        for proc in reversed(started):
            proc.stop(grace_s=5.0)
        net.remove()
        assert not [ns for ns in hosts.existing_netns() if ns.startswith(net.switch.rsplit("-", 1)[0])]


def run_client(net: hosts.HostNetwork, master: procs.ManagedProcess, op: str, path: str = "auto") -> tuple[dict, str]:
    argv = [sys.executable, str(WORKER), op, "--master", master.info["address"], "--path", path, "--num-keys", str(NUM_KEYS),
            "--size-bytes", str(SIZE_BYTES), "--regions", str(REGIONS)]  # fmt: skip
    env = {**os.environ, "UCX_LOG_LEVEL": "info", "UCX_TLS": "tcp"}  # tcp: no RDMA, whatever the machine has
    done = subprocess.run(net["client"].wrap(argv), capture_output=True, text=True, timeout=60, env=env)
    if done.returncode != 0:
        raise AssertionError(f"client {op} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stdout + done.stderr


@pytest.mark.parametrize("path", ["nixl", "auto"])
def test_put_get_across_hosts_then_a_node_dies(cluster, path):
    net, master, nodes = cluster
    put, _ = run_client(net, master, "put", path)
    assert put["statuses"] == [PUT_ALLOCATED] * NUM_KEYS
    # three different hosts as kvpool sees them: the client's and both nodes'
    node_hosts = {name: n["host_id"] for name, n in put["nodes"].items()}
    assert len({put["host_id"], *node_hosts.values()}) == 3
    on_node = {name: n["num_objects"] for name, n in put["nodes"].items()}
    assert sum(on_node.values()) == NUM_KEYS and min(on_node.values()) > 0

    got, log = run_client(net, master, "get", path)  # another process, no state shared with the writer
    assert got["paths"] == ["nixl"]
    assert put["master_lane"] == got["master_lane"] == "tcp"  # the master's Unix socket is its host's only
    # auto (no RDMA here): every job over the segment lanes, the one-key gets (256 KiB) and the batch
    # (~6 MiB per node, but in 64 KiB regions); path nixl: everything by NIXL, over UCX's TCP only
    want = {"nixl": {"lane": 0, "nixl": 2 + NUM_KEYS}, "auto": {"lane": 2 + NUM_KEYS, "nixl": 0}}[path]
    assert {k: got["jobs"][k] for k in ("lane", "nixl")} == want
    if path == "nixl":  # no same-kernel transport between the hosts
        remote = [tls for scope, tls in hosts.ucx_lanes(log) if scope == "inter-node"]
        assert remote and all(tls == {"tcp"} for tls in remote), hosts.ucx_lanes(log)

    nodes["node1"].kill()  # SIGKILL: no unmount, the master learns it from the dead transfers or the TTL
    after, _ = run_client(net, master, "get", path)
    assert "wrong" not in after["outcome"]
    assert after["outcome"].count("ok") == on_node["node2"]
    assert after["outcome"].count("miss") == on_node["node1"]
    assert after["batch_wrong"] == []


HOLDER = """
import signal, sys, time
from kvpool.bench import hosts
# Ctrl-C as in a terminal, whatever this test inherited (a background job starts with SIGINT ignored,
# and the harness then keeps ignoring it after removing the namespaces, as it should)
signal.signal(signal.SIGINT, signal.default_int_handler)
net = hosts.HostNetwork(["a", "b"]).create()
print(" ".join([net.switch, *(h.netns for h in net.hosts.values())]), flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("how", ["sigint", "sigterm", "sigkill"])
def test_namespaces_are_removed_on_ctrl_c_term_and_after_a_kill(how):
    reason = hosts.why_unavailable()
    if reason is not None:
        pytest.skip(f"multi-host harness unavailable: {reason}")
    import signal

    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True)
    names = holder.stdout.readline().split()
    assert len(names) == 3 and set(names) <= set(hosts.existing_netns())
    holder.send_signal({"sigint": signal.SIGINT, "sigterm": signal.SIGTERM, "sigkill": signal.SIGKILL}[how])
    holder.wait(timeout=20)
    if how == "sigkill":  # nobody could clean up: the next harness sweeps what a dead run left
        assert set(names) <= set(hosts.existing_netns())
        assert set(names) <= set(hosts.sweep_stale())
    assert not set(names) & set(hosts.existing_netns())


def test_processes_of_one_host_share_it_and_other_hosts_differ():
    reason = hosts.why_unavailable()
    if reason is not None:
        pytest.skip(f"multi-host harness unavailable: {reason}")
    code = "import socket; from kvpool.transfer.hostinfo import host_id; print(host_id(), socket.gethostname())"
    with hosts.HostNetwork(["a", "b"]) as net:
        ids = [subprocess.run(net[h].wrap([sys.executable, "-c", code]), capture_output=True, text=True,
                              check=True).stdout.split() for h in ("a", "a", "b")]  # fmt: skip
        switch = net.switch
    assert ids[0] == ids[1] and ids[0][1] == "a"  # one machine: the same-host path stays possible there
    assert ids[2][0] != ids[0][0] and ids[2][1] == "b"
    assert ids[0][0] != subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.split()[0]
    assert not [ns for ns in hosts.existing_netns() if ns.startswith(switch.rsplit("-", 1)[0])]
