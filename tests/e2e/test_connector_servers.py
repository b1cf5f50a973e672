"""Two vLLM OpenAI servers share one pool: turn 2 of a conversation, sent to the server that never
saw turn 1, loads the whole history from the pool, including turn 1's output (decode-phase KV).
The pool is an authenticated one (`kvpool master --auth`): the node, both connectors (one tenant
identity, from kv_connector_extra_config) and the test's admin client all connect over CURVE."""

from __future__ import annotations

import json
import random
import time
import urllib.request

import pytest

from kvpool.bench import procs
from kvpool.bench.tiny_model import TinyLlamaConfig, write_tiny_llama
from kvpool.client import Client
from kvpool.transfer.credentials import AuthDir

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 32


def complete(url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_turn_two_on_another_server_hits_the_whole_history(make_pool, tmp_path, vllm_cache_root):
    auth = AuthDir(tmp_path / "auth")
    auth.init(("admin", "node"))
    fleet = auth.add("tenant:fleet")
    pool = make_pool(num_nodes=0, master_args=("--auth", str(auth.path)))
    pool.add_node("64MiB", "--credential", str(auth.path / "node.cred"))
    model = write_tiny_llama(tmp_path / "model", TinyLlamaConfig(dtype="float32"))
    kv_transfer_config = {
        "kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool.connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"master_address": pool.address, "credential": str(fleet)},
    }  # fmt: skip
    servers = [
        procs.start_vllm_server(
            tmp_path, model, name=f"vllm{i}", kv_cache_memory_bytes=32 << 20, max_model_len=1024,
            kv_transfer_config=kv_transfer_config, cpu_bind=str(i), cache_root=vllm_cache_root,
            extra_args=("--block-size", str(BLOCK_SIZE), "--dtype", "float32"),
        )
        for i in range(2)
    ]  # fmt: skip
    try:
        url1, url2 = (s.info["url"] for s in servers)
        rng = random.Random(7)
        turn1 = [rng.randrange(10, 7990) for _ in range(100)]
        answer1 = complete(url1, turn1, max_tokens=40)["choices"][0]["token_ids"]
        history = turn1 + answer1  # 140 tokens: 4 full blocks, the 4th mostly turn 1's output
        with Client(pool.address, credential=str(auth.path / "admin.cred")) as client:  # saves run in the background
            deadline = time.monotonic() + 30
            while client.stats().num_objects < 4 and time.monotonic() < deadline:
                time.sleep(0.1)
        turn2 = history + [rng.randrange(10, 7990) for _ in range(20)]
        reply2 = complete(url2, turn2, max_tokens=8)
        cached = reply2["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == 4 * BLOCK_SIZE  # every full block of the history, output included
        assert metric(url2, "vllm:external_prefix_cache_hits_total") == 4 * BLOCK_SIZE
        assert metric(url2, "vllm:kvpool_loaded_blocks_total") == 4
        with Client(pool.address, credential=str(auth.path / "admin.cred")) as client:
            assert {t.tenant for t in client.stats().tenants} == {"fleet"}  # both servers wrote as the one tenant
        # server 1 answers turn 2 from its own prefix cache: the same tokens
        assert complete(url1, turn2, max_tokens=8)["choices"][0]["token_ids"] == reply2["choices"][0]["token_ids"]
    finally:
        for server in servers:
            server.stop()
