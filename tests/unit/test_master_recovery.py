"""A master restart that keeps the cache: master A commits chains of objects on two nodes, the
nodes' directories are fed by A's heartbeat replies, then a new master B (another epoch) is told
what they hold (MountSegment(recovering=True) + AnnounceObjects) and must serve the same objects,
chains and LRU order, refuse conflicting entries, and keep new puts off a segment until its
announcement ends (or recovery_timeout_s). Pure: MasterCore driven with a fake clock."""

import pytest

from kvpool.core import protocol as p
from kvpool.master import MasterConfig, MasterCore
from kvpool.node.directory import NodeDirectory

SLOT = 64
EPOCH_A, EPOCH_B = (5 << 32) | 7, (9 << 32) | 7
T_RESTART = 100.0


def make_core(epoch, **overrides) -> MasterCore:
    config = {"alignment_bytes": SLOT, "node_ttl_s": 1000.0, "put_timeout_s": 1000.0, "lease_ttl_s": 5.0,
              "recovery_timeout_s": 30.0, "high_watermark": 1.0, "low_watermark": 0.5, **overrides}
    core = MasterCore(MasterConfig(**config), epoch=epoch)
    handle = core.handle
    core.handle = lambda req, now_s: p.reply_decoder.decode(p.reply_encoder.encode(handle(req, now_s)))
    return core


def mount(core, node_id, now_s=0.0, slots=16, recovering=False) -> int:
    msg = p.MountSegment(node_id, "host", slots * SLOT, 0, f"agent-{node_id}", b"", recovering=recovering)
    reply = core.handle(msg, now_s)
    assert isinstance(reply, p.MountReply), reply
    return reply.segment_id


def put(core, keys, sizes, parents, checksums, now_s, replicas=1) -> p.PutStartReply:
    started = core.handle(p.PutStart("t", keys, sizes, parents, replicas), now_s)
    assert started.statuses == [p.PUT_ALLOCATED] * len(keys), started
    assert core.handle(p.PutEnd("t", keys, started.tokens, checksums), now_s).ended == len(keys)
    return started


def sync(core, nodes, now_s) -> None:
    """Every node heartbeats: acknowledges what it applied and applies the deltas it gets."""
    for node_id, (segment_id, directory) in nodes.items():
        reply = core.handle(p.Heartbeat(node_id, [segment_id], [directory.applied_seq]), now_s)
        for delta in reply.deltas:
            directory.apply(delta, now_s)


def lease(core, keys, now_s):
    reply = core.handle(p.LookupPrefix("t", keys, lease=True), now_s)
    return reply.num_hit, reply.replica_lists(), p.unpack_checksums(reply.checksums)


def announce(core, segment_id, directory, now_s, chunk, last=True) -> list[p.AnnounceReply]:
    """What a remounted node does: its directory, oldest first, in chunks; forgets what is rejected."""
    entries, ages = directory.oldest_first(now_s)
    replies = []
    for i in range(0, max(1, len(entries)), chunk):
        is_last = last and i + chunk >= len(entries)
        reply = core.handle(p.AnnounceObjects(segment_id, entries[i : i + chunk], ages[i : i + chunk], is_last), now_s)
        assert isinstance(reply, p.AnnounceReply), reply
        directory.forget(reply.rejected_offsets)
        replies.append(reply)
    return replies


def evict_one(core, now_s) -> str | None:
    before = set(core.index.tenants["t"])
    core.pressure.evict(now_s, SLOT)
    gone = before - set(core.index.tenants["t"])
    assert len(gone) <= 1
    return gone.pop() if gone else None


CHAIN_KEYS = ["a", "b", "c", "x", "y"]
CHECKSUMS = {"a": 0xA1, "b": 0xB2, "c": 0xC3, "x": 0xD4, "y": 0xE5}


def run_master_a():
    """Master A: chain a -> b -> c across both segments, x (on both nodes) -> y, and z put then
    removed. One commit per second, the nodes heartbeating after each."""
    core = make_core(EPOCH_A)
    s1, s2 = mount(core, "n1"), mount(core, "n2")
    nodes = {"n1": (s1, NodeDirectory()), "n2": (s2, NodeDirectory())}
    steps = [  # (keys, sizes, parents, replicas)
        (["a"], [64], [None], 1),  # s1 @ 0 (tie: lower id)
        (["b"], [100], ["a"], 1),  # s2 @ 0, 128 bytes aligned
        (["c"], [64], ["b"], 1),  # s1 @ 64 (960/1024 free > 896/1024)
        (["x"], [64], [None], 2),  # s1 @ 128 and s2 @ 128
        (["y"], [64], ["x"], 1),  # s1 @ 192 (both 832/1024 free: tie)
        (["z"], [64], [None], 1),  # s2 @ 192, removed below
    ]
    for t, (keys, sizes, parents, replicas) in enumerate(steps, start=1):
        put(core, keys, sizes, parents, [CHECKSUMS.get(k, 0) for k in keys], float(t), replicas)
        sync(core, nodes, float(t))
    assert core.handle(p.Remove("t", ["z"]), 7.0).count == 1
    sync(core, nodes, 7.0)
    sync(core, nodes, 8.0)  # acknowledges the removal
    return core, nodes


