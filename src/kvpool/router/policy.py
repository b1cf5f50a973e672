"""Routing policies: which backend serves a request, as a pure function of plain state.

Rules:
- No I/O, no clocks, no asyncio: the HTTP router, the fleet simulator and the tests feed the same
  frozen views in and get the same `Decision` out.
- `backends` is the list the caller routes over; `Decision.index` points into it. An unhealthy
  backend is never chosen; with none healthy, `choose` raises `NoHealthyBackend`.
- Ties are broken deterministically (backend order, or a hash of the session and backend names),
  never by a random draw, so a replayed trace takes the same routes.
- Stateful policies (the round-robin cursor, the hash ring) hold only that state; load and cache
  contents always come in through the views.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol


class NoHealthyBackend(RuntimeError):
    """Every backend is marked unhealthy: the caller answers 503, nothing is routed."""


@dataclass(frozen=True)
class BackendView:
    name: str
    healthy: bool = True
    inflight_prompt_tokens: int = 0  # prompt tokens of requests sent there and not yet prefilled
    inflight_decode_tokens: int = 0  # tokens still to generate for requests there
    local_prefix_tokens: int = 0  # tokens of THIS request's prefix in that backend's own KV cache
    # how long the oldest request sent there has waited for its first token: what its queue
    # actually is, whatever the token counts say (a surprise recompute, KV memory full)
    oldest_wait_s: float = 0.0

    @property
    def inflight_tokens(self) -> int:
        return self.inflight_prompt_tokens + self.inflight_decode_tokens


@dataclass(frozen=True)
class RouteRequest:
    session_id: str
    prompt_tokens: int
    pool_prefix_tokens: int = 0  # tokens of the prefix the shared pool holds (any backend can load them)


@dataclass(frozen=True)
class CostModel:
    """Seconds per token of each way a prompt token can reach a backend's KV cache."""

    prefill_s_per_token: float  # recomputed
    pool_load_s_per_token: float  # loaded from the pool
    decode_s_per_token: float = 0.0  # one generated token of another request in the same batch

    def __post_init__(self) -> None:
        for name in ("prefill_s_per_token", "pool_load_s_per_token", "decode_s_per_token"):
            if not getattr(self, name) >= 0.0:  # also refuses NaN
                raise ValueError(f"CostModel.{name} must be >= 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class Decision:
    index: int
    reason: str
    # the cache-aware policy's estimate on each backend (None: not eligible), for the access log
    estimates: tuple[Estimate | None, ...] = field(default=(), compare=False)


class Policy(Protocol):
    def choose(self, request: RouteRequest, backends: Sequence[BackendView]) -> Decision: ...


def _healthy_indexes(backends: Sequence[BackendView]) -> list[int]:
    healthy = [i for i, b in enumerate(backends) if b.healthy]
    if not healthy:
        raise NoHealthyBackend(f"none of the {len(backends)} backends is healthy")
    return healthy


def _hash64(text: str) -> int:
    # blake2b, not hash(): the same ring in every process, whatever PYTHONHASHSEED says.
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class RoundRobinPolicy:
    """The reference baseline: the next healthy backend after the last one chosen."""

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: RouteRequest, backends: Sequence[BackendView]) -> Decision:
        healthy = _healthy_indexes(backends)
        for offset in range(len(backends)):
            index = (self._next + offset) % len(backends)
            if index in healthy:
                self._next = index + 1
                return Decision(index, "next" if offset == 0 else "next_healthy")
        raise AssertionError("unreachable: healthy is not empty")


class LeastLoadedPolicy:
    """Fewest in-flight prompt + decode tokens; ties go to the earlier backend."""

    def choose(self, request: RouteRequest, backends: Sequence[BackendView]) -> Decision:
        index = min(_healthy_indexes(backends), key=lambda i: (backends[i].inflight_tokens, i))
        return Decision(index, "least_loaded")


