"""Lease release (ReleaseLeases) and the compact leased-lookup reply, driven on MasterCore with time
passed in: two readers on one object, release by one or both, stale and duplicate releases,
removed objects freed at release, tenants, multi-replica packing."""

import pytest

from kvpool.client import plan
from kvpool.core import protocol as p
from kvpool.master import MasterConfig, MasterCore

SLOT = 64


def make_core(slots=10, **overrides) -> MasterCore:
    config = {"alignment_bytes": SLOT, "node_ttl_s": 1000.0, "high_watermark": 0.9, "low_watermark": 0.5,
              "lease_ttl_s": 5.0, "max_lease_hold_s": 20.0}
    core = MasterCore(MasterConfig(**{**config, **overrides}))
    handle = core.handle
    core.handle = lambda req, now_s: p.reply_decoder.decode(p.reply_encoder.encode(handle(req, now_s)))
    return core


def mount(core, node_id, slots=10) -> int:
    return core.handle(p.MountSegment(node_id, "host", slots * SLOT, 0, f"agent-{node_id}", b""), 0.0).segment_id


def put(core, keys, now_s=0.0, replicas=1, tenant="t"):
    reply = core.handle(p.PutStart(tenant, keys, [SLOT] * len(keys), [None] * len(keys), replicas, False), now_s)
    assert reply.statuses == [p.PUT_ALLOCATED] * len(keys), reply
    ended = core.handle(p.PutEnd(tenant, keys, reply.tokens, [0] * len(keys)), now_s)
    assert ended == p.PutEndReply(ended=len(keys)), ended


def lease(core, keys, now_s, tenant="t") -> p.LookupReply:
    reply = core.handle(p.LookupPrefix(tenant, keys, lease=True), now_s)
    assert isinstance(reply, p.LookupReply), reply
    return reply


def release(core, lease_ids, now_s, tenant="t") -> int:
    return core.handle(p.ReleaseLeases(tenant, lease_ids), now_s).count


def evictable(core, now_s) -> list[str]:
    """Evict everything evictable right now; the keys that went."""
    before = set(core.index.tenants["t"])
    core.pressure.evict(now_s, 1 << 40)
    return sorted(before - set(core.index.tenants["t"]))


def test_release_by_one_of_two_readers_keeps_the_object_leased_and_by_both_makes_it_evictable():
    core = make_core()
    mount(core, "n1")
    put(core, ["a", "b"])
    first, second = lease(core, ["a"], 1.0), lease(core, ["a"], 2.0)
    assert first.lease_id != second.lease_id and 0 not in (first.lease_id, second.lease_id)
    assert core.index.tenants["t"]["a"].lease_count == 2
    assert release(core, [first.lease_id], 3.0) == 1
    assert core.index.tenants["t"]["a"].lease_count == 1
    assert evictable(core, 3.0) == ["b"]  # a: the second reader still holds it
    assert release(core, [second.lease_id], 3.5) == 1
    assert evictable(core, 3.5) == ["a"]  # well before the lease TTL (7.0)
    assert core.stats(3.5).lease_releases == 2


def test_a_second_release_of_the_same_lease_is_ignored_and_cannot_end_another_readers_lease():
    core = make_core()
    mount(core, "n1")
    put(core, ["a"])
    first, second = lease(core, ["a"], 1.0), lease(core, ["a"], 1.0)
    assert release(core, [first.lease_id], 2.0) == 1
    assert release(core, [first.lease_id, first.lease_id, 999], 2.0) == 0
    assert evictable(core, 2.0) == []
    assert release(core, [second.lease_id], 2.0) == 1
    assert evictable(core, 2.0) == ["a"]


def test_a_release_after_the_lease_expired_does_not_end_a_newer_readers_lease():
    core = make_core()
    mount(core, "n1")
    put(core, ["a"])
    old = lease(core, ["a"], 1.0)  # until 6.0
    new = lease(core, ["a"], 7.0)  # until 12.0; the old entry has not been purged yet
    assert release(core, [old.lease_id], 8.0) == 1
    assert evictable(core, 8.0) == []
    core.tick(8.0)  # purges nothing more: the old entry is gone, the new one is live
    assert core.index.tenants["t"]["a"].lease_count == 1
    assert release(core, [new.lease_id], 9.0) == 1
    assert evictable(core, 9.0) == ["a"]


