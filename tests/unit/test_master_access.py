"""The master's authorization, driven on MasterCore with principals passed in (no sockets): roles,
namespaces that tenants cannot leave, node ids bound to the identity that mounted them, segment
metadata only for segments holding the caller's objects."""

import pytest

from kvpool.core import protocol as p
from kvpool.master import MasterConfig, MasterCore
from kvpool.master.core import MAX_POOL_BYTES, MAX_SEGMENT_BYTES
from kvpool.master.access import OPEN, Principal, namespace_owner, refusal, scoped_tenant

SLOT = 64
ALICE = Principal("tenant", "alice", "key-alice")
BOB = Principal("tenant", "bob", "key-bob")
NODE_A = Principal("node", "", "key-node-a")
NODE_B = Principal("node", "", "key-node-b")
ADMIN = Principal("admin", "", "key-admin")


def make_core() -> MasterCore:
    return MasterCore(MasterConfig(alignment_bytes=SLOT, node_ttl_s=1000.0))


def mount(core, node_id, who=NODE_A, slots=16) -> p.Reply:
    return core.handle(p.MountSegment(node_id, "host", slots * SLOT, 0, f"agent-{node_id}", b""), 0.0, who)


def put(core, who, keys, tenant="default") -> p.PutStartReply:
    started = core.handle(p.PutStart(tenant, keys, [SLOT] * len(keys), [None] * len(keys)), 0.0, who)
    assert started.statuses == [p.PUT_ALLOCATED] * len(keys), started
    ended = core.handle(p.PutEnd(tenant, keys, started.tokens, [7] * len(keys)), 0.0, who)
    assert ended == p.PutEndReply(ended=len(keys)), ended
    return started


def forbidden(reply) -> bool:
    return isinstance(reply, p.ErrorReply) and reply.kind == "forbidden"


def test_roles_reach_only_their_calls():
    lookup, stats = p.LookupPrefix("t", ["k"]), p.Stats()
    mount_req, unmount_req = p.MountSegment("n", "h", 4096, 0, "a", b""), p.UnmountSegment(1)
    assert refusal(OPEN, unmount_req) is None and refusal(OPEN, stats) is None  # --insecure: today's behaviour
    assert refusal(ALICE, lookup) is None
    assert "needs admin" in refusal(ALICE, stats)
    assert "needs a node" in refusal(ALICE, mount_req) and "needs a node" in refusal(ADMIN, unmount_req)
    assert refusal(NODE_A, mount_req) is None
    assert "tenant or admin" in refusal(NODE_A, lookup)
    assert refusal(ADMIN, lookup) is None and refusal(ADMIN, stats) is None
    assert refusal(Principal("guest", "", "k"), lookup) is not None  # an unknown role reaches nothing


def test_a_tenant_namespace_is_stored_under_its_name_whatever_it_sends():
    assert scoped_tenant(ALICE, "default") == "alice/default"
    assert scoped_tenant(ALICE, "bob/default") == "alice/bob/default"  # cannot climb into bob's
    assert scoped_tenant(ADMIN, "bob/default") == "bob/default" and scoped_tenant(OPEN, "x") == "x"
    assert namespace_owner("alice/vllm-llama-1") == "alice" and namespace_owner("plain") == "plain"


def test_tenant_b_cannot_read_list_remove_or_size_tenant_a_objects():
    core = make_core()
    mount(core, "n1")
    put(core, ALICE, ["k0", "k1"])
    assert sorted(core.index.tenants) == ["alice/default"]
    for namespace in ("default", "alice/default", "alice"):  # every name bob could try
        hit = core.handle(p.LookupPrefix(namespace, ["k0", "k1"]), 1.0, BOB)
        assert hit.num_hit == 0 and hit.replica_locations == b"" and hit.checksums == b""
        assert core.handle(p.Exists(namespace, ["k0", "k1"]), 1.0, BOB).exists == [False, False]
        assert core.handle(p.Remove(namespace, ["k0", "k1"]), 1.0, BOB).count == 0
    # bob's own put of the same keys is his own object, not a PUT_EXISTS that would reveal alice's
    put(core, BOB, ["k0"])
    assert core.handle(p.LookupPrefix("default", ["k0", "k1"]), 1.0, ALICE).num_hit == 2
    assert forbidden(core.handle(p.Stats(), 1.0, BOB))  # Stats would tell sizes of every tenant
    assert isinstance(core.handle(p.Stats(), 1.0, ADMIN), p.StatsReply)
    assert core.handle(p.LookupPrefix("alice/default", ["k0"]), 1.0, ADMIN).num_hit == 1