class SessionPolicy:
    """Consistent hashing with bounded load: a session sticks to its backend on the ring while that
    backend carries at most `load_factor` times the mean load (the mean counting this request); past
    it the request spills to the next backend clockwise that is under the bound.

    Adding a backend moves only the sessions whose ring points now fall to it (about 1/n of them);
    the rest keep their home and with it their local KV cache. Load is in-flight tokens, the unit
    the other policies use; an idle backend is always under the bound.
    """

    def __init__(self, backends: Sequence[str] = (), virtual_nodes: int = 64, load_factor: float = 1.5) -> None:
        if virtual_nodes < 1:
            raise ValueError(f"virtual_nodes must be >= 1, got {virtual_nodes}")
        if not load_factor >= 1.0:
            raise ValueError(f"load_factor must be >= 1.0 (1.0 = perfectly even), got {load_factor}")
        self.virtual_nodes = virtual_nodes
        self.load_factor = load_factor
        self._points: list[int] = []  # sorted ring positions
        self._owners: list[str] = []  # backend name at each position
        self._members: set[str] = set()
        for name in backends:
            self.add_backend(name)

    @property
    def members(self) -> frozenset[str]:
        return frozenset(self._members)

    def add_backend(self, name: str) -> None:
        if name in self._members:
            raise ValueError(f"backend {name!r} is already on the ring")
        self._members.add(name)
        for v in range(self.virtual_nodes):
            point = _hash64(f"{name}#{v}")
            at = bisect.bisect_left(self._points, point)
            self._points.insert(at, point)
            self._owners.insert(at, name)

    def remove_backend(self, name: str) -> None:
        if name not in self._members:
            raise ValueError(f"backend {name!r} is not on the ring")
        self._members.discard(name)
        kept = [(p, o) for p, o in zip(self._points, self._owners) if o != name]
        self._points = [p for p, _ in kept]
        self._owners = [o for _, o in kept]

    def ring_order(self, session_id: str) -> list[str]:
        """Backend names in the order a session tries them: its home first, then clockwise."""
        if not self._points:
            return []
        start = bisect.bisect_right(self._points, _hash64(session_id)) % len(self._points)
        order: list[str] = []
        for k in range(len(self._points)):
            owner = self._owners[(start + k) % len(self._points)]
            if owner not in order:
                order.append(owner)
                if len(order) == len(self._members):
                    break
        return order

    def choose(self, request: RouteRequest, backends: Sequence[BackendView]) -> Decision:
        healthy = _healthy_indexes(backends)
        by_name = {backends[i].name: i for i in healthy}
        candidates = [by_name[n] for n in self.ring_order(request.session_id) if n in by_name]
        if not candidates:
            raise NoHealthyBackend(f"no healthy backend is on the ring ({sorted(self._members)})")
        total = sum(backends[i].inflight_tokens for i in healthy) + request.prompt_tokens
        bound = self.load_factor * total / len(healthy)
        # The load a backend has before this request is compared with the bound. Rejected: adding the
        # request first (load + prompt <= bound): a prompt larger than everything in flight (the usual
        # case with short outputs, as prompt tokens leave the load at the first token) then fits
        # nowhere, and every such request fell back to least-loaded, losing its session's home.
        for rank, index in enumerate(candidates):
            if backends[index].inflight_tokens <= bound:
                return Decision(index, "home" if rank == 0 else "spill")
        # unreachable with load_factor >= 1 (the least loaded is at most the mean); kept as a guard
        index = min(candidates, key=lambda i: backends[i].inflight_tokens)
        return Decision(index, "overloaded")


@dataclass(frozen=True)
class Estimate:
    """How one backend would serve a request: where its prompt tokens come from, and the time."""

    local_tokens: int
    pool_tokens: int
    recompute_tokens: int
    queue_s: float
    ttft_s: float


def oldest_wait_s(sent_at: Mapping[object, float], now_s: float) -> float:
    """`BackendView.oldest_wait_s` from the send times of the requests still without a first token,
    in send order (the router's backends and the simulator's instances keep them so)."""
    oldest = next(iter(sent_at.values()), None)
    return 0.0 if oldest is None else max(0.0, now_s - oldest)


def estimate_ttft(request: RouteRequest, backend: BackendView, costs: CostModel) -> Estimate:
    """Time to first token on `backend`: its queue, plus each prompt token by the cheapest way it
    can get there (own cache free, pool at transfer cost, the rest recomputed).

    The queue is what the tokens in flight cost, or, when longer, how long the oldest request
    there has already waited for its first token: a request routed there now queues behind it.
    The token count misses what the router cannot see (a prefix it expected cached but the server
    recomputed, requests held back because the server's KV memory is full); the observed wait does
    not. On the long e2e trace every slowest request sat on one server the token estimate called
    idle (benchmarks/results/e2e_peers/2026-12-02-2cpu-epyc-quiet-long-wm/tails.md)."""
    prompt = max(0, request.prompt_tokens)
    local = min(max(0, backend.local_prefix_tokens), prompt)
    pool = max(0, min(request.pool_prefix_tokens, prompt) - local)
    recompute = prompt - local - pool
    queue_s = max(backend.inflight_prompt_tokens * costs.prefill_s_per_token
                  + backend.inflight_decode_tokens * costs.decode_s_per_token, backend.oldest_wait_s)  # fmt: skip
    ttft_s = queue_s + pool * costs.pool_load_s_per_token + recompute * costs.prefill_s_per_token
    return Estimate(local, pool, recompute, queue_s, ttft_s)


class CacheAwarePolicy:
    """Lowest estimated time to first token wins. Ties (idle, equally cold backends) go by a hash
    of session and backend name (rendezvous), so a session's turns meet on the same backend and
    different sessions spread out. `costs` is replaced as measured rates come in."""

    def __init__(self, costs: CostModel) -> None:
        self.costs = costs

    def set_costs(self, costs: CostModel) -> None:
        self.costs = costs

    def estimates(self, request: RouteRequest, backends: Sequence[BackendView]) -> list[Estimate | None]:
        return [estimate_ttft(request, b, self.costs) if b.healthy else None for b in backends]

    def choose(self, request: RouteRequest, backends: Sequence[BackendView]) -> Decision:
        estimates = self.estimates(request, backends)
        scored = [(i, estimates[i]) for i in _healthy_indexes(backends)]
        index, best = min(scored, key=lambda ie: (
            ie[1].ttft_s, -ie[1].local_tokens, -_hash64(f"{request.session_id}@{backends[ie[0]].name}")))
        reason = "local" if best.local_tokens > 0 else "pool" if best.pool_tokens > 0 else "cold"
        return Decision(index, reason, tuple(estimates))


POLICY_NAMES = ("round_robin", "least_loaded", "session", "cache_aware")

DEFAULT_COSTS = CostModel(prefill_s_per_token=1e-3, pool_load_s_per_token=1e-4, decode_s_per_token=1e-4)
"""A starting point only: the router replaces it with measured rates (see `rates.py`)."""


def make_policy(name: str, backends: Sequence[str], costs: CostModel | None = None) -> Policy:
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_loaded":
        return LeastLoadedPolicy()
    if name == "session":
        return SessionPolicy(backends)
    if name == "cache_aware":
        return CacheAwarePolicy(costs if costs is not None else DEFAULT_COSTS)
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
