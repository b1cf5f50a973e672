"""Tenant quotas, per-tenant accounting and tenant-dedicated segments in the master (pure: MasterCore
driven with a fake clock, every reply through the wire encoding). Tiny pools of 64-byte slots,
exact eviction victims, exact placement, and usage checked against a scan of the index after
every path that adds or drops a record."""

import pytest

from kvpool.core import protocol as p
from kvpool.master import MasterConfig, MasterCore
from kvpool.master.quotas import QuotaTable, TenantQuota, parse_quota, quota_table_from_toml
from test_master_tiers import FakeNode, put_chain, where

SLOT = 64
ALLOC, EXISTS, NO_SPACE = p.PUT_ALLOCATED, p.PUT_EXISTS, p.PUT_NO_SPACE


def make_core(quotas: dict | None = None, default: TenantQuota | None = None, dedicated=frozenset(),
              **overrides) -> MasterCore:
    config = {"alignment_bytes": SLOT, "node_ttl_s": 1000.0, "put_timeout_s": 1000.0, "lease_ttl_s": 5.0,
              "max_lease_hold_s": 5.0, "high_watermark": 1.0, "low_watermark": 0.5,
              "quotas": QuotaTable(quotas or {}, default, dedicated), **overrides}
    core = MasterCore(MasterConfig(**config), epoch=(5 << 32) | 1)
    handle = core.handle
    core.handle = lambda req, now_s: p.reply_decoder.decode(p.reply_encoder.encode(handle(req, now_s)))
    return core


def mount(core, node_id, slots, tenant="", now_s=0.0, recovering=False) -> int:
    msg = p.MountSegment(node_id, "host", slots * SLOT, 0, f"agent-{node_id}", b"", recovering=recovering,
                         tenant=tenant)
    reply = core.handle(msg, now_s)
    assert isinstance(reply, p.MountReply), reply
    return reply.segment_id


def put(core, tenant, keys, now_s, size=SLOT, replicas=1, pinned=False, parents=None, end=True):
    parents = parents if parents is not None else [None] * len(keys)
    started = core.handle(p.PutStart(tenant, keys, [size] * len(keys), parents, replicas, pinned), now_s)
    assert isinstance(started, p.PutStartReply), started
    if end:
        allocated = [(k, t) for k, t, s in zip(keys, started.tokens, started.statuses) if s == ALLOC]
        if allocated:
            ended = core.handle(p.PutEnd(tenant, [k for k, _ in allocated], [t for _, t in allocated],
                                         [7] * len(allocated)), now_s)
            assert ended.ended == len(allocated)
    return started


def keys_of(core, tenant) -> set[str]:
    return set(core.index.tenants.get(tenant, {}))


def usage(core, tenant) -> tuple[int, int]:
    account = core.index.accounts[tenant]
    return account.used_bytes, account.num_objects


def check_usage(core) -> None:
    """Every tenant's counters equal a scan of its namespaces' records (the accounting is exact)."""
    expected: dict[str, tuple[int, int, dict[int, int]]] = {}
    for space in core.index.tenants.values():
        used, objects, per_segment = expected.setdefault(space.account.name, (0, 0, {}))
        for rec in space.values():
            if rec.locations:
                replicas = rec.replicas
                used += rec.size_bytes * len(replicas)
                objects += 1
                for r in replicas:
                    per_segment[r.segment_id] = per_segment.get(r.segment_id, 0) + 1
        expected[space.account.name] = (used, objects, per_segment)
    for name, account in core.index.accounts.items():
        assert (account.used_bytes, account.num_objects, account.segment_replicas) == expected.get(name, (0, 0, {})), name


# ---- configuration ---------------------------------------------------------------------------


