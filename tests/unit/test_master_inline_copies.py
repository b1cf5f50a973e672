"""Copies of inline values on nodes (master/inline_copies.py), pure: master A copies its values to a
node through the node's directory; a new master B takes back only what A made, only for a tenant
the node may hold, never over a key B holds; a drop reaches the node before the reply to it."""

from kvpool.core import protocol as p
from kvpool.master import MasterConfig, MasterCore
from kvpool.node.directory import NodeDirectory

EPOCH_A, EPOCH_B = (5 << 32) | 7, (9 << 32) | 7


def make_core(epoch) -> MasterCore:
    return MasterCore(MasterConfig(node_ttl_s=1000.0, recovery_timeout_s=30.0), epoch=epoch)


def mount(core, node_id, recovering=False, tenant="") -> int:
    reply = core.handle(p.MountSegment(node_id, "host", 1 << 20, 0, f"agent-{node_id}", b"", recovering=recovering,
                                       tenant=tenant), 0.0)
    assert isinstance(reply, p.MountReply), reply
    return reply.segment_id


def feed(core, node_id, segment_id, directory: NodeDirectory) -> None:
    """One heartbeat round: the node applies what the master logged for it."""
    reply = core.handle(p.Heartbeat(node_id, [segment_id], [directory.applied_seq]), 1.0)
    for delta in reply.deltas:
        directory.apply(delta, 1.0)


def test_a_new_master_takes_back_an_older_masters_copies_and_drops_its_own_and_foreign_ones():
    a = make_core(EPOCH_A)
    seg = mount(a, "n")
    node = NodeDirectory()
    assert a.handle(p.PutValue("t", "k1", b"one"), 0.5).status == p.PUT_ALLOCATED
    assert a.handle(p.PutValue("t", "k2", b"two"), 0.5).status == p.PUT_ALLOCATED
    feed(a, "n", seg, node)
    assert {k: op.value for k, op in node.values.items()} == {("t", "k1"): b"one", ("t", "k2"): b"two"}
    assert {op.checksum for op in node.values.values()} == {EPOCH_A}  # stamped with the master that made them
    a.handle(p.Remove("t", ["k2"]), 0.6)
    feed(a, "n", seg, node)
    assert set(node.values) == {("t", "k1")}

    b = make_core(EPOCH_B)
    seg_b = mount(b, "n", recovering=True)
    forged = p.DirEntry(0, 5, "t", "k3", None, EPOCH_B, p.DIR_VALUE, b"three")  # "made by B": B knows it did not
    reply = b.handle(p.AnnounceObjects(seg_b, [], [], last=True, values=[*node.values.values(), forged]), 2.0)
    assert reply.accepted == 1
    assert b.handle(p.GetValue("t", "k1"), 2.1).value == b"one"
    assert b.handle(p.GetValue("t", "k3"), 2.1).inline is False
    node.new_mount()
    feed(b, "n", seg_b, node)
    assert ("t", "k1") in node.values  # kept where it was


def test_a_node_dedicated_to_one_tenant_cannot_bring_back_another_tenants_values():
    b = make_core(EPOCH_B)
    seg = mount(b, "n", recovering=True, tenant="alice")
    value = p.DirEntry(0, 3, "bob", "k", None, EPOCH_A, p.DIR_VALUE, b"bad")
    assert b.handle(p.AnnounceObjects(seg, [], [], last=True, values=[value]), 1.0).accepted == 0
    assert b.handle(p.GetValue("bob", "k"), 1.1).inline is False


def test_replacing_a_value_drops_the_old_copy_in_the_same_requests_commits():
    a = make_core(EPOCH_A)
    mount(a, "n1")
    mount(a, "n2")
    assert a.handle(p.PutValue("t", "k", b"v1"), 0.5).status == p.PUT_ALLOCATED
    a.space.take_commits()
    a.handle(p.Remove("t", ["k"]), 0.6)
    removed = a.space.take_commits()
    assert len(removed) == 1  # the Remove's reply waits for the drop (durability.py)
    assert a.handle(p.PutValue("t", "k", b"v2"), 0.7).status == p.PUT_ALLOCATED
    assert len(a.space.take_commits()) == 1
