"""Disk tiers: which objects have a copy on a node's disk, demotion, promotion, disk eviction (pure).

Rules:
- A segment whose node mounted it with `disk_bytes > 0` has a DiskTier here. The node writes
  committed objects of its segment to disk in the background (write-back, bounded queue, off the put
  path) and reports each one written (TierReport.written, with the checksum it verified on the bytes
  it copied). Only then does the master count the object as having a disk copy (`disk_segment`).
  Rejected: asking the node to write an object back when DRAM eviction picks it; the DRAM range
  would have to stay allocated until the node answered, a heartbeat or more, while the put that
  caused the eviction needs the space now.
- DRAM eviction of an object with a disk copy is a demotion: its DRAM range is freed at once (the
  copy is already safe on disk) and it stays in the index as disk-only (`locations == b""`). An
  object without a disk copy is dropped as before.
- Disk-only objects are not readable one-sidedly. A lookup that reaches one stops there (a miss for
  this lookup) and starts its promotion and that of the disk-only keys after it (up to
  `max_promotions_per_lookup`): a DRAM range on the same segment is allocated and a DIR_PROMOTE op
  in the segment's directory log tells the node to read its file into the range. The record becomes
  readable only when the node reports the promotion done (TierReport.promoted), after it verified the
  checksum; the range is never reused before the node answered for it (done or failed), even if the
  object is removed meanwhile, because the node may still be writing into it.
- Prefix rule across tiers: `num_children` counts children that hold DRAM (or are pending) and
  `disk_children` those held on disk only. DRAM eviction takes objects without DRAM children (so a
  parent can go to disk once its children did); disk eviction drops a disk-only object only when it
  has no children at all, and drops the disk copy of an object still in DRAM at any time (its DRAM
  copy keeps the prefix readable). So no prefix disappears from the pool before its suffixes.
- Disk space is accounted as the node stores it (stored_bytes: header and 4 KiB blocks).
- Disk eviction is LRU per tier, above the master's high watermark of the tier's capacity, down to
  the low watermark; each dropped copy is a DIR_DISK_DROP op so the node deletes the file.
- Reports are applied idempotently (a node resends them until a heartbeat reply arrives): a write
  of an object the index no longer holds as that object (gone, another checksum) is answered with a
  DIR_DISK_DROP, so no file is kept that nobody can reach.
"""

from __future__ import annotations

from heapq import heappop, heappush
from typing import TYPE_CHECKING

from kvpool.core.protocol import DiskEntry, TierReport, TierStats, pack_replicas
from kvpool.core.protocol import Replica
from kvpool.master import chains
from kvpool.master.records import COMPLETE, GONE, IN_DISK_HEAP, PINNED, PROMOTING, ObjectRecord

if TYPE_CHECKING:
    from kvpool.master.index import ObjectIndex
    from kvpool.master.segments import Segment

STORED_BLOCK = 4096  # node/disk_store.py: a 4 KiB header, the payload in 4 KiB blocks


