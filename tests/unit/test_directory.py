"""The directory a node keeps of its committed objects: the master's per-segment log of ops
(master/directory.py), the node's copy (node/directory.py), and the two joined by heartbeats on a
MasterCore with a fake clock (acks, re-sends, gaps, the overflow reset)."""

from kvpool.core import protocol as p
from kvpool.master import MasterConfig, MasterCore
from kvpool.master.directory import DirectoryLog
from kvpool.node.directory import NodeDirectory

SLOT = 64


def add(offset: int, key: str, parent: str | None = None, checksum: int = 0) -> p.DirEntry:
    return p.DirEntry(offset, SLOT, "t", key, parent, checksum)


def keys_of(directory: NodeDirectory, now_s: float = 0.0) -> list[str]:
    return [e.key for e in directory.oldest_first(now_s)[0]]


# ---- the master's log ----------------------------------------------------------------------------


def test_the_log_numbers_ops_from_one_and_an_ack_drops_what_it_covers():
    log = DirectoryLog(max_ops=10)
    assert log.delta(7, 100) is None and log.last_seq == 0
    for i, key in enumerate("abc"):
        log.append(add(i * SLOT, key))
    assert log.delta(7, 100) == p.DirectoryDelta(7, 1, [add(0, "a"), add(64, "b"), add(128, "c")])
    log.ack(2)
    assert log.delta(7, 100) == p.DirectoryDelta(7, 3, [add(128, "c")])
    log.ack(1)  # stale: nothing changes
    assert (log.first_seq, log.last_seq) == (3, 3)
    log.ack(3)
    assert log.delta(7, 100) is None and log.first_seq == 4


def test_a_delta_carries_at_most_ops_per_reply_from_the_oldest_unacked():
    log = DirectoryLog(max_ops=10)
    for i in range(5):
        log.append(add(i * SLOT, f"k{i}"))
    assert log.delta(7, 2) == p.DirectoryDelta(7, 1, [add(0, "k0"), add(64, "k1")], more=True)
    log.ack(2)
    assert log.delta(7, 2) == p.DirectoryDelta(7, 3, [add(128, "k2"), add(192, "k3")], more=True)
    log.ack(4)
    assert log.delta(7, 2) == p.DirectoryDelta(7, 5, [add(256, "k4")])  # all of it: nothing more


def test_past_max_ops_the_log_restarts_with_reset_until_an_ack_at_the_reset_point():
    log = DirectoryLog(max_ops=3)
    for i in range(4):
        log.append(add(i * SLOT, f"k{i}"))  # the 4th finds 3 unacked: they are dropped
    assert log.delta(7, 100) == p.DirectoryDelta(7, 4, [add(192, "k3")], reset=True)
    log.ack(2)  # from before the reset: the node still lists what the log dropped
    assert log.reset
    log.ack(3)  # the node had applied every dropped op: its directory is whole
    assert log.delta(7, 100) == p.DirectoryDelta(7, 4, [add(192, "k3")], reset=False)
    log.ack(4)
    assert log.delta(7, 100) is None


# ---- the node's copy -----------------------------------------------------------------------------


def test_ops_apply_in_order_and_resent_ones_are_skipped():
    d = NodeDirectory()
    assert d.apply(p.DirectoryDelta(7, 1, [add(0, "a"), add(64, "b")]), 1.0) == 2
    assert d.apply(p.DirectoryDelta(7, 1, [add(0, "a"), add(64, "b")]), 2.0) == 0  # the same reply again
    assert d.apply(p.DirectoryDelta(7, 2, [add(64, "b"), add(128, "c")]), 3.0) == 1
    assert (d.applied_seq, len(d), d.resets) == (3, 3, 0)
    entries, ages = d.oldest_first(10.0)
    assert [e.key for e in entries] == ["a", "b", "c"] and ages == [9.0, 9.0, 7.0]  # b kept its first time


def test_a_gap_empties_the_directory_before_applying():
    d = NodeDirectory()
    d.apply(p.DirectoryDelta(7, 1, [add(0, "a"), add(64, "b")]), 1.0)
    assert d.apply(p.DirectoryDelta(7, 4, [add(128, "d")]), 2.0) == 1  # op 3 never arrived
    assert (keys_of(d), d.applied_seq, d.resets) == (["d"], 4, 1)


