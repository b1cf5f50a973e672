"""The router in P/D mode against small local servers: the prefill request asks for remote decode
with one token and no stream, the decode request carries exactly the params the prefill returned
and the client's own max_tokens and stream; streams pass through; a session keeps its decode
instance; the policy places prefills over the prefill set only; failed prefills are retried
elsewhere and a failed decode redoes the request; a prefill without params is a clear 502;
/health, /v1/models, metrics, access log; the command line's mode errors."""

import asyncio
import time

import aiohttp
import pytest
from router_fakes import FakeBackend, RunningRouter, served_by, stream, wait_for
from test_router_kv_events import BS, PREFIX, Publisher, stored

from kvpool.cli import main as kvpool_main
from kvpool.router.config import RouterConfig
from kvpool.router.kv_transfer import REMOTE_DECODE


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def config(prefill, decode, **kw) -> RouterConfig:
    return RouterConfig(prefill=tuple(p.url for p in prefill), decode=tuple(d.url for d in decode),
                        **{"health_interval_s": 0.1, "health_timeout_s": 1.0, **kw})  # fmt: skip


async def fleet(num_prefill: int = 1, num_decode: int = 1, **kw) -> tuple[list[FakeBackend], list[FakeBackend]]:
    prefill = [await FakeBackend(f"p{i}", prefill=True, **kw).start() for i in range(num_prefill)]
    decode = [await FakeBackend(f"d{i}", **kw).start() for i in range(num_decode)]
    return prefill, decode


async def stop(*groups: list[FakeBackend]) -> None:
    for group in groups:
        for b in group:
            await b.stop()


def header(request: dict, name: str) -> str | None:
    return next((v for k, v in request["headers"].items() if k.lower() == name), None)


async def metrics(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url + "/metrics") as r:
        return await r.text()


def test_prefill_asks_for_remote_decode_and_decode_gets_exactly_its_params():
    async def main():
        (p,), (d,) = await fleet()
        try:
            async with RunningRouter(config([p], [d])) as router, aiohttp.ClientSession() as http:
                body = {"prompt": [1, 2, 3], "max_tokens": 7, "stream": True,
                        "stream_options": {"include_usage": True}, "min_tokens": 2}  # fmt: skip
                status, events = await stream(http, router.url, body)
                assert status == 200 and served_by(events) == {"d0"} and events[-1] == "[DONE]"
                sent = p.requests[0]["body"]
                assert sent["kv_transfer_params"] == REMOTE_DECODE
                assert sent["max_tokens"] == 1 and sent["stream"] is False
                assert "stream_options" not in sent and "min_tokens" not in sent and sent["prompt"] == [1, 2, 3]
                got = d.requests[0]["body"]
                assert got["kv_transfer_params"] == p.sent_params[0]  # exactly what the prefill returned
                assert got["max_tokens"] == 7 and got["stream"] is True
                assert got["stream_options"] == {"include_usage": True} and got["min_tokens"] == 2
                # both halves of one handoff carry the same request id
                assert header(p.requests[0], "x-request-id") == header(d.requests[0], "x-request-id")

                # chat, not streamed, with max_completion_tokens
                chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9}
                async with http.post(router.url + "/v1/chat/completions", json=chat, headers={"x-request-id": "r1"}) as r:
                    assert r.status == 200 and (await r.json())["served_by"] == "d0"
                sent, got = p.requests[1], d.requests[1]
                assert sent["body"]["max_completion_tokens"] == 1 and sent["body"]["max_tokens"] == 1
                assert got["body"]["max_completion_tokens"] == 9 and "max_tokens" not in got["body"]
                assert got["body"]["kv_transfer_params"] == p.sent_params[1] and "stream" not in got["body"]
                assert header(sent, "x-request-id") == header(got, "x-request-id") == "r1"
                assert d.received_params == p.sent_params
        finally:
            await stop([p], [d])

    run(main())


