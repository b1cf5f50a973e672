"""Two vLLM OpenAI servers on two hosts share one pool on a third: turn 2 of a conversation, sent to
the server that never saw turn 1, loads the whole history from the pool, including turn 1's output
(decode-phase KV). Each host is a network + PID + mount namespace of its own (kvpool.bench.hosts),
so the KV takes the path a cluster's does: NIXL over UCX's TCP transport between hosts, checked
from UCX's own log, never a same-host shortcut. The pool is an authenticated one (`kvpool master
--auth`): the node, both connectors (one tenant identity, from kv_connector_extra_config) and the
test's admin client all connect over CURVE, across hosts."""

from __future__ import annotations

import json
import random
import subprocess
import time

import pytest

from kvpool.bench import hosts, procs
from kvpool.bench.tiny_model import TinyLlamaConfig, write_tiny_llama
from kvpool.rpc.credentials import AuthDir

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 32


@pytest.fixture
def net():
    reason = hosts.why_unavailable()
    if reason is not None:
        pytest.skip(f"multi-host harness unavailable: {reason}")
    network = hosts.HostNetwork(["pool", "vllm0", "vllm1"])
    try:
        network.create()
    except hosts.HostsUnavailable as e:
        pytest.skip(f"cannot make network namespaces here: {e}")
    try:
        yield network
    finally:
        network.remove()


def inside(host: hosts.Host, argv: list[str], timeout_s: float = 120.0) -> str:
    """Run `argv` in `host` (this process cannot reach the hosts' network); its stdout."""
    done = subprocess.run(host.wrap(argv), capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise AssertionError(f"{argv[0]} in host {host.name} exited {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout


def complete(host: hosts.Host, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    return json.loads(inside(host, ["curl", "-sf", "--max-time", "120", "-H", "Content-Type: application/json",
                                    "-d", json.dumps(body), url + "/v1/completions"]))  # fmt: skip


def metric(host: hosts.Host, url: str, name: str) -> float:
    text = inside(host, ["curl", "-sf", "--max-time", "30", url + "/metrics"])
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def pool_stats(host: hosts.Host, master: str, credential: str) -> dict:
    return json.loads(inside(host, procs.kvpool_argv("status", "--master", master, "--credential", credential, "--json")))


def test_turn_two_on_another_host_hits_the_whole_history(net, tmp_path, vllm_cache_root):
    auth = AuthDir(tmp_path / "auth")
    auth.init(("admin", "node"))
    fleet = auth.add("tenant:fleet")
    admin = str(auth.path / "admin.cred")
    pool_host = net["pool"]
    started: list[procs.ManagedProcess] = []
    try:
        master_argv = procs.kvpool_argv("master", "--auth", str(auth.path), "--host", pool_host.address, "--port", "0")
        master = procs.ManagedProcess("master", pool_host.wrap(master_argv), tmp_path)
        started.append(master.start(30))
        node_argv = procs.kvpool_argv("node", "--master", master.info["address"], "--memory", "64MiB",
                                      "--node-id", "node", "--credential", str(auth.path / "node.cred"))  # fmt: skip
        started.append(procs.ManagedProcess("node", pool_host.wrap(node_argv), tmp_path).start(60))
        model = write_tiny_llama(tmp_path / "model", TinyLlamaConfig(dtype="float32"))
        kv_transfer_config = {
            "kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"master_address": master.info["address"], "credential": str(fleet)},
        }  # fmt: skip
        servers = [
            procs.start_vllm_server(
                tmp_path, model, name=f"vllm{i}", kv_cache_memory_bytes=32 << 20, max_model_len=1024,
                kv_transfer_config=kv_transfer_config, cpu_bind=str(i), cache_root=vllm_cache_root,
                extra_args=("--block-size", str(BLOCK_SIZE), "--dtype", "float32"), wait=False,
                extra_env={"UCX_LOG_LEVEL": "info"}, host=net[f"vllm{i}"],
            )
            for i in range(2)
        ]  # fmt: skip
        started.extend(servers)
        for server, i in zip(servers, range(2)):
            procs.wait_http_ok(server, server.info["url"] + "/health", 240, net[f"vllm{i}"])
        url1, url2 = (s.info["url"] for s in servers)

        rng = random.Random(7)
        turn1 = [rng.randrange(10, 7990) for _ in range(100)]
        answer1 = complete(pool_host, url1, turn1, max_tokens=40)["choices"][0]["token_ids"]
        history = turn1 + answer1  # 140 tokens: 4 full blocks, the 4th mostly turn 1's output
        deadline = time.monotonic() + 30  # saves run in the background
        while pool_stats(pool_host, master.info["address"], admin)["num_objects"] < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        turn2 = history + [rng.randrange(10, 7990) for _ in range(20)]
        reply2 = complete(pool_host, url2, turn2, max_tokens=8)
        cached = reply2["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == 4 * BLOCK_SIZE  # every full block of the history, output included
        assert metric(pool_host, url2, "vllm:external_prefix_cache_hits_total") == 4 * BLOCK_SIZE
        assert metric(pool_host, url2, "vllm:kvpool_loaded_blocks_total") == 4
        stats = pool_stats(pool_host, master.info["address"], admin)
        assert {t["tenant"] for t in stats["tenants"]} == {"fleet"}  # both servers wrote as the one tenant
        # server 1 answers turn 2 from its own prefix cache: the same tokens
        assert complete(pool_host, url1, turn2, max_tokens=8)["choices"][0]["token_ids"] == reply2["choices"][0]["token_ids"]
        # the KV crossed hosts over TCP: every inter-node UCX lane of both servers is tcp, and
        # each server's workers did open such lanes (to the node on the pool's host)
        for server in servers:
            lanes = hosts.ucx_lanes(server.log_file.read_text(errors="replace"))
            remote = [tls for scope, tls in lanes if scope == "inter-node"]
            assert remote and all(tls == {"tcp"} for tls in remote), (server.name, lanes)
    finally:
        for proc in reversed(started):
            proc.stop(grace_s=10.0)
