"""The router against small local servers: streaming passed through, health checks taking a
backend out and back, retries of failures before the first byte (refused, reset, 503, a
kept-alive connection closed on reuse), an OpenAI error event for a stream cut mid-way,
session stickiness, and /health, /metrics."""

import asyncio
import time

import aiohttp
from router_fakes import FakeBackend, IdleClosingBackend, RunningRouter, served_by, stream, wait_for

from kvpool.router.config import RouterConfig
from kvpool.router.prefix_index import prompt_chain


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def config(*urls, **kw) -> RouterConfig:
    return RouterConfig(backends=tuple(urls), **{"health_interval_s": 0.1, "health_timeout_s": 1.0, **kw})


async def start(*names, **kw):
    return [await FakeBackend(n, **kw).start() for n in names]


def test_streams_are_passed_through_token_by_token():
    async def main():
        (a,) = await start("a", num_tokens=5, token_delay_s=0.3)
        try:
            async with RunningRouter(config(a.url)) as router, aiohttp.ClientSession() as http:
                t0 = time.perf_counter()
                arrivals = []
                async with http.post(router.url + "/v1/completions", json={"prompt": [1, 2, 3], "stream": True}) as r:
                    assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
                    async for raw in r.content:
                        if raw.startswith(b"data:"):
                            arrivals.append(time.perf_counter() - t0)
                assert len(arrivals) == 6  # 5 tokens + [DONE]
                assert arrivals[0] < arrivals[-1] - 1.0  # the first token came long before the end
                assert a.requests[0]["body"]["prompt"] == [1, 2, 3]
        finally:
            await a.stop()

    run(main())


def test_unhealthy_backend_leaves_the_rotation_and_returns():
    async def main():
        a, b = await start("a", "b")
        try:
            async with RunningRouter(config(a.url, b.url)) as router, aiohttp.ClientSession() as http:
                seen = [served_by((await stream(http, router.url, {"prompt": [1]}))[1]) for _ in range(4)]
                assert seen == [{"a"}, {"b"}, {"a"}, {"b"}]
                b.healthy = False
                await wait_for(lambda: not router.router.backends[1].healthy)
                seen = [served_by((await stream(http, router.url, {"prompt": [1]}))[1]) for _ in range(4)]
                assert seen == [{"a"}] * 4
                async with http.get(router.url + "/health") as r:
                    assert r.status == 200 and (await r.json())["unhealthy"] == {b.url: "/health answered 503"}
                b.healthy = True
                await wait_for(lambda: router.router.backends[1].healthy)
                seen = {frozenset(served_by((await stream(http, router.url, {"prompt": [1]}))[1])) for _ in range(4)}
                assert seen == {frozenset({"a"}), frozenset({"b"})}
                a.healthy = b.healthy = False
                await wait_for(lambda: not any(x.healthy for x in router.router.backends))
                async with http.get(router.url + "/health") as r:
                    assert r.status == 503
                status, body = await stream(http, router.url, {"prompt": [1]})
                assert status == 503 and "none of the 2 backends is healthy" in body[0]["error"]["message"]
        finally:
            await a.stop()
            await b.stop()

    run(main())


def test_a_dead_backend_costs_no_failed_request():
    async def main():
        a, b = await start("a", "b")
        dead_url = b.url
        await b.stop()  # connection refused from now on
        try:
            async with RunningRouter(config(a.url, dead_url, health_interval_s=30.0)) as router, \
                    aiohttp.ClientSession() as http:  # fmt: skip
                results = [await stream(http, router.url, {"prompt": [1]}) for _ in range(6)]
                assert [s for s, _ in results] == [200] * 6
                assert all(served_by(ev) == {"a"} and ev[-1] == "[DONE]" for _, ev in results)
                assert not router.router.backends[1].healthy  # taken out by failed requests, not a check
                async with http.get(router.url + "/metrics") as r:
                    text = await r.text()
                assert 'kvpool_router_retries_total{reason="connect"}' in text
                assert f'kvpool_router_backend_healthy{{backend="{dead_url}"}} 0.0' in text
        finally:
            await a.stop()

    run(main())


