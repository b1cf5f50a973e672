"""PutEnd's `as_keys` and `ahead` on MasterCore with a fake clock (client/ahead.py's master side): an
allocation pending under one key is ended under another, unless that key exists (then it stays
pending, its token unchanged); `ahead` allocates afresh after the ends; a malformed `ahead` is
refused before anything ends."""

import pytest

from kvpool.core import protocol as p
from kvpool.master import MasterConfig, MasterCore
from kvpool.master.quotas import QuotaTable, TenantQuota

SLOT = 64
ALLOC, EXISTS = p.PUT_ALLOCATED, p.PUT_EXISTS


def make_core(slots=4, **overrides) -> MasterCore:
    core = MasterCore(MasterConfig(alignment_bytes=SLOT, node_ttl_s=1000.0, put_timeout_s=10.0, lease_ttl_s=5.0,
                                   **overrides))
    handle = core.handle
    core.handle = lambda req, now_s: p.reply_decoder.decode(p.reply_encoder.encode(handle(req, now_s)))
    core.handle(p.MountSegment("n1", "host", slots * SLOT, 0, "agent-n1", b""), 0.0)
    return core


def start(core, keys, now_s=0.0) -> p.PutStartReply:
    reply = core.handle(p.PutStart("t", keys, [SLOT] * len(keys), [None] * len(keys)), now_s)
    assert isinstance(reply, p.PutStartReply), reply
    return reply


def hits(core, keys, now_s=1.0):
    reply = core.handle(p.LookupPrefix("t", keys, lease=True), now_s)
    return reply.num_hit, [r[0].offset for r in reply.replica_lists()], p.unpack_checksums(reply.checksums)


def test_an_allocation_ended_under_another_key_is_read_there_with_its_bytes_range_and_checksum():
    core = make_core()
    slot = start(core, ["ahead:0"])
    offset = slot.replicas[0][0].offset
    reply = core.handle(p.PutEnd("t", ["ahead:0"], list(slot.tokens), [0xABC], as_keys=["real"]), 0.5)
    assert (reply.ended, reply.refused, reply.existed, reply.ahead) == (1, [], [], None)
    assert hits(core, ["real"]) == (1, [offset], [0xABC])
    assert hits(core, ["ahead:0"])[0] == 0
    assert core.handle(p.Exists("t", ["ahead:0", "real"]), 1.0).exists == [False, True]
    # the renamed object is an ordinary one: a second end of the old name is refused, a put of it exists
    again = core.handle(p.PutEnd("t", ["ahead:0"], list(slot.tokens), [0xABC], as_keys=["other"]), 1.0)
    assert (again.ended, again.refused) == (0, [0])
    assert start(core, ["real"]).statuses == [EXISTS]
    stats = core.stats(1.0)
    assert (stats.num_objects, stats.num_pending) == (1, 0)


def test_an_end_under_a_key_that_exists_leaves_the_allocation_pending_and_usable():
    core = make_core()
    first = start(core, ["real"])
    core.handle(p.PutEnd("t", ["real"], list(first.tokens), [0x1]), 0.0)
    slot = start(core, ["ahead:0"])
    reply = core.handle(p.PutEnd("t", ["ahead:0"], list(slot.tokens), [0x2], as_keys=["real"]), 0.5)
    assert (reply.ended, reply.refused, reply.existed) == (0, [], [0])
    assert hits(core, ["real"])[2] == [0x1]  # the first writer's object is untouched
    used = core.handle(p.PutEnd("t", ["ahead:0"], list(slot.tokens), [0x3], as_keys=["second"]), 0.6)
    assert (used.ended, used.existed) == (1, [])
    assert hits(core, ["second"]) == (1, [slot.replicas[0][0].offset], [0x3])


