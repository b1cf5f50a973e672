"""Writes: allocation (PutStart), end (PutEnd), landing (PutLanded), revoke, quarantine and reclaim.

Rules:
- Writes are fenced by tokens: put_start gives each allocation a token (ids.py) kept on its
  record; put_end and put_revoke act only on a pending record whose token matches, so a late or
  duplicate end (reclaimed, revoked, or removed and re-put by another writer) is refused and
  reported, never applied. A revoke whose write may still land (`in_flight`) keeps the space in
  quarantine (space.py) until end_quarantine names the token, the segment goes, or quarantine_max_s.
- put_end's `as_keys` moves a pending record to the key it is ended under (client/ahead.py: an
  allocation a writer held for its next put), unless that key is held here or inline; its token
  and space go with it, so every rule above holds for it as for any pending put. Allocations
  ahead take free space only: nothing is evicted for them.
- put_end with `landing` (a writer ending while its bytes travel) checks, renames and keeps the
  checksum as any end, but the record stays in the landing state until put_landed names it with
  its token; until then it is a miss for readers and an existing key for writers, and reclaim,
  revoke and quarantine treat it as the pending put it is.
- Quotas (quotas.py): a tenant at its quota evicts only its own objects and is refused when they do
  not make room. Placement goes to the segments the tenant may use (segments.placeable).
- Pending records are kept in put order (`_pending`), so reclaiming the ones whose writer died is
  O(reclaimed): a pending record's last_access_s is its put_start time.
- This module changes no record field itself: it asks the index (create, end, land, drop).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from kvpool.core.protocol import PUT_ALLOCATED, PUT_EXISTS, PUT_NO_SPACE, Replica
from kvpool.master import chains
from kvpool.master.config import MasterConfig
from kvpool.master.eviction import PUT_EVICTION_FACTOR
from kvpool.master.ids import IdSource
from kvpool.master.index import ObjectIndex
from kvpool.master.pressure import Pressure
from kvpool.master.quotas import TenantAccount, TenantSpace
from kvpool.master.records import COMPLETE, LANDING, PENDING, ObjectRecord

_NO_REPLICAS: tuple = ()


class Writes:
    def __init__(self, config: MasterConfig, index: ObjectIndex, pressure: Pressure, ids: IdSource) -> None:
        self.config = config
        self.index = index
        self.space = index.space
        self.pressure = pressure
        self.ids = ids
        # pending records in put order; a pending record's last_access_s is its put_start time
        self._pending: deque[ObjectRecord] = deque()
        self._pending_ahead: deque[ObjectRecord] = deque()  # the same, held for a writer's next put
        self.refused_put_ends = 0
        self.reclaimed = 0
        self.ahead_expired = 0
        self.landed = 0
        self.refused_landings = 0

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
        index = self.index
        space = index.space_of(tenant)
        account = space.account
        statuses: list[int] = []
        replicas: list[tuple[Replica, ...]] = []
        tokens: list[int] = []
        message = ""
        allocated = 0
        for i, key in enumerate(keys):
            rec = space.get(key)
            if rec is not None:
                if rec.state == COMPLETE:
                    index.touch(rec, now_s)
                statuses.append(PUT_EXISTS)
                replicas.append(_NO_REPLICAS)
                tokens.append(0)
                continue
            size = index.interned_size(sizes[i])
            parent_key = parents[i] if parents else None
            parent = space.get(parent_key) if parent_key is not None else None
            if parent is not None:
                chains.hold_parent(parent)  # before placing: eviction for this put must spare its prefix
            own_only = account.dedicated  # eviction for it takes only its own objects
            if not account.fits(size, num_replicas):
                own_only = True
                if ahead or not account.fits_when_empty(size, num_replicas) or not self.pressure.evict_for_quota(
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
                    index.release_parent(parent)
                statuses.append(PUT_NO_SPACE)
                replicas.append(_NO_REPLICAS)
                tokens.append(0)
                message = message or why
                continue
            token = self.ids.next()
            rec = index.create(space, key, placed, pinned, now_s, token, parent)
            (self._pending_ahead if ahead else self._pending).append(rec)
            statuses.append(PUT_ALLOCATED)
            replicas.append(placed)
            tokens.append(token)
            allocated += size * len(placed)
        if not ahead:  # held ahead: nothing is evicted for a put that may never come
            self.pressure.evict_over_high(now_s, PUT_EVICTION_FACTOR * allocated)  # the rest: in slices
        return statuses, replicas, message, tokens

    def _place(self, account: TenantAccount, size: int, num_replicas: int, now_s: float,
               own_only: bool, evict: bool = True) -> tuple[tuple[Replica, ...], str]:
        """Allocate replicas on the segments the tenant may use; `own_only`: eviction for room
        takes only its own objects (it is at its quota, or places on its dedicated segments);
        without `evict`, free space only."""
        space = self.space
        placeable = space.placeable(account.name)
        chosen = placeable.choose(size, num_replicas)
        if not chosen:
            why = space.why_nowhere(placeable, account.name, account.dedicated, size)
            if why:
                return _NO_REPLICAS, why
            if evict and self.pressure.evict_for(size, now_s, placeable.segments.values(),
                                                 account if own_only else None):
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
        return space.allocate(chosen, size), ""

    def _pending_with_token(self, space: TenantSpace | None, key: str, token: int) -> ObjectRecord | None:
        rec = space.get(key) if space is not None else None
        if rec is None or rec.state not in (PENDING, LANDING) or rec.token != token:
            return None
        return rec

    def put_end(
        self, tenant: str, keys: list[str], tokens: list[int], checksums: list[int], now_s: float,
        as_keys: list[str] | None = None, taken: Callable[[str], bool] | None = None, landing: bool = False,
    ) -> tuple[int, list[int], list[int]]:
        """Make pending objects readable; returns (how many ended, indices refused: no pending
        allocation under that key has that token any more, indices existed). With `as_keys`, the
        allocation pending under keys[i] is ended under as_keys[i], unless that key is held here
        or `taken(key)` says it is held elsewhere (inline): then it stays pending under keys[i].
        With `landing`, the ended objects stay pending until put_landed names them."""
        space = self.index.tenants.get(tenant)
        ended = 0
        refused: list[int] = []
        existed: list[int] = []
        for i, key in enumerate(keys):
            rec = self._pending_with_token(space, key, tokens[i])
            if rec is None or rec.state == LANDING:
                refused.append(i)
                continue
            new_key = None
            if as_keys and as_keys[i] != key:
                new_key = as_keys[i]
                if new_key in space or (taken is not None and taken(new_key)):
                    existed.append(i)
                    continue
            ended += 1
            self.index.end(rec, checksums[i], new_key, landing, now_s)
        if not landing:
            self.index.count_completed(ended)
        self.refused_put_ends += len(refused)
        return ended, refused, existed

    def put_landed(self, tenant: str, keys: list[str], tokens: list[int], now_s: float,
                   checksums: list[int] | None = None) -> int:
        """Make readable the objects ended with `landing` whose bytes are now written, with their
        checksums where given (non-zero); returns how many."""
        space = self.index.tenants.get(tenant)
        landed = 0
        for i, (key, token) in enumerate(zip(keys, tokens)):
            rec = self._pending_with_token(space, key, token)
            if rec is None or rec.state != LANDING:
                self.refused_landings += 1
                continue
            self.index.land(rec, checksums[i] if checksums else 0, now_s)
            landed += 1
        self.index.count_completed(landed)
        self.landed += landed
        return landed

    def put_revoke(self, tenant: str, keys: list[str], tokens: list[int], in_flight: list[int], now_s: float) -> int:
        """Free pending allocations named by their tokens; those in `in_flight` are quarantined."""
        space = self.index.tenants.get(tenant)
        uncertain = set(in_flight)
        revoked = 0
        for i, key in enumerate(keys):
            rec = self._pending_with_token(space, key, tokens[i])
            if rec is None:
                continue
            revoked += 1
            if i in uncertain:
                self.index.drop(rec, free_space=False)
                self.space.quarantine(rec.token, space, rec.replicas, now_s + self.config.quarantine_max_s)
            else:
                self.index.drop(rec)
        return revoked

    def end_quarantine(self, tenant: str, tokens: list[int]) -> int:
        """Free quarantined space of these tokens (only the tenant's own: tokens of another are ignored)."""
        space = self.index.tenants.get(tenant)
        return self.space.end_quarantine(space, tokens) if space is not None else 0

    @property
    def ahead_timeout_s(self) -> float:
        return min(self.config.ahead_timeout_s, self.config.put_timeout_s)

    def reclaim_pending(self, now_s: float) -> int:
        """Free pending objects whose put never ended within put_timeout_s (their writer died), and
        allocations held ahead not used within ahead_timeout_s (counted apart: nobody died)."""
        reclaimed = self._reclaim(self._pending, now_s - self.config.put_timeout_s)
        self.reclaimed += reclaimed
        self.ahead_expired += self._reclaim(self._pending_ahead, now_s - self.ahead_timeout_s)
        return reclaimed

    def _reclaim(self, pending: deque[ObjectRecord], started_before_s: float) -> int:
        """Drop the pending records at the head of `pending` (put order) started before the limit."""
        reclaimed = 0
        while pending:
            rec = pending[0]
            if rec.state in (PENDING, LANDING):
                if rec.last_access_s > started_before_s:
                    break  # put order: every later entry started later
                self.index.drop(rec)
                reclaimed += 1
            pending.popleft()
        return reclaimed