def test_failure_before_the_first_byte_is_retried_elsewhere():
    async def main():
        a, b = await start("a", "b")
        try:
            for mode in ("die_before_first_chunk", "status503"):
                a.mode = mode
                async with RunningRouter(config(a.url, b.url, health_interval_s=30.0)) as router, \
                        aiohttp.ClientSession() as http:  # fmt: skip
                    status, events = await stream(http, router.url, {"prompt": [1]})  # round robin: a first
                    assert status == 200 and served_by(events) == {"b"} and events[-1] == "[DONE]", (mode, events)
                    assert len(a.requests) >= 1
                a.requests.clear()
            a.mode = b.mode = "status503"
            async with RunningRouter(config(a.url, b.url, health_interval_s=30.0)) as router, \
                    aiohttp.ClientSession() as http:  # fmt: skip
                status, body = await stream(http, router.url, {"prompt": [1]})
                assert status == 502 and "3 attempts failed" in body[0]["error"]["message"]
        finally:
            await a.stop()
            await b.stop()

    run(main())


def test_a_stream_cut_mid_way_ends_with_an_openai_error_event():
    async def main():
        a, b = await start("a", "b", num_tokens=5)
        a.mode = "die_mid_stream"
        try:
            async with RunningRouter(config(a.url, b.url, health_interval_s=30.0)) as router, \
                    aiohttp.ClientSession() as http:  # fmt: skip
                status, events = await stream(http, router.url, {"prompt": [1]})
                assert status == 200
                assert [e["choices"][0]["text"] for e in events[:2]] == ["t0", "t1"]  # what a sent
                assert "error" in events[2] and "failed mid-stream" in events[2]["error"]["message"]
                assert events[3] == "[DONE]" and len(events) == 4
                assert len(b.requests) == 0  # half a stream is never sent twice
        finally:
            await a.stop()
            await b.stop()

    run(main())


def test_a_kept_alive_connection_closed_on_reuse_is_retried():
    async def main():
        backend = await IdleClosingBackend().start()
        try:
            async with RunningRouter(config(backend.url, health_interval_s=30.0)) as router, \
                    aiohttp.ClientSession() as http:  # fmt: skip
                results = [await stream(http, router.url, {"prompt": [1]}) for _ in range(5)]
                assert [s for s, _ in results] == [200] * 5
                assert backend.answered == 5 and backend.closed_on_reuse >= 1  # the race happened, unseen
                assert router.router.backends[0].healthy  # a stale socket is no dead backend
        finally:
            await backend.stop()

    run(main())


def test_session_policy_keeps_a_session_on_one_backend():
    async def main():
        backends = await start("a", "b", "c")
        try:
            async with RunningRouter(config(*(b.url for b in backends), policy="session")) as router, \
                    aiohttp.ClientSession() as http:  # fmt: skip
                homes = {}
                for k in range(12):
                    sid = f"s{k % 4}"
                    _, events = await stream(http, router.url, {"prompt": [k]}, headers={"x-session-id": sid})
                    homes.setdefault(sid, set()).update(served_by(events))
                assert all(len(v) == 1 for v in homes.values()), homes
                for user in ("alice", "bob"):  # the `user` field identifies a session too
                    got = {frozenset(served_by((await stream(http, router.url, {"prompt": [1], "user": user}))[1]))
                           for _ in range(3)}  # fmt: skip
                    assert len(got) == 1
        finally:
            for b in backends:
                await b.stop()

    run(main())


def test_models_and_non_streamed_requests_are_forwarded():
    async def main():
        (a,) = await start("a")
        try:
            async with RunningRouter(config(a.url)) as router, aiohttp.ClientSession() as http:
                async with http.get(router.url + "/v1/models") as r:
                    assert r.status == 200 and (await r.json())["data"][0]["served_by"] == "a"
                async with http.post(router.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 3}) as r:
                    assert r.status == 200 and (await r.json())["served_by"] == "a"
                async with http.get(router.url + "/metrics") as r:
                    text = await r.text()
                assert 'kvpool_router_requests_total{backend="' + a.url + '",status="2xx"} 2.0' in text
                assert 'kvpool_router_decisions_total{policy="round_robin",reason="next"}' in text
        finally:
            await a.stop()

    run(main())