def test_segment_metadata_only_for_segments_holding_the_tenants_objects():
    core = make_core()
    first = mount(core, "n1").segment_id
    second = mount(core, "n2", NODE_B).segment_id
    started = put(core, ALICE, ["k0"])
    alice_segment = started.replicas[0][0].segment_id
    other = second if alice_segment == first else first
    assert [s.segment_id for s in core.handle(p.GetSegments([first, second]), 1.0, ALICE).segments] == [alice_segment]
    assert core.handle(p.GetSegments([first, second]), 1.0, BOB).segments == []
    assert len(core.handle(p.GetSegments([first, second]), 1.0, ADMIN).segments) == 2
    assert other != alice_segment


def test_a_node_id_belongs_to_the_identity_that_mounted_it():
    core = make_core()
    segment_id = mount(core, "n1", NODE_A).segment_id
    assert forbidden(core.handle(p.UnmountSegment(segment_id), 1.0, NODE_B))
    assert forbidden(core.handle(p.UnmountSegment(segment_id), 1.0, ALICE))
    assert forbidden(core.handle(p.Heartbeat("n1", [segment_id]), 1.0, NODE_B))
    assert forbidden(mount(core, "n1", NODE_B))  # a remount that would drop n1's segment
    assert segment_id in core.segments.by_id
    assert core.forbidden == 4
    assert core.handle(p.Heartbeat("n1", [segment_id]), 1.0, NODE_A).unknown_segment_ids == []
    assert core.handle(p.UnmountSegment(segment_id), 1.0, NODE_A).count == 1
    # once n1 holds no segment, another node identity may take the name (a node re-keyed by its operator)
    assert isinstance(mount(core, "n1", NODE_B), p.MountReply)


@pytest.mark.parametrize("tenant", ["", "x" * 129])
def test_a_bad_tenant_is_refused_before_scoping(tenant):
    reply = make_core().handle(p.LookupPrefix(tenant, ["k"]), 0.0, ALICE)
    assert isinstance(reply, p.ErrorReply) and reply.kind == "usage"


def test_hostile_segment_sizes_are_refused_so_stats_stay_encodable():
    core = make_core()
    for size, base, disk in ((2**63 - 1, 0, 0), (4096, 2**64 - 100, 0), (4096, 0, 2**63 - 1), (0, 0, 0)):
        reply = core.handle(p.MountSegment(f"n{size}", "h", size, base, "a", b"", disk_bytes=disk), 0.0, OPEN)
        assert isinstance(reply, p.ErrorReply) and reply.kind == "usage", reply
    for i in range(3):
        assert isinstance(core.handle(p.MountSegment(f"big{i}", "h", 1 << 60, 0, "a", b""), 0.0, OPEN), p.MountReply)
    p.reply_encoder.encode(core.handle(p.Stats(), 0.0, OPEN))  # capacity 3 x 2^60: still a 64-bit int


def test_the_pool_stops_growing_before_its_sums_leave_64_bits():
    core = make_core()
    replies = [core.handle(p.MountSegment(f"max{i}", "h", MAX_SEGMENT_BYTES, 0, "a", b""), 0.0, OPEN) for i in range(16)]
    mounted = [r for r in replies if isinstance(r, p.MountReply)]
    assert len(mounted) == MAX_POOL_BYTES // MAX_SEGMENT_BYTES
    assert all(r.kind == "usage" and "past" in r.message for r in replies[len(mounted):])
    stats = core.handle(p.Stats(), 0.0, OPEN)
    assert stats.capacity_bytes == MAX_POOL_BYTES
    p.reply_encoder.encode(stats)
