"""Disk tiers in the master (pure): a tiny pool of 4 DRAM slots with a disk tier of 6 slots,
driven through MasterCore with a fake clock and a fake node that answers like a real one
(writes back what it is told, promotes on request). Exact placement and eviction order."""

from kvpool.core import protocol as p
from kvpool.master import MasterConfig, MasterCore
from kvpool.master.records import PROMOTING

SLOT = 64
DISK_SLOT = 8192  # what one 64-byte object takes on disk (a 4 KiB header + one 4 KiB block)


def make_core(**overrides) -> MasterCore:
    config = {"alignment_bytes": SLOT, "node_ttl_s": 1000.0, "put_timeout_s": 1000.0, "lease_ttl_s": 5.0,
              "max_lease_hold_s": 5.0, "high_watermark": 1.0, "low_watermark": 0.5, **overrides}
    core = MasterCore(MasterConfig(**config), epoch=(3 << 32) | 1)
    handle = core.handle
    core.handle = lambda req, now_s: p.reply_decoder.decode(p.reply_encoder.encode(handle(req, now_s)))
    return core


class FakeNode:
    """Heartbeats like node/service.py + node/tier.py: writes back every committed object (unless
    told to skip some), does promotions and drops, and reports them."""

    def __init__(self, core: MasterCore, dram_slots=4, disk_slots=6, node_id="n0", tenant="") -> None:
        self.core = core
        self.node_id = node_id
        msg = p.MountSegment(node_id, "host", dram_slots * SLOT, 0, f"agent-{node_id}", b"",
                             disk_bytes=disk_slots * DISK_SLOT, tenant=tenant)
        self.segment_id = core.handle(msg, 0.0).segment_id
        self.applied = 0
        self.disk: dict[str, int] = {}  # key -> checksum
        self.skip_writes: set[str] = set()
        self.fail_promotions: set[str] = set()
        self.report = p.TierReport(self.segment_id)

    def sync(self, now_s: float, rounds: int = 3) -> None:
        for _ in range(rounds):
            reply = self.core.handle(p.Heartbeat(self.node_id, [self.segment_id], [self.applied], [self.report]), now_s)
            self.report = p.TierReport(self.segment_id)
            written, promoted, failed, lost = [], [], [], []
            for delta in reply.deltas:
                for op in delta.ops[max(0, self.applied + 1 - delta.first_seq):]:
                    if op.op == p.DIR_COMMIT and op.size and op.key not in self.skip_writes:
                        self.disk[op.key] = op.checksum
                        written.append(p.DiskEntry(op.tenant, op.key, op.size, op.checksum, op.parent))
                    elif op.op == p.DIR_PROMOTE:
                        if op.key in self.fail_promotions or self.disk.get(op.key) != op.checksum:
                            self.disk.pop(op.key, None)
                            failed.append(op.offset)
                            lost.append(p.DiskEntry(op.tenant, op.key, op.size, op.checksum))
                        else:
                            promoted.append(op.offset)
                    elif op.op == p.DIR_DISK_DROP:
                        if self.disk.get(op.key) == op.checksum:
                            del self.disk[op.key]
                self.applied = delta.first_seq + len(delta.ops) - 1
            self.report = p.TierReport(self.segment_id, written, lost, promoted, failed)


def put_chain(core, keys, now_s, parent=None):
    parents = [parent, *keys[:-1]]
    started = core.handle(p.PutStart("t", keys, [SLOT] * len(keys), parents), now_s)
    assert started.statuses == [p.PUT_ALLOCATED] * len(keys), started
    checksums = [1000 + i for i in range(len(keys))]
    assert core.handle(p.PutEnd("t", keys, started.tokens, checksums), now_s).ended == len(keys)
    return started


def lookup(core, keys, now_s, lease=True):
    reply = core.handle(p.LookupPrefix("t", keys, lease=lease), now_s)
    if reply.lease_id:
        core.handle(p.ReleaseLeases("t", [reply.lease_id]), now_s)
    return reply


def where(core, key) -> str:
    rec = core.index.tenants["t"].get(key)
    if rec is None:
        return "gone"
    if rec.locations:
        return "dram+disk" if rec.disk_segment is not None else "dram"
    return "promoting" if rec.flags & PROMOTING else "disk"


