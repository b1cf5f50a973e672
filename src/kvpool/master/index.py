"""The object index: objects per tenant, puts, prefix lookups with read leases, removal, reclaim.

Rules:
- Pure logic: no I/O, no clock (every call takes `now_s`). The service, the simulator and the tests
  drive the same code.
- Object states: pending (space allocated, writer copying) -> complete (readable) -> gone (evicted,
  removed, revoked, reclaimed, or its last replica's segment died). A key that exists in either
  state answers PUT_EXISTS without new space; unknown keys are misses, never errors.
- Tenants are separate dicts (quotas.TenantSpace, one per stored namespace): no call can reach
  another tenant's keys. The tenant owning a namespace (access.namespace_owner) has an account
  (quotas.TenantAccount) with its usage (bytes, objects, replicas per segment), kept by
  `TenantAccount.charge` wherever a record gains or loses DRAM replicas; a tenant at its quota
  evicts only its own objects and is refused when they do not make room (quotas.py). Placement goes
  to the segments the tenant may use (segments.placeable: its dedicated ones, else the shared ones).
- Space is freed only when no reader can still hold it: a removed object that is leased keeps its
  space until the lease ends (`_zombies`); eviction never picks a leased object.
- One record per object, with __slots__, sharing what can be shared (a batch's `now_s` float, the
  interned size int), because the master must hold millions of small KV blocks. Its replicas are
  kept packed (24 bytes each, one bytes object): a leased lookup sends them as-is, joined.
- Leases: every leased lookup with hits gets a lease id and an entry in `_leases` (id -> tenant
  and the records it leased); each record counts the entries holding it (`lease_count`). A reader
  done with its reads releases its id: the entry goes, its records' counts drop, and a record at 0
  is unleased at once (evictable, or freed if it was removed). Another reader's lease on the same
  object keeps the count above 0, so a release never ends someone else's lease. Rejected: a bare
  per-key count released by key (a release arriving after its lease expired and another reader
  leased the object would end the new reader's lease; a duplicate release would too; and removed
  objects are no longer findable by key). The entry also makes a release cost O(its hits) with no
  key lookups, and a second release of the same id a no-op. Entries whose lease ended are purged
  by `expire_leases` (ids are granted in expiry order: one TTL for all); the lease_until_s check
  stays the authority, so an unreleased lease still ends at its TTL.
- Writes are fenced by tokens: put_start gives each allocation a token (ids.py) kept on its
  record; put_end and put_revoke act only on a pending record whose token matches, so a late or
  duplicate end (reclaimed, revoked, or removed and re-put by another writer) is refused and
  reported, never applied. A revoke whose write may still land (`in_flight`) keeps the space in
  `_quarantine` until end_quarantine names the token, the segment goes, or quarantine_max_s.
  put_end's `as_keys` moves a pending record to the key it is ended under (client/ahead.py: an
  allocation a writer held for its next put), unless that key is held here or inline; its token
  and space go with it, so every rule above holds for it as for any pending put. Allocations
  ahead take free space only: nothing is evicted for them.
- put_end with `landing` (a writer ending while its bytes travel) checks, renames and keeps the
  checksum as any end, but the record stays pending (flag LANDING) until put_landed names it with
  its token; until then it is a miss for readers and an existing key for writers, and reclaim,
  revoke and quarantine treat it as the pending put it is.
- Every change to what a segment holds committed is appended to its directory log (directory.py):
  an add on put_end, a removal (size 0) when a committed object goes. Nodes keep that directory
  and announce it to a new master (`announce`), which rebuilds records, chains, tails and an LRU
  order (by commit age) from it. Announced entries that conflict with what the index already holds
  (another checksum or size under the key, a pending put of it, overlapping ranges) are rejected.
- Disk tiers (tiers.py): an object may also have a copy on its node's disk. DRAM eviction of such
  an object keeps it as disk-only (no replicas); lookups stop at a disk-only key and start its
  promotion. `num_children` counts a record's children that hold DRAM (or are pending),
  `disk_children` those on disk only, so DRAM eviction can take a parent whose children all went to
  disk, and nothing is dropped from the pool before its suffixes.
"""

from __future__ import annotations

from collections import deque

