"""A minimal OpenAI-compatible round-robin proxy in front of several vLLM servers.

The baseline "load balancer" of the reference result: every request goes to the next backend in
turn, whatever its prefix. A cache-aware router replaces the policy later; the HTTP shell stays.

Rules:
- Requests are forwarded as they are (method, path, query, body) and responses streamed back
  chunk by chunk, so SSE streams keep their timing.
- `/health` and `/metrics` are the proxy's own; vLLM's counters are read from each backend.
- A backend that cannot be reached gives the client a 502 with the reason; the proxy keeps serving.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, generate_latest

_HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade"}


@dataclass(frozen=True)
class ProxyConfig:
    backends: tuple[str, ...]
    request_timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        if not self.backends:
            raise ValueError("at least one --backend URL is required")
        for url in self.backends:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"backend {url!r} must start with http:// or https://")
        if self.request_timeout_s <= 0:
            raise ValueError("request_timeout_s must be > 0")


class RoundRobinProxy:
    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self._next = itertools.cycle([b.rstrip("/") for b in config.backends])
        self.registry = CollectorRegistry()
        self.requests = Counter("kvpool_router_requests", "requests forwarded", ["backend"], registry=self.registry)
        self.failures = Counter("kvpool_router_failures", "requests a backend did not answer", ["backend"],
                                registry=self.registry)  # fmt: skip
        self._http: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _app: web.Application) -> None:
        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=self.config.request_timeout_s),
            auto_decompress=False,
        )

    async def _close(self, _app: web.Application) -> None:
        if self._http is not None:
            await self._http.close()

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), content_type="text/plain")

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        if self._http is None:
            raise web.HTTPServiceUnavailable(text="proxy is starting")
        backend = next(self._next)
        self.requests.labels(backend).inc()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        body = await request.read()
        try:
            async with self._http.request(request.method, backend + request.rel_url.path_qs, headers=headers,
                                          data=body or None) as upstream:  # fmt: skip
                response = web.StreamResponse(status=upstream.status)
                for k, v in upstream.headers.items():
                    if k.lower() not in _HOP_HEADERS:
                        response.headers[k] = v
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            self.failures.labels(backend).inc()
            if "response" in locals() and response.prepared:
                raise  # mid-stream: the client sees a cut stream, as it would from the backend itself
            return web.json_response({"error": {"message": f"backend {backend}: {type(e).__name__}: {e}",
                                                "type": "bad_gateway"}}, status=502)  # fmt: skip
