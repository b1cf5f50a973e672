"""Small plain values held by the master (master/inline.py, issue 14): one namespace with the index,
LRU eviction within a byte budget, pinned values, per-tenant quotas, access scoping; MasterCore
driven with a fake clock, every reply through the wire encoding."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core import protocol as p
from kvpool.master import MasterConfig, MasterCore
from kvpool.master.access import Principal
from kvpool.master.inline import InlineValues
from kvpool.master.quotas import TenantQuota
from test_master_quotas import SLOT, make_core, mount, put

ALLOC, EXISTS, NO_SPACE, TOO_LARGE = p.PUT_ALLOCATED, p.PUT_EXISTS, p.PUT_NO_SPACE, p.PUT_TOO_LARGE


def put_value(core: MasterCore, tenant: str, key: str, value: bytes, pinned: bool = False, now_s: float = 0.0):
    reply = core.handle(p.PutValue(tenant, key, value, pinned), now_s)
    assert isinstance(reply, p.PutValueReply), reply
    return reply


def get_value(core: MasterCore, tenant: str, key: str, now_s: float = 0.0) -> p.ValueReply:
    reply = core.handle(p.GetValue(tenant, key), now_s)
    assert isinstance(reply, p.ValueReply), reply
    return reply


def test_a_small_value_is_stored_and_read_in_one_round_trip_each():
    core = make_core(inline_capacity_bytes=1024, max_inline_bytes=256)
    reply = put_value(core, "t", "a", b"x" * 100)
    assert (reply.status, reply.max_inline_bytes) == (ALLOC, 256)
    got = get_value(core, "t", "a")
    assert got.inline and got.value == b"x" * 100 and got.lookup is None
    assert put_value(core, "t", "a", b"y" * 100).status == EXISTS  # a put never overwrites
    assert get_value(core, "t", "a").value == b"x" * 100
    assert not get_value(core, "other", "a").inline  # namespaces are separate
    stats = core.stats(0.0)
    assert (stats.inline_values, stats.inline_bytes, stats.inline_capacity_bytes) == (1, 100, 1024)


def test_a_miss_and_a_node_object_come_back_as_a_leased_lookup():
    core = make_core(inline_capacity_bytes=1024, max_inline_bytes=256)
    mount(core, "n1", 4)
    put(core, "t", ["big"], 0.0)
    miss = get_value(core, "t", "nothing")
    assert not miss.inline and miss.lookup is not None and miss.lookup.num_hit == 0
    hit = get_value(core, "t", "big")
    assert not hit.inline and hit.lookup.num_hit == 1 and hit.lookup.lease_id
    assert len(hit.lookup.replica_lists()[0]) == 1
    assert core.handle(p.ReleaseLeases("t", [hit.lookup.lease_id]), 0.0).count == 1


def test_too_large_empty_and_off():
    core = make_core(inline_capacity_bytes=1024, max_inline_bytes=256)
    reply = put_value(core, "t", "a", b"x" * 257)
    assert reply.status == TOO_LARGE and "256" in reply.message
    assert isinstance(core.handle(p.PutValue("t", "a", b""), 0.0), p.ErrorReply)
    off = make_core(inline_capacity_bytes=0)
    reply = put_value(off, "t", "a", b"x")
    assert (reply.status, reply.max_inline_bytes) == (TOO_LARGE, 0)
    assert get_value(off, "t", "a").max_inline_bytes == 0


def test_one_namespace_with_the_index():
    core = make_core(inline_capacity_bytes=1024, max_inline_bytes=256)
    mount(core, "n1", 8)
    put(core, "t", ["node-key"], 0.0, end=False)  # pending on a node
    assert put_value(core, "t", "node-key", b"v").status == EXISTS
    assert put_value(core, "t", "small", b"v").status == ALLOC
    started = core.handle(p.PutStart("t", ["small", "new"], [SLOT, SLOT], [None, None]), 0.0)
    assert started.statuses == [EXISTS, ALLOC] and started.tokens[0] == 0 and started.tokens[1]
    assert started.replicas[0] == [] and len(started.replicas[1]) == 1
    assert core.handle(p.Exists("t", ["small", "node-key", "new", "none"]), 0.0).exists == [True, False, False, False]
    assert core.handle(p.Remove("t", ["small", "none"]), 0.0).count == 1
    assert not get_value(core, "t", "small").inline
    assert put_value(core, "t", "small", b"again").status == ALLOC  # removed: the key is free again


def test_least_recently_used_values_are_evicted_and_pinned_ones_stay():
    core = make_core(inline_capacity_bytes=300, max_inline_bytes=100)
    assert put_value(core, "t", "pinned", b"p" * 100, pinned=True).status == ALLOC
    for key in ("a", "b"):
        assert put_value(core, "t", key, key.encode() * 100).status == ALLOC
    assert get_value(core, "t", "a").inline  # a is now more recently used than b
    assert put_value(core, "t", "c", b"c" * 100).status == ALLOC
    assert [get_value(core, "t", k).inline for k in ("pinned", "a", "b", "c")] == [True, True, False, True]
    assert core.stats(0.0).inline_evictions == 1
    core2 = make_core(inline_capacity_bytes=200, max_inline_bytes=100)
    for key in ("p1", "p2"):
        assert put_value(core2, "t", key, b"p" * 100, pinned=True).status == ALLOC
    reply = put_value(core2, "t", "x", b"x")
    assert reply.status == NO_SPACE and "pinned" in reply.message


def test_a_tenant_quota_evicts_only_its_own_values():
    core = make_core(quotas={"small": TenantQuota(max_bytes=150)}, inline_capacity_bytes=1000, max_inline_bytes=100)
    assert put_value(core, "big", "b1", b"b" * 100).status == ALLOC
    assert put_value(core, "small", "s1", b"s" * 100).status == ALLOC
    assert put_value(core, "small", "s2", b"s" * 100).status == ALLOC  # evicts s1, not b1
    assert [get_value(core, t, k).inline for t, k in (("big", "b1"), ("small", "s1"), ("small", "s2"))] == \
        [True, False, True]
    assert put_value(core, "small", "pin", b"s" * 100, pinned=True).status == ALLOC  # evicts s2
    reply = put_value(core, "small", "s3", b"s" * 100)
    assert reply.status == NO_SPACE and "quota" in reply.message


def test_a_tenant_principal_reaches_only_its_own_inline_values():
    core = MasterCore(MasterConfig(inline_capacity_bytes=1000, max_inline_bytes=100))
    alice, bob = Principal("tenant", "alice", "ka"), Principal("tenant", "bob", "kb")
    assert core.handle(p.PutValue("ns", "k", b"alice's"), 0.0, alice).status == ALLOC
    assert not core.handle(p.GetValue("ns", "k"), 0.0, bob).inline
    assert core.handle(p.GetValue("ns", "k"), 0.0, alice).value == b"alice's"
    assert core.handle(p.Remove("ns", ["k"]), 0.0, bob).count == 0
    node = Principal("node", "", "kn")
    assert core.handle(p.GetValue("ns", "k"), 0.0, node).kind == "forbidden"


def test_a_recovered_node_object_replaces_a_value_put_inline_meanwhile():
    core = make_core(inline_capacity_bytes=1000, max_inline_bytes=100)
    assert put_value(core, "t", "k", b"inline").status == ALLOC
    seg = mount(core, "n1", 4, recovering=True)
    reply = core.handle(p.AnnounceObjects(seg, [p.DirEntry(0, SLOT, "t", "k", None, 7)], [1.0], last=True), 0.0)
    assert reply.accepted == 1
    got = get_value(core, "t", "k")
    assert not got.inline and got.lookup.num_hit == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "pin", "get", "remove"]), st.sampled_from("abcdef"),
                          st.integers(1, 120)), max_size=60))
def test_inline_values_never_answer_other_bytes_and_stay_within_budget(ops):
    """Against a model: a get returns exactly the bytes last stored under that key, or None after an
    eviction; the budget and the byte counts hold after every step."""
    store = InlineValues(capacity_bytes=300, max_value_bytes=120)
    stored: dict[str, bytes] = {}
    for n, (op, key, size) in enumerate(ops):
        if op in ("put", "pin"):
            data = bytes([n % 256]) * size
            status, _ = store.put("t", "t", key, data, op == "pin", None)
            if key in stored and store.contains("t", key):
                assert status == EXISTS
            elif status == ALLOC:
                stored[key] = data
        elif op == "get":
            got = store.get("t", key)
            assert got is None or got == stored[key]
        else:
            store.remove("t", [key])
            stored.pop(key, None)
        live = {k: v for k, v in stored.items() if store.contains("t", k)}
        assert store.used_bytes == sum(map(len, live.values())) <= 300
        assert len(store) == len(live)
