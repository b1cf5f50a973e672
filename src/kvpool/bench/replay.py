"""Replay agent sessions against OpenAI-compatible endpoints (vLLM, or a router in front of several).

Rules:
- One asyncio client per session, started at its `trace_offset_s` x `time_scale` (plus its share
  of `ramp_up_s`); its turns go in order, each after the previous answer plus the turn's think
  time x `time_scale`. Prompts are token ids (see `prompts.py`); each turn carries
  the previous prompt and the output the server actually returned (`return_token_ids`).
- Every request names its session (`x-session-id`); a session's last turn also says the session
  ends (`x-session-end: true`), as an agent that knows its task is done would.
- Several endpoints are used round-robin per request: the baseline "load balancer".
- Every request streams (`stream` + usage), so TTFT and inter-token gaps are measured at the
  client; `ignore_eos` + `min_tokens` make the output length follow the trace.
- A failed request is recorded with its error and ends its session (the next prompt would need its
  output): the session's remaining turns are recorded as "skipped" with the reason, so every planned
  turn has a record. A turn that would not fit the server's `max_model_len` and the turns after it
  are "skipped" too. Nothing here raises for one bad request.
- Ctrl-C / SIGTERM during a replay stops it: requests in flight and turns not sent yet are recorded
  as "skipped" (interrupted) and the partial result comes back with `interrupted=True`, so the
  caller can still write what was measured.
- Each request carries `x-session-id: <session id>`, so a router can keep a session together.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import aiohttp

from kvpool.bench.prompts import PrefixLedger, SessionPrompts, TokenSpace
from kvpool.bench.server_metrics import CacheCounters, scrape_all, total_delta
from kvpool.workload.model import Session


@dataclass(frozen=True)
class ReplayConfig:
    endpoints: tuple[str, ...]
    metrics_urls: tuple[str, ...] | None = None  # where to read vLLM counters; None = the endpoints
    time_scale: float = 1.0  # think time multiplier; 0 = no waits
    max_sessions: int | None = None
    concurrency: int | None = None  # sessions running at once; None = all
    ramp_up_s: float = 0.0  # session starts spread evenly over this span
    vocab_size: int = 8000  # the model's vocabulary (the OpenAI API does not expose it); 8000 = tiny model
    seed: int = 0
    model: str | None = None  # None = the first model the endpoint lists
    cache_block_size: int = 128  # the engine's block size, for the potential hit rate
    request_timeout_s: float = 600.0
    keep_token_ids: bool = False  # store every prompt and output in the records (tests, debugging)

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("at least one endpoint is required")
        for url in self.endpoints + (self.metrics_urls or ()):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"endpoint {url!r} must start with http:// or https://")
        if self.time_scale < 0:
            raise ValueError("time_scale must be >= 0")
        if self.max_sessions is not None and self.max_sessions <= 0:
            raise ValueError("max_sessions must be > 0")
        if self.concurrency is not None and self.concurrency <= 0:
            raise ValueError("concurrency must be > 0")
        if self.ramp_up_s < 0 or self.request_timeout_s <= 0 or self.cache_block_size <= 0:
            raise ValueError("ramp_up_s must be >= 0, request_timeout_s and cache_block_size > 0")
        if self.vocab_size < 8:
            raise ValueError("vocab_size must be >= 8")


@dataclass
class RequestRecord:
    session_id: str
    turn_index: int
    endpoint: str
    start_s: float  # since the replay started
    prompt_tokens: int
    output_tokens_planned: int
    ideal_cached_tokens: int  # what an unbounded shared cache could have served
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    status: str = "ok"  # ok | error | skipped
    error: str | None = None
    prompt_token_ids: list[int] | None = None  # only with ReplayConfig.keep_token_ids
    output_token_ids: list[int] | None = None


@dataclass
class ReplayResult:
    config: ReplayConfig
    model: str
    max_model_len: int | None
    started_at: float  # unix time
    duration_s: float
    records: list[RequestRecord]
    counters: CacheCounters | None  # summed over metrics_urls, after - before
    planned_requests: int
    interrupted: bool = False  # stopped by Ctrl-C / SIGTERM: the records after it are "skipped"


async def _server_info(http: aiohttp.ClientSession, endpoint: str, model: str | None) -> tuple[str, int | None]:
    async with http.get(endpoint.rstrip("/") + "/v1/models", timeout=aiohttp.ClientTimeout(total=30)) as r:
        if r.status != 200:
            raise RuntimeError(f"{endpoint}/v1/models answered {r.status}: {(await r.text())[:300]}")
        data = (await r.json()).get("data") or []
    if not data:
        raise RuntimeError(f"{endpoint} serves no model")
    entry = next((m for m in data if m.get("id") == model), None) if model else data[0]
    if entry is None:
        raise RuntimeError(f"{endpoint} does not serve {model!r}; it serves {[m.get('id') for m in data]}")
    return entry["id"], entry.get("max_model_len")


async def stream_completion(
    http: aiohttp.ClientSession, endpoint: str, payload: dict, record: RequestRecord, timeout_s: float,
    headers: dict[str, str] | None = None,
) -> list[int]:
    """Send one streamed completion, fill `record`'s timings and usage, return the output token ids."""
    output: list[int] = []
    t0 = time.perf_counter()
    last = None
    try:
        async with http.post(
            endpoint.rstrip("/") + "/v1/completions", json=payload, headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"server error: {str(chunk['error'])[:300]}")
                for choice in chunk.get("choices") or []:
                    ids = choice.get("token_ids") or []
                    if not ids:
                        continue
                    now = time.perf_counter()
                    if record.ttft_s is None:
                        record.ttft_s = now - t0
                    else:  # a chunk may carry several tokens: its gap is shared among them
                        record.itl_s.extend([(now - last) / len(ids)] * len(ids))
                    last = now
                    output += ids
                usage = chunk.get("usage")
                if usage:
                    details = usage.get("prompt_tokens_details") or {}
                    record.cached_tokens = details.get("cached_tokens")
        record.e2e_s = time.perf_counter() - t0
        record.output_tokens = len(output)
        if record.ttft_s is None:
            raise RuntimeError("the stream ended without any token (is --skip-tokenizer-init + return_token_ids supported?)")
    except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError) as e:
        record.status, record.error = "error", f"{type(e).__name__}: {e}"[:500]
    return output


