"""Eviction order on tiny pools: LRU, chain tails first, leased/pinned/pending skipped, the lease
hold cap (draining), and watermarks. Time is passed in; nothing sleeps."""

from kvpool.core import protocol as p
from kvpool.master import MasterConfig, MasterCore

SLOT = 64  # every object here takes one 64-byte slot


def make_core(slots=10, **overrides) -> MasterCore:
    config = {"alignment_bytes": SLOT, "node_ttl_s": 1000.0, "high_watermark": 0.9, "low_watermark": 0.5}
    core = MasterCore(MasterConfig(**{**config, **overrides}))
    core.handle(p.MountSegment("n1", "host", slots * SLOT, 0, "agent", b""), 0.0)
    return core


def put(core, keys, now_s, parents=None, pinned=False, end=True):
    parents = parents if parents is not None else [None] * len(keys)
    reply = core.handle(p.PutStart("t", keys, [SLOT] * len(keys), parents, 1, pinned), now_s)
    assert reply.statuses == [p.PUT_ALLOCATED] * len(keys), reply
    if end:
        ended = core.handle(p.PutEnd("t", keys, reply.tokens, [0] * len(keys)), now_s)
        assert ended == p.PutEndReply(ended=len(keys)), ended


def present(core, keys):
    return [k for k, e in zip(keys, core.handle(p.Exists("t", keys), 0.0).exists) if e]


def evict_one(core, now_s, keys):
    before = set(present(core, keys))
    core.pressure.evict(now_s, SLOT)
    gone = before - set(present(core, keys))
    assert len(gone) <= 1
    return gone.pop() if gone else None


def test_lru_above_high_watermark_a_put_evicts_its_share_and_the_tick_the_rest():
    core = make_core()
    keys = [f"k{i}" for i in range(10)]
    for i in range(9):
        put(core, [keys[i]], now_s=float(i))  # 9 of 10 slots: 0.9, not above the watermark
    assert core.stats(9.0).evictions == 0
    core.handle(p.LookupPrefix("t", ["k0"], lease=False), 9.0)  # k0 is used again
    put(core, ["k9"], now_s=10.0)  # 10/10 > 0.9: back under it (9) and two slots more (the put's bytes x 2)
    assert present(core, keys) == ["k0", "k4", "k5", "k6", "k7", "k8", "k9"]
    assert core.stats(10.0).used_bytes == 7 * SLOT
    core.tick(10.5)  # the timed work evicts on down to the low watermark (5 of 10)
    assert present(core, keys) == ["k0", "k6", "k7", "k8", "k9"]
    stats = core.stats(10.5)
    assert (stats.evictions, stats.evicted_bytes, stats.used_bytes) == (5, 5 * SLOT, 5 * SLOT)


def test_eviction_work_per_call_is_bounded_on_a_full_pool(monkeypatch):
    """A put evicts back under the high watermark plus at most twice its bytes; the way down to the
    low watermark goes in slices (idle work, ticks), whatever the gap between the watermarks: no
    call holds the master's one thread for a batch of evictions."""
    import kvpool.master.core as master_core
    from kvpool.master.eviction import PUT_EVICTION_FACTOR

    monkeypatch.setattr(master_core, "EVICTION_SLICE_BYTES", 20 * SLOT)
    core = make_core(slots=1000, high_watermark=0.99, low_watermark=0.5)
    for i in range(990):
        put(core, [f"k{i}"], now_s=i / 100)
    assert not core.has_idle_work
    for i in range(990, 1100):  # saturated (no idle work): every put evicts about its own size
        before = core.stats(i / 100).evictions
        put(core, [f"k{i}"], now_s=i / 100)
        assert core.stats(i / 100).evictions - before <= 1 + PUT_EVICTION_FACTOR
        assert core.stats(i / 100).used_bytes <= 990 * SLOT
    assert core.has_idle_work
    evicted = core.stats(20.0).evictions
    core.tick(20.0)
    assert core.stats(20.0).evictions - evicted == 20  # one slice of bytes
    core.pressure.evict_slice(20.0, 1 << 30, max_objects=5)
    assert core.stats(20.0).evictions - evicted == 25  # one slice of a count
    assert core.has_idle_work  # the count ended it, not a lack of candidates
    for _ in range(30):
        if core.has_idle_work:
            before = core.stats(20.0).evictions
            core.idle_work(20.0)
            assert core.stats(20.0).evictions - before <= 20
    assert core.stats(20.0).used_bytes == 500 * SLOT and not core.has_idle_work  # the low watermark
    core.tick(21.0)
    core.idle_work(21.0)
    assert core.stats(21.0).used_bytes == 500 * SLOT  # and no further


