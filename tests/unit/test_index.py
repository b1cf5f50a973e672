"""The master's logic driven directly (no sockets), with time passed in: placement, puts, lookups,
leases, tenants, removal, reclaim and usage errors."""

import pytest

from kvpool.core import protocol as p
from kvpool.master import MasterConfig, MasterCore
from kvpool.master.placement import PlacementGroup
from kvpool.master.segments import Segment

ALLOC, EXISTS, NO_SPACE = p.PUT_ALLOCATED, p.PUT_EXISTS, p.PUT_NO_SPACE


def make_core(**overrides) -> MasterCore:
    core = MasterCore(MasterConfig(**{"alignment_bytes": 64, "node_ttl_s": 1000.0, **overrides}))
    handle = core.handle
    # every reply goes through the wire encoding, as the service sends it
    core.handle = lambda req, now_s: p.reply_decoder.decode(p.reply_encoder.encode(handle(req, now_s)))
    return core


def mount(core, node_id, size_bytes, now_s=0.0, agent="agent") -> int:
    reply = core.handle(p.MountSegment(node_id, "host", size_bytes, 0, f"{agent}-{node_id}", b""), now_s)
    assert isinstance(reply, p.MountReply)
    return reply.segment_id


def put_start(core, keys, sizes, now_s=0.0, tenant="t", parents=None, replicas=1, pinned=False):
    parents = parents if parents is not None else [None] * len(keys)
    reply = core.handle(p.PutStart(tenant, keys, sizes, parents, replicas, pinned), now_s)
    assert isinstance(reply, p.PutStartReply), reply
    return reply


def put_end(core, started, keys, now_s=0.0, tenant="t", checksums=None) -> p.PutEndReply:
    """End `keys` of an earlier put_start (`started`, its reply for the same keys) with its tokens."""
    checksums = checksums if checksums is not None else [0] * len(keys)
    reply = core.handle(p.PutEnd(tenant, keys, list(started.tokens), checksums), now_s)
    assert isinstance(reply, p.PutEndReply), reply
    return reply


def put(core, keys, size=64, now_s=0.0, tenant="t", parents=None, pinned=False):
    reply = put_start(core, keys, [size] * len(keys), now_s, tenant, parents, pinned=pinned)
    put_end(core, reply, keys, now_s, tenant)
    return reply


def lookup(core, keys, now_s=0.0, tenant="t", lease=True) -> p.LookupReply:
    return core.handle(p.LookupPrefix(tenant, keys, lease), now_s)


def test_placement_is_free_ratio_first_with_exact_offsets():
    core = make_core()
    s1, s2 = mount(core, "n1", 1024), mount(core, "n2", 2048)
    reply = put_start(core, ["a", "b", "c", "d"], [100, 64, 300, 64])
    assert reply.statuses == [ALLOC] * 4
    # a: both empty, tie -> lower id; b: n2 freer; c: n2 (1856/2048 > 896/1024); d: n1 (896/1024 > 1536/2048)
    assert reply.replicas == [
        [p.Replica(s1, 0, 100)],
        [p.Replica(s2, 0, 64)],
        [p.Replica(s2, 64, 300)],
        [p.Replica(s1, 128, 64)],
    ]


def test_replicas_go_to_distinct_nodes():
    core = make_core()
    s1, s2 = mount(core, "n1", 1024), mount(core, "n2", 1024)
    reply = put_start(core, ["a"], [64], replicas=3)
    assert reply.replicas == [[p.Replica(s1, 0, 64), p.Replica(s2, 0, 64)]]  # as many as there are nodes
    # two segments of one node (the table keeps one per node; placement must not rely on that)
    same_node = [Segment(p.SegmentInfo(sid, "n1", "host", 1024, 0, "agent", b""), 64, 0.0, 10) for sid in (7, 8)]
    other = Segment(p.SegmentInfo(9, "n2", "host", 1024, 0, "agent", b""), 64, 0.0, 10)
    group = PlacementGroup()
    for segment in (*same_node, other):
        group.add(segment)
    assert [s.segment_id for s in group.choose(64, 3)] == [7, 9]


