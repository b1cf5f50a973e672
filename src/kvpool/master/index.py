"""The object index: each tenant's records, and the only code that moves a record through its lifecycle.

Rules:
- Pure logic: no I/O, no clock (every call takes `now_s`). The service, the simulator and the tests
  drive the same code.
- Lifecycle (records.LIFECYCLE): pending (space allocated, writer copying) -> [landing ->] complete
  (readable) -> gone (evicted, removed, revoked, reclaimed, or its last replica's segment died).
  Only this class calls `records.move`; writes.py, reads.py and pressure.py ask it. A key that
  exists in any state answers PUT_EXISTS without new space; unknown keys are misses, never errors.
- Tenants are separate dicts (quotas.TenantSpace, one per stored namespace): no call can reach
  another tenant's keys. The tenant owning a namespace (access.namespace_owner) has an account
  (quotas.TenantAccount) with its usage, kept by `TenantAccount.charge` wherever a record gains or
  loses DRAM replicas.
- This class calls down and is never called back: the segment space frees and logs ranges, the
  evictor and the disk tiers keep candidates, chains.py keeps parent and child counts, recovery and
  tiers check and return what must go, and the index drops it. When a record leaves, its parent may
  become a tail: `became_tail` puts it among the candidates of the tier that holds it.
- Every change to what a segment holds committed is appended to its directory log (space.py): an
  add when a record completes, a removal (size 0) when a complete record goes. Nodes keep that
  directory and announce it to a new master (`announce`), which rebuilds records, chains, tails
  and an LRU order (by commit age) from it.
- Disk tiers (tiers.py): DRAM eviction of an object with a disk copy keeps it as disk-only (no
  replicas), and nothing is dropped from the pool before its suffixes (chains.py).
- What subscribers see (pool_events.py): a key is reported stored where a record completes or is
  rebuilt from an announcement, removed where a complete record is dropped; nowhere else.
"""

from __future__ import annotations

from kvpool.core.protocol import DirEntry, DiskEntry, Replica, TenantStats, TierReport, pack_replicas
from kvpool.core.types import SegmentId
from kvpool.master import chains
from kvpool.master.access import namespace_owner
from kvpool.master.config import MasterConfig
from kvpool.master.eviction import Evictor
from kvpool.master.leases import LeaseTable
from kvpool.master.pool_events import PoolEvents
from kvpool.master.quotas import TenantAccount, TenantSpace
from kvpool.master.records import (COMPLETE, GONE, IN_DISK_HEAP, IN_HEAP, LANDING, PENDING, PINNED, ObjectRecord,
                                   move)
from kvpool.master.recovery import Recovery
from kvpool.master.replicas import keep_other_replicas, on_segment
from kvpool.master.segments import Segment
from kvpool.master.space import SegmentSpace
from kvpool.master.tiers import DiskTier, Tiers