def test_ahead_allocates_after_the_ends_and_an_unused_one_is_reclaimed_after_ahead_timeout_s():
    core = make_core()
    slot = start(core, ["ahead:0"])
    reply = core.handle(p.PutEnd("t", ["ahead:0"], list(slot.tokens), [0x5], as_keys=["a"], ahead=["ahead:1"],
                                 ahead_sizes=[SLOT]), 0.5)
    assert reply.ended == 1 and reply.ahead is not None and reply.ahead.statuses == [ALLOC]
    assert reply.ahead.tokens[0] not in (0, slot.tokens[0])
    assert reply.ahead.put_timeout_s == 1.0  # ahead_timeout_s: an unused allocation is not held for long
    assert reply.ahead.replicas[0][0].offset != slot.replicas[0][0].offset
    core.tick(1.0)
    assert core.stats(1.0).num_pending == 1
    core.tick(1.6)  # never ended: reclaimed, its space free again, and not counted as a writer that died
    stats = core.stats(1.6)
    assert (stats.num_pending, stats.ahead_expired, core.writes.reclaimed) == (0, 1, 0)
    late = core.handle(p.PutEnd("t", ["ahead:1"], list(reply.ahead.tokens), [0x6], as_keys=["b"]), 1.7)
    assert (late.ended, late.refused) == (0, [0])
    assert hits(core, ["a"], 2.0)[0] == 1 and core.stats(2.0).num_objects == 1


@pytest.mark.parametrize("ahead, sizes, replicas", [(["x"], [], 1), (["x"], [0], 1), (["x"], [SLOT], 0), ([""], [SLOT], 1)])
def test_a_malformed_ahead_is_refused_before_anything_ends(ahead, sizes, replicas):
    core = make_core()
    slot = start(core, ["ahead:0"])
    reply = core.handle(p.PutEnd("t", ["ahead:0"], list(slot.tokens), [0x5], as_keys=["a"], ahead=ahead,
                                 ahead_sizes=sizes, ahead_replicas=replicas), 0.5)
    assert isinstance(reply, p.ErrorReply) and reply.kind == "usage"
    assert hits(core, ["a"])[0] == 0
    ok = core.handle(p.PutEnd("t", ["ahead:0"], list(slot.tokens), [0x5], as_keys=["a"]), 0.6)
    assert ok.ended == 1


def test_as_keys_must_match_the_keys():
    core = make_core()
    slot = start(core, ["ahead:0"])
    reply = core.handle(p.PutEnd("t", ["ahead:0"], list(slot.tokens), [0x5], as_keys=["a", "b"]), 0.5)
    assert isinstance(reply, p.ErrorReply) and reply.kind == "usage"


def test_a_tenant_at_its_quota_gets_no_allocation_ahead_and_evicts_nothing_for_one():
    core = make_core(quotas=QuotaTable({"t": TenantQuota(2 * SLOT, None)}, None, frozenset()))
    first = start(core, ["a"])
    reply = core.handle(p.PutEnd("t", ["a"], list(first.tokens), [0x1], ahead=["ahead:0"], ahead_sizes=[SLOT]), 0.1)
    assert reply.ended == 1 and reply.ahead.statuses == [ALLOC]  # a + the held one: at the quota
    used = core.handle(p.PutEnd("t", ["ahead:0"], list(reply.ahead.tokens), [0x2], as_keys=["b"],
                                ahead=["ahead:1"], ahead_sizes=[SLOT]), 0.2)
    assert used.ended == 1 and used.ahead.statuses == [p.PUT_NO_SPACE]  # would evict "a" early: not asked to
    assert core.handle(p.Exists("t", ["a", "b"]), 0.3).exists == [True, True]
    tenant = {t.tenant: t for t in core.stats(0.3).tenants}["t"]
    assert (tenant.num_objects, tenant.quota_evictions, tenant.quota_refusals) == (2, 0, 0)
    assert start(core, ["c"], 0.4).statuses == [ALLOC]  # a put itself still evicts its tenant's own
    assert {t.tenant: t for t in core.stats(0.4).tenants}["t"].quota_evictions == 1



def test_allocations_ahead_take_free_space_only_and_never_evict():
    core = make_core(slots=4)
    full = start(core, ["a", "b", "c", "d"])
    reply = core.handle(p.PutEnd("t", ["a", "b", "c"], full.tokens[:3], [0x1, 0x2, 0x3]), 0.1)
    assert reply.ended == 3
    asked = core.handle(p.PutEnd("t", ["d"], full.tokens[3:], [0x4], ahead=["ahead:0"], ahead_sizes=[SLOT]), 0.2)
    assert asked.ended == 1 and asked.ahead.statuses == [p.PUT_NO_SPACE]  # the pool is full: nothing evicted for it
    assert core.handle(p.Exists("t", ["a", "b", "c", "d"]), 0.3).exists == [True] * 4
    assert start(core, ["e"], 0.4).statuses == [ALLOC]  # a put itself still evicts
    assert core.handle(p.Exists("t", ["a", "b", "c", "d"]), 0.5).exists.count(True) < 4