def test_quota_flags_and_file_parse_to_exact_limits():
    assert parse_quota("b=64MiB:1000") == ("b", TenantQuota(64 << 20, 1000))
    assert parse_quota("b=1GiB") == ("b", TenantQuota(1 << 30, None))
    assert parse_quota("b=none:500") == ("b", TenantQuota(None, 500))
    assert parse_quota("*=4096") == ("*", TenantQuota(4096, None))
    for bad in ("b", "=64MiB", "b=lots", "b=64MiB:many", "b=none", "b=0", "b=64MiB:0"):
        with pytest.raises(ValueError):
            parse_quota(bad)
    table = quota_table_from_toml({"default": {"max_objects": 10},
                                   "tenants": {"a": {"max_bytes": "1KiB"}, "b": {"max_bytes": 512, "max_objects": 3}}})
    assert table.quota_of("a") == TenantQuota(1024, None)
    assert table.quota_of("b") == TenantQuota(512, 3)
    assert table.quota_of("other") == TenantQuota(None, 10)
    # flags override the file, '*' replaces the default
    table = table.updated([parse_quota("a=2KiB:5"), parse_quota("*=none:20")])
    assert (table.quota_of("a"), table.quota_of("other")) == (TenantQuota(2048, 5), TenantQuota(None, 20))
    assert QuotaTable().quota_of("a") is None
    for bad in ({"tenant": {}}, {"tenants": {"a": {"max_byte": 1}}}, {"tenants": {"a": {}}},
                {"default": {"max_bytes": -1}}, {"tenants": {"a": {"max_bytes": "big"}}}):
        with pytest.raises(ValueError):
            quota_table_from_toml(bad)


def test_master_cli_reads_the_quota_file_and_flags_over_it(tmp_path):
    from kvpool.master.cli import quota_table

    path = tmp_path / "quotas.toml"
    path.write_text('[default]\nmax_bytes = "1MiB"\n\n[tenants.a]\nmax_bytes = "64KiB"\nmax_objects = 8\n')
    table = quota_table(path, ["b=2KiB"])
    assert (table.quota_of("a"), table.quota_of("b"), table.quota_of("c")) == (
        TenantQuota(64 << 10, 8), TenantQuota(2048, None), TenantQuota(1 << 20, None))
    path.write_text("[tenants.a\n")
    with pytest.raises(ValueError, match="quotas.toml"):
        quota_table(path, [])
    path.write_text("[tenants.a]\ndedicated = true\n[tenants.b]\nmax_objects = 2\ndedicated = false\n")
    table = quota_table(path, [], ["c"])
    assert (table.dedicated, table.quota_of("a"), table.quota_of("b")) == (frozenset({"a", "c"}), None, TenantQuota(None, 2))
    path.write_text("[tenants.a]\ndedicated = 1\n")
    with pytest.raises(ValueError, match="dedicated must be true or false"):
        quota_table(path, [])


# ---- quotas ----------------------------------------------------------------------------------


def test_tenant_at_its_byte_quota_evicts_its_own_lru_never_another_tenants():
    core = make_core({"b": TenantQuota(max_bytes=3 * SLOT)})
    mount(core, "n1", 16)
    for i in range(4):
        put(core, "a", [f"a{i}"], 1.0 + i)  # a's objects are the oldest in the pool
    for i in range(3):
        put(core, "b", [f"b{i}"], 5.0 + i)
    assert usage(core, "b") == (3 * SLOT, 3)
    core.handle(p.LookupPrefix("b", ["b0"], lease=False), 8.0)  # b0 used again: b1 is b's LRU
    reply = put(core, "b", ["b3"], 9.0)
    assert reply.statuses == [ALLOC] and reply.message == ""
    assert keys_of(core, "a") == {"a0", "a1", "a2", "a3"}
    assert keys_of(core, "b") == {"b0", "b2", "b3"}
    assert usage(core, "b") == (3 * SLOT, 3)
    stats = {t.tenant: t for t in core.stats(9.0).tenants}
    assert stats["b"] == p.TenantStats("b", 3 * SLOT, 3, 3 * SLOT, 0, quota_refusals=0, quota_evictions=1,
                                       num_segments=1)
    assert stats["a"] == p.TenantStats("a", 4 * SLOT, 4, num_segments=1)
    assert core.index.evictor.evictions == 1
    check_usage(core)


def test_quota_full_of_leased_and_pinned_objects_refuses_with_tenant_and_quota_in_the_message():
    core = make_core({"b": TenantQuota(max_objects=2)})
    mount(core, "n1", 16)
    put(core, "a", ["a0"], 1.0)
    put(core, "b", ["b0"], 2.0, pinned=True)
    put(core, "b", ["b1"], 3.0)
    leased = core.handle(p.LookupPrefix("b", ["b1"], lease=True), 4.0)
    assert leased.num_hit == 1
    reply = put(core, "b", ["b2", "b3"], 4.5)
    assert reply.statuses == [NO_SPACE, NO_SPACE]
    assert "tenant 'b'" in reply.message and "2 objects" in reply.message and "--quota b=" in reply.message
    assert keys_of(core, "a") == {"a0"} and keys_of(core, "b") == {"b0", "b1"}
    assert core.index.accounts["b"].quota_refusals == 2
    # the lease released, b1 is b's only candidate: the next put takes its place
    core.handle(p.ReleaseLeases("b", [leased.lease_id]), 5.0)
    assert put(core, "b", ["b2"], 6.0).statuses == [ALLOC]
    assert keys_of(core, "b") == {"b0", "b2"} and keys_of(core, "a") == {"a0"}
    check_usage(core)


