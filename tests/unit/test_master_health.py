"""Node health with a fake clock: heartbeats, expiry, dropped replicas, remounts, node state."""

from kvpool.core import protocol as p
from kvpool.master import MasterConfig, MasterCore


def make_core() -> MasterCore:
    return MasterCore(MasterConfig(alignment_bytes=64, node_ttl_s=5.0, heartbeat_interval_s=1.0, put_timeout_s=100.0))


def mount(core, node_id, now_s=0.0, agent="agent", size_bytes=1024) -> int:
    return core.handle(p.MountSegment(node_id, "host", size_bytes, 0, agent, b""), now_s).segment_id


def put(core, keys, now_s=0.0, replicas=1, end=True) -> p.PutStartReply:
    reply = core.handle(p.PutStart("t", keys, [64] * len(keys), [None] * len(keys), replicas), now_s)
    if end:
        core.handle(p.PutEnd("t", keys, reply.tokens, [0] * len(keys)), now_s)
    return reply


def test_a_silent_node_is_unmounted_and_its_objects_dropped():
    core = make_core()
    s1, s2 = mount(core, "n1"), mount(core, "n2")
    put(core, ["on1", "on2"])  # free-ratio first: on1 -> s1, on2 -> s2
    put(core, ["both"], replicas=2)
    pending1 = put(core, ["pending1"], end=False)
    assert core.index.tenants["t"]["pending1"].replicas[0].segment_id == s1
    events = []
    for t in (2.0, 4.0, 6.0):
        assert core.handle(p.Heartbeat("n2", [s2]), t).unknown_segment_ids == []
        events.append(core.tick(t))
    assert events[:2] == [[], []]
    # lost: on1 and the pending put (neither had another replica)
    assert events[2] == [
        f"node n1 silent for over 5 s: segment {s1:x} dropped with 2 objects that had no other replica"
    ]
    assert sorted(core.segments.by_id) == [s2]
    assert core.handle(p.Exists("t", ["on1", "on2", "both"]), 6.0).exists == [False, True, True]
    assert [r.segment_id for r in core.index.tenants["t"]["both"].replicas] == [s2]
    late = core.handle(p.PutEnd("t", ["pending1"], pending1.tokens, [0]), 6.0)
    assert late == p.PutEndReply(ended=0, refused=[0])
    stats = core.stats(6.0)
    assert (stats.num_objects, stats.num_pending, stats.capacity_bytes) == (2, 0, 1024)
    assert [(n.node_id, n.num_objects, n.used_bytes) for n in stats.nodes] == [("n2", 2, 128)]


def test_a_returning_node_is_told_to_mount_again_and_gets_a_new_id():
    core = make_core()
    s1 = mount(core, "n1")
    core.tick(5.1)
    assert core.segments.by_id == {}
    assert core.handle(p.Heartbeat("n1", [s1]), 6.0).unknown_segment_ids == [s1]
    s1b = mount(core, "n1", now_s=6.0)
    assert s1b != s1 and core.ids.issued_here(s1b)  # ids are never reused
    assert core.handle(p.Heartbeat("n1", [s1b]), 7.0).unknown_segment_ids == []
    assert core.handle(p.Heartbeat("n2", [s1b]), 7.0).unknown_segment_ids == [s1b]  # not n2's


def test_a_restarted_node_replaces_its_old_segments_at_once():
    core = make_core()
    s1 = mount(core, "n1", agent="pid-100")
    put(core, ["a"])
    s1b = mount(core, "n1", now_s=1.0, agent="pid-200")  # a new process under the same name
    assert sorted(core.segments.by_id) == [s1b]
    assert core.handle(p.Exists("t", ["a"]), 1.0).exists == [False]
    assert list(put(core, ["b"], now_s=1.0).replicas[0]) == [p.Replica(s1b, 0, 64)]
    assert s1 not in core.segments.by_id


def test_a_remount_with_the_same_agent_replaces_the_nodes_segment_too():
    core = make_core()
    s1, s2 = mount(core, "n1", agent="pid-100"), mount(core, "n2")
    put(core, ["a", "b"])  # a -> s1, b -> s2
    s1b = mount(core, "n1", now_s=1.0, agent="pid-100")  # the same memory mounted again: one segment, not two
    assert sorted(core.segments.by_id) == sorted([s1b, s2]) and s1b not in (s1, s2)
    assert core.handle(p.Exists("t", ["a", "b"]), 1.0).exists == [False, True]
    assert core.stats(1.0).capacity_bytes == 2048


def test_unmount_drops_objects_and_frees_nothing_elsewhere():
    core = make_core()
    s1, s2 = mount(core, "n1"), mount(core, "n2")
    put(core, ["a", "b"])
    assert core.handle(p.UnmountSegment(s1), 0.0).count == 1
    assert core.handle(p.UnmountSegment(s1), 0.0).count == 0
    assert core.handle(p.Exists("t", ["a", "b"]), 0.0).exists == [False, True]
    assert core.stats(0.0).used_bytes == 64


def test_node_state_turns_suspect_after_two_missed_heartbeats():
    core = make_core()
    s1 = mount(core, "n1")
    assert [n.state for n in core.stats(2.0).nodes] == ["alive"]
    assert [n.state for n in core.stats(2.5).nodes] == ["suspect"]
    core.handle(p.Heartbeat("n1", [s1]), 3.0)
    node = core.stats(3.5).nodes[0]
    assert (node.state, node.last_heartbeat_age_s) == ("alive", 0.5)


def test_get_segments_leaves_unknown_ids_out():
    core = make_core()
    s1 = mount(core, "n1")
    reply = core.handle(p.GetSegments([s1, 999]), 0.0)
    assert [s.segment_id for s in reply.segments] == [s1]
    assert reply.segments[0].node_id == "n1" and reply.segments[0].size_bytes == 1024
