"""Write tokens and quarantine on MasterCore with a fake clock: a PutEnd or PutRevoke acts only on
the allocation its token names (late, duplicate and wrong ends are refused and change nothing),
and a revoked write that may still land keeps its space until its writer or the time limit ends it."""

from kvpool.core import protocol as p
from kvpool.master import MasterConfig, MasterCore

SLOT = 64
ALLOC, NO_SPACE = p.PUT_ALLOCATED, p.PUT_NO_SPACE


def make_core(slots=4, **overrides) -> MasterCore:
    config = {"alignment_bytes": SLOT, "node_ttl_s": 1000.0, "put_timeout_s": 10.0, "lease_ttl_s": 5.0,
              "quarantine_max_s": 50.0, **overrides}
    core = MasterCore(MasterConfig(**config), epoch=(5 << 32) | 7)
    handle = core.handle
    core.handle = lambda req, now_s: p.reply_decoder.decode(p.reply_encoder.encode(handle(req, now_s)))
    core.handle(p.MountSegment("n1", "host", slots * SLOT, 0, "agent-n1", b""), 0.0)
    return core


def start(core, keys, now_s=0.0, size=SLOT, replicas=1) -> p.PutStartReply:
    reply = core.handle(p.PutStart("t", keys, [size] * len(keys), [None] * len(keys), replicas), now_s)
    assert isinstance(reply, p.PutStartReply), reply
    return reply


def end(core, keys, tokens, now_s=0.0, checksums=None) -> p.PutEndReply:
    checksums = checksums if checksums is not None else [0] * len(keys)
    return core.handle(p.PutEnd("t", keys, list(tokens), checksums), now_s)


def revoke(core, keys, tokens, in_flight=(), now_s=0.0) -> int:
    return core.handle(p.PutRevoke("t", keys, list(tokens), list(in_flight)), now_s).count


def offsets(reply: p.PutStartReply) -> list[int | None]:
    return [r[0].offset if r else None for r in reply.replicas]


def lease(core, keys, now_s):
    reply = core.handle(p.LookupPrefix("t", keys, lease=True), now_s)
    return reply.num_hit, reply.replica_lists(), p.unpack_checksums(reply.checksums)


def segment_id(core) -> int:
    return next(iter(core.segments.by_id))


def test_a_late_end_after_reclaim_is_refused_and_cannot_complete_another_writers_put():
    core = make_core()
    first = start(core, ["k"], now_s=0.0)
    assert first.put_timeout_s == 10.0 and offsets(first) == [0]
    core.tick(10.0)  # the first writer missed its deadline: reclaimed
    second = start(core, ["k"], now_s=11.0)
    assert second.statuses == [ALLOC] and offsets(second) == [0]
    assert second.tokens[0] not in (0, first.tokens[0])
    assert end(core, ["k"], first.tokens, 12.0, [0x1111]) == p.PutEndReply(ended=0, refused=[0])
    assert lease(core, ["k"], 12.0)[0] == 0  # still the second writer's pending put
    assert core.index.tenants["t"]["k"].token == second.tokens[0]
    assert end(core, ["k"], second.tokens, 13.0, [0x2222]) == p.PutEndReply(ended=1, refused=[])
    assert lease(core, ["k"], 13.0) == (1, [[p.Replica(segment_id(core), 0, SLOT)]], [0x2222])
    stats = core.stats(13.0)
    assert (stats.refused_put_ends, stats.num_objects, stats.puts, stats.used_bytes) == (1, 1, 1, SLOT)


def test_a_duplicate_end_is_refused_and_keeps_the_first_checksum():
    core = make_core()
    started = start(core, ["a", "b"])
    assert end(core, ["a", "b"], started.tokens, 1.0, [7, 8]) == p.PutEndReply(ended=2, refused=[])
    assert end(core, ["b", "a"], started.tokens[::-1], 2.0, [9, 9]) == p.PutEndReply(ended=0, refused=[0, 1])
    assert lease(core, ["a", "b"], 3.0)[2] == [7, 8]
    ops = core.handle(p.Heartbeat("n1", [segment_id(core)], [0]), 3.0).deltas[0].ops
    assert [(op.key, op.checksum) for op in ops] == [("a", 7), ("b", 8)]  # one directory add each
    assert core.stats(3.0).refused_put_ends == 2


def test_an_end_with_a_wrong_token_is_refused_and_the_put_stays_the_writers():
    core = make_core()
    started = start(core, ["a", "b"])
    ta, tb = started.tokens
    assert end(core, ["a", "b"], [ta, tb + 1000]) == p.PutEndReply(ended=1, refused=[1])
    assert end(core, ["b"], [ta]) == p.PutEndReply(ended=0, refused=[0])  # a's token does not end b
    assert core.handle(p.Exists("t", ["a", "b"]), 0.0).exists == [True, False]
    assert end(core, ["b"], [tb]) == p.PutEndReply(ended=1, refused=[])
    assert end(core, ["nope"], [tb]) == p.PutEndReply(ended=0, refused=[0])


def test_a_revoke_with_a_wrong_token_changes_nothing():
    core = make_core()
    started = start(core, ["a"])
    assert revoke(core, ["a"], [started.tokens[0] + 1], in_flight=[0]) == 0
    stats = core.stats(0.0)
    assert (stats.num_pending, stats.used_bytes, stats.quarantined) == (1, SLOT, 0)
    assert end(core, ["a"], started.tokens).ended == 1
    assert revoke(core, ["a"], started.tokens) == 0  # complete now: a revoke cannot take it back
    assert core.stats(0.0).num_objects == 1