def test_idle_work_stops_when_nothing_more_can_be_evicted():
    core = make_core(slots=10, lease_ttl_s=5.0, max_lease_hold_s=20.0)
    keys = [f"k{i}" for i in range(10)]
    put(core, keys[:9], now_s=0.0)
    core.handle(p.LookupPrefix("t", keys[:9], lease=True), 1.0)  # every object leased until 6.0
    put(core, ["k9"], now_s=2.0)  # above the high watermark, and k9 was pending when its put evicted
    assert not core.has_idle_work  # nothing evictable: no busy loop of empty slices
    assert present(core, keys) == keys
    core.idle_work(3.0)  # still above the high watermark: k9 is complete now, the only one that can go
    assert present(core, keys) == keys[:9]
    assert not core.has_idle_work
    core.idle_work(4.0)
    assert present(core, keys) == keys[:9]  # 0.9 is not above the watermark: nothing starts again


def test_chains_are_evicted_from_the_tail_even_when_the_head_is_older():
    core = make_core(slots=20)
    put(core, ["a", "b", "c"], now_s=0.0, parents=[None, "a", "b"])  # one batch: equal access times
    put(core, ["x"], now_s=1.0)
    put(core, ["d", "e"], now_s=2.0, parents=[None, "d"])
    keys = ["a", "b", "c", "x", "d", "e"]
    order = [evict_one(core, 10.0, keys) for _ in range(6)]
    assert order == ["c", "b", "a", "x", "e", "d"]


def test_a_prefix_with_a_pending_child_is_not_evicted():
    core = make_core(slots=20)
    put(core, ["a"], now_s=0.0)
    put(core, ["b"], now_s=1.0, parents=["a"], end=False)  # being written
    put(core, ["z"], now_s=2.0)
    assert evict_one(core, 5.0, ["a", "b", "z"]) == "z"
    assert evict_one(core, 5.0, ["a", "b", "z"]) is None


def test_leased_pinned_and_pending_objects_are_skipped():
    core = make_core(slots=20, lease_ttl_s=5.0, max_lease_hold_s=20.0)
    put(core, ["pinned"], now_s=0.0, pinned=True)
    put(core, ["pending"], now_s=0.0, end=False)
    put(core, ["leased", "plain"], now_s=1.0)
    core.handle(p.LookupPrefix("t", ["leased"], lease=True), 2.0)  # leased until 7.0
    core.handle(p.LookupPrefix("t", ["plain"], lease=False), 3.0)  # newer, but not leased
    keys = ["pinned", "pending", "leased", "plain"]
    assert evict_one(core, 4.0, keys) == "plain"
    assert evict_one(core, 4.0, keys) is None  # the leased one waits for its lease
    assert evict_one(core, 7.0, keys) == "leased"
    assert evict_one(core, 100.0, keys) is None
    assert present(core, keys) == ["pinned"]  # pending is not visible to exists, but still held
    assert core.stats(100.0).num_pending == 1


def test_exists_and_counting_lookups_do_not_protect_from_eviction():
    core = make_core(slots=20)
    put(core, ["a", "b"], now_s=0.0)
    core.handle(p.Exists("t", ["a"]), 5.0)
    core.handle(p.LookupPrefix("t", ["b"], lease=False), 5.0)
    assert evict_one(core, 5.0, ["a", "b"]) == "a"  # exists is no use: a is older
    assert evict_one(core, 5.0, ["a", "b"]) == "b"


def test_an_object_leased_past_the_hold_cap_drains_when_eviction_wants_it():
    core = make_core(slots=20, lease_ttl_s=5.0, max_lease_hold_s=10.0)
    put(core, ["hot", "young"], now_s=0.0)
    for t in range(0, 13, 2):
        core.handle(p.LookupPrefix("t", ["hot"]), float(t))  # renewed without a break since 0
    core.handle(p.LookupPrefix("t", ["young"]), 11.0)  # leased for 1 s only
    assert evict_one(core, 12.0, ["hot", "young"]) is None  # both leased
    # hot has been held 12 s >= 10 s: it takes no new lease; young is untouched
    assert core.handle(p.LookupPrefix("t", ["hot"]), 13.0).num_hit == 0
    assert core.handle(p.LookupPrefix("t", ["hot"], lease=False), 13.0).num_hit == 1
    assert core.handle(p.LookupPrefix("t", ["young"]), 13.0).num_hit == 1
    assert evict_one(core, 16.9, ["hot", "young"]) is None  # hot's last lease runs to 17.0
    assert evict_one(core, 17.0, ["hot", "young"]) == "hot"


def test_a_drained_object_is_leasable_again_when_eviction_did_not_take_it():
    core = make_core(slots=20, lease_ttl_s=5.0, max_lease_hold_s=5.0)
    put(core, ["a"], now_s=0.0)
    core.handle(p.LookupPrefix("t", ["a"]), 0.0)
    core.handle(p.LookupPrefix("t", ["a"]), 4.0)  # leased until 9.0, held since 0
    core.pressure.evict(6.0, SLOT)  # wants it: drained
    assert core.handle(p.LookupPrefix("t", ["a"]), 9.0).num_hit == 0
    assert core.handle(p.LookupPrefix("t", ["a"]), 13.9).num_hit == 0  # eviction's window: one TTL
    assert core.handle(p.LookupPrefix("t", ["a"]), 14.0).num_hit == 1


