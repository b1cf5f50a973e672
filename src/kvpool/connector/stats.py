"""Connector metrics, carried the way vLLM carries connector stats.

Both halves record into a `StatsRecorder`; vLLM collects `get_kv_connector_stats()` every step
(the worker's ride on the model runner output, the scheduler's are merged in by the scheduler),
rebuilds them with `KVPoolConnector.build_kv_connector_stats(data)` in the logging process, logs
`reduce()` periodically and feeds `KVPoolPromMetrics.observe()` for the Prometheus endpoint.
vLLM's own `vllm:external_prefix_cache_{queries,hits}` counters are fed by the scheduler from the
token counts `get_num_new_matched_tokens` returns, so they reflect pool hits without our help.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

COUNTERS = {
    "lookups": "Prefix lookups sent to the pool master",
    "lookups_prefetched": "Lookups started when vLLM added the request, before its first step asked",
    "lookups_cached": "Lookups answered from the per-request hint (vLLM asked again while the request waited)",
    "lookups_deferred": "Engine steps in which a request's lookup was still in flight (vLLM asked again later)",
    "lookups_given_up": "Lookups unanswered within lookup_timeout_s: the request was computed without the pool",
    "lookup_hit_tokens": "Tokens the pool reported beyond vLLM's local hit",
    "remote_prefills": "P/D decode requests whose prompt KV came from a prefill instance (no lookup, no prompt save)",
    "lookup_failures": "Lookups that failed (master unreachable or error)",
    "prefix_touches": "Lookups that kept a waiting request's prefix fresh in the pool (touch_waiting_s)",
    "prefix_touched_objects": "Pool objects those lookups found (and refreshed in the master's LRU)",
    "prefix_touch_failures": "Such lookups that failed (nothing waits for them)",
    "loads": "Load jobs (one per request hit)",
    "loaded_blocks": "vLLM blocks read from the pool",
    "loaded_bytes": "Bytes read from the pool",
    "load_failed_blocks": "vLLM blocks a load could not read (recomputed by vLLM)",
    "saves": "Save jobs (one per request per step with new full objects)",
    "saved_blocks": "vLLM blocks written to the pool",
    "saved_bytes": "Bytes written to the pool",
    "saved_full_bytes": "Bytes written to the pool for full-attention KV-cache groups",
    "saved_window_bytes": "Bytes written to the pool for sliding-window KV-cache groups (hybrid models)",
    "saved_state_bytes": "Bytes written to the pool for Mamba / linear-attention state groups (hybrid models)",
    "save_existing_blocks": "vLLM blocks already in the pool (not written again)",
    "saves_deferred": "Saves of running requests put off a step: too many blocks pinned for saves",
    "saves_dropped": "Saves of finished requests dropped: too many blocks pinned for saves",
    "save_failed_blocks": "vLLM blocks a save could not store (no space, transfer error, no pool)",
    "pool_unavailable": "Times the connector lost the pool and fell back to no pool",
    "hinted_requests": "Requests that named an agent session or a cache TTL (kv_transfer_params['kvpool'])",
    "bad_hints": "Requests whose kv_transfer_params['kvpool'] did not parse (served without hints)",
}
LATENCIES = {
    "lookup_latency_s": "Lookup round trip",
    "load_latency_s": "One load job, from start to the last byte",
    "save_latency_s": "One save job, from start to the pool's acknowledgement",
}


@dataclass
class KVPoolConnectorStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)
        for name in LATENCIES:
            self.data.setdefault(name, [])

    def reset(self) -> None:
        self.data = {}
        self.__post_init__()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            for name in COUNTERS:
                self.data[name] += other.data.get(name, 0)
            for name in LATENCIES:
                self.data[name] = self.data[name] + list(other.data.get(name, []))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {name: self.data[name] for name in COUNTERS if self.data[name]}
        for name in LATENCIES:
            values = sorted(self.data[name])
            if values:
                label = name.removesuffix("_latency_s")
                out[f"{label}_avg_ms"] = round(1000 * sum(values) / len(values), 3)
                out[f"{label}_p50_ms"] = round(1000 * values[len(values) // 2], 3)
                out[f"{label}_max_ms"] = round(1000 * values[-1], 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(name) for name in COUNTERS) and not any(self.data.get(n) for n in LATENCIES)


class StatsRecorder:
    """Thread-safe accumulation; `take()` hands over what was recorded since the last take."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = KVPoolConnectorStats()

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                self._stats.data[name] += value

    def observe(self, name: str, seconds: float) -> None:
        with self._lock:
            self._stats.data[name].append(seconds)

    def take(self) -> KVPoolConnectorStats | None:
        with self._lock:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, KVPoolConnectorStats()
            return stats


class KVPoolPromMetrics(KVConnectorPromMetrics):
    """Counters `vllm:kvpool_<name>` and histograms `vllm:kvpool_<op>_seconds`, per engine."""

    _BUCKETS_S = [1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(name=f"vllm:kvpool_{name}", documentation=doc, labelnames=labelnames)
            for name, doc in COUNTERS.items()
        }
        self._histograms = {
            name: self._histogram_cls(
                name=f"vllm:kvpool_{name.removesuffix('_latency_s')}_seconds",
                documentation=doc, buckets=self._BUCKETS_S, labelnames=labelnames,
            )
            for name, doc in LATENCIES.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, counter in self._counters.items():
            value = transfer_stats_data.get(name, 0)
            if value:
                counter.labels(*labels).inc(value)
        for name, histogram in self._histograms.items():
            for seconds in transfer_stats_data.get(name, ()):
                histogram.labels(*labels).observe(seconds)