def test_decode_streams_are_passed_through_token_by_token():
    async def main():
        (p,), (d,) = await fleet()
        d.num_tokens, d.token_delay_s = 5, 0.3
        try:
            async with RunningRouter(config([p], [d])) as router, aiohttp.ClientSession() as http:
                t0 = time.perf_counter()
                arrivals = []
                async with http.post(router.url + "/v1/completions", json={"prompt": [1, 2], "stream": True}) as r:
                    assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
                    async for raw in r.content:
                        if raw.startswith(b"data:"):
                            arrivals.append(time.perf_counter() - t0)
                assert len(arrivals) == 6  # 5 tokens + [DONE]
                assert arrivals[0] < arrivals[-1] - 1.0
        finally:
            await stop([p], [d])

    run(main())


def test_a_session_keeps_its_decode_instance_and_new_sessions_spread():
    async def main():
        prefill, decode = await fleet(2, 3)
        try:
            async with RunningRouter(config(prefill, decode)) as router, aiohttp.ClientSession() as http:
                homes: dict[str, set[str]] = {}
                for k in range(12):
                    sid = f"s{k % 6}"
                    _, events = await stream(http, router.url, {"prompt": [k]}, headers={"x-session-id": sid})
                    homes.setdefault(sid, set()).update(served_by(events))
                assert all(len(v) == 1 for v in homes.values()), homes
                assert set().union(*homes.values()) == {"d0", "d1", "d2"}  # idle instances share new sessions
                # a session's instance leaves the rotation: it moves, and stays where it moved
                (home,) = homes["s0"]
                gone = next(b for b in decode if b.name == home)
                gone.healthy = False
                await wait_for(lambda: not router.router.decode[decode.index(gone)].healthy)
                moved = [served_by((await stream(http, router.url, {"prompt": [1]}, headers={"x-session-id": "s0"}))[1])
                         for _ in range(3)]  # fmt: skip
                assert len({frozenset(m) for m in moved}) == 1 and moved[0] != {home}
                text = await metrics(http, router.url)
                assert 'kvpool_router_decisions_total{policy="decode",reason="sticky"}' in text
                assert 'kvpool_router_decisions_total{policy="decode",reason="moved"} 1.0' in text
        finally:
            await stop(prefill, decode)

    run(main())


def test_the_policy_places_prefills_over_the_prefill_set_only():
    async def main():
        prefill, decode = await fleet(2, 2)
        try:
            async with RunningRouter(config(prefill, decode, policy="session")) as router, \
                    aiohttp.ClientSession() as http:  # fmt: skip
                for k in range(12):
                    await stream(http, router.url, {"prompt": [k]}, headers={"x-session-id": f"s{k % 4}"})
                # every completion was prefilled on a prefill instance and decoded on a decode one
                assert sum(len(p.requests) for p in prefill) == 12 and sum(len(d.requests) for d in decode) == 12
                assert all(r["body"]["kv_transfer_params"] == REMOTE_DECODE for p in prefill for r in p.requests)
                assert all(r["body"]["kv_transfer_params"]["remote_engine_id"] in ("engine-p0", "engine-p1")
                           for d in decode for r in d.requests)  # fmt: skip
                by_session: dict[str, set[str]] = {}
                for p in prefill:
                    for r in p.requests:
                        by_session.setdefault(header(r, "x-session-id"), set()).add(p.name)
                assert all(len(v) == 1 for v in by_session.values()), by_session  # the ring over p0, p1
                assert [b.name for b in router.router.backends] == [p.url for p in prefill]
        finally:
            await stop(prefill, decode)

    run(main())


