"""One client request's state in the router, start to end: what it asks for and every try made.

Rules:
- One `RoutedRequest` per client request holds all of it; the access log line is written from it.
- `attempts` are the tries the policy placed (the backends, or in P/D mode the prefill
  instances); `decodes` the decode tries of P/D mode. Each try's `Load` is taken back once,
  when the request ends at the latest.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvpool.router.backends import Backend, Load
from kvpool.router.prefix_index import RouterHash
from kvpool.router.sessions import RequestInfo


@dataclass
class Attempt:
    """One try of a request on one backend."""

    backend: Backend
    reason: str
    load: Load
    local_tokens: int
    pool_tokens: int
    compute_tokens: int  # what the backend must compute before this request's first token
    sent_s: float
    first_byte_s: float | None = None
    estimates: str = ""  # the cache-aware policy's estimated TTFT on each backend, for the access log
    # the backend computes the prompt, so its first byte times the prefill (False for a P/D decode
    # instance: its first byte is a KV transfer and one step)
    computes_prompt: bool = True


@dataclass
class RoutedRequest:
    """Everything the router knows about one client request, start to end."""

    info: RequestInfo
    chain: list[RouterHash]
    block_size: int
    pool_tokens: int
    started_s: float = field(default_factory=time.perf_counter)
    attempts: list[Attempt] = field(default_factory=list)
    status: int = 0
    bytes_out: int = 0
    error: str | None = None
    # not a completion the policy places: any healthy backend (in P/D mode a decode instance) serves it
    to_any: bool = False
    body_json: dict | None = None  # the body, when it is a JSON object
    # P/D mode
    decodes: list[Attempt] = field(default_factory=list)
    prefill_s: float | None = None  # time to the prefill response the decode continued from
    handoff_failures: list[str] = field(default_factory=list)  # each failed step, in order

    def tried(self) -> set[str]:
        return {a.backend.name for a in self.attempts}

    def loads(self) -> list[Load]:
        return [a.load for a in self.attempts + self.decodes]