def test_an_old_tokens_end_after_remove_and_reput_leaves_the_new_object_intact():
    core = make_core()
    sid = segment_id(core)
    first = start(core, ["k"])
    assert end(core, ["k"], first.tokens, 1.0, [0xAAAA]).ended == 1
    assert lease(core, ["k"], 1.0)[0] == 1  # a reader holds [0, 64) until 6.0
    assert core.handle(p.Remove("t", ["k"]), 2.0).count == 1
    second = start(core, ["k"], now_s=3.0)
    assert offsets(second) == [SLOT] and second.tokens[0] != first.tokens[0]
    assert end(core, ["k"], first.tokens, 4.0, [0xBAD]) == p.PutEndReply(ended=0, refused=[0])
    assert core.handle(p.Exists("t", ["k"]), 4.0).exists == [False]  # the old end did not complete it
    assert end(core, ["k"], second.tokens, 5.0, [0xBBBB]) == p.PutEndReply(ended=1, refused=[])
    assert lease(core, ["k"], 5.0) == (1, [[p.Replica(sid, SLOT, SLOT)]], [0xBBBB])
    assert end(core, ["k"], first.tokens, 6.0, [0xBAD]).refused == [0]
    assert lease(core, ["k"], 6.0) == (1, [[p.Replica(sid, SLOT, SLOT)]], [0xBBBB])


def test_a_quarantined_allocation_keeps_its_space_until_its_writer_ends_it():
    core = make_core(slots=2)
    started = start(core, ["a", "b"])
    assert offsets(started) == [0, SLOT]
    ta, tb = started.tokens
    assert revoke(core, ["a", "b"], [ta, tb], in_flight=[0]) == 2  # a's transfer may still land
    stats = core.stats(0.0)
    assert (stats.quarantined, stats.num_pending, stats.used_bytes) == (1, 0, SLOT)
    assert core.segments.by_id[segment_id(core)].allocator.free_ranges() == [(SLOT, SLOT)]
    big = start(core, ["big"], size=2 * SLOT)
    assert big.statuses == [NO_SPACE] and "pool full" in big.message
    again = start(core, ["a"])  # the key is free again, its old range is not
    assert offsets(again) == [SLOT]
    assert end(core, ["a"], [ta]).refused == [0]  # the quarantined write is not the object
    assert core.handle(p.EndQuarantine("t", [ta, tb, 12345]), 1.0).count == 1
    assert core.handle(p.EndQuarantine("t", [ta]), 1.0).count == 0
    assert core.stats(1.0).quarantined == 0
    assert offsets(start(core, ["c"], now_s=1.0)) == [0]


def test_a_quarantine_ends_at_its_time_limit_and_is_counted():
    core = make_core(slots=2, put_timeout_s=1000.0)
    started = start(core, ["a"], now_s=10.0)
    assert revoke(core, ["a"], started.tokens, in_flight=[0], now_s=10.0) == 1
    assert core.tick(59.9) == [] and core.stats(59.9).quarantined == 1
    assert core.tick(60.0) == ["1 quarantined writes freed after 50 s without word from their writer"]
    stats = core.stats(60.0)
    assert (stats.quarantined, stats.quarantine_expiries, stats.used_bytes) == (0, 1, 0)
    assert core.handle(p.EndQuarantine("t", started.tokens), 61.0).count == 0  # the writer reports too late
    assert offsets(start(core, ["b"], now_s=61.0, size=2 * SLOT)) == [0]


def test_a_quarantine_goes_with_the_segments_it_holds():
    core = make_core(slots=2)
    s1 = segment_id(core)
    s2 = core.handle(p.MountSegment("n2", "host", 2 * SLOT, 0, "agent-n2", b""), 0.0).segment_id
    started = start(core, ["a"], replicas=2)
    assert started.replicas == [[p.Replica(s1, 0, SLOT), p.Replica(s2, 0, SLOT)]]
    assert revoke(core, ["a"], started.tokens, in_flight=[0]) == 1
    assert core.handle(p.UnmountSegment(s1), 1.0).count == 1
    assert core.stats(1.0).quarantined == 1  # s2's copy may still be written
    assert core.segments.by_id[s2].allocator.free_ranges() == [(SLOT, SLOT)]
    assert core.handle(p.UnmountSegment(s2), 1.0).count == 1
    stats = core.stats(1.0)
    assert (stats.quarantined, stats.quarantine_expiries) == (0, 0)
    assert core.handle(p.EndQuarantine("t", started.tokens), 2.0).count == 0
    assert core.tick(100.0) == []


def test_ending_a_quarantine_after_one_of_its_segments_went_frees_the_rest():
    core = make_core(slots=2)
    s1 = segment_id(core)
    s2 = core.handle(p.MountSegment("n2", "host", 2 * SLOT, 0, "agent-n2", b""), 0.0).segment_id
    started = start(core, ["a"], replicas=2)
    revoke(core, ["a"], started.tokens, in_flight=[0])
    core.handle(p.UnmountSegment(s1), 1.0)
    assert core.handle(p.EndQuarantine("t", started.tokens), 2.0).count == 1
    assert core.segments.by_id[s2].allocator.free_ranges() == [(0, 2 * SLOT)]
    assert [(n.num_objects, n.used_bytes) for n in core.stats(2.0).nodes] == [(0, 0)]


def test_another_tenant_cannot_end_a_quarantine():
    core = make_core(slots=2)
    started = start(core, ["a"])
    revoke(core, ["a"], started.tokens, in_flight=[0])
    assert core.handle(p.EndQuarantine("other", started.tokens), 1.0).count == 0
    assert core.stats(1.0).quarantined == 1
