"""TTL hints in the master's eviction (master/retention.py, master/hints.py): exact order on tiny
pools, the tenant's share as the limit, and no reach into another tenant's namespace."""

from __future__ import annotations

import pytest

from kvpool.core import protocol as p
from kvpool.master import MasterConfig, MasterCore
from kvpool.master.quotas import TenantQuota

SLOT = 64


def make_core(slots: int = 10, **config) -> MasterCore:
    core = MasterCore(MasterConfig(alignment_bytes=SLOT, node_ttl_s=1e9, high_watermark=0.9, low_watermark=0.5,
                                   **config))
    core.handle(p.MountSegment("n1", "host", slots * SLOT, 0, "agent", b""), 0.0)
    return core


def put(core, keys, now_s, tenant="t", ttl_s=0.0, session=""):
    parents = [None] * len(keys)  # separate chains: every object is a candidate
    reply = core.handle(p.PutStart(tenant, keys, [SLOT] * len(keys), parents, 1, False, session, ttl_s), now_s)
    assert isinstance(reply, p.PutStartReply), reply
    done = [(k, t) for k, s, t in zip(keys, reply.statuses, reply.tokens) if s == p.PUT_ALLOCATED]
    core.handle(p.PutEnd(tenant, [k for k, _ in done], [t for _, t in done], [0] * len(done)), now_s)
    return reply.statuses


def present(core, keys, tenant="t"):
    return [k for k, e in zip(keys, core.handle(p.Exists(tenant, keys), 0.0).exists) if e]


def eviction_order(core, now_s, keys, tenant="t"):
    order = []
    for _ in keys:
        before = set(present(core, keys, tenant))
        core.pressure.evict(now_s, SLOT)
        gone = before - set(present(core, keys, tenant))
        if gone:
            order.append(gone.pop())
    return order


def test_objects_under_a_ttl_are_evicted_after_the_others_then_by_lru():
    core = make_core()
    put(core, ["a"], 1.0, ttl_s=100.0)
    put(core, ["b"], 2.0)
    put(core, ["c"], 3.0, ttl_s=100.0)
    put(core, ["d"], 4.0)
    assert eviction_order(core, 10.0, ["a", "b", "c", "d"]) == ["b", "d"]  # a, c kept while their TTL runs
    assert present(core, ["a", "c"]) == ["a", "c"]
    assert eviction_order(core, 102.0, ["a", "c"]) == ["a"]  # a's TTL ended at 101; c's at 103
    assert eviction_order(core, 104.0, ["c"]) == ["c"]


def test_a_lookup_with_a_ttl_renews_what_it_hit():
    core = make_core()
    put(core, ["a"], 1.0, ttl_s=10.0)
    put(core, ["b"], 2.0)
    reply = core.handle(p.LookupPrefix("t", ["a"], lease=False, ttl_s=50.0), 5.0)
    assert reply.num_hit == 1
    assert eviction_order(core, 30.0, ["a", "b"]) == ["b"]  # kept until 55, not 11
    assert core.hints.ttl_hits == 1  # the first lookup hit what the put's TTL kept
    core.handle(p.LookupPrefix("t", ["a"], lease=False), 31.0)
    assert core.hints.ttl_hits == 2


def test_a_ttl_never_outlives_the_tenants_share():
    # no quota: at most max_retained_fraction of the pool (10 slots x 0.3 = 3 objects)
    core = make_core(max_retained_fraction=0.3)
    put(core, ["a", "b", "c", "d", "e"], 1.0, ttl_s=100.0)
    retention = core.hints.retention
    assert retention.num_retained == 3 and retention.refused == 2
    assert retention.retained_bytes == 3 * SLOT
    assert len(eviction_order(core, 10.0, ["a", "b", "c", "d", "e"])) == 2  # the two past the share go


def test_a_tenant_with_a_quota_retains_up_to_its_quota():
    core = make_core(slots=20, max_retained_fraction=0.9)
    account = core.index.account_of("q")
    account.quota = TenantQuota(max_bytes=2 * SLOT)
    put(core, ["a", "b"], 1.0, tenant="q", ttl_s=100.0)
    retention = core.hints.retention
    assert retention.num_retained == 2
    assert retention.share_bytes(account) == 2 * SLOT


def test_a_hostile_client_cannot_keep_or_reorder_another_tenants_objects():
    core = make_core(eviction_order="session")
    put(core, ["x"], 1.0, tenant="victim")
    put(core, ["y"], 2.0, tenant="victim")
    # the attacker names the victim's keys in its own namespace: nothing of the victim's is touched
    reply = core.handle(p.LookupPrefix("attacker", ["x", "y"], lease=False, ttl_s=1000.0), 3.0)
    assert reply.num_hit == 0
    statuses = put(core, ["x"], 3.0, tenant="attacker", ttl_s=1000.0, session="s")
    assert statuses == [p.PUT_ALLOCATED]  # its own object of that name, not the victim's
    core.handle(p.SessionEvents("attacker", [p.SessionEvent("s", "r", p.TURN_ARRIVED, 1000.0)]), 3.0)
    assert eviction_order(core, 4.0, ["x", "y"], tenant="victim") == ["x", "y"]  # plain LRU for the victim
    victim = core.index.tenants["victim"]
    assert not any(rec in core.hints.retention.until for rec in victim.values())


@pytest.mark.parametrize("bad", [
    p.SessionEvents("t", [p.SessionEvent("s" * 300, "r", p.TURN_ARRIVED)]),
    p.SessionEvents("t", [p.SessionEvent("s", "r", 7)]),
    p.SessionEvents("t", [p.SessionEvent("s", "r", p.TURN_ARRIVED, -1.0)]),
    p.LookupPrefix("t", ["a"], lease=False, ttl_s=float("nan")),
    p.PutStart("t", ["a"], [SLOT], [None], 1, False, "s", 1e9),
])
def test_bad_hints_are_refused_with_a_clear_error_and_change_nothing(bad):
    core = make_core()
    put(core, ["z"], 1.0)
    reply = core.handle(bad, 2.0)
    assert isinstance(reply, p.ErrorReply) and reply.kind == "usage", reply
    assert present(core, ["z", "a"]) == ["z"]


def test_removed_objects_leave_no_retention_behind():
    core = make_core()
    put(core, ["a", "b"], 1.0, ttl_s=100.0)
    core.handle(p.Remove("t", ["a"]), 2.0)
    assert core.hints.retention.num_retained == 1
    assert core.hints.retention.retained_bytes == SLOT


def test_status_and_metrics_show_what_hints_did():
    from prometheus_client import CollectorRegistry, generate_latest
    from rich.console import Console

    from kvpool.client.status_cli import render
    from kvpool.master.metrics import MasterCollector

    core = make_core(eviction_order="session")
    put(core, ["a"], 1.0, ttl_s=60.0, session="s")
    core.handle(p.SessionEvents("t", [p.SessionEvent("s", "r", p.TURN_DONE)]), 1.0)
    core.handle(p.LookupPrefix("t", ["a"], lease=False), 2.0)
    stats = core.stats(2.0)
    assert stats.hints.retained_objects == 1 and stats.hints.ttl_hits == 1 and stats.hints.turns_done == 1
    registry = CollectorRegistry()
    registry.register(MasterCollector(lambda: stats))
    text = generate_latest(registry).decode()
    assert 'kvpool_master_retained_bytes{tenant="t"} 64.0' in text
    assert 'kvpool_master_hint_hit_keys_total{reason="ttl"} 1.0' in text
    console = Console(record=True, width=160)
    console.print(render(stats, "tcp://m"))
    assert "retained by TTL hints" in console.export_text()
