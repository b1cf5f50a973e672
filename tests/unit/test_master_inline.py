"""Small plain values held by the master (master/inline.py): one namespace with the index,
LRU eviction within a byte budget, pinned values, per-tenant quotas, access scoping; MasterCore
driven with a fake clock, every reply through the wire encoding."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core import protocol as p
from kvpool.master import MasterConfig, MasterCore
from kvpool.master.access import Principal
from kvpool.master.inline import InlineValues, entry_cost
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
    assert (stats.inline_values, stats.inline_bytes, stats.inline_capacity_bytes) == (1, entry_cost("t", "a", 100), 1024)
    assert (stats.puts, stats.gets, stats.hit_keys) == (1, 2, 2)  # an inline get counts as the leased lookup it replaces


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
    cost = entry_cost("t", "a", 100)  # a value is charged its bytes, its names and the entry's overhead
    core = make_core(inline_capacity_bytes=3 * cost, max_inline_bytes=100)
    assert put_value(core, "t", "p", b"p" * 100, pinned=True).status == ALLOC
    for key in ("a", "b"):
        assert put_value(core, "t", key, key.encode() * 100).status == ALLOC
    assert get_value(core, "t", "a").inline  # a is now more recently used than b
    assert put_value(core, "t", "c", b"c" * 100).status == ALLOC
    assert [get_value(core, "t", k).inline for k in ("p", "a", "b", "c")] == [True, True, False, True]
    assert core.stats(0.0).inline_evictions == 1
    core2 = make_core(inline_capacity_bytes=2 * cost, max_inline_bytes=100)
    for key in ("p", "q"):
        assert put_value(core2, "t", key, b"p" * 100, pinned=True).status == ALLOC
    reply = put_value(core2, "t", "x", b"x")
    assert reply.status == NO_SPACE and "pinned" in reply.message


def test_long_keys_are_charged_so_tiny_values_cannot_hold_unbounded_memory():
    core = make_core(inline_capacity_bytes=10_000, max_inline_bytes=100)
    for i in range(100):
        put_value(core, "t", f"{i:04d}" + "k" * 996, b"x")  # 1-byte values under 1,000-character keys
    stats = core.stats(0.0)
    assert stats.inline_bytes <= 10_000 and stats.inline_values == 10_000 // entry_cost("t", "k" * 1000, 1)


def test_a_tenant_quota_evicts_only_its_own_values():
    cost = entry_cost("small", "s1", 100)
    core = make_core(quotas={"small": TenantQuota(max_bytes=cost + cost // 2)}, inline_capacity_bytes=100 * cost,
                     max_inline_bytes=100)
    assert put_value(core, "big", "b1", b"b" * 100).status == ALLOC
    assert put_value(core, "small", "s1", b"s" * 100).status == ALLOC
    assert put_value(core, "small", "s2", b"s" * 100).status == ALLOC  # evicts s1, not b1
    assert [get_value(core, t, k).inline for t, k in (("big", "b1"), ("small", "s1"), ("small", "s2"))] == \
        [True, False, True]
    assert put_value(core, "small", "pn", b"s" * 100, pinned=True).status == ALLOC  # evicts s2
    reply = put_value(core, "small", "s3", b"s" * 100)
    assert reply.status == NO_SPACE and "quota" in reply.message


def test_a_refused_put_evicts_nothing():
    """Room under the tenant's quota could be made by evicting its own value, but the master's room
    is held by another tenant's pinned values: refused, and the tenant's value is still there."""
    cost = entry_cost("A", "a1", 100)
    core = make_core(quotas={"B": TenantQuota(max_bytes=500)}, inline_capacity_bytes=3 * cost, max_inline_bytes=300)
    for key in ("a1", "a2"):
        assert put_value(core, "A", key, b"a" * 100, pinned=True).status == ALLOC
    assert put_value(core, "B", "b1", b"b" * 100).status == ALLOC
    assert put_value(core, "B", "b2", b"b" * 250).status == NO_SPACE
    assert get_value(core, "B", "b1").value == b"b" * 100
    assert core.stats(0.0).inline_evictions == 0


def test_a_read_carries_a_bounded_run_of_inline_values():
    """A leased lookup naming one key many times gets its value once per key until the reply's
    budget (a quarter of max_message_bytes) is spent: no reply grows with a hostile request."""
    core = make_core(inline_capacity_bytes=1 << 20, max_inline_bytes=1024, max_message_bytes=4096)
    assert put_value(core, "t", "k", b"v" * 600).status == ALLOC
    reply = core.handle(p.LookupPrefix("t", ["k"] * 10_000, lease=True), 0.0)
    assert reply.num_hit == 1 and reply.inline_values == [b"v" * 600]
    assert core.handle(p.LookupPrefix("t", ["k"] * 10_000, lease=False), 0.0).num_hit == 10_000


def test_a_counting_lookup_through_inline_and_node_keys_is_counted_once():
    core = make_core(inline_capacity_bytes=1 << 20, max_inline_bytes=1024)
    mount(core, "n1", 8)
    assert put_value(core, "t", "head", b"h").status == ALLOC
    put(core, "t", ["mid"], 0.0)
    assert put_value(core, "t", "tail", b"t").status == ALLOC
    before = core.stats(0.0)
    assert core.handle(p.LookupPrefix("t", ["head", "mid", "tail", "none"], lease=False), 0.0).num_hit == 3
    after = core.stats(0.0)
    assert (after.lookups - before.lookups, after.hit_keys - before.hit_keys, after.miss_keys - before.miss_keys) \
        == (1, 3, 1)
    read = core.handle(p.LookupPrefix("t", ["head", "mid"], lease=True), 0.0)
    assert read.num_hit == 1 and read.inline_values == [b"h"]  # a read ends after the inline run


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


def test_an_announcement_the_master_rejects_leaves_the_inline_value():
    core = make_core(inline_capacity_bytes=1000, max_inline_bytes=100)
    assert put_value(core, "t", "k", b"inline").status == ALLOC
    seg = mount(core, "n1", 4, recovering=True)
    entries = [p.DirEntry(0, SLOT, "t", "other", None, 7), p.DirEntry(0, SLOT, "t", "k", None, 7)]  # same range
    reply = core.handle(p.AnnounceObjects(seg, entries, [1.0, 1.0], last=True), 0.0)
    assert reply.accepted == 1 and reply.rejected_offsets == [0]
    assert core.index.holds("t", "other") and not core.index.holds("t", "k")
    assert get_value(core, "t", "k").value == b"inline"  # the node's copy was refused: the inline one stays


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "pin", "get", "remove"]), st.sampled_from("abcdef"),
                          st.integers(1, 120)), max_size=60))
def test_inline_values_never_answer_other_bytes_and_stay_within_budget(ops):
    """Against a model: a get returns exactly the bytes last stored under that key, or None after an
    eviction; the budget and the byte counts hold after every step."""
    capacity = 3 * entry_cost("t", "a", 100)
    store = InlineValues(capacity_bytes=capacity, max_value_bytes=120)
    stored: dict[str, bytes] = {}
    for n, (op, key, size) in enumerate(ops):
        if op in ("put", "pin"):
            data = bytes([n % 256]) * size
            existed = store.contains("t", key)
            status, _ = store.put("t", "t", key, data, op == "pin", None)
            if existed:
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
        assert store.used_bytes == sum(entry_cost("t", k, len(v)) for k, v in live.items()) <= capacity
        assert len(store) == len(live)