def test_a_full_pool_of_leased_objects_refuses_puts_until_leases_end():
    core = make_core(slots=4, lease_ttl_s=5.0)
    put(core, ["a", "b", "c", "d"], now_s=0.0)
    core.handle(p.LookupPrefix("t", ["a", "b", "c", "d"]), 1.0)
    reply = core.handle(p.PutStart("t", ["e"], [SLOT], [None]), 2.0)
    assert reply.statuses == [p.PUT_NO_SPACE] and "pool full" in reply.message
    reply = core.handle(p.PutStart("t", ["e"], [SLOT], [None]), 6.0)
    assert reply.statuses == [p.PUT_ALLOCATED]
    stats = core.stats(6.0)
    assert stats.evictions >= 1 and stats.lease_expiries >= 1


def test_lease_expiries_and_grants_are_counted():
    core = make_core(lease_ttl_s=5.0)
    put(core, ["a"], now_s=0.0)
    core.handle(p.LookupPrefix("t", ["a"]), 0.0)
    core.handle(p.LookupPrefix("t", ["a"]), 1.0)  # renewal within the lease: same grant
    core.handle(p.LookupPrefix("t", ["a"]), 10.0)  # the first lease ran out at 6.0
    stats = core.stats(10.0)
    assert (stats.lease_grants, stats.lease_expiries) == (2, 1)


def test_tick_evicts_once_leases_that_blocked_eviction_have_ended():
    core = make_core(slots=10, lease_ttl_s=5.0)
    keys = [f"k{i}" for i in range(10)]
    put(core, keys[:9], now_s=0.0)
    for i in range(9):
        core.handle(p.LookupPrefix("t", [keys[i]]), 1.0 + i / 100)  # leased until 6.0x, in key order
    put(core, ["k9"], now_s=2.0)  # 10/10 > 0.9, but only k9 could go, and it is pending
    core.handle(p.LookupPrefix("t", ["k9"]), 2.0)  # leased until 7.0
    core.tick(5.9)
    assert core.stats(5.9).evictions == 0
    core.tick(6.05)  # k0..k4 are out of their leases (6.00..6.04), k5.. are not
    stats = core.stats(6.05)
    assert (stats.evictions, stats.used_bytes) == (5, 5 * SLOT)
    assert present(core, keys) == keys[5:]


def test_eviction_for_a_put_spares_the_prefix_that_put_extends():
    core = make_core(slots=2, high_watermark=1.0)
    put(core, ["head"], now_s=0.0)
    put(core, ["other"], now_s=1.0)
    core.handle(p.LookupPrefix("t", ["other"], lease=False), 2.0)  # head is the LRU one
    reply = core.handle(p.PutStart("t", ["tail"], [SLOT], ["head"]), 3.0)
    assert reply.statuses == [p.PUT_ALLOCATED]
    assert present(core, ["head", "other"]) == ["head"]  # "other" went, although newer
    assert core.index.tenants["t"]["tail"].parent is core.index.tenants["t"]["head"]


def test_the_master_core_leaves_no_cyclic_garbage():
    """What `kvpool master` relies on when it freezes the collector each tick (service.py): a mix of
    requests (puts, reads, leases, removals, refusals, inline values, eviction, ticks) makes no
    reference cycles, so everything it drops is freed by reference count, frozen or not."""
    import gc

    core = make_core(slots=20, lease_ttl_s=1.0)
    gc.collect()
    gc.disable()
    try:
        for n in range(60):
            keys = [f"s{n % 5}/{n}/{i}" for i in range(3)]
            put(core, keys, now_s=n, parents=[None, keys[0], keys[1]])
            leased = core.handle(p.LookupPrefix("t", keys, lease=True), n + 0.1)
            core.handle(p.ReleaseLeases("t", [leased.lease_id]), n + 0.2)
            core.handle(p.LookupPrefix("t", keys + ["missing"], lease=False), n + 0.3)
            core.handle(p.PutStart("t", ["bad"], [0], [None]), n + 0.4)  # refused: a UsageError inside
            core.handle(p.PutValue("t", f"v{n}", b"x" * 100), n + 0.5)
            core.handle(p.GetValue("t", f"v{n}"), n + 0.6)
            if n % 7 == 0:
                core.handle(p.Remove("t", keys[2:]), n + 0.7)
            core.idle_work(n + 0.8)
            core.tick(n + 0.9)
        assert core.stats(60.0).evictions > 0
        assert gc.collect() == 0
    finally:
        gc.enable()
