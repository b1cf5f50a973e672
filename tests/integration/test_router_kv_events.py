"""cache_aware routing from KV events: a ZMQ publisher speaking vLLM's wire format (topic,
sequence, msgpack KVEventBatch of tagged maps) tells the router what backend b holds; requests
with that prefix go to b, others spread, and a removal is seen."""

import asyncio
import time

import aiohttp
import msgspec
import zmq
from router_fakes import FakeBackend, RunningRouter, served_by, stream, wait_for

from kvpool.router.config import RouterConfig

BS = 16
PREFIX = list(range(1000, 1000 + 4 * BS))


class Publisher:
    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.seq = 0

    def publish(self, *events: dict) -> None:
        payload = msgspec.msgpack.encode([time.time(), list(events)])
        self.sock.send_multipart([b"", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def close(self) -> None:
        self.sock.close(linger=0)


def stored(hashes, parent, tokens):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, "medium": "GPU"}  # fmt: skip


def test_cache_aware_follows_the_prefix_the_events_report():
    async def main():
        a, b = FakeBackend("a"), FakeBackend("b")
        await a.start()
        await b.start()
        pubs = [Publisher(), Publisher()]
        cfg = RouterConfig(backends=(a.url, b.url), policy="cache_aware", kv_events=tuple(p.endpoint for p in pubs),
                           health_interval_s=0.2)  # fmt: skip
        try:
            async with RunningRouter(cfg) as running, aiohttp.ClientSession() as http:
                router = running.router
                cache_b = router.backends[1].cache
                # SUB sockets connect asynchronously: publish until the router has seen one event
                hashes = [b"h%d" % i for i in range(4)]
                while cache_b.num_events == 0:
                    pubs[1].publish(stored(hashes, None, PREFIX))
                    await asyncio.sleep(0.05)
                assert cache_b.block_size == BS
                sessions = [f"s{k}" for k in range(8)]
                for sid in sessions:
                    _, events = await stream(http, running.url, {"prompt": PREFIX + [7, 8, 9]},
                                             headers={"x-session-id": sid})  # fmt: skip
                    assert served_by(events) == {"b"}, sid
                # a prompt with no cached prefix: ties spread sessions over both
                cold = set()
                for sid in sessions:
                    _, events = await stream(http, running.url, {"prompt": [5] * 40}, headers={"x-session-id": sid})
                    cold |= served_by(events)
                assert cold == {"a", "b"}
                pubs[1].publish({"type": "BlockRemoved", "block_hashes": [hashes[0]], "medium": "GPU"})
                await wait_for(lambda: cache_b.prefix_blocks([]) == 0 and len(cache_b.present) == 3)
                picks = set()
                for sid in sessions:
                    _, events = await stream(http, running.url, {"prompt": PREFIX + [7]}, headers={"x-session-id": sid})
                    picks |= served_by(events)
                assert picks == {"a", "b"}  # b lost the prefix's first block: no longer preferred
                async with http.get(running.url + "/metrics") as r:
                    text = await r.text()
                assert 'kvpool_router_decisions_total{policy="cache_aware",reason="local"} 8.0' in text
                assert f'kvpool_router_local_prefix_tokens_total{{backend="{b.url}"}} {8 * 4 * BS}.0' in text
        finally:
            for p in pubs:
                p.close()
            await a.stop()
            await b.stop()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_pooled_backends_count_what_any_of_them_stored_as_pool_tokens():
    async def main():
        a, b = FakeBackend("a"), FakeBackend("b")
        await a.start()
        await b.start()
        pubs = [Publisher(), Publisher()]
        cfg = RouterConfig(backends=(a.url, b.url), policy="cache_aware", kv_events=tuple(p.endpoint for p in pubs),
                           pooled=True)  # fmt: skip
        try:
            async with RunningRouter(cfg) as running, aiohttp.ClientSession() as http:
                router = running.router
                while router.backends[0].cache.num_events == 0:
                    pubs[0].publish(stored([b"x0", b"x1"], None, PREFIX[: 2 * BS]))
                    await asyncio.sleep(0.05)
                pubs[0].publish({"type": "BlockRemoved", "block_hashes": [b"x0", b"x1"], "medium": "GPU"})
                await wait_for(lambda: not router.backends[0].cache.present)
                # a dropped them from its own cache; the pool (ledger) still has them
                await stream(http, running.url, {"prompt": PREFIX}, headers={"x-session-id": "s"})
                async with http.get(running.url + "/metrics") as r:
                    text = await r.text()
                assert f"kvpool_router_pool_prefix_tokens_total {2 * BS}.0" in text
                assert 'reason="pool"' in text
        finally:
            for p in pubs:
                p.close()
            await a.stop()
            await b.stop()

    asyncio.run(asyncio.wait_for(main(), 60))
