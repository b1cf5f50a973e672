"""The router's HTTP shell: an OpenAI-compatible proxy in front of several vLLM servers.

Rules:
- Which backend serves a request is the policy's choice (`policy.py`, pure); this module only
  gathers the views it needs (health, load, prefix held) and carries the request there.
- Requests are forwarded as they are (method, path, query, body) and responses streamed back
  chunk by chunk, so SSE streams keep their timing.
- Nothing is sent to the client before the backend's first body chunk: until then a failure
  (refused, reset, a stale keep-alive connection, a 502/503/504) is retried, on another backend
  where there is one, up to `max_attempts`. After it, a failure ends an SSE stream with an
  OpenAI-style `{"error": ...}` event and `[DONE]`; other responses are cut.
- `/health` (200 while a backend is in rotation), `/metrics` are the router's own; `/v1/models`
  goes to any healthy backend.
- P/D mode (`--prefill`/`--decode`): the two completion endpoints take the two-step path of
  `disagg.py`; the policy, the gate and the KV events concern the prefill instances (`backends`),
  everything else goes to a healthy decode instance; `/health` is 200 while both sets have one.
- One access log line per request (logger `kvpool.router.access`).
- Text and chat prompts (`--tokenizer`): a middleware tokenizes them on a worker thread before the
  request is planned (prompt_tokens.py), so they are sized and matched like token-id prompts.
- What the pool holds (`--pooled`): with `--master`, exactly (pool_state.py, fed by pool_feed.py
  and the backends' KV events); without, the ledger's estimate of what the backends stored.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import aiohttp
from aiohttp import web
from prometheus_client import generate_latest

from kvpool.router.backends import Backend, Load
from kvpool.router.config import RouterConfig
from kvpool.router.disagg import PrefillDecode
from kvpool.router.dispatch import ClientLeft, DispatchGate
from kvpool.router.health import HealthChecker
from kvpool.router.hints import request_hint, with_hint
from kvpool.router.kv_events import EventStream, EventSubscriber
from kvpool.router.metrics import RouterMetrics
from kvpool.router.policy import (
    BackendView,
    CacheAwarePolicy,
    NoHealthyBackend,
    RouteRequest,
    estimate_ttft,
    make_policy,
)
from kvpool.router.pool_feed import PoolFeed
from kvpool.router.pool_state import PoolIndex
from kvpool.router.prefix_index import PoolLedger, prompt_chain
from kvpool.router.prompt_tokens import TOKENIZED_PATHS, PromptTokenizer
from kvpool.router.rates import RateConfig, RateEstimator
from kvpool.router.replies import HOP_HEADERS, RETRY_STATUSES, SEND_ERRORS, error_response, write_stream_error
from kvpool.router.routed import Attempt, RoutedRequest
from kvpool.router.sessions import parse_body, request_info

access_log = logging.getLogger("kvpool.router.access")
_PARSED = "kvpool_parsed_body"  # request keys the tokenizing middleware sets for _plan
_PROMPT_IDS = "kvpool_prompt_ids"


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        def backends(urls: tuple[str, ...]) -> list[Backend]:
            return [Backend(url.rstrip("/"), url.rstrip("/"), fail_threshold=config.fail_threshold) for url in urls]

        self.backends = backends(config.policy_backends)
        self.decode = backends(config.decode)
        self.pd = PrefillDecode(self) if config.disaggregated else None
        self.policy = make_policy(config.policy, [b.name for b in self.backends], config.prior_costs)
        self.rates = RateEstimator(RateConfig(config.prior_costs))
        self.ledger = PoolLedger(config.pool_ledger_blocks)
        self.pool = PoolIndex(config.pool_object_blocks, [config.pool_namespace] if config.pool_namespace else [])
        self.pool_feed = PoolFeed(config.master, self.pool, config.pool_namespace) if config.master else None
        self.tokenizer = PromptTokenizer(config.tokenizer) if config.tokenizer else None
        self.metrics = RouterMetrics()
        streams = [EventStream(ep, b.cache) for ep, b in zip(config.kv_events, self.backends)]
        on_stored = (self.pool.learn if config.master else lambda _e, ours: self.ledger.add(ours)) if config.pooled \
            else lambda _e, _ours: None  # fmt: skip
        self.events = EventSubscriber(streams, on_stored)
        self.health = HealthChecker(self.backends + self.decode, config, self.metrics)
        self.gate = DispatchGate(self.backends, config.max_waiting)
        self._http: aiohttp.ClientSession | None = None
        self._next_any = 0
        for b in self.backends + self.decode:
            self.metrics.healthy.labels(b.name).set(1)
        self._publish_costs()

    # ---- lifecycle ----------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30, middlewares=[self._tokenize] if self.tokenizer else [])
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _app: web.Application) -> None:
        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=self.config.keepalive_timeout_s),
            timeout=aiohttp.ClientTimeout(total=self.config.request_timeout_s, sock_connect=self.config.connect_timeout_s),
            auto_decompress=False,
        )
        self.health.start()
        self.events.start()
        if self.pool_feed is not None:
            self.pool_feed.start()

    async def _close(self, _app: web.Application) -> None:
        await self.health.stop()
        await self.events.stop()
        if self.pool_feed is not None:
            await self.pool_feed.stop()
        if self._http is not None:
            await self._http.close()

    @web.middleware
    async def _tokenize(self, request: web.Request, handler):
        """Token ids of a text or chat prompt, computed on a worker thread before `_plan` runs."""
        if request.method == "POST" and request.path in TOKENIZED_PATHS and self.tokenizer is not None:
            parsed = parse_body(await request.read())  # aiohttp keeps the body: the handler reads it again
            request[_PARSED] = parsed
            if parsed is not None and request_info(request.headers, parsed).prompt_token_ids is None:
                started = time.perf_counter()
                request[_PROMPT_IDS] = await asyncio.to_thread(self.tokenizer.token_ids, request.path, parsed)
                self.metrics.tokenize_s.observe(time.perf_counter() - started)
        return await handler(request)

    # ---- the router's own endpoints -----------------------------------------------------------

    async def _health(self, _request: web.Request) -> web.Response:
        every = self.backends + self.decode
        healthy = [b.name for b in every if b.healthy]
        if self.pd is None:
            status = "ok" if healthy else "no healthy backend"
        elif not any(b.healthy for b in self.backends):
            status = "no healthy prefill instance"
        elif not any(b.healthy for b in self.decode):
            status = "no healthy decode instance"
        else:
            status = "ok"
        body = {"status": status, "healthy": healthy,
                "unhealthy": {b.name: b.last_error for b in every if not b.healthy}}  # fmt: skip
        return web.json_response(body, status=200 if status == "ok" else 503)

    async def _metrics(self, _request: web.Request) -> web.Response:
        for b in self.backends + self.decode:
            self.metrics.inflight.labels(b.name).set(b.inflight_requests)
            self.metrics.inflight_tokens.labels(b.name, "prompt").set(b.inflight_prompt_tokens)
            self.metrics.inflight_tokens.labels(b.name, "decode").set(b.inflight_decode_tokens)
            self.metrics.oldest_wait.labels(b.name).set(b.oldest_wait_s(time.perf_counter()))
            self.metrics.cached_blocks.labels(b.name).set(len(b.cache.present))
        if self.pool_feed is not None:
            self._pool_metrics(self.pool_feed)
        return web.Response(body=generate_latest(self.metrics.registry), content_type="text/plain")

    def _pool_metrics(self, feed: PoolFeed) -> None:
        pending = self.pool.num_pending
        self.metrics.pool_index_keys.labels("placed").set(self.pool.num_held - pending)
        self.metrics.pool_index_keys.labels("pending").set(pending)
        for reason, n in feed.stats.resyncs.items():
            self.metrics.pool_index_resyncs.labels(reason).set(n)
        self.metrics.pool_index_batches.set(feed.stats.batches)
        if feed.stats.confirmed_s is not None:
            self.metrics.pool_index_age_s.set(time.monotonic() - feed.stats.confirmed_s)

    # ---- routing ------------------------------------------------------------------------------

    def _block_size(self) -> int:
        return next((b.cache.block_size for b in self.backends if b.cache.block_size), 0)

    def _plan(self, request: web.Request, body: bytes) -> RoutedRequest:
        parsed = (request[_PARSED] if _PARSED in request else parse_body(body)) if request.method == "POST" else None
        info = request_info(request.headers, parsed)
        ids = request.get(_PROMPT_IDS)
        if ids is not None and info.prompt_token_ids is None:
            info = dataclasses.replace(info, prompt_token_ids=ids, prompt_tokens=len(ids))
        block_size = self._block_size()
        chain = prompt_chain(info.prompt_token_ids, block_size) if info.prompt_token_ids and block_size else []
        # vLLM never takes a prompt's last token from the cache
        usable = max(0, (info.prompt_tokens - 1) // block_size) if block_size else 0
        pool_blocks = min(self._pool_prefix_blocks(chain), usable) if self.config.pooled else 0
        path = request.path
        if self.pd is not None:
            to_any = not self.pd.handles(request.method, path, parsed)
        else:
            to_any = not path.startswith("/v1/") or path == "/v1/models"
        return RoutedRequest(info, chain, block_size, pool_blocks * block_size, to_any=to_any, body_json=parsed)

    def _pool_prefix_blocks(self, chain: list) -> int:
        """Leading blocks of the prompt the pool holds: exact with --master, else the ledger's estimate."""
        started = time.perf_counter()
        blocks = self.pool.prefix_blocks(chain) if self.pool_feed is not None else self.ledger.prefix_blocks(chain)
        self.metrics.pool_answer_s.observe(time.perf_counter() - started)
        return blocks

    def _choose(self, routed: RoutedRequest, rooms: list[bool] | None = None) -> Attempt:
        """The next attempt's backend (among those with `rooms`, when given); raises NoHealthyBackend."""
        tried = routed.tried()
        estimates = ""
        now = time.perf_counter() if self.config.observed_wait else None
        bs = routed.block_size
        usable = max(0, (routed.info.prompt_tokens - 1) // bs) if bs else 0
        if routed.to_any:
            backend = self._any_healthy(tried)
            local_tokens = min(backend.cache.prefix_blocks(routed.chain), usable) * bs
            reason = "any"
        else:
            local = [min(b.cache.prefix_blocks(routed.chain), usable) * bs for b in self.backends]
            untried_healthy = any(b.healthy and b.name not in tried for b in self.backends)
            views = [b.view(local[i], excluded=(untried_healthy and b.name in tried) or (rooms is not None and not rooms[i]),
                            now_s=now) for i, b in enumerate(self.backends)]  # fmt: skip
            route = RouteRequest(routed.info.session_id, routed.info.prompt_tokens, routed.pool_tokens)
            decision = self.policy.choose(route, views)
            backend, reason, local_tokens = self.backends[decision.index], decision.reason, local[decision.index]
            estimates = _estimates_text(decision.estimates, views)
        costs = self.policy.costs if isinstance(self.policy, CacheAwarePolicy) else self.rates.costs()
        est = estimate_ttft(RouteRequest(routed.info.session_id, routed.info.prompt_tokens, routed.pool_tokens),
                            backend.view(local_tokens, now_s=now), costs)  # fmt: skip
        queued = backend.inflight_prompt_tokens
        # a P/D prefill generates one token; the decode instance the rest
        decode_tokens = 1 if self.pd is not None and not routed.to_any else routed.info.max_tokens
        load = Load(backend, est.recompute_tokens, decode_tokens, sent_s=time.perf_counter())
        return Attempt(backend, reason, load, est.local_tokens, est.pool_tokens, est.recompute_tokens + queued,
                       time.perf_counter(), estimates=estimates)  # fmt: skip

    def _any_healthy(self, tried: set[str]) -> Backend:
        """The next healthy backend (P/D mode: decode instance), untried ones first."""
        pool = self.decode if self.pd is not None else self.backends
        order = [(self._next_any + k) % len(pool) for k in range(len(pool))]
        for pick in ([i for i in order if pool[i].healthy and pool[i].name not in tried],
                     [i for i in order if pool[i].healthy]):  # fmt: skip
            if pick:
                self._next_any = pick[0] + 1
                return pool[pick[0]]
        raise NoHealthyBackend("no backend is healthy" if self.pd is None else "no decode instance is healthy")

    # ---- forwarding ---------------------------------------------------------------------------

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        if self._http is None:
            raise web.HTTPServiceUnavailable(text="router is starting")
        body = await request.read()
        routed = self._plan(request, body)
        if self.config.session_hints and routed.body_json is not None and not routed.to_any:
            hint = request_hint(routed.info.session_id, request.headers, routed.body_json, self.config.session_ttl_s)
            body = with_hint(body, routed.body_json, hint)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        try:
            if self.pd is not None and not routed.to_any:
                return await self.pd.serve(request, headers, routed)
            return await self._serve(request, body, headers, routed)
        finally:
            for load in routed.loads():
                load.end()
            self.gate.notify()
            self._log(request, routed)

    async def _serve(self, request: web.Request, body: bytes, headers: dict[str, str],
                     routed: RoutedRequest) -> web.StreamResponse:  # fmt: skip
        """Forward the request as it is; a failure before the first byte is tried again elsewhere."""
        while True:
            try:
                attempt = await self._next_attempt(routed, request)
            except ClientLeft:
                return self._client_left(routed)
            except NoHealthyBackend as e:
                return self._no_backend(routed, e)
            if len(routed.attempts) == 1 and attempt.reason != "any":  # a policy decision
                self._count_decision(routed, attempt)
            result = await self._try(request, body, headers, routed, attempt)
            if isinstance(result, web.StreamResponse):
                return result
            routed.error = result
            attempt.load.end()  # the failed try no longer loads its backend
            self.gate.notify()
            if len(routed.attempts) >= self.config.max_attempts:
                routed.status = 502
                return error_response(502, f"{len(routed.attempts)} attempts failed; last: {result}", "bad_gateway")
            self.metrics.retries.labels(result.split(":", 1)[0]).inc()

    def _client_left(self, routed: RoutedRequest) -> web.Response:
        routed.status, routed.error = 499, "the client hung up while held at the router"
        return web.Response(status=499)  # nginx's "client closed request"; nobody reads it

    def _no_backend(self, routed: RoutedRequest, e: NoHealthyBackend) -> web.Response:
        self.metrics.no_backend.inc()
        routed.status = 503 if not routed.attempts else 502
        message = str(e) if not routed.attempts else f"every attempt failed; last: {routed.error}"
        return error_response(routed.status, message, "no_backend" if routed.status == 503 else "bad_gateway")

    async def _next_attempt(self, routed: RoutedRequest, request: web.Request) -> Attempt:
        """Choose the next attempt and take its load. A first try of a streamed completion goes
        through the gate (late binding, dispatch.py); retries do not wait again."""
        gated = self.gate.enabled and not routed.attempts and routed.info.stream and not routed.to_any
        if not gated:
            attempt = self._choose(routed)
            routed.attempts.append(attempt)
            return attempt
        self.metrics.held.inc()
        started = time.perf_counter()
        try:
            front = False
            while True:
                async with self.gate.turn(lambda: _client_gone(request), front=front):
                    rooms = self.gate.rooms()
                    if any(rooms) or not any(b.healthy for b in self.backends):  # none healthy: 503 below
                        attempt = self._choose(routed, rooms if any(rooms) else None)
                        routed.attempts.append(attempt)
                        self.metrics.held_s.observe(time.perf_counter() - started)
                        return attempt
                # the room went (a retry took it, or its backend left the rotation): wait again, first
                front = True
        finally:
            self.metrics.held.dec()

    def _count_decision(self, routed: RoutedRequest, attempt: Attempt) -> None:
        self.metrics.decisions.labels(self.config.policy, attempt.reason).inc()
        self.metrics.prompt_tokens.inc(routed.info.prompt_tokens)
        self.metrics.local_prefix_tokens.labels(attempt.backend.name).inc(attempt.local_tokens)
        self.metrics.pool_prefix_tokens.inc(routed.pool_tokens)

    async def _try(self, request: web.Request, body: bytes, headers: dict[str, str], routed: RoutedRequest,
                   attempt: Attempt) -> web.StreamResponse | str:  # fmt: skip
        """Serve the request from `attempt.backend`: the response, or why it failed before any byte
        reached the client (then the caller may retry)."""
        assert self._http is not None
        backend = attempt.backend
        try:
            upstream = await self._http.request(request.method, backend.url + request.rel_url.path_qs,
                                                headers=headers, data=body or None)  # fmt: skip
        except SEND_ERRORS as e:
            return self._failed(backend, "connect", e)
        try:
            if upstream.status in RETRY_STATUSES:
                text = (await upstream.text(errors="replace"))[:200]
                backend.request_answered()
                return f"status: {backend.name} answered {upstream.status}: {text}"
            try:
                first = await upstream.content.readany()
            except SEND_ERRORS as e:
                return self._failed(backend, "first_byte", e)
            backend.request_answered()
            self._first_byte(routed, attempt)
            response = web.StreamResponse(status=upstream.status)
            for k, v in upstream.headers.items():
                if k.lower() not in HOP_HEADERS:
                    response.headers[k] = v
            routed.status = upstream.status
            await response.prepare(request)
            is_sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
            chunks = 0
            chunk = first
            while chunk:
                chunks += chunk.count(b"data:")
                try:
                    await response.write(chunk)
                except (ConnectionResetError, aiohttp.ClientConnectionResetError) as e:
                    routed.error = f"client went away: {e}"
                    return response  # nothing to tell it; the backend's request ends with ours
                routed.bytes_out += len(chunk)
                try:
                    chunk = await upstream.content.readany()
                except SEND_ERRORS as e:
                    self._stream_cut(routed, backend, e)
                    if is_sse:
                        await write_stream_error(response, backend.name, e)
                    return response
            if is_sse and routed.info.stream and attempt.first_byte_s is not None:
                self.rates.observe_decode(max(0, chunks - 3), time.perf_counter() - attempt.first_byte_s)
                self._publish_costs()
            self.metrics.requests.labels(backend.name, f"{upstream.status // 100}xx").inc()
            try:
                await response.write_eof()
            except (ConnectionResetError, aiohttp.ClientConnectionResetError):
                pass  # the client had what it wanted ([DONE]) and closed before the chunked terminator
            return response
        finally:
            upstream.release()

    def _failed(self, backend: Backend, stage: str, e: BaseException) -> str:
        self.metrics.failures.labels(backend.name).inc()
        if backend.request_failed(f"{type(e).__name__}: {e}"):
            self.metrics.healthy.labels(backend.name).set(0)
        return f"{stage}: {backend.name}: {type(e).__name__}: {e}"

    def _stream_cut(self, routed: RoutedRequest, backend: Backend, e: BaseException) -> None:
        routed.error = f"stream cut by {backend.name}: {type(e).__name__}: {e}"
        self.metrics.stream_errors.labels(backend.name).inc()
        self.metrics.requests.labels(backend.name, "cut").inc()
        if backend.request_failed(routed.error):
            self.metrics.healthy.labels(backend.name).set(0)

    def _first_byte(self, routed: RoutedRequest, attempt: Attempt) -> None:
        now = time.perf_counter()
        attempt.first_byte_s = now
        attempt.load.first_byte()
        self.gate.notify()
        if routed.info.stream and routed.info.prompt_tokens > 0:
            ttft = now - attempt.sent_s
            self.metrics.ttft_s.observe(ttft)
            if attempt.computes_prompt:  # a P/D prefill is observed when its response comes (disagg.py)
                self.rates.observe_ttft(attempt.compute_tokens, attempt.pool_tokens, ttft)
                self._publish_costs()

    def _publish_costs(self) -> None:
        costs = self.rates.costs()
        if isinstance(self.policy, CacheAwarePolicy):
            self.policy.set_costs(costs)
        self.metrics.cost.labels("prefill").set(costs.prefill_s_per_token)
        self.metrics.cost.labels("pool_load").set(costs.pool_load_s_per_token)
        self.metrics.cost.labels("decode").set(costs.decode_s_per_token)
        if self.rates.decode_latency_s_per_token is not None:
            self.metrics.decode_latency.set(self.rates.decode_latency_s_per_token)

    def _log(self, request: web.Request, routed: RoutedRequest) -> None:
        """`backend`, `reason`, `local` and `est` are the policy's choice (in P/D mode the prefill
        instance); `ttft_s` is when the client's first byte went out."""
        last = routed.attempts[-1] if routed.attempts else None
        served = routed.decodes[-1] if routed.decodes else last
        ttft = f"{served.first_byte_s - routed.started_s:.3f}" if served and served.first_byte_s else "-"
        access_log.info(
            '%s "%s %s" %s session=%s(%s) backend=%s reason=%s attempts=%d prompt=%d local=%d pool=%d '
            "ttft_s=%s total_s=%.3f bytes=%d%s%s%s",
            request.remote, request.method, request.path_qs, routed.status, routed.info.session_id,
            routed.info.session_source, last.backend.name if last else "-", last.reason if last else "-",
            len(routed.attempts), routed.info.prompt_tokens, last.local_tokens if last else 0,
            routed.pool_tokens, ttft, time.perf_counter() - routed.started_s, routed.bytes_out,
            self.pd.log_fields(routed) if self.pd is not None and not routed.to_any else "",
            f" est={last.estimates}" if last and last.estimates else "",
            f' error="{routed.error}"' if routed.error else "",
        )  # fmt: skip


def _estimates_text(estimates: tuple, views: list[BackendView]) -> str:
    """`url:ttft/queue` seconds per backend the policy scored ("-": not eligible), as the access log
    shows them: why a request went where it went; "" from a policy that estimates nothing."""
    return ",".join(f"{v.name}:{e.ttft_s:.2f}/{e.queue_s:.2f}" if e is not None else f"{v.name}:-"
                    for v, e in zip(views, estimates))  # fmt: skip


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()
