"""Prometheus metrics for the master, read from the latest stats snapshot.

Rules:
- Nothing on the request path: the service loop publishes a StatsReply snapshot each tick and the
  collector turns that snapshot into metrics when scraped (from the HTTP server's thread, which
  must not walk the index while the loop mutates it).
- Each service has its own registry, so several masters can live in one process (tests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvpool.core.protocol import StatsReply


class MasterCollector(Collector):
    def __init__(self, snapshot: Callable[[], StatsReply | None], extra: Callable[[], Iterable] | None = None) -> None:
        self._snapshot = snapshot
        self._extra = extra  # more families from the service itself (gc_pauses.py)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        if self._extra is not None:
            yield from self._extra()
        s = self._snapshot()
        if s is None:
            return
        yield GaugeMetricFamily("kvpool_master_capacity_bytes", "Bytes in mounted segments", value=s.capacity_bytes)
        yield GaugeMetricFamily("kvpool_master_used_bytes", "Bytes allocated to objects", value=s.used_bytes)
        yield GaugeMetricFamily("kvpool_master_objects", "Complete objects", value=s.num_objects)
        yield GaugeMetricFamily("kvpool_master_pending_objects", "Objects being written", value=s.num_pending)
        yield GaugeMetricFamily("kvpool_master_quarantined", "Allocations held: their write may still land",
                                value=s.quarantined)
        yield GaugeMetricFamily("kvpool_master_inline_values", "Small plain values held by the master itself",
                                value=s.inline_values)
        yield GaugeMetricFamily("kvpool_master_inline_bytes", "Bytes of small plain values held by the master",
                                value=s.inline_bytes)
        yield GaugeMetricFamily("kvpool_master_inline_capacity_bytes", "The master's room for small plain values",
                                value=s.inline_capacity_bytes)
        yield GaugeMetricFamily("kvpool_master_leader", "1 while this master leads its pool", value=1)
        info = GaugeMetricFamily("kvpool_master_info", "1, labelled with this incarnation's epoch", labels=["epoch"])
        info.add_metric([f"{s.epoch:016x}"], 1)
        yield info
        yield GaugeMetricFamily(
            "kvpool_master_fragmentation", "1 - largest free range / total free", value=s.fragmentation
        )
        for name, doc, value in (
            ("puts", "Objects made readable by put_end", s.puts),
            ("gets", "Leased lookups (reads)", s.gets),
            ("lookups", "lookup_prefix calls", s.lookups),
            ("hit_keys", "Keys found by lookup_prefix", s.hit_keys),
            ("miss_keys", "Keys not found by lookup_prefix", s.miss_keys),
            ("evictions", "Objects evicted", s.evictions),
            ("evicted_bytes", "Object bytes evicted", s.evicted_bytes),
            ("lease_grants", "Read leases granted (new lease periods)", s.lease_grants),
            ("lease_expiries", "Read leases seen expired", s.lease_expiries),
            ("lease_releases", "Leased lookups released by their reader before the TTL", s.lease_releases),
            ("refused_put_ends", "PutEnd keys refused: their write token no longer named a pending put",
             s.refused_put_ends),
            ("ahead_expired", "Allocations held for a writer's next plain put that it never used (reclaimed)",
             s.ahead_expired),
            ("landed", "Objects made readable by PutLanded: ended while their bytes travelled", s.landed),
            ("refused_landings", "PutLanded keys not pending a landing under that token (reclaimed or revoked first)",
             s.refused_landings),
            ("quarantine_expiries", "Quarantined writes freed by the time limit, not by their writer",
             s.quarantine_expiries),
            ("recovered_objects", "Objects taken back from node directories after a (re)mount", s.recovered_objects),
            ("rejected_announcements", "Directory entries refused on recovery", s.rejected_announcements),
            ("forbidden", "Requests refused by the access policy (role, namespace or node ownership)", s.forbidden),
            ("rate_limited", "Requests refused by their identity's rate limit", s.rate_limited),
            ("refused_handshakes", "Connections refused: CURVE key not trusted", s.refused_handshakes),
            ("commits_confirmed", "Put replies sent once their objects were in their nodes' directories",
             s.commits_confirmed),
            ("commits_unconfirmed", "Put replies sent at --confirm-timeout-s before their nodes confirmed",
             s.commits_unconfirmed),
            ("inline_copied", "Inline values copied to a node (kept across a restart)", s.inline_copied),
            ("inline_uncopied", "Inline values stored while no node could keep a copy", s.inline_uncopied),
            ("inline_taken_back", "Inline values a recovering node brought back", s.inline_taken_back),
            ("inline_evictions", "Small plain values the master evicted to make room", s.inline_evictions),
        ):
            yield CounterMetricFamily(f"kvpool_master_{name}", doc, value=value)
        labels = ["node_id", "segment_id", "state"]
        capacity = GaugeMetricFamily("kvpool_master_node_capacity_bytes", "Segment capacity", labels=labels)
        used = GaugeMetricFamily("kvpool_master_node_used_bytes", "Segment bytes in use", labels=labels)
        objects = GaugeMetricFamily("kvpool_master_node_objects", "Replicas in the segment", labels=labels)
        age = GaugeMetricFamily("kvpool_master_node_heartbeat_age_seconds", "Since the last heartbeat", labels=labels)
        for n in s.nodes:
            values = [n.node_id, str(n.segment_id), n.state]
            capacity.add_metric(values, n.capacity_bytes)
            used.add_metric(values, n.used_bytes)
            objects.add_metric(values, n.num_objects)
            age.add_metric(values, n.last_heartbeat_age_s)
        yield from (capacity, used, objects, age)
        tier_labels = ["node_id", "segment_id"]
        gauges = {name: GaugeMetricFamily(f"kvpool_master_disk_tier_{name}", doc, labels=tier_labels) for name, doc in (
            ("capacity_bytes", "Disk tier capacity"), ("used_bytes", "Disk tier bytes held"),
            ("objects", "Objects with a disk copy"), ("disk_only_objects", "Objects on disk only"),
            ("promoting", "Promotions in progress"))}
        counters = {name: CounterMetricFamily(f"kvpool_master_disk_tier_{name}", doc, labels=tier_labels)
                    for name, doc in (("demotions", "DRAM evictions kept on disk"),
                                      ("promotions", "Disk-only objects copied back to DRAM"),
                                      ("promotions_failed", "Promotions the node could not do"),
                                      ("hits", "Lookup keys found on disk only (promoted for the reader)"),
                                      ("evictions", "Disk copies dropped for room"))}
        for t in s.tiers:
            values = [t.node_id, str(t.segment_id)]
            for name, value in (("capacity_bytes", t.capacity_bytes), ("used_bytes", t.used_bytes),
                                ("objects", t.num_objects), ("disk_only_objects", t.num_disk_only),
                                ("promoting", t.promoting)):
                gauges[name].add_metric(values, value)
            for name, value in (("demotions", t.demotions), ("promotions", t.promotions),
                                ("promotions_failed", t.promotions_failed), ("hits", t.disk_hits),
                                ("evictions", t.disk_evictions)):
                counters[name].add_metric(values, value)
        yield from gauges.values()
        yield from counters.values()
        yield from _tenant_metrics(s)
        if s.hints is not None:
            yield from _hint_metrics(s.hints, s.hit_keys)


def _hint_metrics(h, hit_keys: int) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Session hints and TTL retention (master/hints.py)."""
    retained = GaugeMetricFamily("kvpool_master_retained_bytes", "Object bytes a TTL hint keeps from eviction now",
                                 labels=["tenant"])
    for tenant, value in sorted(h.retained_by_tenant.items()):
        retained.add_metric([tenant], value)
    yield retained
    yield GaugeMetricFamily("kvpool_master_retained_objects", "Objects a TTL hint keeps from eviction now",
                            value=h.retained_objects)
    hits = CounterMetricFamily("kvpool_master_hint_hit_keys", "Lookup hits by why the object was still there: "
                               "a TTL hint kept it (ttl) or the eviction order did (order)", labels=["reason"])
    hits.add_metric(["ttl"], h.ttl_hits)
    hits.add_metric(["order"], max(0, hit_keys - h.ttl_hits))
    yield hits
    events = CounterMetricFamily("kvpool_master_session_events", "Session hints received, by kind", labels=["kind"])
    for kind, value in (("arrived", h.turns_arrived), ("done", h.turns_done), ("end", h.sessions_ended)):
        events.add_metric([kind], value)
    yield events
    for name, doc, value in (
        ("retention_refused", "TTL grants refused: past the tenant's share", h.retention_refused),
        ("retention_kept", "Eviction candidates passed over because a TTL kept them", h.retention_kept),
        ("session_objects", "Objects put naming their agent session", h.session_objects),
        ("admission_refusals", "Puts refused by the session order: they would evict blocks needed sooner",
         h.admission_refusals),
    ):
        yield CounterMetricFamily(f"kvpool_master_{name}", doc, value=value)


