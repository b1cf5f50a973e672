"""Session hints the router passes to the pool through vLLM: who a request belongs to, how long its
context is worth keeping, whether its session ends. Pure: no I/O.

Rules:
- They travel in the body's `kv_transfer_params["kvpool"]` = {"session", "ttl_s", "end"}; vLLM
  hands kv_transfer_params to the KV connector unchanged (connector/session_hints.py reads them).
- The session is the router's own (sessions.py: header, `user`, or the first prompt block's hash).
- TTL, first that applies: the `x-kvpool-ttl` header (seconds, or "5m" / "1h"); a `cache_control`
  with a `ttl` on the body, on its last message or on that message's content parts (as agents send
  for prompt caching); else the router's default (`--session-ttl-s`, 0: none). A `cache_control`
  without a ttl means the provider default, 5 minutes.
- End of session: the `x-session-end` header (1 / true / yes).
- A body that already carries kv_transfer_params["kvpool"] keeps it: the client said it itself.
- Adding them costs no re-encoding of the prompt when the body has no kv_transfer_params: the
  field is spliced in after the body's opening brace.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from kvpool.core.protocol import MAX_TTL_S

PARAMS_KEY = "kvpool"
TTL_HEADER = "x-kvpool-ttl"
END_HEADER = "x-session-end"
DEFAULT_CACHE_CONTROL_TTL_S = 300.0
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*$")
_UNIT_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: object) -> float | None:
    """Seconds from 30, 30.5, "30", "30s", "5m", "1h"; None when it is none of these."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.match(value)):
        seconds = float(m.group(1)) * _UNIT_S[m.group(2)]
    else:
        return None
    return seconds if 0 <= seconds <= MAX_TTL_S else None


def _cache_control_ttl(body: Mapping) -> float | None:
    """The TTL of the latest cache_control marker in the body (None: no marker)."""
    marks = [body.get("cache_control")]
    messages = body.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
        last = messages[-1]
        marks.append(last.get("cache_control"))
        content = last.get("content")
        if isinstance(content, list):
            marks += [part.get("cache_control") for part in content if isinstance(part, dict)]
    found = None
    for mark in marks:
        if isinstance(mark, dict):
            ttl = parse_duration(mark["ttl"]) if "ttl" in mark else DEFAULT_CACHE_CONTROL_TTL_S
            if ttl is not None:
                found = ttl
    return found


def request_hint(session: str, headers: Mapping[str, str], body: Mapping | None, default_ttl_s: float) -> dict:
    """The hint for one request: {"session": ..., "ttl_s": ..., "end": ...}."""
    lowered = {k.lower(): v for k, v in headers.items()}
    ttl = parse_duration(lowered[TTL_HEADER]) if TTL_HEADER in lowered else None
    if ttl is None and body is not None:
        ttl = _cache_control_ttl(body)
    if ttl is None:
        ttl = default_ttl_s
    end = lowered.get(END_HEADER, "").strip().lower() in ("1", "true", "yes")
    return {"session": session, "ttl_s": ttl, "end": end}


def with_hint(body: bytes, parsed: dict, hint: dict) -> bytes:
    """The body with the hint in kv_transfer_params (`parsed` is updated too). Unchanged when the
    client set kv_transfer_params["kvpool"] itself."""
    params = parsed.get("kv_transfer_params")
    if isinstance(params, dict) and PARAMS_KEY in params:
        return body
    if "kv_transfer_params" not in parsed:
        parsed["kv_transfer_params"] = {PARAMS_KEY: hint}
        start = body.find(b"{")
        field = json.dumps({"kv_transfer_params": {PARAMS_KEY: hint}}).encode()[1:-1]
        return body[: start + 1] + field + (b"," if parsed.keys() - {"kv_transfer_params"} else b"") + body[start + 1 :]
    if params is None:
        params = parsed["kv_transfer_params"] = {}
    if not isinstance(params, dict):
        return body  # not ours to fix: vLLM answers the client's error
    params[PARAMS_KEY] = hint
    return json.dumps(parsed).encode()


def keep_hint(source: Mapping, params: dict) -> dict:
    """`params` (kv_transfer_params the router sets for P/D) with the source body's hint kept."""
    hint = source.get("kv_transfer_params")
    if isinstance(hint, dict) and PARAMS_KEY in hint:
        return {**params, PARAMS_KEY: hint[PARAMS_KEY]}
    return params