def test_put_existing_key_answers_exists_without_space():
    core = make_core()
    mount(core, "n1", 1024)
    first = put_start(core, ["a"], [64])
    assert first.statuses == [ALLOC] and first.tokens[0] != 0
    again = put_start(core, ["a", "a"], [64, 64])  # pending: still exists
    assert again.statuses == [EXISTS, EXISTS] and again.replicas == [[], []] and again.tokens == [0, 0]
    assert put_end(core, first, ["a"]).ended == 1
    assert put_start(core, ["a"], [64]).statuses == [EXISTS]
    assert core.stats(0.0).used_bytes == 64


def test_objects_are_readable_only_after_put_end_and_lookup_stops_at_first_miss():
    core = make_core()
    s1 = mount(core, "n1", 1024)
    started = put_start(core, ["a", "b", "c"], [64, 64, 64], parents=[None, "a", "b"])
    ta, tb, tc = started.tokens
    assert lookup(core, ["a", "b", "c"]).num_hit == 0
    assert core.handle(p.PutEnd("t", ["a", "c"], [ta, tc], [0xA, 0]), 1.0) == p.PutEndReply(ended=2, refused=[])
    reply = lookup(core, ["a", "b", "c"], 1.0)
    assert reply.num_hit == 1 and reply.replica_lists() == [[p.Replica(s1, 0, 64)]]
    assert reply.replica_locations == p.pack_replicas([p.Replica(s1, 0, 64)]) and reply.replica_counts == b""
    assert reply.lease_ttl_s == core.config.lease_ttl_s
    assert p.unpack_checksums(reply.checksums) == [0xA]
    core.handle(p.PutEnd("t", ["b"], [tb], [0]), 1.0)
    leased = lookup(core, ["a", "b", "c", "zz"], 2.0)
    assert leased.num_hit == 3 and p.unpack_checksums(leased.checksums) == [0xA, 0, 0]
    counting = lookup(core, ["a", "b", "c"], 2.0, lease=False)
    assert counting.num_hit == 3 and counting.replica_locations == b"" and counting.lease_id == 0
    assert counting.checksums == b""
    stats = core.stats(2.0)
    assert (stats.lookups, stats.gets, stats.hit_keys, stats.miss_keys) == (4, 3, 7, 6)


def test_exists_never_leases_and_unknown_keys_are_misses():
    core = make_core()
    mount(core, "n1", 1024)
    put(core, ["a"])
    reply = core.handle(p.Exists("t", ["a", "nope"]), 0.0)
    assert reply.exists == [True, False]
    rec = core.index.tenants["t"]["a"]
    assert rec.lease_until_s is None
    assert lookup(core, ["nope"]).num_hit == 0
    assert core.handle(p.Remove("t", ["nope"]), 0.0).count == 0


def test_tenants_never_see_each_others_objects():
    core = make_core()
    mount(core, "n1", 1024)
    put(core, ["a"], tenant="alice")
    assert lookup(core, ["a"], tenant="bob").num_hit == 0
    assert core.handle(p.Exists("bob", ["a"]), 0.0).exists == [False]
    assert core.handle(p.Remove("bob", ["a"]), 0.0).count == 0
    assert put_start(core, ["a"], [64], tenant="bob").statuses == [ALLOC]  # bob's own "a"
    assert lookup(core, ["a"], tenant="alice").num_hit == 1


def test_revoke_frees_space_and_pending_puts_are_reclaimed_after_the_timeout():
    core = make_core(put_timeout_s=10.0)
    mount(core, "n1", 1024)
    started = put_start(core, ["a", "b"], [64, 64], now_s=0.0)
    ta, tb = started.tokens
    assert started.put_timeout_s == 10.0
    assert core.handle(p.PutRevoke("t", ["a", "unknown"], [ta, tb]), 0.0).count == 1
    assert core.stats(0.0).used_bytes == 64
    core.tick(9.9)
    assert core.stats(9.9).num_pending == 1
    core.tick(10.0)
    stats = core.stats(10.0)
    assert (stats.num_pending, stats.used_bytes) == (0, 0)
    late = core.handle(p.PutEnd("t", ["b"], [tb], [0]), 10.0)  # too late: the key is gone
    assert late == p.PutEndReply(ended=0, refused=[0])
    assert lookup(core, ["b"], 10.0).num_hit == 0