class Replayer:
    def __init__(self, sessions: list[Session], config: ReplayConfig,
                 on_record: Callable[[RequestRecord], None] | None = None) -> None:  # fmt: skip
        self.sessions = sessions[: config.max_sessions] if config.max_sessions else list(sessions)
        self.config = config
        self.on_record = on_record
        self.records: list[RequestRecord] = []
        self._rr = itertools.cycle(config.endpoints)
        self._ledger = PrefixLedger(config.cache_block_size)
        self._t0 = 0.0

    @property
    def planned_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    async def run(self) -> ReplayResult:
        cfg = self.config
        metrics_urls = list(cfg.metrics_urls or cfg.endpoints)
        connector = aiohttp.TCPConnector(limit=0)
        interrupted = asyncio.Event()
        async with aiohttp.ClientSession(connector=connector) as http:
            model, max_model_len = await _server_info(http, cfg.endpoints[0], cfg.model)
            space = TokenSpace(vocab_size=cfg.vocab_size, seed=cfg.seed)
            before = await scrape_all(http, metrics_urls)
            started_at, self._t0 = time.time(), time.perf_counter()
            limit = asyncio.Semaphore(cfg.concurrency or max(1, len(self.sessions)))
            n = len(self.sessions)
            tasks = [
                asyncio.create_task(self._session(http, s, space, model, max_model_len, limit,
                                    s.trace_offset_s * cfg.time_scale + (cfg.ramp_up_s * i / (n - 1) if n > 1 else 0.0)))
                for i, s in enumerate(self.sessions)
            ]  # fmt: skip

            def interrupt() -> None:
                interrupted.set()
                for t in tasks:
                    t.cancel()

            with _interrupts_call(interrupt):
                await asyncio.gather(*tasks, return_exceptions=True)
            duration_s = time.perf_counter() - self._t0
            after = await scrape_all(http, metrics_urls)
        return ReplayResult(cfg, model, max_model_len, started_at, duration_s, self.records,
                            total_delta(before, after), self.planned_requests, interrupted.is_set())  # fmt: skip

    def _done(self, record: RequestRecord) -> None:
        self.records.append(record)
        if self.on_record is not None:
            self.on_record(record)

    def _skip_rest(self, session: Session, first: int, reason: str) -> None:
        """Record turns `first`.. of `session` as skipped: none of a session's turns vanish."""
        for k in range(first, len(session.turns)):
            turn = session.turns[k]
            record = RequestRecord(session.session_id, k, "", time.perf_counter() - self._t0,
                                   session.input_tokens(turn), max(1, turn.output_tokens), 0)  # fmt: skip
            record.status, record.error = "skipped", reason
            self._done(record)

    async def _session(self, http: aiohttp.ClientSession, session: Session, space: TokenSpace, model: str,
                       max_model_len: int | None, limit: asyncio.Semaphore, delay_s: float) -> None:  # fmt: skip
        next_turn = 0
        try:
            await asyncio.sleep(delay_s)
            async with limit:
                prompts = SessionPrompts(session, space)
                output: list[int] | None = None
                for k, turn in enumerate(session.turns):
                    output, reason = await self._turn(http, session, k, prompts, output, model, max_model_len)
                    next_turn = k + 1
                    if reason is not None:
                        self._skip_rest(session, k + 1, reason)
                        next_turn = len(session.turns)
                        return
        except asyncio.CancelledError:
            self._skip_rest(session, next_turn, "interrupted (Ctrl-C / SIGTERM)")

    async def _turn(self, http: aiohttp.ClientSession, session: Session, k: int, prompts: SessionPrompts,
                    output: list[int] | None, model: str, max_model_len: int | None) -> tuple[list[int], str | None]:  # fmt: skip
        """Send turn `k`; its output and, when the session cannot go on, why."""
        cfg = self.config
        turn = session.turns[k]
        if k > 0 and turn.think_time_s > 0 and cfg.time_scale > 0:
            await asyncio.sleep(turn.think_time_s * cfg.time_scale)
        prompt = prompts.next_prompt(k, output)
        max_tokens = max(1, turn.output_tokens)
        record = RequestRecord(session.session_id, k, "", time.perf_counter() - self._t0, len(prompt),
                               max_tokens, self._ledger.hit_tokens(prompt))  # fmt: skip
        if max_model_len is not None and len(prompt) + max_tokens > max_model_len:
            record.status = "skipped"
            record.error = f"{len(prompt)} prompt + {max_tokens} output tokens exceed max_model_len {max_model_len}"
            self._done(record)
            return [], f"session ended: turn {k} exceeds max_model_len"
        record.endpoint = next(self._rr)
        self._ledger.add(prompt)
        payload = {
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True,
        }  # fmt: skip
        headers = {"x-session-id": session.session_id}
        if k + 1 == len(session.turns):
            headers["x-session-end"] = "true"  # as an agent that knows its task is done would say
        new_output = await stream_completion(http, record.endpoint, payload, record, cfg.request_timeout_s,
                                             headers)  # fmt: skip
        self._ledger.add(prompt + new_output[:-1])
        if cfg.keep_token_ids:
            record.prompt_token_ids, record.output_token_ids = prompt, new_output
        self._done(record)
        return new_output, (None if record.status == "ok" else f"session ended: turn {k} failed")


@contextlib.contextmanager
def _interrupts_call(callback: Callable[[], None]):
    """While inside, SIGINT and SIGTERM call `callback` (main thread only); the handlers before
    are put back after, so a caller's own SIGTERM handling survives the replay."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    loop = asyncio.get_running_loop()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        loop.add_signal_handler(sig, callback)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            loop.remove_signal_handler(sig)
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def replay(sessions: list[Session], config: ReplayConfig,
           on_record: Callable[[RequestRecord], None] | None = None) -> ReplayResult:  # fmt: skip
    return asyncio.run(Replayer(sessions, config, on_record).run())
