"""PutEnd with `landing` and PutLanded on MasterCore with a fake clock (client/landing.py's master
side): an end sent while its bytes travel checks, renames and keeps the checksum, but the object is
a miss (and an existing key for other writers) until PutLanded names it with its token; a landing
never sent leaves it to the put timeout's reclaim; a revoke frees it; nothing but the right token
lands it, and only once."""

from kvpool.core import protocol as p
from test_master_ahead import EXISTS, SLOT, hits, make_core, start


def landing_end(core, keys, tokens, now_s=0.5, **extra) -> p.PutEndReply:
    reply = core.handle(p.PutEnd("t", keys, list(tokens), [0xC0 + i for i in range(len(keys))], landing=True,
                                 **extra), now_s)
    assert isinstance(reply, p.PutEndReply), reply
    return reply


def landed(core, keys, tokens, now_s=0.6) -> int:
    return core.handle(p.PutLanded("t", keys, list(tokens)), now_s).count


def directory_keys(core) -> list[str]:
    segment = next(iter(core.segments.by_id.values()))
    return [op.key for op in segment.log.ops if op.size]


def test_an_object_ended_while_landing_is_a_miss_until_its_landing_then_an_ordinary_object():
    core = make_core()
    put = start(core, ["a", "b"])
    assert put.lands  # this master says it takes landing ends
    reply = landing_end(core, ["a", "b"], put.tokens)
    assert (reply.ended, reply.refused, reply.existed) == (2, [], [])
    assert hits(core, ["a"])[0] == 0
    assert core.handle(p.Exists("t", ["a", "b"]), 0.6).exists == [False, False]
    assert start(core, ["a"]).statuses == [EXISTS]  # another writer cannot put it meanwhile
    # its node is told at the end, so the end's reply can wait for it while the bytes travel: a crash
    # after the put returns loses nothing (a node announcing it before its bytes landed is a checksum miss)
    assert directory_keys(core) == ["a", "b"]
    stats = core.stats(0.6)
    assert (stats.num_objects, stats.num_pending, stats.puts) == (0, 2, 0)
    assert landed(core, ["a", "b"], put.tokens) == 2
    assert hits(core, ["a", "b"]) == (2, [r[0].offset for r in put.replicas], [0xC0, 0xC1])
    assert directory_keys(core) == ["a", "b"]  # not logged again: the checksums came with the end
    stats = core.stats(1.0)
    assert (stats.num_objects, stats.num_pending, stats.puts, stats.landed) == (2, 0, 2, 1 * 2)
    # landed once: a second landing, or an end of a landed object, is refused and changes nothing
    assert landed(core, ["a"], put.tokens[:1]) == 0
    assert landing_end(core, ["a"], put.tokens[:1]).refused == [0]
    assert core.stats(1.0).refused_landings == 1


def test_only_the_allocations_own_token_lands_it_and_a_plain_end_never_needs_a_landing():
    core = make_core()
    put = start(core, ["a", "b"])
    landing_end(core, ["a"], put.tokens[:1])
    assert landed(core, ["a"], [put.tokens[0] + 1]) == 0  # another token
    assert landed(core, ["b"], put.tokens[1:]) == 0  # pending, but not ended while landing
    assert hits(core, ["a"])[0] == 0
    assert core.stats(1.0).refused_landings == 2
    assert core.handle(p.PutEnd("t", ["b"], put.tokens[1:], [0]), 1.0).ended == 1  # the usual end
    assert hits(core, ["b"])[0] == 1
    assert landing_end(core, ["a"], put.tokens[:1]).refused == [0]  # ended once already, while landing


def test_a_landing_that_never_comes_leaves_the_object_to_the_put_timeout_and_a_revoke_frees_it_at_once():
    core = make_core(slots=2)
    put = start(core, ["lost", "failed"])
    landing_end(core, ["lost", "failed"], put.tokens)
    # the write of "failed" failed after its end was sent: revoked, its space free at once
    assert core.handle(p.PutRevoke("t", ["failed"], put.tokens[1:]), 0.7).count == 1
    assert start(core, ["next"], 0.8).statuses == [p.PUT_ALLOCATED]
    core.tick(5.0)
    assert core.stats(5.0).num_pending == 2  # "lost" and "next": within the put timeout
    core.tick(10.5)  # past put_timeout_s (10 s) from "lost"'s PutStart
    assert core.stats(10.5).num_pending == 1
    assert landed(core, ["lost"], put.tokens[:1], 10.6) == 0  # too late: reclaimed, never readable
    assert hits(core, ["lost"], 10.7)[0] == 0


def test_an_allocation_ended_ahead_while_landing_is_renamed_at_once_and_readable_on_landing():
    core = make_core()
    slot = start(core, ["ahead:0"])
    reply = landing_end(core, ["ahead:0"], slot.tokens, as_keys=["real"], ahead=["ahead:1"], ahead_sizes=[SLOT])
    assert (reply.ended, reply.existed) == (1, [])
    assert reply.ahead.statuses == [p.PUT_ALLOCATED] and reply.ahead.lands
    assert start(core, ["real"]).statuses == [EXISTS]
    assert hits(core, ["real"])[0] == 0
    assert landed(core, ["ahead:0"], slot.tokens) == 0  # the old name: no longer pending there
    assert landed(core, ["real"], slot.tokens) == 1
    assert hits(core, ["real"])[:2] == (1, [slot.replicas[0][0].offset])
    # a key that exists: the allocation stays pending under its own name, not landing, given back as usual
    other = start(core, ["ahead:2"])
    reply = landing_end(core, ["ahead:2"], other.tokens, as_keys=["real"])
    assert (reply.ended, reply.existed) == (0, [0])
    assert landed(core, ["ahead:2"], other.tokens) == 0
    assert core.handle(p.PutRevoke("t", ["ahead:2"], other.tokens), 1.0).count == 1


def test_a_landing_may_bring_the_checksums_its_end_went_without():
    """A plain put hashes its value while the bytes travel (plain_values.py): its PutEnd carries no
    checksum and its PutLanded does. The object is readable with that checksum, in the node's
    directory too; 0 keeps the end's; a landing with the wrong number of checksums, or one out of
    range, is refused whole and lands nothing."""
    core = make_core()
    put = start(core, ["a", "b", "c"])
    reply = core.handle(p.PutEnd("t", ["a", "b", "c"], put.tokens, [0, 0, 0xC2], landing=True), 0.5)
    assert reply.ended == 3
    for bad in ([7], [7, 8, 1 << 64], [7, -1, 9]):
        refused = core.handle(p.PutLanded("t", ["a", "b", "c"], put.tokens, bad), 0.6)
        assert isinstance(refused, p.ErrorReply) and ("checksum" in refused.message or "must match" in refused.message)
    assert hits(core, ["a"])[0] == 0  # nothing landed by a refused PutLanded
    assert core.handle(p.PutLanded("t", ["a", "b", "c"], put.tokens, [0xA0, 0xB0, 0]), 0.6).count == 3
    assert hits(core, ["a", "b", "c"])[2] == [0xA0, 0xB0, 0xC2]
    segment = next(iter(core.segments.by_id.values()))
    assert {op.key: op.checksum for op in segment.log.ops if op.size} == {"a": 0xA0, "b": 0xB0, "c": 0xC2}