def test_object_larger_than_the_quota_is_refused_without_evicting():
    core = make_core({"b": TenantQuota(max_bytes=2 * SLOT)})
    mount(core, "n1", 16)
    put(core, "b", ["b0"], 1.0)
    reply = put(core, "b", ["big"], 2.0, size=3 * SLOT)
    assert reply.statuses == [NO_SPACE]
    assert "larger than its quota of 128 bytes" in reply.message
    assert keys_of(core, "b") == {"b0"}  # evicting it would not have made room: kept
    assert core.index.accounts["b"].quota_evictions == 0


def test_quota_spares_the_prefix_of_the_object_being_put():
    core = make_core({"b": TenantQuota(max_objects=2)})
    mount(core, "n1", 16)
    put(core, "b", ["old"], 1.0)
    put(core, "b", ["head"], 2.0)
    core.handle(p.LookupPrefix("b", ["old"], lease=False), 3.0)  # head is now b's LRU tail
    # head is the new object's parent: the put must evict "old", not the prefix it extends
    assert put(core, "b", ["tail"], 4.0, parents=["head"]).statuses == [ALLOC]
    assert keys_of(core, "b") == {"head", "tail"}


def test_replicas_count_in_the_byte_quota_and_a_lost_replica_gives_it_back():
    core = make_core({"b": TenantQuota(max_bytes=4 * SLOT)})
    s1, s2 = mount(core, "n1", 8), mount(core, "n2", 8)
    put(core, "b", ["x"], 1.0, replicas=2)
    put(core, "b", ["y"], 2.0, replicas=2)
    assert usage(core, "b") == (4 * SLOT, 2)
    assert core.index.tenant_segments("b") == {s1, s2}
    put(core, "b", ["z"], 3.0, replicas=2)  # x (b's LRU) goes
    assert keys_of(core, "b") == {"y", "z"} and usage(core, "b") == (4 * SLOT, 2)
    core.handle(p.UnmountSegment(s2), 4.0)
    assert usage(core, "b") == (2 * SLOT, 2)  # each kept its replica on s1
    assert core.index.tenant_segments("b") == {s1}
    check_usage(core)


def test_watermark_eviction_stays_global_lru_across_tenants_with_and_without_quotas():
    core = make_core({"b": TenantQuota(max_bytes=100 * SLOT)}, high_watermark=0.9, low_watermark=0.5)
    mount(core, "n1", 10)
    order = ["a0", "b0", "a1", "b1", "c0", "b2", "a2", "c1", "b3"]
    for i, key in enumerate(order):
        put(core, key[0], [key], 1.0 + i)
    # 9 of 10 slots: not above 0.9 yet; the 10th put crosses it and evicts 3 slots (back under
    # 0.9 and twice its own size), the timed work the rest, down to 5 slots
    put(core, "a", ["a3"], 20.0)
    core.tick(20.5)
    left = {k for t in "abc" for k in keys_of(core, t)}
    assert left == {"b2", "a2", "c1", "b3", "a3"}  # the five oldest went, whichever heap they were in
    check_usage(core)