def test_cache_aware_prefill_follows_the_prefill_instances_kv_events():
    async def main():
        prefill, decode = await fleet(2, 1)
        pubs = [Publisher(), Publisher()]
        try:
            cfg = config(prefill, decode, policy="cache_aware", kv_events=tuple(p.endpoint for p in pubs))
            async with RunningRouter(cfg) as router, aiohttp.ClientSession() as http:
                cache = router.router.backends[1].cache  # p1's
                while cache.num_events == 0:
                    pubs[1].publish(stored([b"h%d" % i for i in range(4)], None, PREFIX))
                    await asyncio.sleep(0.05)
                assert cache.block_size == BS
                for k in range(6):
                    await stream(http, router.url, {"prompt": PREFIX + [7]}, headers={"x-session-id": f"s{k}"})
                assert len(prefill[1].requests) == 6 and len(prefill[0].requests) == 0
                assert len(decode[0].requests) == 6
                text = await metrics(http, router.url)
                assert 'kvpool_router_decisions_total{policy="cache_aware",reason="local"} 6.0' in text
        finally:
            for p in pubs:
                p.close()
            await stop(prefill, decode)

    run(main())


@pytest.mark.parametrize("failure", ["refused", "status500"])
def test_a_failed_prefill_is_retried_on_the_other_prefill_instance(failure):
    async def main():
        prefill, decode = await fleet(2, 1)
        dead = prefill[0]
        if failure == "refused":
            await dead.stop()
        else:
            dead.fail_from_request = 0
        try:
            async with RunningRouter(config(prefill, decode, health_interval_s=30.0)) as router, \
                    aiohttp.ClientSession() as http:  # fmt: skip
                results = [await stream(http, router.url, {"prompt": [k]}) for k in range(4)]
                assert [s for s, _ in results] == [200] * 4
                assert all(served_by(ev) == {"d0"} and ev[-1] == "[DONE]" for _, ev in results)
                assert decode[0].received_params == prefill[1].sent_params  # every decode continued p1's prefill
                reason = "connect" if failure == "refused" else "status"
                text = await metrics(http, router.url)
                assert f'kvpool_router_handoff_retries_total{{reason="{reason}",stage="prefill"}}' in text
                assert f'kvpool_router_prefill_requests_total{{backend="{dead.url}",outcome="{reason}"}}' in text
                assert f'kvpool_router_prefill_requests_total{{backend="{prefill[1].url}",outcome="ok"}} 4.0' in text
        finally:
            await stop(prefill[1:], decode)
            if failure != "refused":
                await dead.stop()

    run(main())


def test_a_decode_that_fails_before_its_first_byte_redoes_the_whole_request(caplog):
    async def main():
        prefill, decode = await fleet(1, 2)
        decode[0].mode = "die_before_first_chunk"
        try:
            async with RunningRouter(config(prefill, decode, health_interval_s=30.0)) as router, \
                    aiohttp.ClientSession() as http:  # fmt: skip
                status, events = await stream(http, router.url, {"prompt": [1], "max_tokens": 4},
                                              headers={"x-session-id": "s"})  # fmt: skip
                assert status == 200 and served_by(events) == {"d1"} and events[-1] == "[DONE]"
                p = prefill[0]
                assert len(p.requests) == 2  # prefilled again: the first prefill's blocks may be gone
                assert decode[0].received_params == [p.sent_params[0]]
                assert decode[1].received_params == [p.sent_params[1]]  # never the first params twice
                ids = [header(r, "x-request-id") for r in p.requests]
                assert ids[1] == ids[0] + "-retry1"
                text = await metrics(http, router.url)
                assert 'kvpool_router_handoff_retries_total{reason="first_byte",stage="decode"} 1.0' in text
                assert f'kvpool_router_decode_requests_total{{backend="{decode[0].url}",outcome="first_byte"}} 1.0' in text
                assert f'kvpool_router_decode_requests_total{{backend="{decode[1].url}",outcome="ok"}} 1.0' in text
                # the session now lives where it was served
                _, events = await stream(http, router.url, {"prompt": [2]}, headers={"x-session-id": "s"})
                assert served_by(events) == {"d1"}
                # every decode instance failing: the request ends after max_attempts prefills
                decode[1].mode = "status503"
                status, body = await stream(http, router.url, {"prompt": [3]}, headers={"x-session-id": "t"})
                assert status == 502 and "3 attempts failed; last: decode status" in body[0]["error"]["message"]
        finally:
            await stop(prefill, decode)

    with caplog.at_level("INFO", logger="kvpool.router.access"):
        run(main())
    first = next(r.getMessage() for r in caplog.records if "/v1/completions" in r.getMessage())
    assert " attempts=2 " in first and " decode_reason=moved " in first
    assert ' handoffs="decode first_byte: http://127.0.0.1:' in first