def test_eviction_demotes_to_disk_tails_first_and_lookups_promote_back():
    core = make_core()
    node = FakeNode(core)
    put_chain(core, ["a0", "a1"], 1.0)
    put_chain(core, ["b0", "b1"], 2.0)
    node.sync(2.5)
    assert [where(core, k) for k in ("a0", "a1", "b0", "b1")] == ["dram+disk"] * 4
    tier = core.index.tiers.by_segment[node.segment_id]
    assert (tier.used_bytes, tier.num_objects) == (4 * DISK_SLOT, 4)
    # DRAM is full: two new objects push out the LRU chain, tail first, to disk (not dropped)
    put_chain(core, ["c0", "c1"], 3.0)
    assert [where(core, k) for k in ("a0", "a1", "b0", "b1", "c0", "c1")] == [
        "disk", "disk", "dram+disk", "dram+disk", "dram", "dram"]
    assert tier.demotions == 2 and tier.num_disk_only == 2
    # a lookup stops at the disk-only prefix and starts promoting the whole chain
    reply = lookup(core, ["a0", "a1"], 4.0)
    assert (reply.num_hit, reply.num_promoting) == (0, 2)
    assert [where(core, k) for k in ("a0", "a1")] == ["promoting", "promoting"]
    # room was made by demoting the LRU chain b (tail first), which had disk copies
    assert [where(core, k) for k in ("b0", "b1")] == ["disk", "disk"]
    node.sync(4.1)
    reply = lookup(core, ["a0", "a1"], 4.2)
    assert (reply.num_hit, reply.num_promoting) == (2, 0)
    assert [r[0].segment_id for r in reply.replica_lists()] == [node.segment_id] * 2
    assert p.unpack_checksums(reply.checksums) == [1000, 1001]
    assert [where(core, k) for k in ("a0", "a1")] == ["dram+disk", "dram+disk"]
    assert tier.promotions == 2 and tier.disk_hits == 2
    stats = core.stats(5.0)
    assert stats.tiers[0].promotions == 2 and stats.num_objects == 6


def test_disk_eviction_drops_lru_disk_only_tails_never_a_prefix_first():
    core = make_core()
    node = FakeNode(core, dram_slots=2, disk_slots=4)
    put_chain(core, ["a0", "a1"], 1.0)
    node.sync(1.5)
    put_chain(core, ["b0", "b1"], 2.0)  # a0, a1 -> disk
    node.sync(2.5)  # b0, b1 written: the disk holds 4 slots of 4
    assert [where(core, k) for k in ("a0", "a1", "b0", "b1")] == ["disk", "disk", "dram+disk", "dram+disk"]
    put_chain(core, ["c0"], 3.0)  # DRAM: b1 -> disk
    node.sync(3.5)  # c0 written: 5 of 4 slots -> evict down to 2 (low watermark 0.5)
    # LRU on disk: a0 is oldest but a prefix of a1, so a1 goes first, then a0; then b0's copy
    # (b0 stays readable in DRAM, so its disk-only suffix b1 keeps its prefix)
    assert [where(core, k) for k in ("a0", "a1", "b0", "b1", "c0")] == ["gone", "gone", "dram", "disk", "dram+disk"]
    assert sorted(node.disk) == ["b1", "c0"]  # the node was told to delete the other files
    tier = core.index.tiers.by_segment[node.segment_id]
    assert tier.disk_evictions == 3 and tier.used_bytes == 2 * DISK_SLOT


def test_object_without_disk_copy_is_dropped_and_a_failed_promotion_frees_its_range():
    core = make_core()
    node = FakeNode(core, dram_slots=2, disk_slots=8)
    node.skip_writes = {"x"}
    put_chain(core, ["x"], 1.0)
    put_chain(core, ["y"], 1.1)
    node.sync(1.5)
    put_chain(core, ["z"], 2.0)  # x is LRU and has no disk copy: dropped as before
    assert [where(core, k) for k in ("x", "y", "z")] == ["gone", "dram+disk", "dram"]
    put_chain(core, ["w"], 2.1)  # y -> disk
    assert where(core, "y") == "disk"
    node.fail_promotions = {"y"}
    assert lookup(core, ["y"], 3.0).num_promoting == 1
    segment = core.segments.by_id[node.segment_id]
    used = segment.used_bytes
    node.sync(3.1)
    assert where(core, "y") == "gone"  # its disk copy was bad: the pool no longer has it
    assert segment.used_bytes == used - SLOT  # the range reserved for it is free again
    assert lookup(core, ["y"], 3.2).num_hit == 0


