"""`kvpool router --tokenizer`: chat and text prompts are tokenized as vLLM does, so cache_aware
matches them against what a backend's KV events say it holds, like token-id prompts."""

import asyncio
import json

import aiohttp
from router_fakes import FakeBackend, RunningRouter, served_by, wait_for
from test_router_kv_events import Publisher, stored

from kvpool.bench.tiny_tokenizer import write_tiny_tokenizer
from kvpool.router.config import RouterConfig
from kvpool.router.prompt_tokens import PromptTokenizer

BS = 16
MESSAGES = [{"role": "system", "content": "You are a careful coding agent. " * 8},
            {"role": "user", "content": "Read src/kvpool/router/app.py and explain _plan."}]  # fmt: skip


async def chat(http, url, messages, session):
    body = {"model": "tiny", "messages": messages, "stream": True}
    async with http.post(url + "/v1/chat/completions", json=body, headers={"x-session-id": session}) as r:
        assert r.status == 200
        raw = await r.text()
    return [json.loads(line[5:]) for line in raw.splitlines() if line.startswith("data:") and "[DONE]" not in line]


def test_chat_prompts_are_matched_against_the_backends_caches(tmp_path):
    model = str(write_tiny_tokenizer(tmp_path / "tok", vocab_size=400))
    ids = PromptTokenizer(model).token_ids("/v1/chat/completions", {"messages": MESSAGES})
    held = ids[: len(ids) // BS * BS]
    assert len(held) >= 4 * BS

    async def main():
        a, b = FakeBackend("a"), FakeBackend("b")
        await a.start()
        await b.start()
        pubs = [Publisher(), Publisher()]
        cfg = RouterConfig(backends=(a.url, b.url), policy="cache_aware", kv_events=tuple(p.endpoint for p in pubs),
                           tokenizer=model, health_interval_s=0.2)  # fmt: skip
        try:
            async with RunningRouter(cfg) as running, aiohttp.ClientSession() as http:
                cache_b = running.router.backends[1].cache
                hashes = [b"h%d" % i for i in range(len(held) // BS)]
                while cache_b.num_events == 0:
                    pubs[1].publish({**stored(hashes, None, held), "block_size": BS})
                    await asyncio.sleep(0.05)
                for k in range(6):
                    assert served_by(await chat(http, running.url, MESSAGES, f"s{k}")) == {"b"}
                async with http.get(running.url + "/metrics") as r:
                    text = await r.text()
                assert 'kvpool_router_decisions_total{policy="cache_aware",reason="local"} 6.0' in text
                assert f"kvpool_router_prompt_tokens_total {6.0 * len(ids)}" in text  # sized exactly
                assert "kvpool_router_tokenize_seconds_count 6.0" in text
                await wait_for(lambda: len(b.requests) == 6)
                assert b.requests[0]["body"]["messages"] == MESSAGES  # forwarded as it came
        finally:
            for pub in pubs:
                pub.close()
            await a.stop()
            await b.stop()

    asyncio.run(main())
