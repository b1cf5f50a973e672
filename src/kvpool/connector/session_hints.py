"""Session hints on a vLLM request, as the router (or any client) sends them. Pure: no I/O.

Rules:
- They ride in the request's `kv_transfer_params` under "kvpool": {"session": str, "ttl_s": number,
  "end": bool}; vLLM hands those to every connector unchanged (other connectors ignore the key).
- A hint that does not parse is ignored, counted and logged once per request: a request is never
  refused for its hints, and nothing but eviction order and retention depends on them.
- `TTLKeys` is a list of keys that carries the request's TTL to its lookup.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.core.protocol import MAX_SESSION_LENGTH, MAX_TTL_S

PARAMS_KEY = "kvpool"


@dataclass(frozen=True)
class SessionHint:
    session: str
    ttl_s: float = 0.0
    end: bool = False  # the client says this is the session's last turn


class BadHint(ValueError):
    pass


def hint_of(kv_transfer_params: object) -> SessionHint | None:
    """The request's hint; None when it has none; BadHint when it has one that does not parse."""
    if not isinstance(kv_transfer_params, dict):
        return None
    raw = kv_transfer_params.get(PARAMS_KEY)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise BadHint(f"kv_transfer_params[{PARAMS_KEY!r}] must be an object, got {type(raw).__name__}")
    session = raw.get("session", "")
    if not isinstance(session, str) or len(session) > MAX_SESSION_LENGTH:
        raise BadHint(f"session must be a string of at most {MAX_SESSION_LENGTH} characters")
    ttl = raw.get("ttl_s", 0.0)
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 <= ttl <= MAX_TTL_S:
        raise BadHint(f"ttl_s must be a number of seconds in [0, {MAX_TTL_S:.0f}], got {ttl!r}")
    end = raw.get("end", False)
    if not isinstance(end, bool):
        raise BadHint(f"end must be true or false, got {end!r}")
    if not session and not ttl:
        return None
    return SessionHint(session, float(ttl), end)


class TTLKeys(list):
    """Lookup keys with the TTL their hits should be kept for (0: none)."""

    __slots__ = ("ttl_s",)

    def __init__(self, keys, ttl_s: float) -> None:
        super().__init__(keys)
        self.ttl_s = ttl_s
