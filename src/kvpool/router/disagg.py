"""Prefill/decode disaggregation: a completion is prefilled on one instance and decoded on another,
the KV cache passed between them by the engines' KV connector (`kv_transfer_params`, kv_transfer.py).

Rules:
- The prefill instance is the configured policy's choice over the prefill set, as a backend is in
  aggregated mode (the router's `_next_attempt`: cache-aware over the prefill instances' KV
  events, late binding, retries on untried instances first). The decode instance is
  `DecodePolicy`'s (decode_policy.py): the session's own while healthy, else the least loaded.
- The prefill is read whole (no stream) before anything reaches the client. A prefill that is
  refused, reset, timed out or answers 5xx is tried again on another prefill instance; a 4xx is
  the client's error and goes back to it as it is. A 2xx without `kv_transfer_params` means the
  instance is not set up for P/D: 502 naming it, never a silent fallback to aggregated serving.
- The decode is forwarded and streamed back exactly as an aggregated backend's response (the
  router's `_try`). A decode failure before the client's first byte redoes the whole request,
  prefill included, on another decode instance where there is one: the first prefill's blocks
  may already have been freed, so its params are never sent twice. After the first byte, a cut
  stream ends as in aggregated mode.
- `max_attempts` bounds the prefills sent per request. The same request id (`x-request-id`: the
  client's, else a fresh one; a suffix per retry) goes to both halves of one handoff, as vLLM's
  P/D proxies send it.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING

from aiohttp import web

from kvpool.router.backends import Load
from kvpool.router.decode_policy import DecodePolicy
from kvpool.router.dispatch import ClientLeft
from kvpool.router.kv_transfer import COMPLETION_PATHS, NoTransferParams, decode_body, prefill_body, transfer_params
from kvpool.router.policy import NoHealthyBackend
from kvpool.router.replies import SEND_ERRORS, error_response
from kvpool.router.routed import Attempt, RoutedRequest

if TYPE_CHECKING:
    from kvpool.router.app import Router


class PrefillDecode:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.policy = DecodePolicy()

    @staticmethod
    def handles(method: str, path: str, body: dict | None) -> bool:
        """Whether a request takes the two-step path (anything else goes to a decode instance as it is;
        a body that is not a JSON object gets the decode instance's own error)."""
        return method == "POST" and path in COMPLETION_PATHS and body is not None

    async def serve(self, request: web.Request, headers: dict[str, str], routed: RoutedRequest) -> web.StreamResponse:
        r = self.router
        assert routed.body_json is not None  # handles() said so
        request_id = next((v for k, v in headers.items() if k.lower() == "x-request-id"), None) or uuid.uuid4().hex
        headers = {k: v for k, v in headers.items()
                   if k.lower() not in ("x-request-id", "content-type", "accept-encoding")}  # fmt: skip
        # identity: the prefill's JSON is read here, and the router's client session does not decompress
        headers.update({"content-type": "application/json", "accept-encoding": "identity"})
        while True:
            if not any(b.healthy for b in r.decode):  # checked first: a prefill nobody decodes holds its blocks
                r.metrics.no_backend.inc()
                routed.status = 503 if not routed.attempts else 502
                return error_response(routed.status, f"none of the {len(r.decode)} decode instances is healthy"
                                      + (f"; last: {routed.error}" if routed.error else ""), "no_backend")  # fmt: skip
            try:
                prefill = await r._next_attempt(routed, request)
            except ClientLeft:
                return r._client_left(routed)
            except NoHealthyBackend as e:
                return r._no_backend(routed, NoHealthyBackend(f"no prefill instance is healthy ({e})"))
            if len(routed.attempts) == 1:
                r._count_decision(routed, prefill)
            n = len(routed.attempts)
            round_headers = {**headers, "x-request-id": request_id if n == 1 else f"{request_id}-retry{n - 1}"}
            outcome = await self._prefill(request, round_headers, routed, prefill)
            if isinstance(outcome, web.Response):
                return outcome
            if isinstance(outcome, str):
                failed = self._failed_step(routed, "prefill", outcome)
                if failed is not None:
                    return failed
                continue
            try:
                decode = self._choose_decode(routed, prefill)
            except NoHealthyBackend as e:  # the last one left the rotation during the prefill
                failed = self._failed_step(routed, "decode", f"no_decode: {e}")
                if failed is not None:
                    return failed
                continue
            body = json.dumps(decode_body(routed.body_json, outcome)).encode()
            result = await r._try(request, body, round_headers, routed, decode)
            if isinstance(result, web.StreamResponse):
                cut = routed.error is not None and routed.error.startswith("stream cut")
                outcome_label = "cut" if cut else "ok" if routed.status < 400 else f"{routed.status // 100}xx"
                r.metrics.decode_requests.labels(decode.backend.name, outcome_label).inc()
                return result
            decode.load.end()  # the failed try no longer loads its instance
            r.gate.notify()
            r.metrics.decode_requests.labels(decode.backend.name, result.split(":", 1)[0]).inc()
            failed = self._failed_step(routed, "decode", result)
            if failed is not None:
                return failed

    async def _prefill(self, request: web.Request, headers: dict[str, str], routed: RoutedRequest,
                       attempt: Attempt) -> dict | str | web.Response:  # fmt: skip
        """Send the prefill and read its answer whole: the kv_transfer_params for the decode; a str
        saying why it failed (the caller may try another instance); or the response that ends the
        request (the instance's own 4xx, or a 502 for an instance not set up for P/D)."""
        r = self.router
        backend = attempt.backend
        assert r._http is not None and routed.body_json is not None
        body = json.dumps(prefill_body(routed.body_json)).encode()
        upstream, raw, failure = None, b"", None
        try:
            upstream = await r._http.post(backend.url + request.rel_url.path_qs, headers=headers, data=body)
            raw = await upstream.read()
        except SEND_ERRORS as e:
            failure = r._failed(backend, "connect" if upstream is None else "read", e)
        finally:
            if upstream is not None:
                upstream.release()
        prefill_s = time.perf_counter() - attempt.sent_s
        attempt.load.end()  # answered or failed, its instance carries nothing more of this request
        r.gate.notify()
        if failure is not None:
            r.metrics.prefill_requests.labels(backend.name, failure.split(":", 1)[0]).inc()
            return failure
        assert upstream is not None
        backend.request_answered()
        status, content_type = upstream.status, upstream.headers.get("content-type", "application/json")
        if status >= 500:
            r.metrics.prefill_requests.labels(backend.name, "status").inc()
            return f"status: {backend.name} answered {status}: {raw[:200].decode(errors='replace')}"
        if status >= 400:
            r.metrics.prefill_requests.labels(backend.name, f"{status // 100}xx").inc()
            routed.status = status
            routed.error = f"prefill {backend.name} answered {status}"
            return web.Response(status=status, body=raw, content_type=content_type.split(";")[0])
        try:
            params = transfer_params(json.loads(raw))
        except (ValueError, NoTransferParams) as e:
            r.metrics.prefill_requests.labels(backend.name, "no_params").inc()
            r.metrics.handoff_failures.labels("prefill", "no_params").inc()
            routed.status = 502
            routed.error = f"prefill instance {backend.name} answered {status} without kv_transfer_params ({e})"
            message = (f"{routed.error}: it is not set up for prefill/decode disaggregation; start it with "
                       '--kv-transfer-config "$(kvpool connector-config --pd --master ...)" (NixlConnector beside '
                       "the pool), or another connector that hands KV over, or route to it with --backend instead")  # fmt: skip
            return error_response(502, message, "bad_gateway")
        r.metrics.prefill_requests.labels(backend.name, "ok").inc()
        r.metrics.prefill_s.observe(prefill_s)
        routed.prefill_s = prefill_s
        if routed.info.prompt_tokens > 0:
            r.rates.observe_ttft(attempt.compute_tokens, attempt.pool_tokens, prefill_s)
            r._publish_costs()
        return params

    def _choose_decode(self, routed: RoutedRequest, prefill: Attempt) -> Attempt:
        r = self.router
        tried = {a.backend.name for a in routed.decodes}
        untried_healthy = any(b.healthy and b.name not in tried for b in r.decode)
        views = [b.view(excluded=untried_healthy and b.name in tried) for b in r.decode]
        session = routed.info.session_id if routed.info.session_source != "none" else None
        decision = self.policy.choose(session, views)
        backend = r.decode[decision.index]
        r.metrics.decisions.labels("decode", decision.reason).inc()
        load = Load(backend, 0, routed.info.max_tokens, sent_s=time.perf_counter())
        # sent_s: when its prefill was sent, so the TTFT observed at its first byte is the client's
        attempt = Attempt(backend, decision.reason, load, 0, 0, 0, prefill.sent_s, computes_prompt=False)
        routed.decodes.append(attempt)
        return attempt

    def _failed_step(self, routed: RoutedRequest, stage: str, failure: str) -> web.Response | None:
        """Count a step that failed before the client's first byte; the 502 that ends the request
        when no attempt is left, else None (the caller prefills again)."""
        r = self.router
        reason = failure.split(":", 1)[0]
        routed.error = failure
        routed.handoff_failures.append(f"{stage} {failure}")
        r.metrics.handoff_failures.labels(stage, reason).inc()
        if len(routed.attempts) >= r.config.max_attempts:
            routed.status = 502
            return error_response(502, f"{len(routed.attempts)} attempts failed; last: {stage} {failure}", "bad_gateway")
        r.metrics.handoff_retries.labels(stage, reason).inc()
        return None

    @staticmethod
    def log_fields(routed: RoutedRequest) -> str:
        """The access log's P/D part: where each half ran, the prefill's time, what failed on the way."""
        prefill = routed.attempts[-1].backend.name if routed.attempts else "-"
        decode = routed.decodes[-1] if routed.decodes else None
        prefill_s = f"{routed.prefill_s:.3f}" if routed.prefill_s is not None else "-"
        failures = "; ".join(f.replace('"', "'") for f in routed.handoff_failures)
        return (f" prefill={prefill} decode={decode.backend.name if decode else '-'}"
                f" decode_reason={decode.reason if decode else '-'} prefill_s={prefill_s}"
                + (f' handoffs="{failures}"' if failures else ""))  # fmt: skip