def test_accounting_is_exact_through_every_path_that_adds_or_drops_a_record():
    core = make_core(put_timeout_s=10.0, high_watermark=1.0, low_watermark=0.5, lease_ttl_s=5.0)
    s1 = mount(core, "n1", 8)
    started = put(core, "t", ["pending"], 1.0, end=False)
    assert usage(core, "t") == (SLOT, 1)  # pending counts
    core.handle(p.PutEnd("t", ["pending"], started.tokens, [9]), 1.5)
    assert usage(core, "t") == (SLOT, 1)
    revoked = put(core, "t", ["revoked", "uncertain"], 2.0, end=False)
    assert usage(core, "t") == (3 * SLOT, 3)
    core.handle(p.PutRevoke("t", ["revoked", "uncertain"], revoked.tokens, [1]), 2.5)
    assert usage(core, "t") == (SLOT, 1)  # a quarantined allocation is no longer the tenant's object
    put(core, "t", ["abandoned"], 3.0, end=False)
    core.tick(14.0)  # its writer is gone: reclaimed
    assert "abandoned" not in keys_of(core, "t") and usage(core, "t") == (SLOT, 1)
    put(core, "t", ["leased"], 15.0)
    lease = core.handle(p.LookupPrefix("t", ["leased"], lease=True), 15.5)
    assert core.handle(p.Remove("t", ["leased"]), 16.0).count == 1  # removed while leased: space held, not charged
    assert usage(core, "t") == (SLOT, 1)
    core.handle(p.ReleaseLeases("t", [lease.lease_id]), 16.5)
    for i in range(6):  # fills the segment (the quarantine holds a slot)
        put(core, "t", [f"k{i}"], 17.0 + i / 10)
    assert usage(core, "t") == (7 * SLOT, 7)
    put(core, "t", ["one-more"], 18.0)  # pool full: evicts down to the low watermark (4 slots), then fits
    assert usage(core, "t") == (4 * SLOT, 4)
    assert keys_of(core, "t") == {"k3", "k4", "k5", "one-more"}
    assert core.index.tenant_segments("t") == {s1}
    check_usage(core)
    core.handle(p.UnmountSegment(s1), 19.0)
    assert usage(core, "t") == (0, 0) and core.index.tenant_segments("t") == set()
    check_usage(core)


def test_recovered_objects_count_and_an_overlapping_one_is_uncharged():
    core = make_core()
    s1 = mount(core, "n1", 8, recovering=True)
    entries = [p.DirEntry(0, 2 * SLOT, "a", "k1", None, 11), p.DirEntry(SLOT, SLOT, "b", "k2", None, 12)]
    assert core.handle(p.AnnounceObjects(s1, entries, [1.0, 1.0]), 1.0).accepted == 2
    assert usage(core, "a") == (2 * SLOT, 1) and usage(core, "b") == (SLOT, 1)
    assert core.index.tenant_segments("b") == {s1}
    core.handle(p.AnnounceObjects(s1, [], [], last=True), 2.0)  # k2 overlaps k1: dropped
    assert usage(core, "b") == (0, 0) and core.index.tenant_segments("b") == set()
    assert usage(core, "a") == (2 * SLOT, 1)
    check_usage(core)


def test_demotion_to_disk_frees_quota_and_promotion_charges_it_again():
    core = make_core({"t": TenantQuota(max_objects=4)}, put_timeout_s=1000.0)
    node = FakeNode(core)  # 4 DRAM slots, a disk tier
    put_chain(core, ["a0", "a1"], 1.0)
    put_chain(core, ["b0", "b1"], 2.0)
    node.sync(2.5)
    assert usage(core, "t") == (4 * SLOT, 4)
    put_chain(core, ["c0", "c1"], 3.0)  # at its quota: its own LRU chain a goes to disk
    assert [where(core, k) for k in ("a0", "a1")] == ["disk", "disk"]
    assert usage(core, "t") == (4 * SLOT, 4) and core.index.accounts["t"].quota_evictions == 2
    check_usage(core)
    reply = core.handle(p.LookupPrefix("t", ["a0", "a1"], lease=False), 4.0)
    assert reply.num_promoting == 2
    node.sync(4.1)
    assert [where(core, k) for k in ("a0", "a1")] == ["dram+disk", "dram+disk"]
    check_usage(core)  # promoted records count again (a promotion is not refused by the quota)


# ---- tenant-dedicated segments ---------------------------------------------------------------


def placed_on(reply) -> list[list[int]]:
    return [[r.segment_id for r in replicas] for replicas in reply.replicas]


