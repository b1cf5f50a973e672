"""`kvpool router --policy cache_aware` in front of two real vLLM-CPU servers publishing their KV
events: a session's second turn goes to the server that holds its first turn's prefix (also when
the turn comes under another session id, so no session affinity can explain it), and chat
requests work through the router with the tiny model's tokenizer and chat template."""

import json
import re
import time
import urllib.request

import pytest

from kvpool.bench import procs
from kvpool.bench.prompts import TokenSpace
from kvpool.bench.tiny_model import TinyLlamaConfig, write_tiny_llama
from kvpool.bench.tiny_tokenizer import write_tiny_tokenizer

pytestmark = pytest.mark.vllm

MAX_MODEL_LEN = 2048


def post(url: str, body: dict, headers: dict | None = None) -> dict | list[dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=300) as r:
        raw = r.read().decode()
    if not body.get("stream"):
        return json.loads(raw)
    return [json.loads(line[5:]) for line in raw.splitlines() if line.startswith("data:") and "[DONE]" not in line]


def access_line(log, session, timeout_s=10.0):
    """The router's access log line of `session` (written as the response ends: wait for it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [line for line in log.read_text().splitlines() if f"session={session}(" in line] if log.exists() else []
        if lines or time.monotonic() > deadline:
            assert lines, f"no access log line for {session}"
            return lines[-1]
        time.sleep(0.05)


def backend_of(line: str) -> str:
    return re.search(r"backend=(\S+)", line).group(1)


def test_cache_aware_sends_turn_two_where_its_prefix_is(tmp_path, vllm_cache_root):
    model = write_tiny_llama(tmp_path / "model", TinyLlamaConfig(max_position_embeddings=MAX_MODEL_LEN))
    write_tiny_tokenizer(model, 8000, MAX_MODEL_LEN)
    servers = [procs.start_vllm_server(tmp_path, model, name=f"vllm{i}", kv_cache_memory_bytes=32 * 2**20,
                                       max_model_len=MAX_MODEL_LEN, kv_events=True, tokenizer=model,
                                       cpu_bind=str(i % 2), cache_root=vllm_cache_root, wait=False)
               for i in range(2)]  # fmt: skip
    router = None
    try:
        for s in servers:
            procs.wait_http_ok(s, s.info["url"] + "/health", 400)
        log = tmp_path / "access.log"
        router = procs.start_router(tmp_path, [s.info["url"] for s in servers], "--policy", "cache_aware",
                                    "--access-log", str(log),
                                    *[a for s in servers for a in ("--kv-events", s.info["kv_events"])])  # fmt: skip
        url = router.info["url"]
        space = TokenSpace(vocab_size=8000)
        firsts = {}
        for k in range(3):
            prompt = space.tail(f"s{k}", 0, 400)
            chunks = post(url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 4, "min_tokens": 4,
                                                    "ignore_eos": True, "stream": True, "return_token_ids": True},
                          {"x-session-id": f"s{k}"})  # fmt: skip
            output = [t for c in chunks for ch in c.get("choices", []) for t in ch.get("token_ids") or []]
            firsts[k] = (prompt, output, backend_of(access_line(log, f"s{k}")))
        time.sleep(1.0)  # the engines publish their events after each step: let the router read them
        for k, (prompt, output, first_backend) in firsts.items():
            turn2 = prompt + output + space.tail(f"s{k}", 1, 100)
            answer = post(url + "/v1/completions", {"model": "tiny", "prompt": turn2, "max_tokens": 2, "stream": False},
                          {"x-session-id": f"other-{k}"})  # fmt: skip
            line = access_line(log, f"other-{k}")
            assert backend_of(line) == first_backend, line
            local = int(re.search(r" local=(\d+)", line).group(1))
            assert "reason=local" in line and 300 <= local <= 400, line  # turn 1's prompt, in whole blocks
            assert answer["usage"]["prompt_tokens"] == len(turn2)
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert 'kvpool_router_decisions_total{policy="cache_aware",reason="local"} 3.0' in metrics

        chat = post(url + "/v1/chat/completions", {"model": "tiny", "max_tokens": 5,
                                                   "messages": [{"role": "user", "content": "hello from a chat client"}]})  # fmt: skip
        assert chat["choices"][0]["message"]["role"] == "assistant"
        assert isinstance(chat["choices"][0]["message"]["content"], str) and chat["usage"]["completion_tokens"] == 5
        streamed = post(url + "/v1/chat/completions", {"model": "tiny", "max_tokens": 3, "stream": True,
                                                       "messages": [{"role": "user", "content": "again"}]})  # fmt: skip
        assert sum(1 for c in streamed if c["choices"] and c["choices"][0]["delta"].get("content") is not None) >= 1
    finally:
        if router is not None:
            assert router.stop() == 0
        for s in servers:
            s.stop()