def stored_bytes(size: int) -> int:
    """What an object of `size` bytes takes on a node's disk (accounted so, not by its size: small
    objects would otherwise fill the disk before the master saw it full)."""
    return STORED_BLOCK + -(-size // STORED_BLOCK) * STORED_BLOCK


TieredRecord = ObjectRecord  # every record may have a disk copy (records.py)


class _DiskHeapEntry:
    __slots__ = ("rec",)

    def __init__(self, rec: TieredRecord) -> None:
        self.rec = rec

    def __lt__(self, other: "_DiskHeapEntry") -> bool:
        return self.rec.disk_heap_s < other.rec.disk_heap_s


class DiskTier:
    """One segment's disk tier, as the master accounts it."""

    __slots__ = ("segment_id", "node_id", "capacity_bytes", "used_bytes", "num_objects", "num_disk_only", "heap",
                 "promoting", "demotions", "promotions", "promotions_failed", "disk_hits", "disk_evictions")

    def __init__(self, segment_id: int, node_id: str, capacity_bytes: int) -> None:
        self.segment_id = segment_id
        self.node_id = node_id
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.num_objects = 0
        self.num_disk_only = 0
        self.heap: list[_DiskHeapEntry] = []
        self.promoting: dict[int, TieredRecord] = {}  # DRAM offset -> record being promoted into it
        self.demotions = 0
        self.promotions = 0
        self.promotions_failed = 0
        self.disk_hits = 0
        self.disk_evictions = 0

    def stats(self) -> TierStats:
        return TierStats(self.segment_id, self.node_id, self.capacity_bytes, self.used_bytes, self.num_objects,
                         self.num_disk_only, self.demotions, self.promotions, self.promotions_failed,
                         len(self.promoting), self.disk_hits, self.disk_evictions)


class Tiers:
    def __init__(self, index: "ObjectIndex") -> None:
        self.index = index
        self.by_segment: dict[int, DiskTier] = {}

    # ---- membership ----------------------------------------------------------------------------

    def mount(self, segment: "Segment", disk_bytes: int) -> DiskTier:
        tier = DiskTier(segment.segment_id, segment.node_id, disk_bytes)
        self.by_segment[segment.segment_id] = tier
        return tier

    def drop_segment(self, segment_id: int) -> int:
        """The segment (and with it its node's disk tier) is gone: disk-only objects there go, the
        others lose their disk copy. Returns how many objects went."""
        tier = self.by_segment.pop(segment_id, None)
        if tier is None:
            return 0
        lost = 0
        for space in list(self.index.tenants.values()):
            for rec in [r for r in space.values() if getattr(r, "disk_segment", None) == segment_id]:
                if rec.disk_only:
                    self.index.drop(rec)
                    lost += 1
                else:
                    rec.disk_segment = None
        tier.promoting.clear()  # their ranges were on the segment: gone with it
        return lost

    # ---- reports from the node -----------------------------------------------------------------

    def apply_report(self, segment: "Segment", report: TierReport, now_s: float) -> None:
        tier = self.by_segment.get(segment.segment_id)
        if tier is None:
            return
        for entry in report.written:
            self._written(segment, tier, entry)
        for entry in report.lost:
            rec = self._find(entry)
            if rec is not None and rec.disk_segment == tier.segment_id:
                if rec.disk_only and not rec.flags & PROMOTING:
                    self.index.drop(rec)
                elif not rec.disk_only:
                    self._forget_copy(rec, tier, tell_node=False)
        for offset in report.promoted:
            self._promoted(segment, tier, offset, ok=True)
        for offset in report.failed:
            self._promoted(segment, tier, offset, ok=False)
        self.maybe_evict(tier, now_s)

    def _find(self, entry: DiskEntry) -> TieredRecord | None:
        space = self.index.tenants.get(entry.tenant)
        rec = space.get(entry.key) if space is not None else None
        if rec is None or rec.state != COMPLETE or rec.size_bytes != entry.size:
            return None
        if int.from_bytes(rec.checksum, "little") != entry.checksum:
            return None
        return rec

    def _written(self, segment: "Segment", tier: DiskTier, entry: DiskEntry) -> None:
        rec = self._find(entry)
        if rec is not None and rec.disk_segment == tier.segment_id:
            return  # a resent report
        if rec is None or rec.disk_segment is not None or rec.disk_only or rec.flags & PINNED or not any(
                r.segment_id == tier.segment_id for r in rec.replicas):
            # not this object any more (gone, re-put, or already on another disk): the file is of no use
            self.index.space.log_disk_drop(segment.segment_id, entry.tenant, entry.key, entry.checksum)
            return
        self._add_copy(rec, tier, entry.size)

    def _add_copy(self, rec: TieredRecord, tier: DiskTier, size: int) -> None:
        rec.disk_segment = tier.segment_id
        rec.disk_size = size
        tier.used_bytes += stored_bytes(size)
        tier.num_objects += 1
        self.push(rec, tier)

    def _promoted(self, segment: "Segment", tier: DiskTier, offset: int, ok: bool) -> None:
        rec = tier.promoting.pop(offset, None)
        if rec is None:
            return  # a resent report, or a promotion this master never asked for
        rec.flags &= ~PROMOTING
        size = rec.disk_size
        if not ok or rec.state == GONE:
            self.index.space.free_range(segment, offset, size)
            if not ok:
                tier.promotions_failed += 1
                if rec.state != GONE:
                    self.index.drop(rec)  # its disk copy is bad (the node dropped it) and it has no other
            return
        tier.promotions += 1
        tier.num_disk_only -= 1
        rec.locations = pack_replicas([Replica(segment.segment_id, offset, size)])
        rec.space.account.charge(rec, 1)
        chains.to_dram(rec)
        if not rec.num_children and not rec.flags & PINNED:
            self.index.evictor.push(rec)

    # ---- DRAM eviction and promotion -----------------------------------------------------------

    def demote(self, rec: TieredRecord) -> bool:
        """DRAM eviction chose `rec`: keep it as disk-only when its disk copy is there. False: drop it."""
        tier = self.by_segment.get(rec.disk_segment) if rec.disk_segment is not None else None
        if tier is None:
            return False
        index = self.index
        index.space.free(rec.replicas)
        index.space.log_removal(rec.replicas)
        rec.space.account.charge(rec, -1)  # disk-only objects do not count in the tenant's quota (quotas.py)
        rec.locations = b""
        tier.num_disk_only += 1
        tier.demotions += 1
        tail = chains.to_disk(rec)
        if tail is not None:
            index.became_tail(tail)
        return True

    def promote_chain(self, records: list[TieredRecord], now_s: float) -> int:
        """Start promoting these disk-only records (a lookup's keys after its hits, in chain order);
        stops at the first that is not disk-only or cannot get DRAM. Returns how many are promoting."""
        promoting = 0
        for rec in records[: self.index.config.max_promotions_per_lookup]:
            if not rec.disk_only:
                break
            tier = self.by_segment.get(rec.disk_segment)
            if tier is None:
                break
            if not rec.flags & PROMOTING and not self._start_promotion(rec, tier, now_s):
                break
            tier.disk_hits += 1
            promoting += 1
        return promoting

    def _start_promotion(self, rec: TieredRecord, tier: DiskTier, now_s: float) -> bool:
        segment = self.index.segments.by_id.get(tier.segment_id)
        if segment is None or segment.recovering:
            return False
        size = rec.disk_size
        space = self.index.space
        offset = space.allocate_on(segment, size)
        if offset is None:
            if segment.tenant:  # a dedicated segment: room only from its tenant's objects there
                self.index.evictor.evict(now_s, segment.allocator.aligned(size), rec.space.account,
                                         on_segments={segment.segment_id})
            else:
                self.index.evictor.evict(now_s, segment.allocator.aligned(size))
            offset = space.allocate_on(segment, size)
            if offset is None:
                return False
        rec.flags |= PROMOTING
        rec.last_access_s = now_s
        tier.promoting[offset] = rec
        parent_key = rec.parent.key if rec.parent is not None else None
        space.log_promote(segment, offset, size, self.tenant_of(rec), rec.key, parent_key,
                          int.from_bytes(rec.checksum, "little"))
        return True

    # ---- disk eviction -------------------------------------------------------------------------

    def push(self, rec: TieredRecord, tier: DiskTier) -> None:
        rec.heaps |= IN_DISK_HEAP
        rec.disk_heap_s = rec.last_access_s
        heappush(tier.heap, _DiskHeapEntry(rec))

    def maybe_evict(self, tier: DiskTier, now_s: float) -> int:
        config = self.index.config
        if tier.used_bytes <= tier.capacity_bytes * config.high_watermark:
            return 0
        return self.evict(tier, tier.used_bytes - int(tier.capacity_bytes * config.low_watermark))

    def evict(self, tier: DiskTier, bytes_to_free: int) -> int:
        """Drop LRU disk copies until `bytes_to_free` bytes are free; returns the bytes freed."""
        heap = tier.heap
        freed = 0
        set_aside: list[TieredRecord] = []
        while freed < bytes_to_free and heap:
            rec = heappop(heap).rec
            rec.heaps &= ~IN_DISK_HEAP
            if rec.state == GONE or rec.disk_segment != tier.segment_id:
                continue
            if rec.last_access_s != rec.disk_heap_s:
                self.push(rec, tier)
                continue
            if rec.disk_only:
                if rec.num_children or rec.disk_children:
                    continue  # pushed again when its last child goes (ObjectIndex._became_tail)
                if rec.flags & PROMOTING:
                    set_aside.append(rec)
                    continue
                freed += stored_bytes(rec.disk_size)
                tier.disk_evictions += 1
                self.index.drop(rec)
            else:
                freed += stored_bytes(rec.disk_size)
                tier.disk_evictions += 1
                self._forget_copy(rec, tier, tell_node=True)
        for rec in set_aside:
            self.push(rec, tier)
        return freed

    def _forget_copy(self, rec: TieredRecord, tier: DiskTier, tell_node: bool) -> None:
        """The object keeps its DRAM copy and loses its disk one."""
        rec.disk_segment = None
        tier.used_bytes -= stored_bytes(rec.disk_size)
        tier.num_objects -= 1
        if tell_node:
            self._log_disk_drop(rec, tier)

    def forget(self, rec: TieredRecord) -> None:
        """`rec` left the index (ObjectIndex.drop): its disk copy goes too."""
        tier = self.by_segment.get(rec.disk_segment) if rec.disk_segment is not None else None
        if tier is None:
            return
        if rec.disk_only:
            tier.num_disk_only -= 1
        self._forget_copy(rec, tier, tell_node=True)

    def _log_disk_drop(self, rec: TieredRecord, tier: DiskTier) -> None:
        self.index.space.log_disk_drop(tier.segment_id, self.tenant_of(rec), rec.key,
                                       int.from_bytes(rec.checksum, "little"))

    def tenant_of(self, rec: ObjectRecord) -> str:
        return rec.space.name

    # ---- recovery ------------------------------------------------------------------------------

    def announce(self, segment: "Segment", entries: list[DiskEntry], now_s: float) -> int:
        """Take what a remounted node's disk tier holds; returns how many entries were refused
        (each answered with a DIR_DISK_DROP, so the node deletes the file)."""
        tier = self.by_segment.get(segment.segment_id)
        index = self.index
        refused = 0
        for entry in entries:
            # a disk announcing more than its capacity is lying or was shrunk: the excess is refused
            ok = (tier is not None and entry.tenant and entry.key and 0 < entry.size
                  and stored_bytes(entry.size) <= tier.capacity_bytes - tier.used_bytes
                  and 0 < entry.checksum < (1 << 64))
            rec = None
            if ok:
                space = index.space_of(entry.tenant)
                rec = space.get(entry.key)
                if rec is not None:
                    # its DRAM replica announced just before, or another node's: only the same object, once
                    same = self._find(entry) is rec
                    if same and rec.disk_segment is None and not rec.disk_only and any(
                            r.segment_id == segment.segment_id for r in rec.replicas):
                        self._add_copy(rec, tier, entry.size)
                    else:
                        ok = False
                else:
                    rec = ObjectRecord(space, entry.key, b"", COMPLETE, 0, now_s - max(0.0, entry.age_s))
                    rec.checksum = entry.checksum.to_bytes(8, "little")
                    space[entry.key] = rec
                    index.num_complete += 1
                    tier.num_disk_only += 1
                    self._add_copy(rec, tier, entry.size)
                    index.recovery.orphans.link(rec, entry.tenant, entry.parent)
            if not ok:
                refused += 1
                self.index.space.log_disk_drop(segment.segment_id, entry.tenant, entry.key, entry.checksum)
        index.recovered_objects += len(entries) - refused
        index.rejected_announcements += refused
        return refused

    def stats(self) -> list[TierStats]:
        return [tier.stats() for tier in self.by_segment.values()]
