"""What the master reports held and forgotten (pool_events.py), driven through MasterCore with time
passed in: completions, landings, evictions, removals, recovery; batches and snapshots agree with
the index, and nothing is recorded while nobody follows."""

import msgspec

from kvpool.core import protocol as p
from kvpool.master import MasterConfig, MasterCore
from kvpool.master.pool_events import PoolEvents
from kvpool.node.directory import NodeDirectory

SLOT = 64
EPOCH = (3 << 32) | 1


def make_core(slots=10, **overrides) -> MasterCore:
    config = {"alignment_bytes": SLOT, "node_ttl_s": 1000.0, "put_timeout_s": 1000.0, "high_watermark": 0.9,
              "low_watermark": 0.5, **overrides}
    core = MasterCore(MasterConfig(**config), epoch=EPOCH)
    core.index.events.start()
    core.handle(p.MountSegment("n1", "host", slots * SLOT, 0, "agent", b""), 0.0)
    return core


def put(core, keys, now_s=0.0, tenant="t", parents=None, landing=False, checksum=0):
    parents = parents if parents is not None else [None] + keys[:-1]
    reply = core.handle(p.PutStart(tenant, keys, [SLOT] * len(keys), parents, 1, False), now_s)
    assert reply.statuses == [p.PUT_ALLOCATED] * len(keys), reply
    ended = core.handle(p.PutEnd(tenant, keys, reply.tokens, [checksum] * len(keys), landing=landing), now_s)
    assert ended.ended == len(keys), ended
    return reply


def take(core) -> dict[str, tuple[list[str], list[str]]]:
    batch = core.index.events.take(core.epoch)
    if batch is None:
        return {}
    return {c.tenant: (sorted(c.stored), sorted(c.removed)) for c in batch.changes}


def held(core, tenant="t") -> list[str]:
    offer = core.index.events.snapshot("tcp://x:1", core.epoch, core.index.tenants, tenant)
    return sorted(k for entry in offer.held for k in entry.keys)


def test_a_completed_put_is_stored_a_pending_one_is_not():
    core = make_core()
    reply = core.handle(p.PutStart("t", ["a"], [SLOT], [None], 1, False), 0.0)
    assert take(core) == {}  # pending: not readable yet
    core.handle(p.PutEnd("t", ["a"], reply.tokens, [0]), 0.0)
    put(core, ["b", "c"], tenant="u")
    assert take(core) == {"t": (["a"], []), "u": (["b", "c"], [])}
    assert take(core) == {}  # a batch is cut once


def test_batches_are_numbered_and_carry_the_epoch():
    core = make_core()
    put(core, ["a"])
    first = core.index.events.take(core.epoch)
    put(core, ["b"])
    second = core.index.events.take(core.epoch)
    assert (first.epoch, first.seq, second.seq) == (EPOCH, 1, 2)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(second), type=p.PoolEventBatch) == second


def test_landing_objects_are_stored_when_they_land():
    core = make_core()
    reply = put(core, ["a"], landing=True)
    assert take(core) == {}
    core.handle(p.PutLanded("t", ["a"], reply.tokens), 0.0)
    assert take(core) == {"t": (["a"], [])}


def test_eviction_and_removal_are_removals_and_the_net_change_is_sent():
    core = make_core(slots=10)
    keys = [f"k{i}" for i in range(9)]
    for i, k in enumerate(keys):
        put(core, [k], now_s=float(i), parents=[None])
    take(core)
    put(core, ["k9"], now_s=9.0, parents=[None])  # above the high watermark: evicts the oldest
    stored, removed = take(core)["t"]
    assert stored == ["k9"] and removed and set(removed) <= set(keys)
    assert held(core) == sorted(set(keys + ["k9"]) - set(removed))
    core.handle(p.Remove("t", ["k9"]), 10.0)
    assert take(core) == {"t": ([], ["k9"])}
    # stored and removed before the batch is cut: once, as its end state
    put(core, ["x"], now_s=11.0, parents=[None])
    core.handle(p.Remove("t", ["x"]), 11.0)
    assert take(core) == {"t": ([], ["x"])}


def test_nothing_is_recorded_while_nobody_follows():
    core = make_core()
    core.index.events.stop()
    put(core, ["a", "b"])
    core.handle(p.Remove("t", ["a"]), 1.0)
    assert core.index.events.changes == {} and core.index.events.take(core.epoch) is None
    core.index.events.start()
    assert held(core) == ["b"]  # a new follower starts from the snapshot


def test_a_snapshot_needs_the_pending_batch_cut_first():
    events = PoolEvents()
    events.start()
    events.stored("t", "a")
    try:
        events.snapshot("tcp://x:1", EPOCH, {})
    except RuntimeError:
        pass
    else:
        raise AssertionError("a snapshot with uncut changes must refuse")
    assert events.take(EPOCH).seq == 1
    assert events.snapshot("tcp://x:1", EPOCH, {}).seq == 1


def test_objects_announced_to_a_new_master_are_stored():
    a = make_core(slots=16, high_watermark=1.0)
    directory = NodeDirectory()
    put(a, ["a", "b", "c"], checksum=0xC0FFEE)  # a node's directory serves only checksummed objects
    reply = a.handle(p.Heartbeat("n1", [next(iter(a.segments.by_id))], [0]), 1.0)
    for delta in reply.deltas:
        directory.apply(delta, 1.0)
    b = MasterCore(a.config, epoch=EPOCH + 1)
    b.index.events.start()
    mount = b.handle(p.MountSegment("n1", "host", 16 * SLOT, 0, "agent", b"", recovering=True), 2.0)
    directory.new_mount()
    entries, ages = directory.oldest_first(2.0)
    answer = b.handle(p.AnnounceObjects(mount.segment_id, entries, ages, True), 2.0)
    assert answer.accepted == 3
    batch = b.index.events.take(b.epoch)
    assert batch.epoch == EPOCH + 1 and batch.seq == 1
    assert {c.tenant: sorted(c.stored) for c in batch.changes} == {"t": ["a", "b", "c"]}