def test_a_reset_empties_the_directory_and_removals_drop_by_offset():
    d = NodeDirectory()
    d.apply(p.DirectoryDelta(7, 1, [add(0, "a"), add(64, "b"), add(128, "c")]), 1.0)
    d.apply(p.DirectoryDelta(7, 4, [p.DirEntry(64, 0), p.DirEntry(999, 0)]), 2.0)  # unknown offset: no-op
    assert keys_of(d) == ["a", "c"]
    d.apply(p.DirectoryDelta(7, 6, [add(64, "e")], reset=True), 3.0)
    assert (keys_of(d), d.applied_seq, d.resets) == (["e"], 6, 1)


def test_oldest_first_orders_by_commit_here_and_a_reused_offset_is_newest():
    d = NodeDirectory()
    d.apply(p.DirectoryDelta(7, 1, [add(0, "a"), add(64, "b")]), 1.0)
    d.apply(p.DirectoryDelta(7, 3, [add(128, "c")]), 4.0)
    d.apply(p.DirectoryDelta(7, 4, [p.DirEntry(0, 0), add(0, "a2")]), 6.0)  # a went, a2 took its range
    entries, ages = d.oldest_first(10.0)
    assert [(e.offset, e.key) for e in entries] == [(64, "b"), (128, "c"), (0, "a2")]
    assert ages == [9.0, 6.0, 4.0]
    assert d.oldest_first(0.0)[1] == [0.0, 0.0, 0.0]  # a clock behind the commits: never negative
    d.forget([128, 4096])
    assert keys_of(d) == ["b", "a2"]
    d.new_mount()
    assert (d.applied_seq, len(d)) == (0, 2)  # a remount restarts the numbering, keeps the entries


# ---- joined by heartbeats ------------------------------------------------------------------------


def make_core(**overrides) -> MasterCore:
    config = {"alignment_bytes": SLOT, "node_ttl_s": 1000.0, "lease_ttl_s": 5.0, **overrides}
    core = MasterCore(MasterConfig(**config), epoch=(5 << 32) | 7)
    handle = core.handle
    core.handle = lambda req, now_s: p.reply_decoder.decode(p.reply_encoder.encode(handle(req, now_s)))
    return core


def mount(core, node_id, slots=8) -> int:
    return core.handle(p.MountSegment(node_id, "host", slots * SLOT, 0, f"agent-{node_id}", b""), 0.0).segment_id


def put(core, keys, now_s=0.0, replicas=1, checksums=None, end=True) -> p.PutStartReply:
    started = core.handle(p.PutStart("t", keys, [SLOT] * len(keys), [None] * len(keys), replicas), now_s)
    if end:
        checksums = checksums if checksums is not None else [0] * len(keys)
        assert core.handle(p.PutEnd("t", keys, started.tokens, checksums), now_s).ended == len(keys)
    return started


def heartbeat(core, node_id, segment_id, directory, now_s) -> p.HeartbeatReply:
    """What a node does: acknowledge what it applied, apply what comes back."""
    reply = core.handle(p.Heartbeat(node_id, [segment_id], [directory.applied_seq]), now_s)
    for delta in reply.deltas:
        assert delta.segment_id == segment_id
        directory.apply(delta, now_s)
    return reply


def test_put_ends_add_and_drops_of_complete_objects_remove_on_every_replicas_segment():
    core = make_core()
    s1, s2 = mount(core, "n1"), mount(core, "n2")
    put(core, ["both"], replicas=2, checksums=[5])
    put(core, ["one"], checksums=[6])  # s1: freer after "both" took a slot on each, tie -> lower id
    pending = put(core, ["pending"], end=False)  # s2
    d1, d2 = NodeDirectory(), NodeDirectory()
    reply = heartbeat(core, "n1", s1, d1, 1.0)
    assert reply.deltas == [p.DirectoryDelta(s1, 1, [p.DirEntry(0, SLOT, "t", "both", None, 5),
                                                     p.DirEntry(SLOT, SLOT, "t", "one", None, 6)])]
    heartbeat(core, "n2", s2, d2, 1.0)
    assert keys_of(d1) == ["both", "one"] and keys_of(d2) == ["both"]
    assert core.handle(p.PutRevoke("t", ["pending"], pending.tokens), 2.0).count == 1  # never committed: no op
    assert core.handle(p.Remove("t", ["both"]), 2.0).count == 1
    assert heartbeat(core, "n1", s1, d1, 3.0).deltas == [p.DirectoryDelta(s1, 3, [p.DirEntry(0, 0)])]
    assert heartbeat(core, "n2", s2, d2, 3.0).deltas == [p.DirectoryDelta(s2, 2, [p.DirEntry(0, 0)])]
    core.pressure.evict(4.0, SLOT)  # "one" is the only candidate
    heartbeat(core, "n1", s1, d1, 5.0)
    assert (len(d1), len(d2)) == (0, 0)
    assert heartbeat(core, "n1", s1, d1, 6.0).deltas == [] and heartbeat(core, "n2", s2, d2, 6.0).deltas == []