def test_dedicated_segments_take_only_their_tenant_and_it_places_only_there():
    core = make_core()
    shared1, shared2 = mount(core, "s1", 8), mount(core, "s2", 8)
    ded_a = mount(core, "d1", 8, tenant="a")
    ra = put(core, "a", ["a0", "a1", "a2"], 1.0, replicas=2)
    assert placed_on(ra) == [[ded_a]] * 3  # one dedicated segment: one replica, never a shared one
    rb = put(core, "b", ["b0", "b1", "b2"], 2.0)
    assert placed_on(rb) == [[shared1], [shared2], [shared1]]  # free-ratio order among shared ones
    ded_a2 = mount(core, "d2", 16, tenant="a")
    ra = put(core, "a", ["a3"], 3.0, replicas=2)
    assert placed_on(ra) == [[ded_a2, ded_a]]
    assert core.index.tenant_segments("a") == {ded_a, ded_a2}
    assert core.index.tenant_segments("b") == {shared1, shared2}
    nodes = {n.segment_id: n.tenant for n in core.stats(3.0).nodes}
    assert nodes == {shared1: "", shared2: "", ded_a: "a", ded_a2: "a"}
    check_usage(core)


def test_tenant_whose_dedicated_segments_are_gone_is_refused_not_spilled_onto_shared_ones():
    core = make_core()
    mount(core, "s1", 8)
    ded = mount(core, "d1", 8, tenant="a")
    put(core, "a", ["a0"], 1.0)
    core.handle(p.UnmountSegment(ded), 2.0)
    reply = put(core, "a", ["a1"], 3.0)
    assert reply.statuses == [NO_SPACE]
    assert "tenant 'a' places only on segments dedicated to it" in reply.message
    assert "kvpool node --tenant a" in reply.message
    assert keys_of(core, "a") == set()


def test_only_dedicated_segments_mounted_refuses_other_tenants_clearly():
    core = make_core()
    mount(core, "d1", 8, tenant="a")
    reply = put(core, "b", ["b0"], 1.0)
    assert reply.statuses == [NO_SPACE] and "every mounted segment is dedicated" in reply.message


def test_full_dedicated_segment_evicts_only_its_tenant_and_shared_eviction_spares_dedicated_tenants():
    core = make_core()
    shared = mount(core, "s1", 4)
    put(core, "a", ["a-old"], 0.5)  # placed on the shared segment before a had a dedicated one
    ded = mount(core, "d1", 2, tenant="a")
    for i in range(3):  # shared: 4 of 4 with a-old
        put(core, "b", [f"b{i}"], 1.0 + i / 10)
    put(core, "a", ["a0", "a1"], 2.0)  # dedicated: 2 of 2
    # a's dedicated segment is full: a's own LRU on it goes, not b's older objects
    ra = put(core, "a", ["a2"], 3.0)
    assert placed_on(ra) == [[ded]]
    assert keys_of(core, "b") == {"b0", "b1", "b2"}
    assert keys_of(core, "a") == {"a-old", "a1", "a2"}  # a-old is a's LRU but not on its dedicated segment
    # the shared segment is full: b's put evicts b's objects down to the low watermark, never a's
    rb = put(core, "b", ["b3"], 4.0)
    assert placed_on(rb) == [[shared]]
    assert "a-old" in keys_of(core, "a")
    assert keys_of(core, "b") == {"b2", "b3"}  # 4 -> 2 slots (low watermark 0.5): b0, b1 went
    check_usage(core)


def test_tenant_segments_follows_puts_removals_and_segment_loss():
    core = make_core()
    s1, s2 = mount(core, "n1", 8), mount(core, "n2", 8)
    assert core.index.tenant_segments("t") == set()
    put(core, "t", ["x"], 1.0)  # s1 (tie: lower id)
    assert core.index.tenant_segments("t") == {s1}
    started = put(core, "t", ["y"], 2.0, end=False)  # pending on s2 counts
    assert core.index.tenant_segments("t") == {s1, s2}
    assert core.index.tenant_segments("other") == set()
    core.handle(p.PutRevoke("t", ["y"], started.tokens, []), 3.0)
    assert core.index.tenant_segments("t") == {s1}
    core.handle(p.Remove("t", ["x"]), 4.0)
    assert core.index.tenant_segments("t") == set()


