"""Late binding (--max-waiting): completions wait at the router until a backend has room, then go
to the one that has it; a held client that leaves gives its place up; off by default."""

import asyncio

import aiohttp
import pytest
from router_fakes import FakeBackend, RunningRouter, served_by, stream, wait_for

from kvpool.router.config import RouterConfig


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def config(*urls, **kw) -> RouterConfig:
    return RouterConfig(backends=tuple(urls), **{"health_interval_s": 0.1, "health_timeout_s": 1.0, **kw})


def metric(text: str, name: str) -> float:
    return float(next(line for line in text.splitlines() if line.startswith(name + " ")).split()[1])


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware"])
def test_requests_wait_at_the_router_and_go_to_the_backend_that_frees_up(policy):
    async def main():
        slow = await FakeBackend("slow", first_byte_delay_s=3.0).start()
        fast = await FakeBackend("fast", first_byte_delay_s=0.1).start()
        try:
            async with RunningRouter(config(slow.url, fast.url, policy=policy, max_waiting=1)) as router, \
                    aiohttp.ClientSession() as http:  # fmt: skip
                tasks = [asyncio.create_task(stream(http, router.url, {"prompt": [k], "max_tokens": 1},
                                                    headers={"x-session-id": f"s{k}"})) for k in range(8)]  # fmt: skip
                await wait_for(lambda: slow.unanswered == 1)
                async with http.get(router.url + "/metrics") as r:
                    assert metric(await r.text(), "kvpool_router_held_requests") >= 1  # the rest wait at the router
                results = await asyncio.gather(*tasks)
                assert all(status == 200 for status, _ in results)
                by = [served_by(events) for _, events in results]
                # sent as they arrived, half would have queued behind slow's 3 s; held, only the
                # one slow took at once did: the others went to fast as it freed up
                assert by.count({"slow"}) == 1 and by.count({"fast"}) == 7, by
                assert slow.max_unanswered == 1 and fast.max_unanswered == 1
                assert router.router.gate.waiting == 0
                async with http.get(router.url + "/metrics") as r:
                    text = await r.text()
                assert metric(text, "kvpool_router_held_requests") == 0
                assert metric(text, "kvpool_router_held_seconds_count") == 8
        finally:
            await slow.stop()
            await fast.stop()

    run(main())


def test_a_held_client_that_leaves_gives_up_its_place():
    async def main():
        (a,) = [await FakeBackend("a", first_byte_delay_s=0.5).start()]
        try:
            async with RunningRouter(config(a.url, max_waiting=1)) as router, aiohttp.ClientSession() as http:
                first = asyncio.create_task(stream(http, router.url, {"prompt": [1], "max_tokens": 1}))
                await wait_for(lambda: a.unanswered == 1)
                leaving = asyncio.create_task(stream(http, router.url, {"prompt": [2], "max_tokens": 1}))
                await wait_for(lambda: router.router.gate.waiting == 1)
                leaving.cancel()  # the client hangs up while held
                await wait_for(lambda: router.router.gate.waiting == 0)
                status, events = await stream(http, router.url, {"prompt": [3], "max_tokens": 1})
                assert status == 200 and served_by(events) == {"a"}
                assert (await first)[0] == 200
                assert len(a.requests) == 2  # the one that left never reached the backend
        finally:
            await a.stop()

    run(main())


def test_off_by_default_every_request_is_sent_at_once():
    async def main():
        a, b = [await FakeBackend(n, first_byte_delay_s=0.5).start() for n in ("a", "b")]
        try:
            async with RunningRouter(config(a.url, b.url)) as router, aiohttp.ClientSession() as http:
                results = await asyncio.gather(*[stream(http, router.url, {"prompt": [k], "max_tokens": 1})
                                                 for k in range(6)])  # fmt: skip
                assert all(status == 200 for status, _ in results)
                assert a.max_unanswered == 3 and b.max_unanswered == 3
                assert not router.router.gate.enabled
        finally:
            await a.stop()
            await b.stop()

    run(main())


def test_non_streamed_requests_are_not_held():
    # their first byte is their end: holding them would cap what runs on a backend, not what queues
    async def main():
        (a,) = [await FakeBackend("a", first_byte_delay_s=0.5).start()]
        try:
            async with RunningRouter(config(a.url, max_waiting=1)) as router, aiohttp.ClientSession() as http:
                async def plain(k):
                    async with http.post(router.url + "/v1/completions", json={"prompt": [k], "max_tokens": 1}) as r:
                        return r.status

                assert await asyncio.gather(*[plain(k) for k in range(3)]) == [200, 200, 200]
                assert a.max_unanswered == 3
        finally:
            await a.stop()

    run(main())


def test_max_waiting_must_not_be_negative():
    with pytest.raises(ValueError, match="--max-waiting"):
        RouterConfig(backends=("http://127.0.0.1:1",), max_waiting=-1)
