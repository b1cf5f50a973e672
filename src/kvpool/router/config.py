"""The router's one config object, validated at construction (errors say what to change).

Two modes: aggregated (`backends`: each serves whole requests) or prefill/decode disaggregated
(`prefill` and `decode`: a completion is prefilled on one set and decoded on the other, see
`disagg.py`). The policy, `kv_events` and late binding concern the instances that compute
prompts: the backends, or in P/D mode the prefill instances (`policy_backends`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.core.protocol import MAX_TTL_S
from kvpool.router.policy import DEFAULT_COSTS, POLICY_NAMES, CostModel


@dataclass(frozen=True)
class RouterConfig:
    backends: tuple[str, ...] = ()
    prefill: tuple[str, ...] = ()  # P/D mode: the instances that compute prompts (kv_producer)
    decode: tuple[str, ...] = ()  # P/D mode: the instances that generate from transferred KV (kv_consumer)
    policy: str = "round_robin"
    kv_events: tuple[str, ...] = ()  # one zmq endpoint per policy backend, same order; () = none
    pooled: bool = False  # the backends share a kvpool pool: blocks one computed, all can load
    # with `pooled`: the pool's master (tcp://HOST:PORT); the router follows what it holds exactly
    # (pool_feed.py) instead of estimating it from what the backends stored (the ledger); "": estimate
    master: str = ""
    pool_object_blocks: int = 1  # vLLM blocks per pool object (the connector's blocks_per_object)
    pool_namespace: str = ""  # the one pool namespace to follow; "": every namespace
    tokenizer: str = ""  # the served model's tokenizer (path or cached hub id): text and chat prompts get chains
    request_timeout_s: float = 3600.0
    connect_timeout_s: float = 5.0
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    fail_threshold: int = 2  # failed requests in a row that take a backend out before a check does
    max_attempts: int = 3  # per request, on different backends where there are
    # below the idle timeout of uvicorn (vLLM's server, 5 s): a pooled connection is never reused
    # just as the backend closes it
    keepalive_timeout_s: float = 3.0
    prior_costs: CostModel = DEFAULT_COSTS
    pool_ledger_blocks: int = 1_000_000
    # pass each request's session, cache TTL and end to the pool's eviction (router/hints.py)
    session_hints: bool = False
    session_ttl_s: float = 0.0  # TTL for requests that name none (0: none)
    # a backend's queue is also how long its oldest request has waited for a first byte
    # (policy.estimate_ttft); False: from the tokens in flight only
    observed_wait: bool = True
    # late binding (dispatch.py): a streamed completion waits at the router while every backend already has
    # this many requests without a first byte; 0: off, every request is sent as it arrives
    max_waiting: int = 0

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill)

    @property
    def policy_backends(self) -> tuple[str, ...]:
        """The instances the policy chooses among: the backends, or the prefill instances."""
        return self.prefill if self.disaggregated else self.backends

    def __post_init__(self) -> None:
        if self.backends and (self.prefill or self.decode):
            raise ValueError("give either --backend (aggregated) or --prefill and --decode (P/D), not both")
        if bool(self.prefill) != bool(self.decode):
            raise ValueError("P/D mode needs at least one --prefill and one --decode URL")
        if not self.backends and not self.prefill:
            raise ValueError("at least one --backend URL (or --prefill and --decode URLs) is required")
        role = "--prefill" if self.disaggregated else "--backend"
        every = self.backends + self.prefill + self.decode
        for url in every:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"backend {url!r} must start with http:// or https://")
        if len(set(every)) != len(every):
            raise ValueError("a --backend is given twice" if not self.disaggregated
                             else "a URL is given twice among --prefill and --decode (an instance has one role)")  # fmt: skip
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"unknown --policy {self.policy!r}; choose one of {', '.join(POLICY_NAMES)}")
        if self.kv_events and len(self.kv_events) != len(self.policy_backends):
            raise ValueError(f"give one --kv-events endpoint per {role} ({len(self.policy_backends)}), "
                             f"in the same order; got {len(self.kv_events)}")  # fmt: skip
        for ep in self.kv_events:
            if not ep.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"--kv-events {ep!r} must be a zmq endpoint (tcp://HOST:PORT)")
        for name in ("request_timeout_s", "connect_timeout_s", "health_interval_s", "health_timeout_s",
                     "keepalive_timeout_s"):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if not 0 <= self.session_ttl_s <= MAX_TTL_S:
            raise ValueError(f"--session-ttl-s must be in [0, {MAX_TTL_S:.0f}], got {self.session_ttl_s}")
        if self.max_waiting < 0:
            raise ValueError(f"--max-waiting must be >= 0 (0: off), got {self.max_waiting}")
        if self.master and not self.pooled:
            raise ValueError("--master names the pool the backends share: give --pooled with it")
        if self.master and not all(a.strip().startswith(("tcp://", "ipc://")) for a in self.master.split(",")):
            raise ValueError(f"--master {self.master!r} must be the master's zmq endpoint (tcp://HOST:PORT)")
        if self.pool_object_blocks < 1:
            raise ValueError(f"--pool-object-blocks must be >= 1, got {self.pool_object_blocks}")
        if self.fail_threshold < 1 or self.max_attempts < 1 or self.pool_ledger_blocks < 1:
            raise ValueError("fail_threshold, max_attempts and pool_ledger_blocks must be >= 1")