def test_a_full_reply_is_followed_by_the_rest_on_the_next_heartbeat():
    core = make_core(directory_ops_per_reply=2)
    s1 = mount(core, "n1")
    put(core, ["a", "b", "c"])
    d = NodeDirectory()
    assert [len(x.ops) for x in heartbeat(core, "n1", s1, d, 1.0).deltas] == [2]
    assert [(x.first_seq, len(x.ops)) for x in heartbeat(core, "n1", s1, d, 1.1).deltas] == [(3, 1)]
    assert heartbeat(core, "n1", s1, d, 1.2).deltas == []
    assert keys_of(d) == ["a", "b", "c"]


def test_a_lost_reply_is_resent_and_applied_once():
    core = make_core()
    s1 = mount(core, "n1")
    put(core, ["a", "b"])
    d = NodeDirectory()
    core.handle(p.Heartbeat("n1", [s1], [0]), 1.0)  # the reply never reaches the node
    put(core, ["c"], now_s=1.5)
    assert [x.first_seq for x in heartbeat(core, "n1", s1, d, 2.0).deltas] == [1]
    d.apply(p.DirectoryDelta(s1, 1, [add(0, "a"), add(64, "b"), add(128, "c")]), 2.5)  # a duplicate
    assert keys_of(d) == ["a", "b", "c"] and d.resets == 0
    assert heartbeat(core, "n1", s1, d, 3.0).deltas == []


def test_an_overflowed_log_resets_the_node_which_clears_acks_and_ends_the_reset():
    core = make_core(directory_max_ops=3)
    s1 = mount(core, "n1")
    d = NodeDirectory()
    put(core, ["a", "b"], now_s=1.0)
    core.handle(p.Heartbeat("n1", [s1], [0]), 1.0)  # ops 1-2 sent; the node is stuck and never applies them
    put(core, ["c", "d"], now_s=2.0)  # op 4 finds 3 unacked ops: the log drops them
    segment = core.segments.by_id[s1]
    reply = heartbeat(core, "n1", s1, d, 3.0)
    assert reply.deltas == [p.DirectoryDelta(s1, 4, [p.DirEntry(192, SLOT, "t", "d", None, 0)], reset=True)]
    assert (keys_of(d), d.resets, d.applied_seq) == (["d"], 1, 4)
    assert segment.log.reset  # until the node's ack says it applied the reset
    assert heartbeat(core, "n1", s1, d, 4.0).deltas == []
    assert not segment.log.reset and len(segment.log.ops) == 0
    put(core, ["e"], now_s=5.0)
    assert heartbeat(core, "n1", s1, d, 5.0).deltas == [p.DirectoryDelta(s1, 5, [p.DirEntry(256, SLOT, "t", "e")])]
    assert keys_of(d) == ["d", "e"]


def test_heartbeats_for_another_nodes_or_an_unknown_segment_get_no_delta():
    core = make_core()
    s1 = mount(core, "n1")
    put(core, ["a"])
    reply = core.handle(p.Heartbeat("n2", [s1, 999], [0, 0]), 1.0)
    assert reply == p.HeartbeatReply(unknown_segment_ids=[s1, 999], deltas=[])
    assert len(core.segments.by_id[s1].log.ops) == 1  # nothing acked by a stranger
    reply = core.handle(p.Heartbeat("n1", [s1]), 1.0)  # an old node without directory_seqs: sent, never acked
    assert [len(x.ops) for x in reply.deltas] == [1]
