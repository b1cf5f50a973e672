"""Reads: prefix lookups (leased or counting), lease release, existence probes and removal.

Rules:
- A lookup answers how many leading keys are complete and readable; with a lease it returns their
  packed replica locations, joined (protocol.LookupReply), and a lease id the reader hands back in
  ReleaseLeases (leases.py keeps the lease and is the only writer of its fields).
- A lookup that reaches a disk-only key stops there (a miss for this lookup) and starts the
  promotion of the disk-only keys from there on (up to `max_promotions_per_lookup`, tiers.py). A
  promotion that finds no DRAM range on its segment evicts for one (pressure.py) and tries once more.
- A draining object (eviction is waiting for its lease to end) takes no new lease, so a leased
  lookup stops there; a counting lookup still sees it.
- `exists` never leases and never touches recency: a probe is not a use.
- Removal takes complete objects only (pending ones belong to their writer: put_revoke). A leased
  one vanishes from its namespace at once but keeps its space until its lease ends (leases.py).
"""

from __future__ import annotations

from kvpool.core.protocol import REPLICA_BYTES
from kvpool.master.ids import IdSource
from kvpool.master.config import MasterConfig
from kvpool.master.index import ObjectIndex
from kvpool.master.leases import LeaseTable
from kvpool.master.pressure import Pressure
from kvpool.master.records import COMPLETE, PROMOTING, ObjectRecord

# byte length of a hit's packed replicas -> its replica count (protocol.MAX_REPLICAS fit in a byte)
_COUNT_OF_LENGTH = bytes(n // REPLICA_BYTES if n % REPLICA_BYTES == 0 else 0 for n in range(256))


class Reads:
    def __init__(self, config: MasterConfig, index: ObjectIndex, leases: LeaseTable, pressure: Pressure,
                 ids: IdSource) -> None:
        self.config = config
        self.index = index
        self.leases = leases
        self.pressure = pressure
        self.ids = ids
        self.last_num_promoting = 0  # of the last lookup: disk-only keys after its hits, being promoted
        self.lookups = 0
        self.gets = 0
        self.hit_keys = 0
        self.miss_keys = 0

    def lookup_prefix(
        self, tenant: str, keys: list[str], lease: bool, now_s: float, counted: bool = True
    ) -> tuple[int, int, bytes, bytes, bytes]:
        """How many leading keys are complete; with `lease`, lease them and return (num_hit,
        lease_id, packed replica locations, per-hit replica counts or b"" when all are 1, packed
        checksums). `counted=False`: a continuation of a lookup already counted (lookups, hits)."""
        if counted:
            self.lookups += 1
        self.last_num_promoting = 0
        space = self.index.tenants.get(tenant)
        num_hit = 0
        lease_id = 0
        locations = counts = checksums = b""
        if space is not None:
            get = space.get
            if lease:
                self.gets += 1
                ttl_s = self.config.lease_ttl_s
                hits, disk_only_at = self.leases.lease_run(get, keys, now_s, ttl_s)
                if disk_only_at >= 0:
                    self.last_num_promoting = self._promote(space, keys, disk_only_at, now_s)
                num_hit = len(hits)
                if num_hit:
                    lease_id = self.ids.next()
                    self.leases.grant(lease_id, tenant, hits, now_s + ttl_s)
                    parts = [rec.locations for rec in hits]
                    locations = b"".join(parts)
                    if len(locations) != REPLICA_BYTES * num_hit:
                        counts = bytes(map(len, parts)).translate(_COUNT_OF_LENGTH)
                    checksums = b"".join([rec.checksum for rec in hits])
            else:
                for key in keys:
                    rec = get(key)
                    if rec is None or rec.state != COMPLETE:
                        break
                    if not rec.locations:  # disk-only
                        self.last_num_promoting = self._promote(space, keys, num_hit, now_s)
                        break
                    rec.last_access_s = now_s
                    num_hit += 1
        if counted:
            self.hit_keys += num_hit
            self.miss_keys += len(keys) - num_hit
        return num_hit, lease_id, locations, counts, checksums

    def _promote(self, space: dict, keys: list[str], start: int, now_s: float) -> int:
        """Promote the disk-only keys from keys[start] on, in chain order; stops at the first that
        is not disk-only or cannot get DRAM. Returns how many are promoting."""
        tiers = self.index.tiers
        promoting = 0
        for key in keys[start : start + self.config.max_promotions_per_lookup]:
            rec: ObjectRecord | None = space.get(key)
            if rec is None or rec.locations or rec.state != COMPLETE:
                break
            tier = tiers.by_segment.get(rec.disk_segment)
            if tier is None:
                break
            if not rec.flags & PROMOTING:
                segment = tiers.promotion_segment(tier)
                if segment is None:
                    break
                if not tiers.start_promotion(rec, tier, segment, now_s):
                    self.pressure.make_room_on(segment, rec.disk_size, rec.space.account, now_s)
                    if not tiers.start_promotion(rec, tier, segment, now_s):
                        break
            tier.disk_hits += 1
            promoting += 1
        return promoting

    def count_hits_after(self, num_hits: int) -> None:
        """Keys the last lookup counted as misses were hits found elsewhere (inline values)."""
        self.hit_keys += num_hits
        self.miss_keys -= num_hits

    def count_inline_get(self) -> None:
        """A GetValue served inline, counted as the leased lookup it replaces."""
        self.lookups += 1
        self.gets += 1
        self.hit_keys += 1

    def release_leases(self, tenant: str, lease_ids: list[int]) -> int:
        return self.leases.release(tenant, lease_ids)

    def exists(self, tenant: str, keys: list[str]) -> list[bool]:
        """Complete or not, per key. Never leases and never touches recency: a probe is not a use."""
        space = self.index.tenants.get(tenant)
        if space is None:
            return [False] * len(keys)
        get = space.get
        return [(rec := get(key)) is not None and rec.state == COMPLETE for key in keys]

    def remove(self, tenant: str, keys: list[str], now_s: float) -> int:
        """Remove complete objects. A leased one vanishes from the namespace at once but keeps its
        space until its lease ends."""
        space = self.index.tenants.get(tenant)
        if space is None:
            return 0
        removed = 0
        for key in keys:
            rec = space.get(key)
            if rec is None or rec.state != COMPLETE:
                continue
            removed += 1
            if self.leases.is_leased(rec, now_s):
                self.index.drop(rec, free_space=False)
                self.leases.hold_removed(rec)
            else:
                self.index.drop(rec)
        return removed
