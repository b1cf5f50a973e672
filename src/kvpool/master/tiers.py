"""Disk tiers: which objects have a copy on a node's disk, demotion, promotion, disk eviction (pure).

Rules:
- This module takes the segment space and the evictor, never the index: it keeps each tier's
  accounting, its disk heap and the records' disk fields, and returns (or yields, where the order
  matters) the records that must leave the pool; the index drops them. Between two yielded records
  the caller's drop has run, so a parent whose last child went is already a candidate.
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

from collections.abc import Iterator, Mapping
from heapq import heappop, heappush
from typing import TYPE_CHECKING

from kvpool.core.protocol import DiskEntry, Replica, TierReport, TierStats, pack_replicas
from kvpool.core.types import NodeId, SegmentId
from kvpool.master.chains import to_dram
from kvpool.master.config import MasterConfig
from kvpool.master.eviction import Evictor
from kvpool.master.quotas import TenantSpace
from kvpool.master.records import COMPLETE, GONE, IN_DISK_HEAP, PINNED, PROMOTING, ObjectRecord
from kvpool.master.space import SegmentSpace

if TYPE_CHECKING:
    from kvpool.master.segments import Segment

Tenants = Mapping[str, TenantSpace]  # stored namespace -> its records (ObjectIndex.tenants)

STORED_BLOCK = 4096  # node/disk_store.py: a 4 KiB header, the payload in 4 KiB blocks


def stored_bytes(size: int) -> int:
    """What an object of `size` bytes takes on a node's disk (accounted so, not by its size: small
    objects would otherwise fill the disk before the master saw it full)."""
    return STORED_BLOCK + -(-size // STORED_BLOCK) * STORED_BLOCK


class _DiskHeapEntry:
    __slots__ = ("rec",)

    def __init__(self, rec: ObjectRecord) -> None:
        self.rec = rec

    def __lt__(self, other: "_DiskHeapEntry") -> bool:
        return self.rec.disk_heap_s < other.rec.disk_heap_s


class DiskTier:
    """One segment's disk tier, as the master accounts it."""

    __slots__ = ("segment_id", "node_id", "capacity_bytes", "used_bytes", "num_objects", "num_disk_only", "heap",
                 "promoting", "demotions", "promotions", "promotions_failed", "disk_hits", "disk_evictions")

    def __init__(self, segment_id: SegmentId, node_id: NodeId, capacity_bytes: int) -> None:
        self.segment_id = segment_id
        self.node_id = node_id
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.num_objects = 0
        self.num_disk_only = 0
        self.heap: list[_DiskHeapEntry] = []
        self.promoting: dict[int, ObjectRecord] = {}  # DRAM offset -> record being promoted into it
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
    def __init__(self, config: MasterConfig, space: SegmentSpace, evictor: Evictor) -> None:
        self.config = config
        self.space = space
        self.evictor = evictor
        self.by_segment: dict[SegmentId, DiskTier] = {}

    # ---- membership ----------------------------------------------------------------------------

    def mount(self, segment: "Segment", disk_bytes: int) -> DiskTier:
        tier = DiskTier(segment.segment_id, segment.node_id, disk_bytes)
        self.by_segment[segment.segment_id] = tier
        return tier

    def drop_segment(self, segment_id: SegmentId, tenants: Tenants) -> list[ObjectRecord]:
        """The segment (and with it its node's disk tier) is gone: the others lose their disk copy;
        returns the disk-only objects there, which go (the caller drops them)."""
        tier = self.by_segment.pop(segment_id, None)
        if tier is None:
            return []
        lost = []
        for space in list(tenants.values()):
            for rec in [r for r in space.values() if r.disk_segment == segment_id]:
                if rec.disk_only:
                    lost.append(rec)
                else:
                    rec.disk_segment = None
        tier.promoting.clear()  # their ranges were on the segment: gone with it
        return lost

    # ---- reports from the node -----------------------------------------------------------------

    def apply_report(self, segment: "Segment", report: TierReport, tenants: Tenants,
                     now_s: float) -> Iterator[ObjectRecord]:
        """Apply a node's report; yields the objects that go from the pool (the caller drops each
        before the next is decided: a dropped tail makes its parent a disk eviction candidate)."""
        tier = self.by_segment.get(segment.segment_id)
        if tier is None:
            return
        for entry in report.written:
            self._written(segment, tier, entry, tenants)
        for entry in report.lost:
            rec = self.find(entry, tenants)
            if rec is not None and rec.disk_segment == tier.segment_id:
                if rec.disk_only and not rec.flags & PROMOTING:
                    yield rec
                elif not rec.disk_only:
                    self._forget_copy(rec, tier, tell_node=False)
        for offset in report.promoted:
            self._promoted(segment, tier, offset, ok=True)
        for offset in report.failed:
            rec = self._promoted(segment, tier, offset, ok=False)
            if rec is not None:
                yield rec  # its disk copy is bad (the node dropped it) and it has no other
        yield from self.maybe_evict(tier, now_s)

    def find(self, entry: DiskEntry, tenants: Tenants) -> ObjectRecord | None:
        """The complete record this entry describes (same size and checksum), if the index holds it."""
        space = tenants.get(entry.tenant)
        rec = space.get(entry.key) if space is not None else None
        if rec is None or rec.state != COMPLETE or rec.size_bytes != entry.size:
            return None
        if int.from_bytes(rec.checksum, "little") != entry.checksum:
            return None
        return rec

    def _written(self, segment: "Segment", tier: DiskTier, entry: DiskEntry, tenants: Tenants) -> None:
        rec = self.find(entry, tenants)
        if rec is not None and rec.disk_segment == tier.segment_id:
            return  # a resent report
        if rec is None or rec.disk_segment is not None or rec.disk_only or rec.flags & PINNED or not any(
                r.segment_id == tier.segment_id for r in rec.replicas):
            # not this object any more (gone, re-put, or already on another disk): the file is of no use
            self.space.log_disk_drop(segment.segment_id, entry.tenant, entry.key, entry.checksum)
            return
        self.add_copy(rec, tier, entry.size)

    def add_copy(self, rec: ObjectRecord, tier: DiskTier, size: int) -> None:
        rec.disk_segment = tier.segment_id
        rec.disk_size = size
        tier.used_bytes += stored_bytes(size)
        tier.num_objects += 1
        self.push(rec, tier)

    def _promoted(self, segment: "Segment", tier: DiskTier, offset: int, ok: bool) -> ObjectRecord | None:
        """A promotion ended; returns the record when it must go (its disk copy failed)."""
        rec = tier.promoting.pop(offset, None)
        if rec is None:
            return None  # a resent report, or a promotion this master never asked for
        rec.flags &= ~PROMOTING
        size = rec.disk_size
        if not ok or rec.state == GONE:
            self.space.free_range(segment, offset, size)
            if not ok:
                tier.promotions_failed += 1
                if rec.state != GONE:
                    return rec
            return None
        tier.promotions += 1
        tier.num_disk_only -= 1
        rec.locations = pack_replicas([Replica(segment.segment_id, offset, size)])
        rec.space.account.charge(rec, 1)
        to_dram(rec)
        if not rec.num_children and not rec.flags & PINNED:
            self.evictor.push(rec)
        return None

    # ---- DRAM eviction and promotion -----------------------------------------------------------

    def demote(self, rec: ObjectRecord) -> bool:
        """DRAM eviction chose `rec`: keep it as disk-only when its disk copy is there (the caller
        moves it in its chain, chains.to_disk). False: the caller drops it."""
        tier = self.by_segment.get(rec.disk_segment) if rec.disk_segment is not None else None
        if tier is None:
            return False
        self.space.free(rec.replicas)
        self.space.log_removal(rec.replicas)
        rec.space.account.charge(rec, -1)  # disk-only objects do not count in the tenant's quota (quotas.py)
        rec.locations = b""
        tier.num_disk_only += 1
        tier.demotions += 1
        return True

    def promotion_segment(self, tier: DiskTier) -> "Segment | None":
        """The segment a promotion from this tier reads into, or None while it cannot take one."""
        segment = self.space.segment(tier.segment_id)
        return None if segment is None or segment.recovering else segment

    def start_promotion(self, rec: ObjectRecord, tier: DiskTier, segment: "Segment", now_s: float) -> bool:
        """Reserve a DRAM range on `segment` for a disk-only record and ask its node to fill it.
        False: no free range (the caller may evict for one and ask again)."""
        size = rec.disk_size
        offset = self.space.allocate_on(segment, size)
        if offset is None:
            return False
        rec.flags |= PROMOTING
        rec.last_access_s = now_s
        tier.promoting[offset] = rec
        parent_key = rec.parent.key if rec.parent is not None else None
        self.space.log_promote(segment, offset, size, self.tenant_of(rec), rec.key, parent_key,
                               int.from_bytes(rec.checksum, "little"))
        return True

    # ---- disk eviction -------------------------------------------------------------------------

    def push(self, rec: ObjectRecord, tier: DiskTier) -> None:
        rec.heaps |= IN_DISK_HEAP
        rec.disk_heap_s = rec.last_access_s
        heappush(tier.heap, _DiskHeapEntry(rec))

    def maybe_evict(self, tier: DiskTier, now_s: float) -> Iterator[ObjectRecord]:
        """Above the high watermark of the tier's capacity, `evict` down to the low one."""
        config = self.config
        if tier.used_bytes <= tier.capacity_bytes * config.high_watermark:
            return iter(())
        return self.evict(tier, tier.used_bytes - int(tier.capacity_bytes * config.low_watermark))

    def evict(self, tier: DiskTier, bytes_to_free: int) -> Iterator[ObjectRecord]:
        """Drop LRU disk copies until `bytes_to_free` bytes are free. Yields the disk-only objects
        that go from the pool: the caller drops each before the next is chosen (its parent may
        become a candidate)."""
        heap = tier.heap
        freed = 0
        set_aside: list[ObjectRecord] = []
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
                    continue  # pushed again when its last child goes (ObjectIndex.became_tail)
                if rec.flags & PROMOTING:
                    set_aside.append(rec)
                    continue
                freed += stored_bytes(rec.disk_size)
                tier.disk_evictions += 1
                yield rec
            else:
                freed += stored_bytes(rec.disk_size)
                tier.disk_evictions += 1
                self._forget_copy(rec, tier, tell_node=True)
        for rec in set_aside:
            self.push(rec, tier)

    def _forget_copy(self, rec: ObjectRecord, tier: DiskTier, tell_node: bool) -> None:
        """The object keeps its DRAM copy and loses its disk one."""
        rec.disk_segment = None
        tier.used_bytes -= stored_bytes(rec.disk_size)
        tier.num_objects -= 1
        if tell_node:
            self._log_disk_drop(rec, tier)

    def forget(self, rec: ObjectRecord) -> None:
        """`rec` left the index (ObjectIndex.drop): its disk copy goes too."""
        tier = self.by_segment.get(rec.disk_segment) if rec.disk_segment is not None else None
        if tier is None:
            return
        if rec.disk_only:
            tier.num_disk_only -= 1
        self._forget_copy(rec, tier, tell_node=True)

    def _log_disk_drop(self, rec: ObjectRecord, tier: DiskTier) -> None:
        self.space.log_disk_drop(tier.segment_id, self.tenant_of(rec), rec.key,
                                       int.from_bytes(rec.checksum, "little"))

    def tenant_of(self, rec: ObjectRecord) -> str:
        return rec.space.name

    # ---- recovery ------------------------------------------------------------------------------

    def may_announce(self, tier: DiskTier | None, entry: DiskEntry) -> bool:
        """Whether an announced disk entry can be taken at all (a disk announcing more than its
        capacity is lying or was shrunk: the excess is refused)."""
        return bool(tier is not None and entry.tenant and entry.key and 0 < entry.size
                    and stored_bytes(entry.size) <= tier.capacity_bytes - tier.used_bytes
                    and 0 < entry.checksum < (1 << 64))

    def take_announced_copy(self, rec: ObjectRecord, tier: DiskTier, entry: DiskEntry, tenants: Tenants) -> bool:
        """An announced disk entry names a record the index holds (its DRAM replica announced just
        before, or another node's): only the same object, once, with a replica on this segment."""
        if (self.find(entry, tenants) is rec and rec.disk_segment is None and not rec.disk_only
                and any(r.segment_id == tier.segment_id for r in rec.replicas)):
            self.add_copy(rec, tier, entry.size)
            return True
        return False

    def take_disk_only(self, rec: ObjectRecord, tier: DiskTier, size: int) -> None:
        """A record rebuilt from an announced disk entry alone."""
        tier.num_disk_only += 1
        self.add_copy(rec, tier, size)

    def refuse(self, segment: "Segment", entry: DiskEntry) -> None:
        """Tell the node to delete a file nobody can reach."""
        self.space.log_disk_drop(segment.segment_id, entry.tenant, entry.key, entry.checksum)

    def stats(self) -> list[TierStats]:
        return [tier.stats() for tier in self.by_segment.values()]
