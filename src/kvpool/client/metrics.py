"""Client-side Prometheus metrics (kvpool_client_*).

Rules:
- The metrics are created once per process and registry (Prometheus forbids duplicate names), and
  shared by every Client in it, labelled by tenant; a process that serves /metrics exposes them.
- Counting happens where the outcome is known (after the master's reply, after the transfer), so
  the numbers agree with what callers were told.
- A Client counts through `TenantMetrics`, its tenant's children bound once: prometheus_client's
  `labels()` costs a few microseconds per call, a tenth of a lookup's Python.
"""

from __future__ import annotations

import threading

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

_LATENCY_BUCKETS_S = (50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 20e-3, 50e-3, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class ClientMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        t = ["tenant"]
        self.put_keys = Counter(
            "kvpool_client_put_keys", "Keys passed to put, by outcome", t + ["status"], registry=registry
        )
        self.put_bytes = Counter("kvpool_client_put_bytes", "Bytes written into the pool", t, registry=registry)
        self.get_keys = Counter("kvpool_client_get_keys", "Keys asked for by get calls", t, registry=registry)
        self.hit_keys = Counter(
            "kvpool_client_hit_keys", "Keys read completely and within their lease", t, registry=registry
        )
        self.get_bytes = Counter("kvpool_client_get_bytes", "Bytes read from the pool", t, registry=registry)
        self.lease_expiries = Counter(
            "kvpool_client_lease_expiries",
            "Keys whose read finished after the lease expired (not reported as read)",
            t,
            registry=registry,
        )
        self.transfer_failures = Counter(
            "kvpool_client_transfer_failures",
            "Data-plane jobs that failed (one job = one segment in one round)",
            t + ["op"],
            registry=registry,
        )
        self.checksum_mismatches = Counter(
            "kvpool_client_checksum_mismatches",
            "Objects read whose bytes did not match their writer's checksum (served as misses)",
            t,
            registry=registry,
        )
        self.replica_fallbacks = Counter(
            "kvpool_client_replica_fallbacks", "Reads retried on another replica", t, registry=registry
        )
        self.puts_ahead = Counter(
            "kvpool_client_puts_ahead",
            "Plain puts written into an allocation held ahead: the write and one PutEnd (client/ahead.py)",
            t,
            registry=registry,
        )
        self.put_ends_landing = Counter(
            "kvpool_client_put_ends_landing",
            "Put batches whose PutEnd travelled while their bytes were written (client/landing.py)",
            t,
            registry=registry,
        )
        self.landings_unsent = Counter(
            "kvpool_client_landings_unsent",
            "Put batches written and ended whose PutLanded could not be sent: reported PUT_FAILED",
            t,
            registry=registry,
        )
        self.early_reads = Counter(
            "kvpool_client_early_reads",
            "Plain gets that read where the value was last seen while GetValue travelled "
            "(client/known_places.py), by outcome: used, or read_again (the place was stale)",
            t + ["outcome"],
            registry=registry,
        )
        self.tag_reads = Counter(
            "kvpool_client_tag_reads",
            "Plain gets of values this client never saw that read the node's tag while GetValue "
            "travelled (transfer/tcp_path_tags.py), by outcome: used, read_again (not the value), "
            "unknown (the node knew no such tag), failed (the read broke)",
            t + ["outcome"],
            registry=registry,
        )
        self.latency_s = Histogram(
            "kvpool_client_op_seconds",
            "Latency of client calls, master round trip and transfers included",
            t + ["op"],
            buckets=_LATENCY_BUCKETS_S,
            registry=registry,
        )


class _Bound(dict):
    """label value -> that metric's child for one tenant, bound on first use."""

    def __init__(self, metric, tenant: str) -> None:
        super().__init__()
        self._metric = metric
        self._tenant = tenant

    def __missing__(self, value: str):
        child = self[value] = self._metric.labels(self._tenant, value)
        return child


class TenantMetrics:
    """One tenant's view of ClientMetrics: `latency["get"].observe(s)`, `put_keys["stored"].inc()`."""

    def __init__(self, metrics: ClientMetrics, tenant: str) -> None:
        self.put_keys = _Bound(metrics.put_keys, tenant)  # by status
        self.transfer_failures = _Bound(metrics.transfer_failures, tenant)  # by op
        self.latency_s = _Bound(metrics.latency_s, tenant)  # by op
        self.early_reads = _Bound(metrics.early_reads, tenant)  # by outcome
        self.tag_reads = _Bound(metrics.tag_reads, tenant)  # by outcome
        self.put_bytes = metrics.put_bytes.labels(tenant)
        self.get_keys = metrics.get_keys.labels(tenant)
        self.hit_keys = metrics.hit_keys.labels(tenant)
        self.get_bytes = metrics.get_bytes.labels(tenant)
        self.lease_expiries = metrics.lease_expiries.labels(tenant)
        self.checksum_mismatches = metrics.checksum_mismatches.labels(tenant)
        self.replica_fallbacks = metrics.replica_fallbacks.labels(tenant)
        self.puts_ahead = metrics.puts_ahead.labels(tenant)
        self.put_ends_landing = metrics.put_ends_landing.labels(tenant)
        self.landings_unsent = metrics.landings_unsent.labels(tenant)


_BY_REGISTRY: dict[int, ClientMetrics] = {}
_LOCK = threading.Lock()


def client_metrics(registry: CollectorRegistry | None = None) -> ClientMetrics:
    registry = REGISTRY if registry is None else registry
    with _LOCK:
        metrics = _BY_REGISTRY.get(id(registry))
        if metrics is None:
            metrics = _BY_REGISTRY[id(registry)] = ClientMetrics(registry)
        return metrics