def test_master_a_directories_hold_what_was_committed():
    core, nodes = run_master_a()
    (s1, d1), (s2, d2) = nodes["n1"], nodes["n2"]
    entries1, ages1 = d1.oldest_first(T_RESTART)
    entries2, ages2 = d2.oldest_first(T_RESTART)
    assert [(e.key, e.offset, e.size, e.parent, e.checksum) for e in entries1] == [
        ("a", 0, 64, None, 0xA1), ("c", 64, 64, "b", 0xC3), ("x", 128, 64, None, 0xD4), ("y", 192, 64, "x", 0xE5)]
    assert ages1 == [99.0, 97.0, 96.0, 95.0]
    assert [(e.key, e.offset, e.size, e.parent) for e in entries2] == [("b", 0, 100, "a"), ("x", 128, 64, None)]
    assert ages2 == [98.0, 96.0]
    assert all(len(core.segments.by_id[s].log.ops) == 0 for s in (s1, s2))  # all acknowledged


def recover(order, chunk):
    """Master A's run, then master B with both nodes remounted (in `order`) and announced in chunks."""
    core_a, nodes = run_master_a()
    core_b = make_core(EPOCH_B)
    new_ids = {}
    for node in order:
        new_ids[node] = mount(core_b, node, T_RESTART, recovering=True)
        nodes[node][1].new_mount()
    replies = []
    for node in order:
        replies += announce(core_b, new_ids[node], nodes[node][1], T_RESTART, chunk)
    return core_a, nodes, core_b, new_ids, replies


ORDERS = pytest.mark.parametrize("order", [("n1", "n2"), ("n2", "n1")])  # parent or child announced first


@ORDERS
@pytest.mark.parametrize("chunk", [1, 3])
def test_a_new_master_serves_the_same_objects_and_chains_from_the_announcements(order, chunk):
    core_a, nodes, core_b, new_ids, replies = recover(order, chunk)
    segment_of_a = {sid: node for node, (sid, _) in nodes.items()}
    assert set(new_ids.values()).isdisjoint(segment_of_a)
    assert all(r.rejected_offsets == [] for r in replies) and sum(r.accepted for r in replies) == 6
    stats = core_b.stats(T_RESTART)
    assert (stats.recovered_objects, stats.rejected_announcements, stats.num_objects) == (6, 0, 5)
    assert [n.state for n in stats.nodes] == ["alive", "alive"]

    # chains linked, whichever of parent and child was announced first
    recs = core_b.index.tenants["t"]
    assert (recs["b"].parent, recs["c"].parent, recs["y"].parent) == (recs["a"], recs["b"], recs["x"])
    assert recs["a"].parent is None and recs["x"].parent is None
    assert [recs[k].num_children for k in CHAIN_KEYS] == [1, 1, 0, 1, 0]

    # the allocators: exactly the ranges no announced object covers, as on A
    for node in order:
        free_a = core_a.segments.by_id[nodes[node][0]].allocator.free_ranges()
        assert core_b.segments.by_id[new_ids[node]].allocator.free_ranges() == free_a
    assert core_b.segments.by_id[new_ids["n1"]].allocator.free_ranges() == [(256, 768)]
    assert core_b.segments.by_id[new_ids["n2"]].allocator.free_ranges() == [(192, 832)]

    # the same sizes, offsets and checksums, on B's segment ids; x's replicas in announce order
    for key in CHAIN_KEYS:
        num_hit, replicas, checksums = lease(core_b, [key], T_RESTART)
        old_hit, old_replicas, old_checksums = lease(core_a, [key], 9.0)
        translated = [p.Replica(new_ids[segment_of_a[r.segment_id]], r.offset, r.size) for r in old_replicas[0]]
        assert (num_hit, checksums) == (old_hit, old_checksums) == (1, [CHECKSUMS[key]])
        assert set(replicas[0]) == set(translated) and len(replicas[0]) == len(translated)
    assert lease(core_b, ["x"], T_RESTART)[1] == [[p.Replica(new_ids[n], 128, 64) for n in order]]
    assert lease(core_b, ["a", "b", "c"], T_RESTART) == (3, [[p.Replica(new_ids["n1"], 0, 64)],
                                                          [p.Replica(new_ids["n2"], 0, 100)],
                                                          [p.Replica(new_ids["n1"], 64, 64)]], [0xA1, 0xB2, 0xC3])
    assert lease(core_b, ["z"], T_RESTART)[0] == 0