def test_namespaces_of_one_tenant_share_its_quota_and_segments():
    # authenticated tenants' namespaces are stored as <name>/<namespace> (master/access.py)
    core = make_core({"alice": TenantQuota(max_objects=3)})
    s1 = mount(core, "n1", 16)
    put(core, "alice/m1", ["x0"], 1.0)
    put(core, "bob/m1", ["y0"], 1.5)
    put(core, "alice/m2", ["x1"], 2.0)
    put(core, "alice/m1", ["x2"], 3.0)
    assert usage(core, "alice") == (3 * SLOT, 3) and usage(core, "bob") == (SLOT, 1)
    # alice is at her quota: her LRU object goes, in whichever namespace it is; bob's older one stays
    assert put(core, "alice/m2", ["x3"], 4.0).statuses == [ALLOC]
    assert keys_of(core, "alice/m1") == {"x2"} and keys_of(core, "alice/m2") == {"x1", "x3"}
    assert keys_of(core, "bob/m1") == {"y0"}
    assert core.index.tenant_segments("alice") == core.index.tenant_segments("alice/m1") == {s1}
    assert {t.tenant for t in core.stats(4.0).tenants} == {"alice", "bob"}
    check_usage(core)


def test_dedicated_segment_takes_every_namespace_of_its_tenant():
    core = make_core()
    shared = mount(core, "s1", 8)
    ded = mount(core, "d1", 8, tenant="alice")
    assert placed_on(put(core, "alice/m1", ["x"], 1.0)) == [[ded]]
    assert placed_on(put(core, "alice/m2", ["x"], 1.0)) == [[ded]]
    assert placed_on(put(core, "bob/m1", ["x"], 1.0)) == [[shared]]


def test_promotion_on_a_dedicated_segment_makes_room_from_its_tenant_only():
    core = make_core()
    mount(core, "shared", 4)
    for i in range(4):  # the pool's oldest objects, on the shared segment, no disk copy
        put(core, "u", [f"u{i}"], 0.1 + i / 10)
    node = FakeNode(core, dram_slots=4, node_id="ded", tenant="t")
    put_chain(core, ["a0", "a1"], 1.0)
    put_chain(core, ["b0", "b1"], 2.0)
    node.sync(2.5)
    put_chain(core, ["c0", "c1"], 3.0)  # t's segment full: t's LRU chain a goes to disk
    assert [where(core, k) for k in ("a0", "a1")] == ["disk", "disk"]
    reply = core.handle(p.LookupPrefix("t", ["a0", "a1"], lease=False), 4.0)
    assert reply.num_promoting == 2  # room made on t's segment from t's chain b, not from u's older objects
    assert [where(core, k) for k in ("b0", "b1")] == ["disk", "disk"]
    assert keys_of(core, "u") == {"u0", "u1", "u2", "u3"}
    node.sync(4.1)
    assert [where(core, k) for k in ("a0", "a1")] == ["dram+disk", "dram+disk"]
    check_usage(core)


def test_tenant_declared_dedicated_never_places_on_shared_segments_even_before_its_node_mounts():
    core = make_core(dedicated=frozenset({"alice"}))
    shared = mount(core, "s1", 8)
    reply = put(core, "alice/m", ["x"], 1.0)  # e.g. right after a master restart, before her node remounted
    assert reply.statuses == [NO_SPACE] and "places only on segments dedicated to it" in reply.message
    assert placed_on(put(core, "bob/m", ["y"], 1.0)) == [[shared]]
    ded = mount(core, "d1", 8, tenant="alice")
    assert placed_on(put(core, "alice/m", ["x"], 2.0)) == [[ded]]



def test_a_hybrid_models_kv_cache_groups_are_counted_by_key_prefix():
    from kvpool.master.quotas import key_group

    assert [key_group(k) for k in ("g0-ab", "g12-ab", "gx-ab", "g-ab", "g123456-ab", "ab", "g3")] == \
        ["g0", "g12", None, None, None, None, None]
    core = make_core()
    mount(core, "n1", 16)
    put(core, "t", ["g0-a", "g0-b", "g0-c", "g2-c", "plain"], 0.0)
    put(core, "t", ["g2-d"], 0.0, size=2 * SLOT)
    (stats,) = core.handle(p.Stats(), 1.0).tenants
    assert [(g.group, g.num_objects, g.used_bytes) for g in stats.key_groups] == [("g0", 3, 3 * SLOT),
                                                                                 ("g2", 2, 3 * SLOT)]
    core.handle(p.Remove("t", ["g2-c", "g2-d"]), 2.0)
    (stats,) = core.handle(p.Stats(), 3.0).tenants
    assert [(g.group, g.num_objects) for g in stats.key_groups] == [("g0", 3)]  # an emptied group is gone
    check_usage(core)
