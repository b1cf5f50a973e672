"""The router's view of each backend: health, load in flight, and what its KV cache holds.

Rules:
- One `Backend` object per backend holds all of it; the policy sees a frozen `BackendView` of it.
- Health is a small state table: healthy -> (a refused or failed check, `fail_threshold` timed-out
  checks or `fail_threshold` failed requests in a row) -> unhealthy -> (one passing check) ->
  healthy. A check that only timed out may be a busy machine (a saturated engine, or the router's
  own loop held up) rather than a dead server, so one alone never takes a backend out. A request that reached the backend and got
  an answer resets the count; a stale keep-alive connection that is simply retried counts once, so
  one idle-closed socket never takes a live backend out of rotation.
- In-flight load is added when a request is sent and removed as it progresses: its prompt tokens
  to compute until the first byte comes back, its planned output tokens until it ends. The send
  times of requests still without a first byte give the oldest wait (policy.estimate_ttft).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.router.policy import BackendView, oldest_wait_s
from kvpool.router.prefix_index import BackendCache


@dataclass
class Backend:
    url: str
    name: str
    fail_threshold: int = 2
    healthy: bool = True
    consecutive_failures: int = 0
    last_error: str | None = None
    inflight_requests: int = 0
    inflight_prompt_tokens: int = 0
    inflight_decode_tokens: int = 0
    cache: BackendCache = field(default_factory=BackendCache)
    # send time of each request still waiting for its first byte, by id(Load); in send order
    waiting_since: dict[int, float] = field(default_factory=dict)

    def oldest_wait_s(self, now_s: float) -> float:
        return oldest_wait_s(self.waiting_since, now_s)  # the dict keeps send order

    def view(self, local_prefix_tokens: int = 0, excluded: bool = False, now_s: float | None = None) -> BackendView:
        return BackendView(self.name, healthy=self.healthy and not excluded,
                           inflight_prompt_tokens=self.inflight_prompt_tokens,
                           inflight_decode_tokens=self.inflight_decode_tokens,
                           local_prefix_tokens=local_prefix_tokens,
                           oldest_wait_s=self.oldest_wait_s(now_s) if now_s is not None else 0.0)  # fmt: skip

    def check_passed(self) -> bool:
        """A health check answered 200; True when this brought the backend back."""
        back = not self.healthy
        self.healthy, self.consecutive_failures, self.last_error = True, 0, None
        return back

    def check_failed(self, error: str) -> bool:
        """A health check failed; True when this took the backend out of rotation."""
        out = self.healthy
        self.healthy, self.last_error = False, error
        self.consecutive_failures = max(self.consecutive_failures, self.fail_threshold)
        return out

    def check_timed_out(self, error: str) -> bool:
        """A health check got no answer in time: a failure like a failed request's (counted toward
        `fail_threshold`); True when this took the backend out of rotation."""
        return self.request_failed(error)

    def request_failed(self, error: str) -> bool:
        """A request could not be sent or got no answer; True when this took the backend out."""
        self.consecutive_failures += 1
        self.last_error = error
        if self.healthy and self.consecutive_failures >= self.fail_threshold:
            self.healthy = False
            return True
        return False

    def request_answered(self) -> None:
        self.consecutive_failures = 0


@dataclass
class Load:
    """The load one request put on its backend, taken back exactly once per phase."""

    backend: Backend
    prompt_tokens: int
    decode_tokens: int
    sent_s: float  # the router's clock (time.perf_counter)
    prefilled: bool = False
    ended: bool = False

    def __post_init__(self) -> None:
        self.backend.inflight_requests += 1
        self.backend.inflight_prompt_tokens += self.prompt_tokens
        self.backend.inflight_decode_tokens += self.decode_tokens
        self.backend.waiting_since[id(self)] = self.sent_s

    def first_byte(self) -> None:
        if not self.prefilled:
            self.prefilled = True
            self.backend.inflight_prompt_tokens -= self.prompt_tokens
            self.backend.waiting_since.pop(id(self), None)

    def end(self) -> None:
        if not self.ended:
            self.first_byte()
            self.ended = True
            self.backend.inflight_requests -= 1
            self.backend.inflight_decode_tokens -= self.decode_tokens