@ORDERS
def test_a_new_master_evicts_recovered_tails_in_commit_order(order):
    core_b = recover(order, chunk=2)[2]
    recs = core_b.index.tenants["t"]
    assert [recs[k].last_access_s for k in CHAIN_KEYS] == [1.0, 2.0, 3.0, 4.0, 5.0]  # commit times on A
    # tails only: c (3 s), then its prefix b (2 s) and a (1 s), then y (5 s), then x (4 s)
    assert [evict_one(core_b, T_RESTART) for _ in range(6)] == ["c", "b", "a", "y", "x", None]
    assert [n.used_bytes for n in core_b.stats(T_RESTART).nodes] == [0, 0]


def test_a_recovering_segment_takes_no_new_put_until_its_announcement_ends():
    core_a, nodes = run_master_a()
    core_b = make_core(EPOCH_B)
    s1 = mount(core_b, "n1", T_RESTART, recovering=True)
    nodes["n1"][1].new_mount()
    refused = core_b.handle(p.PutStart("t", ["new"], [64], [None]), T_RESTART)
    assert refused.statuses == [p.PUT_NO_SPACE] and "no segment" in refused.message
    assert [n.state for n in core_b.stats(T_RESTART).nodes] == ["recovering"]
    announce(core_b, s1, nodes["n1"][1], T_RESTART, chunk=2, last=False)
    again = core_b.handle(p.PutStart("t", ["new"], [64], [None]), T_RESTART)
    assert again.statuses == [p.PUT_NO_SPACE]
    assert core_b.handle(p.AnnounceObjects(s1, [], [], last=True), T_RESTART + 1) == p.AnnounceReply(0, [])
    stats = core_b.stats(T_RESTART + 1)
    assert (stats.num_objects, stats.evictions) == (4, 0)  # the refused puts evicted nothing recovered
    placed = core_b.handle(p.PutStart("t", ["new"], [64], [None]), T_RESTART + 1)
    assert placed.statuses == [p.PUT_ALLOCATED] and placed.replicas == [[p.Replica(s1, 256, 64)]]
    assert [n.state for n in core_b.stats(T_RESTART + 1).nodes] == ["alive"]
    # a put to a live segment meanwhile is not held up by another one recovering
    s2 = mount(core_b, "n2", T_RESTART + 2, recovering=True)
    elsewhere = core_b.handle(p.PutStart("t", ["other"], [64], [None]), T_RESTART + 2)
    assert elsewhere.replicas == [[p.Replica(s1, 320, 64)]] and s2 != s1


def test_a_stalled_announcement_ends_at_recovery_timeout_in_tick():
    core_a, nodes = run_master_a()
    core_b = make_core(EPOCH_B)
    s1 = mount(core_b, "n1", 0.0, recovering=True)
    entries, ages = nodes["n1"][1].oldest_first(10.0)
    first = core_b.handle(p.AnnounceObjects(s1, entries[:2], ages[:2]), 10.0)  # then the node goes quiet
    assert first == p.AnnounceReply(accepted=2, rejected_offsets=[])
    assert core_b.tick(40.0) == []  # 30 s of silence since the last chunk, not since the mount
    assert core_b.segments.by_id[s1].recovering
    assert core_b.tick(40.5) == [f"segment {s1:x} of node n1: announcement unfinished after 30 s; taking new objects"]
    assert core_b.segments.by_id[s1].allocator.free_ranges() == [(128, 896)]  # a and c, the first chunk
    placed = core_b.handle(p.PutStart("t", ["new"], [64], [None]), 31.0)
    assert placed.replicas == [[p.Replica(s1, 128, 64)]]
    late = core_b.handle(p.AnnounceObjects(s1, entries[2:3], ages[2:3], last=True), 31.0)
    assert late == p.AnnounceReply(accepted=0, rejected_offsets=[entries[2].offset])  # too late: forgotten
    assert core_b.tick(31.0) == []


def entry(offset, key, size=64, checksum=7, parent=None) -> p.DirEntry:
    return p.DirEntry(offset, size, "t", key, parent, checksum)


