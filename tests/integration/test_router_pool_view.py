"""The router's exact view of the pool (--pooled --master): a real master and node evict from a tiny
pool while a publisher speaking vLLM's KV-event format tells the router which block is which; for
every prompt the router's answer equals a counting LookupPrefix on the master. And a master that
restarts (in process, same port) is followed into its new incarnation; a master records changes
only while someone follows."""

import asyncio
import hashlib
import time

import aiohttp
import zmq
from router_fakes import FakeBackend, RunningRouter, wait_for
from test_router_kv_events import Publisher

from kvpool.bench import procs
from kvpool.client import Client
from kvpool.core import protocol as p
from kvpool.master import MasterConfig
from kvpool.master import service as service_module
from kvpool.master.service import MasterService
from kvpool.router.config import RouterConfig
from kvpool.router.pool_feed import PoolFeed
from kvpool.router.pool_state import PoolIndex
from kvpool.router.prefix_index import prompt_chain
from kvpool.rpc.zmq_channel import MasterChannel

BS = 4
NUM_PROMPTS, NUM_BLOCKS = 6, 8
VALUE = bytes(256 << 10)  # past the master's inline limit: every object lives on the node


def prompts() -> list[list[int]]:
    return [[1000 * (k + 1) + i for i in range(NUM_BLOCKS * BS)] for k in range(NUM_PROMPTS)]


def engine_hashes(tokens: list[int]) -> list[bytes]:
    """Stand-ins for vLLM's chained block hashes (the router never computes them: it learns them)."""
    hashes, parent = [], b""
    for start in range(0, len(tokens), BS):
        parent = hashlib.sha256(parent + repr(tokens[start : start + BS]).encode()).digest()
        hashes.append(parent)
    return hashes


def stored_event(hashes: list[bytes], tokens: list[int]) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": tokens,
            "block_size": BS, "medium": "GPU"}  # fmt: skip


def put_chain(address: str, keys: list[str]) -> None:
    with Client(address) as client:
        parent = None
        for key in keys:
            client.put(key, VALUE, parent)
            parent = key


def master_seq(address: str) -> int:
    channel = MasterChannel(address)
    try:
        return channel.call(p.PoolEventsQuery(with_keys=False)).seq
    finally:
        channel.close()


def test_the_router_knows_what_a_tiny_pool_kept_after_evictions(make_pool):
    pool = make_pool(num_nodes=1, node_memory="4MiB")  # 16 objects; 48 are put

    async def main():
        backend = FakeBackend("a")
        await backend.start()
        pub = Publisher()
        cfg = RouterConfig(backends=(backend.url,), policy="cache_aware", kv_events=(pub.endpoint,), pooled=True,
                           master=pool.address, health_interval_s=0.2)  # fmt: skip
        try:
            async with RunningRouter(cfg) as running:
                router = running.router
                await asyncio.wait_for(router.pool_feed.ready.wait(), 10)
                cache = router.backends[0].cache
                texts = prompts()
                chains = [engine_hashes(t) for t in texts]
                while cache.num_events == 0:  # SUB sockets connect asynchronously
                    pub.publish(stored_event(chains[0], texts[0]))
                    await asyncio.sleep(0.05)
                for hashes, tokens in zip(chains[1:], texts[1:]):
                    pub.publish(stored_event(hashes, tokens))
                await wait_for(lambda: router.pool.num_recent == NUM_PROMPTS * NUM_BLOCKS)
                for hashes in chains:
                    await asyncio.to_thread(put_chain, pool.address, [h.hex() for h in hashes])
                seq = await asyncio.to_thread(master_seq, pool.address)
                await wait_for(lambda: router.pool.seq >= seq)
                with Client(pool.address) as client:
                    stats = client.stats()
                    direct = [client.lookup_prefix([h.hex() for h in hashes]) for hashes in chains]
                assert 0 < stats.num_objects < NUM_PROMPTS * NUM_BLOCKS  # the master evicted
                ours = [router.pool.prefix_blocks(prompt_chain(t, BS)) for t in texts]
                assert ours == direct and any(direct)
                assert router.pool.num_held == stats.num_objects and router.pool.num_pending == 0
                async with aiohttp.ClientSession() as http, http.get(running.url + "/metrics") as r:
                    text = await r.text()
                assert f'kvpool_router_pool_index_keys{{state="placed"}} {float(stats.num_objects)}' in text
        finally:
            pub.close()
            await backend.stop()

    asyncio.run(main())


def test_a_restarted_master_is_followed_into_its_new_incarnation(tmp_path):
    port = procs.free_port()
    config = MasterConfig(host="127.0.0.1", port=port, node_ttl_s=1000.0, alignment_bytes=64)

    def put_metadata(address: str, keys: list[str]) -> None:
        """Puts the master records without bytes (it never touches segment memory)."""
        channel = MasterChannel(address)
        try:
            channel.call(p.MountSegment("n1", "host", 1 << 30, 0, "agent", b""))
            started = channel.call(p.PutStart("t", keys, [64] * len(keys), [None] * len(keys)))
            channel.call(p.PutEnd("t", keys, started.tokens, [0] * len(keys)))
        finally:
            channel.close()

    async def main():
        first = MasterService(config).start()
        index = PoolIndex()
        feed = PoolFeed(first.address, index, probe_interval_s=0.2)
        feed.start()
        second = None
        try:
            await asyncio.wait_for(feed.ready.wait(), 10)
            await asyncio.to_thread(put_metadata, first.address, ["aa", "bb"])
            await wait_for(lambda: index.num_held == 2)
            old_epoch = index.epoch
            first.stop()
            second = MasterService(config).start()
            await asyncio.to_thread(put_metadata, second.address, ["cc"])
            await wait_for(lambda: index.epoch not in (None, old_epoch) and index.num_held == 1, timeout_s=10)
            assert feed.stats.resyncs.get("restart") == 1
        finally:
            await feed.stop()
            if second is not None:
                second.stop()
            first.stop()

    asyncio.run(main())


def test_the_master_records_only_while_someone_follows(monkeypatch):
    monkeypatch.setattr(service_module, "_EVENTS_GRACE_S", 0.2)
    master = MasterService(MasterConfig(host="127.0.0.1", port=0, tick_interval_s=0.05)).start()
    channel = MasterChannel(master.address)
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        events = master.core.index.events
        assert not events.recording  # nobody asked: puts record nothing
        offer = channel.call(p.PoolEventsQuery(with_keys=False))
        assert events.recording and offer.address == master.events_address
        sub.setsockopt(zmq.SUBSCRIBE, p.POOL_EVENTS_TOPIC)
        sub.connect(offer.address)
        time.sleep(0.5)  # past the grace period: the subscription keeps it on
        assert events.recording
        sub.close(linger=0)
        deadline = time.monotonic() + 5
        while events.recording and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not events.recording  # the last subscriber left
    finally:
        sub.close(linger=0)
        channel.close()
        master.stop()