from kvpool.core.protocol import (
    PUT_ALLOCATED,
    PUT_EXISTS,
    PUT_NO_SPACE,
    REPLICA_BYTES,
    DirEntry,
    Replica,
    TenantStats,
    pack_replicas,
)
from kvpool.master.config import MasterConfig
from kvpool.master import chains
from kvpool.master.eviction import PUT_EVICTION_FACTOR, Evictor
from kvpool.master.ids import IdSource
from kvpool.master.access import namespace_owner
from kvpool.master.quotas import TenantAccount, TenantSpace
from kvpool.master.recovery import Recovery
from kvpool.master.replicas import keep_other_replicas, on_segment
from kvpool.master.segments import Segment, SegmentTable
from kvpool.master.records import (COMPLETE, DRAINING, GONE, IN_DISK_HEAP, IN_HEAP, LANDING, PENDING, PINNED,
                                   ObjectRecord, move)
from kvpool.master.space import SegmentSpace
from kvpool.master.tiers import Tiers

_NO_REPLICAS: tuple = ()
# byte length of a hit's packed replicas -> its replica count (protocol.MAX_REPLICAS fit in a byte)
_COUNT_OF_LENGTH = bytes(n // REPLICA_BYTES if n % REPLICA_BYTES == 0 else 0 for n in range(256))


class ObjectIndex:
    def __init__(self, config: MasterConfig, segments: SegmentTable, ids: IdSource) -> None:
        self.config = config
        self.segments = segments
        self.space = SegmentSpace(segments)
        self.ids = ids
        self.tenants: dict[str, TenantSpace] = {}  # stored namespace -> its objects
        self.accounts: dict[str, TenantAccount] = {}  # owning tenant -> usage and quota
        self.evictor = Evictor(self)
        self.tiers = Tiers(self)
        self.recovery = Recovery(self)
        segments.dedicated_tenants.update(config.quotas.dedicated)  # dedicated before their segments mount
        self.last_num_promoting = 0  # of the last lookup: disk-only keys after its hits, being promoted
        # pending records in put order; a pending record's last_access_s is its put_start time
        self._pending: deque[ObjectRecord] = deque()
        self._pending_ahead: deque[ObjectRecord] = deque()  # the same, held for a writer's next put
        self._zombies: set[ObjectRecord] = set()  # removed while leased: space freed when the lease ends
        self._leases: dict[int, tuple[str, list[ObjectRecord]]] = {}  # lease id -> (tenant, records)
        self._lease_order: deque[tuple[float, int]] = deque()  # (until_s, lease id), in grant order
        self.lease_releases = 0
        self.refused_put_ends = 0
        self.recovered_objects = 0
        self.rejected_announcements = 0
        self._sizes: dict[int, int] = {}  # interned size ints: KV blocks mostly share a few sizes
        self.num_complete = 0
        self.num_pending = 0
        self.puts = 0
        self.gets = 0
        self.lookups = 0
        self.hit_keys = 0
        self.miss_keys = 0
        self.lease_grants = 0
        self.lease_expiries = 0
        self.reclaimed = 0
        self.ahead_expired = 0
        self.landed = 0
        self.refused_landings = 0
        self.dropped = 0

    # ---- put -----------------------------------------------------------------------------------

    def put_start(
        self,
        tenant: str,
        keys: list[str],
        sizes: list[int],
        parents: list[str | None],
        num_replicas: int,
        pinned: bool,
        now_s: float,
        ahead: bool = False,
    ) -> tuple[list[int], list[tuple[Replica, ...]], str, list[int]]:
        """`ahead`: allocations a writer holds for its next put (PutEnd.ahead): they take free space
        only, never evicting for it (an object is not dropped for a put that may never come), so a
        full pool, or a tenant at its quota, answers PUT_NO_SPACE for them (not a refusal)."""
        space = self.space_of(tenant)
        account = space.account
        statuses: list[int] = []
        replicas: list[tuple[Replica, ...]] = []
        tokens: list[int] = []
        message = ""
        allocated = 0
        base_flags = PINNED if pinned else 0
        for i, key in enumerate(keys):
            rec = space.get(key)
            if rec is not None:
                if rec.state == COMPLETE:
                    rec.last_access_s = now_s
                statuses.append(PUT_EXISTS)
                replicas.append(_NO_REPLICAS)
                tokens.append(0)
                continue
            size = self._sizes.setdefault(sizes[i], sizes[i])
            parent_key = parents[i] if parents else None
            parent = space.get(parent_key) if parent_key is not None else None
            if parent is not None:
                chains.hold_parent(parent)  # before placing: eviction for this put must spare its prefix
            own_only = account.dedicated  # eviction for it takes only its own objects
            if not account.fits(size, num_replicas):
                own_only = True
                if ahead or not account.fits_when_empty(size, num_replicas) or not self.evictor.evict_for_quota(
                        account, size, num_replicas, now_s):
                    if not ahead:
                        account.quota_refusals += 1
                    placed, why = _NO_REPLICAS, account.refusal_message(size, num_replicas)
                else:
                    placed, why = self._place(account, size, num_replicas, now_s, own_only)
            else:
                placed, why = self._place(account, size, num_replicas, now_s, own_only, evict=not ahead)
            if not placed:
                if parent is not None:
                    self._release_child(parent)
                statuses.append(PUT_NO_SPACE)
                replicas.append(_NO_REPLICAS)
                tokens.append(0)
                message = message or why
                continue
            token = self.ids.next()
            rec = ObjectRecord(space, key, pack_replicas(placed), PENDING, base_flags, now_s, token)
            chains.attach(rec, parent)
            space[key] = rec
            account.charge(rec, 1)
            self.num_pending += 1
            (self._pending_ahead if ahead else self._pending).append(rec)
            statuses.append(PUT_ALLOCATED)
            replicas.append(placed)
            tokens.append(token)
            allocated += size * len(placed)
        if not ahead:  # held ahead: nothing is evicted for a put that may never come
            self.evictor.evict_over_high(now_s, PUT_EVICTION_FACTOR * allocated)  # the rest: in slices (eviction.py)
        return statuses, replicas, message, tokens

    def _place(self, account: TenantAccount, size: int, num_replicas: int, now_s: float,
               own_only: bool, evict: bool = True) -> tuple[tuple[Replica, ...], str]:
        """Allocate replicas on the segments the tenant may use; `own_only`: eviction for room
        takes only its own objects (it is at its quota, or places on its dedicated segments);
        without `evict`, free space only."""
        placeable = self.space.placeable(account.name)
        chosen = placeable.choose(size, num_replicas)
        if not chosen:
            why = self.space.why_nowhere(placeable, account.name, account.dedicated, size)
            if why:
                return _NO_REPLICAS, why
            if evict and self.evictor.evict_for(size, now_s, placeable.segments.values(), account if own_only else None):
                chosen = placeable.choose(size, num_replicas)
            if not chosen:
                where = f"tenant {account.name!r}'s dedicated segments" if account.dedicated else "pool"
                used = sum(s.used_bytes for s in placeable.segments.values())
                capacity = sum(s.capacity_bytes for s in placeable.segments.values())
                return _NO_REPLICAS, (
                    f"{where} full: no segment has a free range of {size} bytes even after eviction "
                    f"(used {used} of {capacity} bytes; the rest is leased, pending or pinned, or fragmented); "
                    "retry later or add nodes"
                )
        return self.space.allocate(chosen, size), ""

    def _pending_with_token(self, space: dict | None, key: str, token: int) -> ObjectRecord | None:
        rec = space.get(key) if space is not None else None
        if rec is None or rec.state not in (PENDING, LANDING) or rec.token != token:
            return None
        return rec

    def put_end(
        self, tenant: str, keys: list[str], tokens: list[int], checksums: list[int], now_s: float,
        as_keys: list[str] | None = None, taken=None, landing: bool = False,
    ) -> tuple[int, list[int], list[int]]:
        """Make pending objects readable; returns (how many ended, indices refused: no pending
        allocation under that key has that token any more, indices existed). With `as_keys`, the
        allocation pending under keys[i] is ended under as_keys[i], unless that key is held here
        or `taken(key)` says it is held elsewhere (inline): then it stays pending under keys[i].
        With `landing`, the ended objects stay pending until put_landed names them."""
        space = self.tenants.get(tenant)
        ended = 0
        refused: list[int] = []
        existed: list[int] = []
        for i, key in enumerate(keys):
            rec = self._pending_with_token(space, key, tokens[i])
            if rec is None or rec.state == LANDING:
                refused.append(i)
                continue
            if as_keys and as_keys[i] != key:
                new_key = as_keys[i]
                if new_key in space or (taken is not None and taken(new_key)):
                    existed.append(i)
                    continue
                del space[key]
                rec.key = new_key
                space[new_key] = rec
            checksum = checksums[i]
            if checksum:
                rec.checksum = checksum.to_bytes(8, "little")
            ended += 1
            if landing:
                move(rec, LANDING)
            else:
                self._complete(rec, tenant, now_s)
        if not landing:
            self._count_completed(ended)
        self.refused_put_ends += len(refused)
        return ended, refused, existed

    def put_landed(self, tenant: str, keys: list[str], tokens: list[int], now_s: float,
                   checksums: list[int] | None = None) -> int:
        """Make readable the objects ended with `landing` whose bytes are now written, with their
        checksums where given (non-zero); returns how many."""
        space = self.tenants.get(tenant)
        landed = 0
        for i, (key, token) in enumerate(zip(keys, tokens)):
            rec = self._pending_with_token(space, key, token)
            if rec is None or rec.state != LANDING:
                self.refused_landings += 1
                continue
            if checksums and checksums[i]:
                rec.checksum = checksums[i].to_bytes(8, "little")
            self._complete(rec, tenant, now_s)
            landed += 1
        self._count_completed(landed)
        self.landed += landed
        return landed

    def _complete(self, rec: ObjectRecord, tenant: str, now_s: float) -> None:
        """A pending record becomes readable: evictable, logged in its segments' directories (the
        caller counts it: _count_completed)."""
        move(rec, COMPLETE)
        rec.last_access_s = now_s
        if not rec.num_children and not rec.flags & PINNED:
            self.evictor.push(rec)
        parent_key = rec.parent.key if rec.parent is not None else None
        self.space.log_commit(rec.replicas, tenant, rec.key, parent_key, int.from_bytes(rec.checksum, "little"))

    def _count_completed(self, num: int) -> None:
        """Counted once per batch of _complete calls (a chain's put ends many at once)."""
        self.num_pending -= num
        self.num_complete += num
        self.puts += num

    def put_revoke(self, tenant: str, keys: list[str], tokens: list[int], in_flight: list[int], now_s: float) -> int:
        """Free pending allocations named by their tokens; those in `in_flight` are quarantined."""
        space = self.tenants.get(tenant)
        uncertain = set(in_flight)
        revoked = 0
        for i, key in enumerate(keys):
            rec = self._pending_with_token(space, key, tokens[i])
            if rec is None:
                continue
            revoked += 1
            if i in uncertain:
                self.drop(rec, free_space=False)
                self.space.quarantine(rec.token, space, rec.replicas, now_s + self.config.quarantine_max_s)
            else:
                self.drop(rec)
        return revoked

    def end_quarantine(self, tenant: str, tokens: list[int]) -> int:
        """Free quarantined space of these tokens (only the tenant's own: tokens of another are ignored)."""
        space = self.tenants.get(tenant)
        return self.space.end_quarantine(space, tokens) if space is not None else 0

    def expire_quarantine(self, now_s: float) -> int:
        """Free quarantines past their limit: a writer silent that long is taken to be gone."""
        return self.space.expire_quarantine(now_s)

    @property
    def num_quarantined(self) -> int:
        return self.space.num_quarantined

    @property
    def quarantine_expiries(self) -> int:
        return self.space.quarantine_expiries

    @property
    def ahead_timeout_s(self) -> float:
        return min(self.config.ahead_timeout_s, self.config.put_timeout_s)

    def reclaim_pending(self, now_s: float) -> int:
        """Free pending objects whose put never ended within put_timeout_s (their writer died), and
        allocations held ahead not used within ahead_timeout_s (counted apart: nobody died)."""
        reclaimed = _reclaim(self, self._pending, now_s - self.config.put_timeout_s)
        self.reclaimed += reclaimed
        self.ahead_expired += _reclaim(self, self._pending_ahead, now_s - self.ahead_timeout_s)
        return reclaimed

    # ---- get -----------------------------------------------------------------------------------

    def lookup_prefix(
        self, tenant: str, keys: list[str], lease: bool, now_s: float, counted: bool = True
    ) -> tuple[int, int, bytes, bytes, bytes]:
        """How many leading keys are complete; with `lease`, lease them and return (num_hit,
        lease_id, packed replica locations, per-hit replica counts or b"" when all are 1, packed
        checksums). `counted=False`: a continuation of a lookup already counted (lookups, hits).

        A draining object (eviction is waiting for its lease to end) takes no new lease, so a
        leased lookup stops there; a counting lookup (lease=False) still sees it.
        """
        if counted:
            self.lookups += 1
        self.last_num_promoting = 0
        space = self.tenants.get(tenant)
        hits: list[ObjectRecord] = []
        num_hit = 0
        lease_id = 0
        locations = counts = checksums = b""
        if space is not None:
            get = space.get
            if lease:
                self.gets += 1
                until_s = now_s + self.config.lease_ttl_s
                reopen_s = now_s - self.config.lease_ttl_s  # a draining object is leasable again after
                append = hits.append
                for key in keys:
                    rec = get(key)
                    if rec is None:
                        break
                    if not rec.locations:  # disk-only
                        self.last_num_promoting = self._promote(space, keys, len(hits), now_s)
                        break
                    if rec.state != COMPLETE:
                        break
                    flags = rec.flags
                    if flags & DRAINING:
                        if (rec.lease_until_s or 0.0) > reopen_s:
                            break
                        rec.flags = flags & ~DRAINING  # eviction had its window and did not need it
                    lease_until = rec.lease_until_s
                    if lease_until is None or lease_until <= now_s:
                        if lease_until is not None:
                            self.lease_expiries += 1
                        rec.lease_since_s = now_s
                        self.lease_grants += 1
                    rec.lease_until_s = until_s
                    rec.last_access_s = now_s
                    rec.lease_count += 1
                    append(rec)
                num_hit = len(hits)
                if num_hit:
                    lease_id = self.ids.next()
                    self._leases[lease_id] = (tenant, hits)
                    self._lease_order.append((until_s, lease_id))
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
        """Promote the disk-only keys from keys[start] on (tiers.py); returns how many are promoting."""
        chain = []
        for key in keys[start : start + self.config.max_promotions_per_lookup]:
            rec = space.get(key)
            if rec is None or rec.locations or rec.state != COMPLETE:
                break
            chain.append(rec)
        return self.tiers.promote_chain(chain, now_s)

    def release_leases(self, tenant: str, lease_ids: list[int], now_s: float) -> int:
        """End these leased lookups' leases (see the module rules); returns how many were live."""
        leases = self._leases
        released = 0
        for lease_id in lease_ids:
            entry = leases.get(lease_id)
            if entry is None or entry[0] != tenant:
                continue  # unknown, expired, released already, or another tenant's
            del leases[lease_id]
            released += 1
            self._unhold(entry[1], now_s)
        self.lease_releases += released
        return released

    def expire_leases(self, now_s: float) -> None:
        """Drop lease entries whose TTL has passed (their records' lease_until_s already says so)."""
        order = self._lease_order
        leases = self._leases
        while order and order[0][0] <= now_s:
            entry = leases.pop(order.popleft()[1], None)
            if entry is not None:
                self._unhold(entry[1], now_s)

    def _unhold(self, records: list[ObjectRecord], now_s: float) -> None:
        zombies = self._zombies
        for rec in records:
            left = rec.lease_count - 1
            rec.lease_count = left
            if left == 0 and rec.lease_until_s is not None:
                rec.lease_until_s = rec.lease_since_s = None  # no reader holds it any more
                if rec in zombies:
                    zombies.discard(rec)
                    self.space.free(rec.replicas)

    def count_hits_after(self, num_hits: int) -> None:
        """Keys the last lookup counted as misses were hits found elsewhere (inline values)."""
        self.hit_keys += num_hits
        self.miss_keys -= num_hits

    def holds(self, tenant: str, key: str) -> bool:
        """Whether the key names a record here in any state (pending, complete, disk-only)."""
        space = self.tenants.get(tenant)
        return space is not None and key in space

    def exists(self, tenant: str, keys: list[str]) -> list[bool]:
        """Complete or not, per key. Never leases and never touches recency: a probe is not a use."""
        space = self.tenants.get(tenant)
        if space is None:
            return [False] * len(keys)
        get = space.get
        return [(rec := get(key)) is not None and rec.state == COMPLETE for key in keys]

    # ---- removal -------------------------------------------------------------------------------

    def remove(self, tenant: str, keys: list[str], now_s: float) -> int:
        """Remove complete objects (pending ones belong to their writer: put_revoke). A leased one
        vanishes from the namespace at once but keeps its space until its lease ends."""
        space = self.tenants.get(tenant)
        if space is None:
            return 0
        removed = 0
        for key in keys:
            rec = space.get(key)
            if rec is None or rec.state != COMPLETE:
                continue
            removed += 1
            if rec.lease_until_s is not None and rec.lease_until_s > now_s:
                self.drop(rec, free_space=False)
                self._zombies.add(rec)
            else:
                self.drop(rec)
        return removed

    def free_zombies(self, now_s: float) -> None:
        """Free removed objects whose lease ran out unreleased (released ones are freed at once)."""
        done = [rec for rec in self._zombies if rec.lease_until_s is None or rec.lease_until_s <= now_s]
        for rec in done:
            self._zombies.discard(rec)
            self.space.free(rec.replicas)

    def drop(self, rec: ObjectRecord, free_space: bool = True) -> None:
        """Forget an object: out of its namespace, out of its parent's child count, space freed."""
        if rec.state == GONE:
            return
        was = move(rec, GONE)
        space = rec.space
        del space[rec.key]
        space.account.charge(rec, -1)
        if was == COMPLETE:
            self.num_complete -= 1
            self.space.log_removal(rec.replicas)
        else:
            self.num_pending -= 1
        if rec.disk_segment is not None:
            self.tiers.forget(rec)
        tail = chains.detach(rec)
        if tail is not None:
            self.became_tail(tail)
        if free_space:
            self.space.free(rec.replicas)

    def evict(self, rec: ObjectRecord) -> None:
        """DRAM eviction chose `rec` (eviction.py): to its disk tier if it has a copy there, else gone."""
        if not self.tiers.demote(rec):
            self.drop(rec)

    def _release_child(self, parent: ObjectRecord) -> None:
        tail = chains.release_parent(parent)
        if tail is not None:
            self.became_tail(tail)

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

    def drop_segment(self, segment_id: int) -> int:
        """The segment is gone: drop its replicas; objects left without any replica disappear."""
        lost = 0
        for space in list(self.tenants.values()):
            hit = [rec for rec in space.values() if on_segment(rec.locations, segment_id)]
            for rec in hit:
                if not keep_other_replicas(rec, segment_id):
                    self.drop(rec)
                    lost += 1
        for rec in [z for z in self._zombies if on_segment(z.locations, segment_id)]:
            if not keep_other_replicas(rec, segment_id, charged=False):
                self._zombies.discard(rec)
        self.space.forget_segment(segment_id)
        lost += self.tiers.drop_segment(segment_id)
        self.recovery.forget_orphans_unless_recovering()
        self.dropped += lost
        return lost

    # ---- recovery (recovery.py) ----------------------------------------------------------------

    def announce(
        self, segment: Segment, entries: list[DirEntry], ages_s: list[float], now_s: float
    ) -> tuple[int, list[int]]:
        """Take objects a remounted segment's node says it holds committed; returns (accepted,
        rejected offsets). Only while the segment is recovering (its allocator is built at the end)."""
        return self.recovery.announce(segment, entries, ages_s, now_s)

    def finish_recovery(self, segment: Segment) -> int:
        """Build the segment's allocator from the announced ranges and let it take new objects;
        objects whose ranges overlap an earlier one lose this replica. Returns how many did."""
        return self.recovery.finish(segment)

    # ---- tenants (quotas.py) -------------------------------------------------------------------

    def space_of(self, tenant: str) -> TenantSpace:
        """The namespace's dict, made on first use in the account of the tenant that owns it (made
        with its quota on first use; a quota or a dedicated segment gives it its own eviction heap)."""
        space = self.tenants.get(tenant)
        if space is None:
            space = self.tenants[tenant] = TenantSpace(tenant, self.account_of(namespace_owner(tenant)))
        account = space.account
        if not account.dedicated and account.name in self.segments.dedicated_tenants:
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

    def tenant_segments(self, tenant: str) -> set[int]:
        """Ids of the segments holding a replica of any pending or complete object of `tenant`, in
        any of its namespaces (a stored namespace `<tenant>/<ns>` names its owner too). Kept per put
        and drop (quotas.TenantAccount.charge), not scanned."""
        account = self.accounts.get(namespace_owner(tenant))
        return account.segments() if account is not None else set()

    def tenant_stats(self) -> list[TenantStats]:
        return [account.stats() for account in self.accounts.values()]


def _reclaim(index: ObjectIndex, pending: deque, started_before_s: float) -> int:
    """Drop the pending records at the head of `pending` (put order) started before the limit."""
    reclaimed = 0
    while pending:
        rec = pending[0]
        if rec.state in (PENDING, LANDING):
            if rec.last_access_s > started_before_s:
                break  # put order: every later entry started later
            index.drop(rec)
            reclaimed += 1
        pending.popleft()
    return reclaimed