def test_a_decode_stream_cut_mid_way_ends_with_an_openai_error_event_and_is_not_redone():
    async def main():
        prefill, decode = await fleet(1, 2)
        decode[0].mode, decode[0].num_tokens = "die_mid_stream", 5
        try:
            async with RunningRouter(config(prefill, decode, health_interval_s=30.0)) as router, \
                    aiohttp.ClientSession() as http:  # fmt: skip
                status, events = await stream(http, router.url, {"prompt": [1]})
                assert status == 200
                assert [e["choices"][0]["text"] for e in events[:2]] == ["t0", "t1"]
                assert "failed mid-stream" in events[2]["error"]["message"] and events[3] == "[DONE]"
                assert len(prefill[0].requests) == 1 and len(decode[1].requests) == 0  # half a stream is never sent twice
                text = await metrics(http, router.url)
                assert f'kvpool_router_decode_requests_total{{backend="{decode[0].url}",outcome="cut"}} 1.0' in text
        finally:
            await stop(prefill, decode)

    run(main())


def test_a_prefill_instance_without_kv_transfer_params_is_a_clear_502():
    async def main():
        prefill, decode = await fleet(2, 1)
        prefill[0].mode = "no_params"  # e.g. started without --kv-transfer-config
        try:
            async with RunningRouter(config(prefill, decode)) as router, aiohttp.ClientSession() as http:
                status, body = await stream(http, router.url, {"prompt": [1]})  # round robin: p0 first
                assert status == 502
                message = body[0]["error"]["message"]
                assert prefill[0].url in message and "kv_transfer_params" in message and "--kv-transfer-config" in message
                assert len(prefill[0].requests) == 1 and len(prefill[1].requests) == 0  # no silent fallback
                assert len(decode[0].requests) == 0
                text = await metrics(http, router.url)
                assert 'kvpool_router_handoff_failures_total{reason="no_params",stage="prefill"} 1.0' in text
        finally:
            await stop(prefill, decode)

    run(main())


def test_a_client_error_from_the_prefill_goes_back_as_it_is():
    async def main():
        prefill, decode = await fleet(2, 1)
        for p in prefill:
            p.fail_from_request, p.fail_status = 0, 400
        try:
            async with RunningRouter(config(prefill, decode)) as router, aiohttp.ClientSession() as http:
                async with http.post(router.url + "/v1/completions", json={"prompt": [1]}) as r:
                    assert r.status == 400 and (await r.json())["error"]["message"] == "injected failure"
                assert [len(p.requests) for p in prefill] == [1, 0]  # the client's error: not retried
                assert len(decode[0].requests) == 0
        finally:
            await stop(prefill, decode)

    run(main())


def test_health_models_and_other_paths_in_pd_mode():
    async def main():
        prefill, decode = await fleet(1, 2)
        try:
            async with RunningRouter(config(prefill, decode)) as router, aiohttp.ClientSession() as http:
                async with http.get(router.url + "/health") as r:
                    assert r.status == 200
                seen = set()
                for _ in range(4):
                    async with http.get(router.url + "/v1/models") as r:
                        seen.add((await r.json())["data"][0]["served_by"])
                assert seen == {"d0", "d1"}  # a decode instance, never the prefill
                # a completion whose body is not JSON goes to a decode instance as it is
                async with http.post(router.url + "/v1/completions", data=b"not json") as r:
                    assert r.status >= 400
                assert len(prefill[0].requests) == 0
                for d in decode:
                    d.healthy = False
                await wait_for(lambda: not any(b.healthy for b in router.router.decode))
                async with http.get(router.url + "/health") as r:
                    assert r.status == 503 and (await r.json())["status"] == "no healthy decode instance"
                status, body = await stream(http, router.url, {"prompt": [1]})
                assert status == 503 and "decode" in body[0]["error"]["message"]
                assert len(prefill[0].requests) == 0  # no prefill whose KV nobody would decode
                for d in decode:
                    d.healthy = True
                prefill[0].healthy = False
                await wait_for(lambda: all(b.healthy for b in router.router.decode)
                               and not router.router.backends[0].healthy)  # fmt: skip
                async with http.get(router.url + "/health") as r:
                    assert r.status == 503 and (await r.json())["status"] == "no healthy prefill instance"
        finally:
            await stop(prefill, decode)

    run(main())