def test_load_in_flight_is_taken_back_when_requests_end():
    async def main():
        a, b = await start("a", "b", num_tokens=3, token_delay_s=0.2)
        try:
            async with RunningRouter(config(a.url, b.url, policy="least_loaded")) as router, \
                    aiohttp.ClientSession() as http:  # fmt: skip
                first = asyncio.create_task(stream(http, router.url, {"prompt": list(range(100)), "max_tokens": 50}))
                await wait_for(lambda: router.router.backends[0].inflight_requests == 1)
                assert router.router.backends[0].inflight_decode_tokens == 50
                _, events = await stream(http, router.url, {"prompt": [1], "max_tokens": 5})
                assert served_by(events) == {"b"}  # a is busy
                await first
                assert [(x.inflight_requests, x.inflight_prompt_tokens, x.inflight_decode_tokens)
                        for x in router.router.backends] == [(0, 0, 0), (0, 0, 0)]  # fmt: skip
        finally:
            await a.stop()
            await b.stop()

    run(main())


def test_a_backend_slow_to_answer_shows_its_oldest_wait_and_cache_aware_routes_around_it():
    # the wiring: send times and first bytes reach the backend's oldest wait and its metric (which
    # way the policy weighs it against tokens in flight: test_router_policy)
    async def main():
        a, b = await start("a", "b")
        a.first_byte_delay_s = 2.0  # a's queue: invisible in the tokens the router sent it
        try:
            async with RunningRouter(config(a.url, b.url, policy="cache_aware")) as router, \
                    aiohttp.ClientSession() as http:  # fmt: skip
                routes = router.router.backends
                waiting = [asyncio.create_task(stream(http, router.url, {"prompt": [k], "max_tokens": 1},
                                                      headers={"x-session-id": f"s{k}"})) for k in range(6)]  # fmt: skip
                await wait_for(lambda: routes[0].inflight_requests >= 1)
                await asyncio.sleep(0.5)
                async with http.get(router.url + "/metrics") as r:
                    text = await r.text()
                wait_a = float(text.split(f'kvpool_router_backend_oldest_wait_seconds{{backend="{a.url}"}} ')[1].split()[0])
                assert 0.4 < wait_a < 2.0  # a request has sat on a for about half a second
                later = [served_by((await stream(http, router.url, {"prompt": [100 + k], "max_tokens": 1},
                                                 headers={"x-session-id": f"s{k}"}))[1]) for k in range(6)]  # fmt: skip
                assert all(s == {"b"} for s in later), later  # the same sessions, now all on b
                await asyncio.gather(*waiting)
                assert [x.oldest_wait_s(1e12) for x in routes] == [0.0, 0.0]  # every wait ended
        finally:
            await a.stop()
            await b.stop()

    run(main())


def test_prompt_chain_is_by_whole_blocks():
    assert len(prompt_chain(list(range(10)), 4)) == 2
    assert prompt_chain([1, 2, 3, 4], 4) == prompt_chain([1, 2, 3, 4, 5], 4)
    assert prompt_chain([1, 2, 3, 4], 4) != prompt_chain([1, 2, 3, 5], 4)


def test_access_log_shows_the_cache_aware_estimate_for_each_backend(caplog):
    urls = []

    async def main():
        a, b = await start("a", "b")
        urls.extend([a.url, b.url])
        try:
            async with RunningRouter(config(a.url, b.url, policy="cache_aware")) as router, aiohttp.ClientSession() as http:
                await stream(http, router.url, {"prompt": list(range(40))}, headers={"x-session-id": "s1"})
        finally:
            await a.stop()
            await b.stop()

    with caplog.at_level("INFO", logger="kvpool.router.access"):
        run(main())
    line = next(r.getMessage() for r in caplog.records if "/v1/completions" in r.getMessage())
    estimates = line.split(" est=")[1].split(",")
    assert [e.rsplit(":", 1)[0] for e in estimates] == urls  # one per backend, in the router's order
    for e in estimates:
        ttft, queue = map(float, e.rsplit(":", 1)[1].split("/"))
        assert ttft > queue == 0.0  # 40 cold tokens on an idle backend: some prefill, no queue