class ObjectIndex:
    def __init__(self, config: MasterConfig, space: SegmentSpace, evictor: Evictor, leases: LeaseTable) -> None:
        self.config = config
        self.space = space
        self.evictor = evictor
        self.leases = leases
        self.tiers = Tiers(config, space, evictor)
        self.recovery = Recovery(space, evictor)
        self.events = PoolEvents()
        self.tenants: dict[str, TenantSpace] = {}  # stored namespace -> its records
        self.accounts: dict[str, TenantAccount] = {}  # owning tenant -> usage and quota
        space.segments.dedicated_tenants.update(config.quotas.dedicated)  # dedicated before their segments mount
        self._sizes: dict[int, int] = {}  # interned size ints: KV blocks mostly share a few sizes
        self.num_complete = 0
        self.num_pending = 0
        self.puts = 0
        self.dropped = 0

    # ---- tenants (quotas.py) -------------------------------------------------------------------

    def space_of(self, tenant: str) -> TenantSpace:
        """The namespace's dict, made on first use in the account of the tenant that owns it (made
        with its quota on first use; a quota or a dedicated segment gives it its own eviction heap)."""
        space = self.tenants.get(tenant)
        if space is None:
            space = self.tenants[tenant] = TenantSpace(tenant, self.account_of(namespace_owner(tenant)))
        account = space.account
        if not account.dedicated and account.name in self.space.segments.dedicated_tenants:
            account.dedicated = True  # from now on it places only on its dedicated segments
            self.evictor.give_own_heap(account)
        return space

    def account_of(self, owner: str) -> TenantAccount:
        account = self.accounts.get(owner)
        if account is None:
            account = self.accounts[owner] = TenantAccount(owner, self.config.quotas.quota_of(owner))
            if account.quota is not None:
                self.evictor.give_own_heap(account)
        return account

    def tenant_segments(self, tenant: str) -> set[SegmentId]:
        """Ids of the segments holding a replica of any pending or complete object of `tenant`, in
        any of its namespaces (a stored namespace `<tenant>/<ns>` names its owner too). Kept per put
        and drop (quotas.TenantAccount.charge), not scanned."""
        account = self.accounts.get(namespace_owner(tenant))
        return account.segments() if account is not None else set()

    def tenant_stats(self) -> list[TenantStats]:
        return [account.stats() for account in self.accounts.values()]

    def holds(self, tenant: str, key: str) -> bool:
        """Whether the key names a record here in any state (pending, complete, disk-only)."""
        space = self.tenants.get(tenant)
        return space is not None and key in space

    # ---- the write path (writes.py) ------------------------------------------------------------

    def interned_size(self, size: int) -> int:
        return self._sizes.setdefault(size, size)

    def create(self, space: TenantSpace, key: str, placed: tuple[Replica, ...], pinned: bool, now_s: float,
               token: int, parent: ObjectRecord | None) -> ObjectRecord:
        """A pending record for a placed put (its parent already held: chains.hold_parent)."""
        rec = ObjectRecord(space, key, pack_replicas(placed), PENDING, PINNED if pinned else 0, now_s, token)
        chains.attach(rec, parent)
        space[key] = rec
        space.account.charge(rec, 1)
        self.num_pending += 1
        return rec

    def release_parent(self, parent: ObjectRecord) -> None:
        """A put that held `parent` was refused, or a child holding DRAM left it."""
        tail = chains.release_parent(parent)
        if tail is not None:
            self.became_tail(tail)

    def end(self, rec: ObjectRecord, checksum: int, new_key: str | None, landing: bool, now_s: float) -> None:
        """A writer ended a pending record (under `new_key` when given): complete it, or, with
        `landing`, keep it pending until `land`. The caller counts completions (`count_completed`)."""
        if new_key is not None:
            space = rec.space
            del space[rec.key]
            rec.key = new_key
            space[new_key] = rec
        if checksum:
            rec.checksum = checksum.to_bytes(8, "little")
        if landing:
            move(rec, LANDING)
            self._log_commit(rec)  # now: the end's reply waits for the node while the bytes travel
        else:
            self._complete(rec, now_s)

    def land(self, rec: ObjectRecord, checksum: int, now_s: float) -> None:
        """A landing record's bytes are written: complete it (the caller counts it)."""
        if checksum:
            rec.checksum = checksum.to_bytes(8, "little")
        self._complete(rec, now_s, logged=not checksum)

    def _log_commit(self, rec: ObjectRecord) -> None:
        parent_key = rec.parent.key if rec.parent is not None else None
        self.space.log_commit(rec.replicas, rec.space.name, rec.key, parent_key, int.from_bytes(rec.checksum, "little"))

    def _complete(self, rec: ObjectRecord, now_s: float, logged: bool = False) -> None:
        """Readable: evictable, logged in its segments' directories (a landing one was when it ended,
        unless its checksum came only with its landing)."""
        move(rec, COMPLETE)
        rec.last_access_s = now_s
        if not rec.num_children and not rec.flags & PINNED:
            self.evictor.push(rec)
        if not logged:
            self._log_commit(rec)
        if self.events.recording:
            self.events.stored(rec.space.name, rec.key)

    def count_completed(self, num: int) -> None:
        """Counted once per batch of completions (a chain's put ends many at once)."""
        self.num_pending -= num
        self.num_complete += num
        self.puts += num

    def touch(self, rec: ObjectRecord, now_s: float) -> None:
        """A put found the object complete already: that is a use."""
        rec.last_access_s = now_s

    # ---- removal and eviction ------------------------------------------------------------------

    def drop(self, rec: ObjectRecord, free_space: bool = True) -> None:
        """Forget an object: out of its namespace, out of its parent's child count, space freed
        (unless the caller keeps it: leased, quarantined, or never the allocator's)."""
        if rec.state == GONE:
            return
        was = move(rec, GONE)
        space = rec.space
        del space[rec.key]
        space.account.charge(rec, -1)
        if was == COMPLETE:
            self.num_complete -= 1
            self.space.log_removal(rec.replicas)
            if self.events.recording:
                self.events.removed(space.name, rec.key)
        else:
            self.num_pending -= 1
            if was == LANDING:  # its node was told when it ended
                self.space.log_removal(rec.replicas)
        if rec.disk_segment is not None:
            self.tiers.forget(rec)
        tail = chains.detach(rec)
        if tail is not None:
            self.became_tail(tail)
        if free_space:
            self.space.free(rec.replicas)
        self.evictor.forget(rec)

    def evict(self, rec: ObjectRecord) -> None:
        """DRAM eviction chose `rec` (pressure.py): to its disk tier if it has a copy there, else gone."""
        if self.tiers.demote(rec):
            tail = chains.to_disk(rec)
            if tail is not None:
                self.became_tail(tail)
        else:
            self.drop(rec)

    def became_tail(self, rec: ObjectRecord) -> None:
        """No child holds DRAM any more (and, for a disk-only record, none is left on disk): an
        eviction candidate again, at its own access time, in the tier that holds it."""
        if rec.state != COMPLETE or rec.flags & PINNED:
            return
        if rec.locations:
            if not rec.heaps & IN_HEAP:
                self.evictor.push(rec)
        elif not rec.disk_children and not rec.heaps & IN_DISK_HEAP:
            tier = self.tiers.by_segment.get(rec.disk_segment)
            if tier is not None:
                self.tiers.push(rec, tier)

    def drop_segment(self, segment_id: SegmentId) -> int:
        """The segment is gone: drop its replicas; objects left without any replica disappear."""
        lost = 0
        for space in list(self.tenants.values()):
            hit = [rec for rec in space.values() if on_segment(rec.locations, segment_id)]
            for rec in hit:
                if not keep_other_replicas(rec, segment_id):
                    self.drop(rec)
                    lost += 1
        self.leases.forget_segment(segment_id)
        self.space.forget_segment(segment_id)
        disk_only = self.tiers.drop_segment(segment_id, self.tenants)
        for rec in disk_only:
            self.drop(rec)
        lost += len(disk_only)
        self.recovery.forget_orphans_unless_recovering()
        self.dropped += lost
        return lost

    # ---- disk tiers (tiers.py) -----------------------------------------------------------------

    def apply_tier_report(self, segment: Segment, report: TierReport, now_s: float) -> None:
        for rec in self.tiers.apply_report(segment, report, self.tenants, now_s):
            self.drop(rec)

    def evict_disk(self, tier: DiskTier, now_s: float) -> None:
        """Disk eviction above the tier's high watermark (tiers.py)."""
        for rec in self.tiers.maybe_evict(tier, now_s):
            self.drop(rec)

    # ---- recovery (recovery.py) ----------------------------------------------------------------

    def announce(
        self, segment: Segment, entries: list[DirEntry], ages_s: list[float], now_s: float
    ) -> tuple[int, list[int]]:
        """Take objects a remounted segment's node says it holds committed; returns (accepted,
        rejected offsets). Only while the segment is recovering (its allocator is built at the end).
        A record rebuilt from its entry takes the LRU place its age says."""
        recovery = self.recovery
        accepted = 0
        rejected: list[int] = []
        for i, entry in enumerate(entries):
            if not recovery.acceptable(segment, entry):
                rejected.append(entry.offset)
                continue
            space = self.space_of(entry.tenant)
            rec = space.get(entry.key)
            if rec is not None:
                if not recovery.add_replica(segment, entry, rec):
                    rejected.append(entry.offset)
                    continue
            else:
                age_s = ages_s[i] if i < len(ages_s) and ages_s[i] > 0 else 0.0
                rec = recovery.rebuild(segment, entry, space, now_s - age_s)
                self._insert_recovered(space, rec)
                recovery.orphans.link(rec, entry.tenant, entry.parent)  # it joins the eviction heap at finish
            recovery.taken(segment, entry, rec)
            accepted += 1
        recovery.counted(accepted, len(rejected))
        return accepted, rejected

    def announce_disk(self, segment: Segment, entries: list[DiskEntry], now_s: float) -> int:
        """Take what a remounted node's disk tier holds; returns how many entries were refused
        (each answered with a DIR_DISK_DROP, so the node deletes the file)."""
        tiers = self.tiers
        tier = tiers.by_segment.get(segment.segment_id)
        refused = 0
        for entry in entries:
            ok = tiers.may_announce(tier, entry)
            if ok:
                space = self.space_of(entry.tenant)
                rec = space.get(entry.key)
                if rec is not None:
                    ok = tiers.take_announced_copy(rec, tier, entry, self.tenants)
                else:
                    rec = self.recovery.rebuild_disk_only(entry, space, now_s)
                    self._insert_recovered(space, rec, charged=False)
                    tiers.take_disk_only(rec, tier, entry.size)
                    self.recovery.orphans.link(rec, entry.tenant, entry.parent)
            if not ok:
                refused += 1
                tiers.refuse(segment, entry)
        self.recovery.counted(len(entries) - refused, refused)
        return refused

    def _insert_recovered(self, space: TenantSpace, rec: ObjectRecord, charged: bool = True) -> None:
        space[rec.key] = rec
        if charged:
            space.account.charge(rec, 1)
        self.num_complete += 1
        if self.events.recording:
            self.events.stored(space.name, rec.key)

    def finish_recovery(self, segment: Segment) -> int:
        """Build the segment's allocator from the announced ranges and let it take new objects;
        objects whose ranges overlap an earlier one lose this replica. Returns how many did."""
        before = self.recovery.rejected_announcements
        for rec in self.recovery.finish(segment):
            self.drop(rec, free_space=False)  # logs the removal
        return self.recovery.rejected_announcements - before