def test_remove_of_a_leased_object_keeps_its_space_until_the_lease_ends():
    core = make_core(lease_ttl_s=5.0)
    s1 = mount(core, "n1", 1024)
    put(core, ["a", "b"])
    lookup(core, ["a"], now_s=1.0)  # a leased until 6.0
    assert core.handle(p.Remove("t", ["a", "b"]), 2.0).count == 2
    assert core.handle(p.Exists("t", ["a", "b"]), 2.0).exists == [False, False]
    assert core.stats(2.0).used_bytes == 64  # b freed, a held for its reader
    core.tick(5.9)
    assert core.stats(5.9).used_bytes == 64
    core.tick(6.0)
    assert core.stats(6.0).used_bytes == 0
    assert put_start(core, ["c"], [64], now_s=6.0).replicas == [[p.Replica(s1, 0, 64)]]


def test_capacity_errors_say_what_is_wrong():
    core = make_core()
    reply = put_start(core, ["a"], [64])
    assert reply.statuses == [NO_SPACE] and "no segment is mounted" in reply.message
    mount(core, "n1", 1024)
    reply = put_start(core, ["big"], [1025])
    assert reply.statuses == [NO_SPACE] and "larger than the largest segment" in reply.message
    put_start(core, ["x"], [1024])  # pending: cannot be evicted
    reply = put_start(core, ["y"], [64])
    assert reply.statuses == [NO_SPACE] and "pool full" in reply.message


@pytest.mark.parametrize(
    "request_",
    [
        p.PutStart("", ["a"], [64], [None]),
        p.PutStart("t", ["a", "b"], [64], [None, None]),
        p.PutStart("t", ["a"], [64], [None, None]),
        p.PutStart("t", ["a"], [-1], [None]),
        p.PutStart("t", ["a"], [0], [None]),
        p.PutStart("t", ["a"], [64], [None], num_replicas=0),
        p.PutStart("t", ["k" * 2000], [64], [None]),
        p.PutStart("t", [""], [64], [None]),
        p.LookupPrefix("", ["a"]),
        p.Exists("x" * 200, ["a"]),
        p.Remove("", ["a"]),
        p.PutEnd("", ["a"], [1], [0]),
        p.PutEnd("t", ["a"], [], [0]),
        p.PutEnd("t", ["a"], [1], []),
        p.PutEnd("t", ["a"], [1], [-1]),
        p.PutEnd("t", ["a"], [1], [1 << 64]),
        p.PutRevoke("", ["a"], [1]),
        p.PutRevoke("t", ["a", "b"], [1]),
        p.PutRevoke("t", ["a"], [1], in_flight=[1]),
        p.PutRevoke("t", ["a"], [1], in_flight=[-1]),
        p.EndQuarantine("", [1]),
    ],
)
def test_usage_errors_change_nothing(request_):
    core = make_core()
    mount(core, "n1", 1024)
    before = core.stats(0.0)
    reply = core.handle(request_, 0.0)
    assert isinstance(reply, p.ErrorReply) and reply.kind == "usage" and reply.message
    assert core.stats(0.0) == before


def test_parents_may_be_empty_and_a_missing_parent_is_a_chain_head():
    core = make_core()
    mount(core, "n1", 1024)
    reply = core.handle(p.PutStart("t", ["a", "b"], [64, 64], []), 0.0)
    assert reply.statuses == [ALLOC, ALLOC]
    put(core, ["c"], parents=["evicted-long-ago"])
    assert core.index.tenants["t"]["c"].parent is None