def test_metrics_and_access_log_show_both_halves(caplog):
    urls = {}

    async def main():
        (p,), (d,) = await fleet()
        urls.update(p=p.url, d=d.url)
        try:
            async with RunningRouter(config([p], [d])) as router, aiohttp.ClientSession() as http:
                await stream(http, router.url, {"prompt": list(range(20))}, headers={"x-session-id": "s1"})
                text = await metrics(http, router.url)
                assert f'kvpool_router_prefill_requests_total{{backend="{p.url}",outcome="ok"}} 1.0' in text
                assert f'kvpool_router_decode_requests_total{{backend="{d.url}",outcome="ok"}} 1.0' in text
                assert "kvpool_router_prefill_seconds_count 1.0" in text
                assert 'kvpool_router_decisions_total{policy="decode",reason="new"} 1.0' in text
                assert f'kvpool_router_backend_healthy{{backend="{d.url}"}} 1.0' in text
                assert [(x.inflight_requests, x.inflight_prompt_tokens, x.inflight_decode_tokens)
                        for x in router.router.backends + router.router.decode] == [(0, 0, 0), (0, 0, 0)]  # fmt: skip
        finally:
            await stop([p], [d])

    with caplog.at_level("INFO", logger="kvpool.router.access"):
        run(main())
    line = next(r.getMessage() for r in caplog.records if "/v1/completions" in r.getMessage())
    assert f" backend={urls['p']} " in line and " session=s1(header) " in line
    assert f" prefill={urls['p']} decode={urls['d']} decode_reason=new prefill_s=0." in line
    assert "handoffs=" not in line and "error=" not in line


@pytest.mark.parametrize("argv, message", [
    (["--prefill", "http://127.0.0.1:1"], "--prefill needs at least one --decode"),
    (["--decode", "http://127.0.0.1:1"], "--decode needs at least one --prefill"),
    (["--backend", "http://127.0.0.1:1", "--prefill", "http://127.0.0.1:2", "--decode", "http://127.0.0.1:3"],
     "not both"),
    ([], "give at least one --backend URL"),
])  # fmt: skip
def test_the_command_line_refuses_a_mixed_or_half_mode(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        kvpool_main(["router", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "usage: kvpool router" in err and message in err


def test_config_refuses_what_p_d_mode_cannot_serve():
    with pytest.raises(ValueError, match="one role"):
        RouterConfig(prefill=("http://127.0.0.1:1",), decode=("http://127.0.0.1:1",))
    with pytest.raises(ValueError, match=r"one --kv-events endpoint per --prefill \(2\)"):
        RouterConfig(prefill=("http://127.0.0.1:1", "http://127.0.0.1:2"), decode=("http://127.0.0.1:3",),
                     kv_events=("tcp://127.0.0.1:5557",))  # fmt: skip
    cfg = RouterConfig(prefill=("http://127.0.0.1:1",), decode=("http://127.0.0.1:2",), kv_events=("tcp://127.0.0.1:5557",))
    assert cfg.disaggregated and cfg.policy_backends == ("http://127.0.0.1:1",)


def test_help_explains_p_d_mode(capsys):
    with pytest.raises(SystemExit):
        kvpool_main(["router", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--prefill URL" in out and "--decode URL" in out and "P/D mode" in out and "kv_transfer_params" in out
