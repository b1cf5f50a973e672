"""The router's Prometheus metrics, in their own registry (several routers can live in one test)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kvpool_router_requests", "requests answered, by backend and status class",
                                ["backend", "status"], registry=r)  # fmt: skip
        self.decisions = Counter("kvpool_router_decisions", "routing decisions by policy and reason",
                                 ["policy", "reason"], registry=r)  # fmt: skip
        self.retries = Counter("kvpool_router_retries", "attempts sent again elsewhere, by why", ["reason"], registry=r)
        self.failures = Counter("kvpool_router_backend_failures", "attempts a backend did not answer",
                                ["backend"], registry=r)  # fmt: skip
        self.stream_errors = Counter("kvpool_router_stream_errors", "streams cut after the first byte",
                                     ["backend"], registry=r)  # fmt: skip
        self.no_backend = Counter("kvpool_router_no_backend", "requests refused: no healthy backend", registry=r)
        self.healthy = Gauge("kvpool_router_backend_healthy", "1 while in rotation", ["backend"], registry=r)
        self.inflight = Gauge("kvpool_router_backend_inflight_requests", "requests in flight", ["backend"], registry=r)
        self.oldest_wait = Gauge("kvpool_router_backend_oldest_wait_seconds",
                                 "how long the oldest request in flight there has waited for its first byte",
                                 ["backend"], registry=r)  # fmt: skip
        self.inflight_tokens = Gauge("kvpool_router_backend_inflight_tokens", "prompt tokens to compute / tokens to decode",
                                     ["backend", "phase"], registry=r)  # fmt: skip
        self.cached_blocks = Gauge("kvpool_router_backend_cached_blocks", "blocks in the backend's KV cache (events)",
                                   ["backend"], registry=r)  # fmt: skip
        self.local_prefix_tokens = Counter("kvpool_router_local_prefix_tokens", "prompt tokens the chosen backend held",
                                           ["backend"], registry=r)  # fmt: skip
        self.pool_prefix_tokens = Counter("kvpool_router_pool_prefix_tokens", "prompt tokens the pool was believed to hold",
                                          registry=r)  # fmt: skip
        self.prompt_tokens = Counter("kvpool_router_prompt_tokens", "prompt tokens routed", registry=r)
        self.ttft_s = Histogram("kvpool_router_ttft_seconds", "time to the backend's first byte",
                                buckets=(0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100), registry=r)  # fmt: skip
        self.held = Gauge("kvpool_router_held_requests", "requests waiting at the router for a backend with room "
                          "(--max-waiting)", registry=r)  # fmt: skip
        self.held_s = Histogram("kvpool_router_held_seconds",
                                "how long a streamed completion waited at the router (--max-waiting; 0: sent at once)",
                                buckets=(0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100), registry=r)  # fmt: skip
        # P/D mode
        self.prefill_requests = Counter("kvpool_router_prefill_requests",
                                        "prefill requests sent, by prefill instance and outcome", ["backend", "outcome"],
                                        registry=r)  # fmt: skip
        self.decode_requests = Counter("kvpool_router_decode_requests",
                                       "decode requests sent, by decode instance and outcome", ["backend", "outcome"],
                                       registry=r)  # fmt: skip
        self.prefill_s = Histogram("kvpool_router_prefill_seconds", "time to a prefill instance's response",
                                   buckets=(0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100), registry=r)  # fmt: skip
        self.handoff_failures = Counter("kvpool_router_handoff_failures",
                                        "prefill or decode steps that failed before the client's first byte, by why",
                                        ["stage", "reason"], registry=r)  # fmt: skip
        self.handoff_retries = Counter("kvpool_router_handoff_retries",
                                       "requests prefilled again after a failed step, by the step and why",
                                       ["stage", "reason"], registry=r)  # fmt: skip
        self.tokenize_s = Histogram("kvpool_router_tokenize_seconds",
                                    "time to tokenize a text or chat prompt (--tokenizer), on a worker thread",
                                    buckets=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3), registry=r)  # fmt: skip
        # the pool's contents (--pooled): exact with --master (pool_state.py), else the ledger's estimate
        self.pool_answer_s = Histogram("kvpool_router_pool_answer_seconds",
                                       "time to answer how many leading blocks of a prompt the pool holds",
                                       buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2), registry=r)  # fmt: skip
        self.pool_index_keys = Gauge("kvpool_router_pool_index_keys",
                                     "pool keys the router knows held (--master): placed in its chains, or pending "
                                     "(no backend's event named their block yet)", ["state"], registry=r)  # fmt: skip
        self.pool_index_resyncs = Gauge("kvpool_router_pool_index_resyncs",
                                        "snapshots taken again since start, by why (gap, epoch, restart, unavailable)",
                                        ["reason"], registry=r)  # fmt: skip
        self.pool_index_batches = Gauge("kvpool_router_pool_index_batches", "event batches applied since start",
                                        registry=r)  # fmt: skip
        self.pool_index_age_s = Gauge("kvpool_router_pool_index_age_seconds",
                                      "seconds since the pool view was last known current (a batch, a snapshot, or "
                                      "a check of the master's sequence every 2 s): how stale it may be",
                                      registry=r)  # fmt: skip
        self.cost = Gauge("kvpool_router_cost_s_per_token", "the cost model in use", ["kind"], registry=r)
        self.decode_latency = Gauge("kvpool_router_decode_latency_s_per_token",
                                    "seconds between a stream's tokens (recent average): latency, not a cost",
                                    registry=r)  # fmt: skip