def _tenant_metrics(s: StatsReply) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Per tenant (label `tenant`): usage, quota (0: none) and what the quota cost it."""
    gauges = [GaugeMetricFamily(f"kvpool_master_tenant_{name}", doc, labels=["tenant"]) for name, doc in (
        ("used_bytes", "Object bytes x replicas the tenant holds in pool DRAM (pending and complete)"),
        ("objects", "Objects the tenant holds in pool DRAM (pending and complete)"),
        ("quota_bytes", "The tenant's byte quota (0: none)"),
        ("quota_objects", "The tenant's object quota (0: none)"),
        ("segments", "Segments holding the tenant's objects"))]
    counters = [CounterMetricFamily(f"kvpool_master_tenant_{name}", doc, labels=["tenant"]) for name, doc in (
        ("quota_refusals", "Keys refused: the tenant's quota was full even after evicting its own objects"),
        ("quota_evictions", "The tenant's objects evicted to make room under its quota"))]
    for t in s.tenants:
        for family, value in zip(gauges, (t.used_bytes, t.num_objects, t.max_bytes, t.max_objects, t.num_segments)):
            family.add_metric([t.tenant], value)
        for family, value in zip(counters, (t.quota_refusals, t.quota_evictions)):
            family.add_metric([t.tenant], value)
    yield from gauges
    yield from counters


def serve_metrics(host: str, port: int, snapshot: Callable[[], StatsReply | None],
                  extra: Callable[[], Iterable] | None = None) -> tuple[object, int]:
    """Start the /metrics HTTP endpoint; returns (server, bound port). Port 0: the OS chooses."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MasterCollector(snapshot, extra))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server, server.server_port