def test_conflicting_entries_are_rejected():
    core = make_core(EPOCH_B)
    s1 = mount(core, "n1", recovering=True)
    s2 = mount(core, "n2", recovering=True)
    live = mount(core, "n3", slots=4)
    pending = core.handle(p.PutStart("t", ["being-written"], [64], [None]), 0.0)
    assert pending.replicas == [[p.Replica(live, 0, 64)]]
    first = core.handle(p.AnnounceObjects(s1, [
        entry(0, "k", checksum=1),
        entry(64, "wide", size=128),
        entry(128, "overlaps-wide"),  # accepted now, refused when the allocator is built
        entry(1024, "past-the-end"),
        entry(960, "runs-past-the-end", size=128),
        entry(-64, "negative"),
        entry(256, "empty", size=0),
        entry(320, ""),
        entry(384, "being-written"),
        entry(0, "same-offset-twice"),
        entry(448, "k2", checksum=3),
        entry(512, "k2", checksum=3),  # the same key twice on one segment
        entry(608, "unaligned"),  # refused at once, as the allocator would
        entry(704, "no-checksum", checksum=0),  # could not be told from bytes that overwrote it
    ], [0.0] * 14), 1.0)
    assert first == p.AnnounceReply(accepted=4, rejected_offsets=[1024, 960, -64, 256, 320, 384, 0, 512, 608, 704])
    second = core.handle(p.AnnounceObjects(s2, [
        entry(0, "k", checksum=2),  # another checksum under the same key
        entry(64, "k2", checksum=3),  # the same object: a second replica
        entry(128, "wide", size=64),  # another size under the same key
    ], [0.0] * 3, last=True), 1.0)
    assert second == p.AnnounceReply(accepted=1, rejected_offsets=[0, 128])
    assert core.handle(p.AnnounceObjects(s1, [], [], last=True), 2.0) == p.AnnounceReply(0, [])
    stats = core.stats(2.0)
    assert (stats.recovered_objects, stats.rejected_announcements) == (5 - 1, 12 + 1)  # 1 refused at the end
    assert core.handle(p.Exists("t", ["k", "wide", "overlaps-wide", "unaligned", "k2"]), 2.0).exists == [
        True, True, False, False, True]
    assert lease(core, ["k"], 2.0) == (1, [[p.Replica(s1, 0, 64)]], [1])
    assert lease(core, ["k2"], 2.0) == (1, [[p.Replica(s1, 448, 64), p.Replica(s2, 64, 64)]], [3])
    assert core.segments.by_id[s1].allocator.free_ranges() == [(192, 256), (512, 512)]
    # the node hears of the entries refused when the allocator was built, as removals
    reply = core.handle(p.Heartbeat("n1", [s1], [0]), 3.0)
    assert reply.deltas == [p.DirectoryDelta(s1, 1, [p.DirEntry(128, 0)])]
    assert core.stats(3.0).num_objects == 3


def test_announcing_to_a_segment_that_is_not_recovering_takes_nothing():
    core = make_core(EPOCH_B)
    live = mount(core, "n1")
    # its recovery already ended (timeout): the rest is refused, so the node forgets it, no remount
    assert core.handle(p.AnnounceObjects(live, [entry(0, "k"), entry(64, "j")], [0.0, 0.0]), 0.0) == (
        p.AnnounceReply(accepted=0, rejected_offsets=[0, 64]))
    reply = core.handle(p.AnnounceObjects(12345, [entry(0, "k")], [0.0]), 0.0)
    assert isinstance(reply, p.ErrorReply) and reply.kind == "usage"  # unknown: mount again
    assert core.stats(0.0).num_objects == 0


def test_the_recovery_timeout_counts_silence_not_the_announcement():
    core = make_core(EPOCH_B, recovery_timeout_s=5.0)
    seg = mount(core, "n1", recovering=True)
    for t in (1.0, 4.0, 7.0, 10.0):  # a chunk every 3 s: 10 s in all, never 5 s of silence
        assert core.handle(p.AnnounceObjects(seg, [entry(int(t) * 64, f"k{t}")], [0.0]), t).accepted == 1
        core.tick(t + 0.5)
        assert core.segments.by_id[seg].recovering
    core.tick(15.1)
    assert not core.segments.by_id[seg].recovering


def test_a_put_while_another_segment_recovers_still_evicts_on_the_live_one():
    core_a, nodes = run_master_a()
    core = make_core(EPOCH_B)
    live = mount(core, "n3", slots=2)
    put(core, ["l1"], [64], [None], [0], 0.0)
    put(core, ["l2"], [64], [None], [0], 0.5)  # full, both evictable, l1 older than anything recovered
    recovering = mount(core, "n1", 2.0, recovering=True)
    announce(core, recovering, nodes["n1"][1], 2.0, chunk=4, last=False)
    reply = core.handle(p.PutStart("t", ["new"], [64], [None]), 3.0)
    assert reply.replicas == [[p.Replica(live, 0, 64)]]  # l1, the LRU object, evicted for it