def test_expired_lease_entries_are_purged_by_tick_and_their_ids_release_nothing():
    core = make_core()
    mount(core, "n1")
    put(core, ["a", "b"])
    reply = lease(core, ["a", "b"], 1.0)
    core.tick(5.9)
    assert core.index.tenants["t"]["a"].lease_count == 1
    core.tick(6.0)
    assert (core.index.tenants["t"]["a"].lease_count, core.index.tenants["t"]["b"].lease_count) == (0, 0)
    assert core.leases.entries == {}
    assert release(core, [reply.lease_id], 6.5) == 0


def test_releasing_a_removed_objects_lease_frees_its_space_at_once():
    core = make_core()
    mount(core, "n1")
    put(core, ["a", "b"])
    reader1, reader2 = lease(core, ["a", "b"], 1.0), lease(core, ["a"], 1.5)
    assert core.handle(p.Remove("t", ["a", "b"]), 2.0).count == 2
    assert core.stats(2.0).used_bytes == 2 * SLOT  # both held for their readers
    assert release(core, [reader1.lease_id], 2.5) == 1
    assert core.stats(2.5).used_bytes == SLOT  # b freed; a still held by reader2
    assert release(core, [reader2.lease_id], 3.0) == 1
    assert core.stats(3.0).used_bytes == 0
    core.tick(10.0)  # nothing is freed twice
    assert core.stats(10.0).used_bytes == 0 and core.stats(10.0).nodes[0].num_objects == 0


def test_another_tenant_cannot_release_a_lease():
    core = make_core()
    mount(core, "n1")
    put(core, ["a"])
    reply = lease(core, ["a"], 1.0)
    assert release(core, [reply.lease_id], 2.0, tenant="other") == 0
    assert evictable(core, 2.0) == []
    assert release(core, [reply.lease_id], 2.0) == 1


def test_lookups_without_hits_or_without_lease_get_no_lease_id():
    core = make_core()
    mount(core, "n1")
    put(core, ["a"])
    assert lease(core, ["zz", "a"], 1.0).lease_id == 0
    assert core.handle(p.LookupPrefix("t", ["a"], lease=False), 1.0).lease_id == 0
    assert core.leases.entries == {}


def test_a_multi_replica_reply_packs_each_hits_replicas_with_counts():
    core = make_core()
    s1, s2 = mount(core, "n1"), mount(core, "n2")
    put(core, ["one"], replicas=1)
    put(core, ["two"], replicas=2)
    reply = lease(core, ["one", "two"], 1.0)
    assert reply.replica_counts == bytes([1, 2])
    expected = [[p.Replica(s1, 0, SLOT)], [p.Replica(s2, 0, SLOT), p.Replica(s1, SLOT, SLOT)]]
    assert reply.replica_lists() == expected
    assert plan.split_replicas(reply.replica_locations, reply.replica_counts, reply.num_hit) == expected
    single = lease(core, ["one"], 1.0)
    assert single.replica_counts == b"" and len(single.replica_locations) == p.REPLICA_BYTES


def test_too_many_replicas_is_a_usage_error():
    core = make_core()
    mount(core, "n1")
    reply = core.handle(p.PutStart("t", ["a"], [SLOT], [None], p.MAX_REPLICAS + 1, False), 0.0)
    assert isinstance(reply, p.ErrorReply) and reply.kind == "usage" and "num_replicas" in reply.message


@pytest.mark.parametrize(
    "locations, counts, num_hit",
    [
        (b"\x00" * 23, b"", 1),  # not a multiple of 24
        (p.pack_replicas([p.Replica(1, 0, 64)]), b"", 2),  # fewer locations than hits
        (p.pack_replicas([p.Replica(1, 0, 64)] * 3), bytes([1, 1]), 2),  # counts sum to 2, 3 locations
        (p.pack_replicas([p.Replica(1, 0, 64)] * 2), bytes([2, 0]), 2),  # a hit with no replica
    ],
)
def test_malformed_packed_replicas_are_rejected(locations, counts, num_hit):
    with pytest.raises(ValueError):
        plan.split_replicas(locations, counts, num_hit)
    with pytest.raises(ValueError):
        p.LookupReply(num_hit, 5.0, 1, locations, counts).replica_lists()