def test_removal_while_promoting_keeps_the_range_until_the_node_answers():
    core = make_core()
    node = FakeNode(core, dram_slots=1, disk_slots=8)
    put_chain(core, ["a"], 1.0)
    node.sync(1.2)
    put_chain(core, ["b"], 2.0)  # a -> disk
    lookup(core, ["a"], 3.0)  # promoting: b demoted for room
    segment = core.segments.by_id[node.segment_id]
    assert segment.used_bytes == SLOT
    assert core.handle(p.Remove("t", ["a"]), 3.1).count == 1
    assert segment.used_bytes == SLOT  # the node may still be writing into it
    put = core.handle(p.PutStart("t", ["c"], [SLOT], [None]), 3.2)
    assert put.statuses == [p.PUT_NO_SPACE]
    node.sync(3.3)
    assert segment.used_bytes == 0


def test_node_restart_announces_its_disk_and_the_chain_is_promoted():
    core = make_core()
    node = FakeNode(core, dram_slots=2, disk_slots=8)
    put_chain(core, ["a0", "a1"], 1.0)
    node.sync(1.5)
    disk = dict(node.disk)
    # the node restarts: a new segment, recovering, announcing its disk (child before parent)
    msg = p.MountSegment("n0", "host", 2 * SLOT, 0, "agent2", b"", recovering=True, disk_bytes=8 * DISK_SLOT)
    segment_id = core.handle(msg, 10.0).segment_id
    assert core.index.num_complete == 0  # the old segment's objects went with it
    entries = [p.DiskEntry("t", "a1", SLOT, disk["a1"], "a0", 1.0), p.DiskEntry("t", "a0", SLOT, disk["a0"], None, 2.0),
               p.DiskEntry("t", "bad", SLOT, 0, None, 0.0)]
    reply = core.handle(p.AnnounceObjects(segment_id, [], [], last=True, disk_entries=entries), 10.0)
    assert (reply.accepted, core.stats(10.0).rejected_announcements) == (2, 1)
    node.segment_id, node.applied, node.report = segment_id, 0, p.TierReport(segment_id)
    assert [where(core, k) for k in ("a0", "a1")] == ["disk", "disk"]
    assert lookup(core, ["a0", "a1"], 11.0).num_promoting == 2
    node.sync(11.1)
    reply = lookup(core, ["a0", "a1"], 11.2)
    assert reply.num_hit == 2
    assert sorted(node.disk) == ["a0", "a1"]  # "bad" was never the node's


def test_stale_write_report_is_answered_with_a_drop():
    core = make_core()
    node = FakeNode(core, dram_slots=4, disk_slots=8)
    put_chain(core, ["a"], 1.0)
    core.handle(p.Remove("t", ["a"]), 1.1)
    node.sync(1.2)  # the node wrote "a" from the commit op, then learns it is gone
    assert node.disk == {}
    assert core.index.tiers.by_segment[node.segment_id].used_bytes == 0


def test_a_disk_announcing_more_than_its_capacity_is_refused_the_excess():
    """Found by the fuzz test: two announced entries of 2^64 - 1 bytes took the tier's used bytes
    past 64 bits, and Stats could no longer be encoded."""
    core = make_core()
    msg = p.MountSegment("n0", "host", 2 * SLOT, 0, "agent", b"", recovering=True, disk_bytes=2 * DISK_SLOT)
    segment_id = core.handle(msg, 0.0).segment_id
    entries = [p.DiskEntry("t", "fits0", SLOT, 11), p.DiskEntry("t", "huge", 2**64 - 1, 12),
               p.DiskEntry("t", "fits1", SLOT, 13), p.DiskEntry("t", "past", SLOT, 14)]
    reply = core.handle(p.AnnounceObjects(segment_id, [], [], last=True, disk_entries=entries), 0.0)
    assert reply.accepted == 2
    stats = core.stats(0.0)
    assert stats.rejected_announcements == 2 and stats.tiers[0].used_bytes == 2 * DISK_SLOT
    p.reply_encoder.encode(stats)
    assert [where(core, k) for k in ("fits0", "fits1")] == ["disk", "disk"]
