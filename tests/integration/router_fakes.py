"""Small local servers for the router's HTTP tests: an OpenAI-ish streaming backend whose health
and failure modes a test sets (it also plays a P/D prefill instance, answering `kv_transfer_params`,
or a decode instance, keeping the params it got), a backend that closes a kept-alive connection
when it is reused (as uvicorn's idle timeout does), and the router itself, all on 127.0.0.1 and
OS-chosen ports."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from kvpool.router.app import Router
from kvpool.router.config import RouterConfig


@dataclass
class FakeBackend:
    name: str
    healthy: bool = True
    mode: str = "ok"  # ok | status503 | die_before_first_chunk | die_mid_stream | no_params
    num_tokens: int = 4
    token_delay_s: float = 0.0
    first_byte_delay_s: float = 0.0  # a queue: nothing is sent back before this
    fail_from_request: int | None = None  # answer fail_status from this request (0-based) on
    fail_status: int = 500
    requests: list[dict] = field(default_factory=list)
    # a P/D prefill instance: a request asking for remote decode is answered with kv_transfer_params
    # naming its blocks (unless mode is no_params); each set it answered, in order
    prefill: bool = False
    sent_params: list[dict] = field(default_factory=list)
    unanswered: int = 0  # requests here now without their first byte
    max_unanswered: int = 0
    runner: web.AppRunner | None = None
    url: str = ""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        return app

    @property
    def received_params(self) -> list[dict | None]:
        """The kv_transfer_params of each request received, in order (a decode instance's view)."""
        return [r["body"].get("kv_transfer_params") for r in self.requests]

    def _transfer_params(self) -> dict:
        first = 10 * len(self.sent_params)
        params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": f"engine-{self.name}",
                  "remote_block_ids": list(range(first, first + 3)), "remote_host": "127.0.0.1",
                  "remote_port": 5600 + len(self.sent_params), "tp_size": 1}  # fmt: skip
        self.sent_params.append(params)
        return params

    async def _health(self, _r: web.Request) -> web.Response:
        return web.Response(text="ok", status=200 if self.healthy else 503)

    async def _models(self, _r: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "tiny", "served_by": self.name}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append({"body": body, "headers": dict(request.headers)})
        if self.fail_from_request is not None and len(self.requests) > self.fail_from_request:
            return web.json_response({"error": {"message": "injected failure"}}, status=self.fail_status)
        if self.mode == "status503":
            return web.json_response({"error": "overloaded"}, status=503)
        self.unanswered += 1
        self.max_unanswered = max(self.max_unanswered, self.unanswered)
        try:
            if self.first_byte_delay_s:
                await asyncio.sleep(self.first_byte_delay_s)
        finally:
            self.unanswered -= 1
        if not body.get("stream"):
            answer = {"served_by": self.name, "choices": [{"text": "x" * self.num_tokens}]}
            asked = body.get("kv_transfer_params") or {}
            if self.prefill and asked.get("do_remote_decode") and self.mode != "no_params":
                answer["kv_transfer_params"] = self._transfer_params()
            return web.json_response(answer)
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        if self.mode == "die_before_first_chunk":
            request.transport.close()
            return response
        for i in range(self.num_tokens):
            if self.mode == "die_mid_stream" and i == 2:
                request.transport.close()
                return response
            chunk = {"served_by": self.name, "choices": [{"text": f"t{i}", "token_ids": [i]}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def start(self, port: int = 0) -> "FakeBackend":
        self.runner = web.AppRunner(self.app())
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


class IdleClosingBackend:
    """Answers the first request of each connection with keep-alive, then closes that connection
    when the next request arrives on it: the race of a pooled connection and an idle timeout."""

    def __init__(self) -> None:
        self.connections = 0
        self.answered = 0
        self.closed_on_reuse = 0
        self.server: asyncio.Server | None = None
        self.url = ""

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)  # fmt: skip
                if length:
                    await reader.readexactly(length)
                if served and not head.startswith(b"GET /health"):
                    self.closed_on_reuse += 1
                    break
                body = b'data: {"choices": [{"text": "a", "token_ids": [1]}]}\n\ndata: [DONE]\n\n'
                if head.startswith(b"GET /health"):
                    body = b"ok"
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: keep-alive\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
                await writer.drain()
                if not head.startswith(b"GET /health"):
                    served += 1
                    self.answered += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def start(self) -> "IdleClosingBackend":
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


class RunningRouter:
    def __init__(self, config: RouterConfig) -> None:
        self.router = Router(config)
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def __aenter__(self) -> "RunningRouter":
        self.runner = web.AppRunner(self.router.app())
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


async def stream(http: aiohttp.ClientSession, url: str, body: dict, headers: dict | None = None) -> tuple[int, list[dict | str]]:
    """POST a streamed completion; the status and the decoded SSE events ('[DONE]' as a string)."""
    events: list[dict | str] = []
    async with http.post(url + "/v1/completions", json={"stream": True, **body}, headers=headers or {}) as r:
        if r.status != 200:
            return r.status, [await r.json()]
        async for raw in r.content:
            line = raw.strip()
            if line.startswith(b"data:"):
                data = line[5:].strip()
                events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return 200, events


def served_by(events: list[dict | str]) -> set[str]:
    return {e["served_by"] for e in events if isinstance(e, dict) and "served_by" in e}


async def wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)
