"""Object records and eviction: LRU over chain tails, never a leased, pending or pinned object.

Rules:
- Candidates are complete, unpinned objects with no children (no object names them as parent):
  evicting only tails means a cached suffix is never left without its prefix. When a tail goes,
  its parent becomes a tail and a candidate, at its own (older) last access time.
- LRU among candidates: a heap of records ordered by the access time they had when pushed, with
  lazy invalidation. An access only writes `last_access_s` (O(1), no heap work on the lookup hot
  path); a popped record whose access time moved on is pushed back with the new time. This is exact
  LRU: a record popped fresh has an access time no later than any stale entry's true time.
- Each record is in the heap at most once (IN_HEAP), so the heap costs one pointer per object.
- Objects held only by segments still recovering are skipped: their space joins the allocator when
  the recovery ends, so evicting them would free nothing a put could use.
- Opt-in `SessionAwareOrder` (below) replaces LRU among the tails by predicted session return,
  from session hints; the default stays LRU.
- Tenants (quotas.py): a tenant with a quota or dedicated segments keeps its candidates in its
  own heap (`TenantAccount.heap`, over all its namespaces); the others share `heap`. Each record is in one heap, and the
  global order pops the oldest top among all heaps (O(heaps) per pop, heaps = such tenants + 1),
  so watermark eviction is the same LRU as with one heap. Scoped eviction pops one tenant's heap
  only: a tenant at its quota (`evict_for_quota`) or placing on its dedicated segments evicts its
  own objects and never another tenant's. Placement on shared segments does not pop dedicated
  tenants' heaps (their objects are not where the room is needed).
- Watermarks: once the pool is above the high watermark, eviction works down to the low one in
  slices of `EVICTION_SLICE_BYTES` (at most `EVICTION_SLICE_OBJECTS` evictions): one whenever the
  master has no request waiting (`MasterCore.idle_work`) and one per tick; a put that finds the
  pool above the high watermark evicts back under it and at most twice its own bytes more
  (`PUT_EVICTION_FACTOR`). So watermark eviction never holds the master's one thread for a batch,
  and a master with spare time evicts in it. (An allocation that does not fit at all still
  evicts on demand, `evict_for`: down to the low watermark, then on until a range fits. With
  the pool kept under the high watermark that takes fragmentation or a burst larger than 1 %.)
  Measured (`benchmarks/results/master_tail/`): when a put evicted 1 % of a 1 GiB pool of 256 KiB
  objects at once, put_start took 0.7 ms at P99 against 37 us at P50.
- Leased objects are skipped. One leased for longer than `max_lease_hold_s` without a break is
  marked DRAINING when eviction wants it: it takes no new lease, so it becomes evictable within one
  lease TTL. Rejected: capping every object's continuous lease (hot objects would turn into misses
  every cap period even with free memory); letting lookups renew leases unconditionally (the
  Mooncake complaint: eviction finds nothing and the pool stays full).
"""

from __future__ import annotations

from bisect import bisect_right, insort
from collections.abc import Callable, Iterable
from heapq import heapify, heappop, heappush
from typing import TYPE_CHECKING

from kvpool.core.protocol import REPLICA_BYTES, unpack_replicas
from kvpool.master.records import COMPLETE, DRAINING, GONE, IN_HEAP, PINNED, ObjectRecord

if TYPE_CHECKING:
    from kvpool.master.index import ObjectIndex
    from kvpool.master.quotas import TenantAccount
    from kvpool.master.segments import Segment

PUT_EVICTION_FACTOR = 2  # a put above the high watermark evicts at most this many times its bytes beyond it
EVICTION_SLICE_BYTES = 1 << 20  # one slice of eviction towards the low watermark (~4 objects of 256 KiB)
EVICTION_SLICE_OBJECTS = 32  # ... and at most this many evictions (small objects: ~10 us each here)


class Evictor:
    def __init__(self, index: "ObjectIndex") -> None:
        self.index = index
        self.heap: list[ObjectRecord] = []
        self.evictions = 0
        self.evicted_bytes = 0
        # the pool went above the high watermark and eviction has not yet reached the low one (or
        # found nothing more it could evict: then it stops until the pool is above the high one again)
        self.descending = False
        self.order: SessionAwareOrder | None = None  # None: LRU over tails (the default)
        self.own: list[TenantAccount] = []  # tenants with their own heap (a quota, or dedicated segments)

    def set_order(self, order: "SessionAwareOrder | None") -> None:
        """Choose among tails by another order (the records now in the heap move over)."""
        waiting = []
        if self.order is None:
            for heap in [self.heap, *(account.heap for account in self.own)]:
                waiting += [rec for rec in heap if rec.state != GONE]
                heap.clear()
        self.order = order
        self.heap = []
        for rec in waiting:
            self.push(rec)

    def give_own_heap(self, account: "TenantAccount") -> None:
        """From now on keep this tenant's candidates apart (its shared-heap entries move over, once)."""
        if account.heap is not None:
            return
        mine = [rec for rec in self.heap if rec.space.account is account]
        if mine:
            self.heap = [rec for rec in self.heap if rec.space.account is not account]
            heapify(self.heap)
            heapify(mine)
        account.heap = mine
        self.own.append(account)

    def push(self, rec: ObjectRecord) -> None:
        rec.heaps |= IN_HEAP
        if self.order is not None:
            self.order.push(rec)
            return
        rec.heap_access_s = rec.last_access_s
        heap = rec.space.account.heap
        if heap is None:
            heappush(self.heap, rec)
            return
        heappush(heap, rec)
        if len(heap) > 2 * rec.space.account.num_objects + 1024:
            live = [r for r in heap if r.state != GONE]
            heapify(live)
            heap[:] = live

    def _pop(self, now_s: float, account: "TenantAccount | None" = None, shared_only: bool = False) -> ObjectRecord | None:
        """The next candidate: of `account` only when given (its own heap), else the oldest top of all
        heaps (with `shared_only`, not those of tenants with dedicated segments)."""
        if self.order is not None:
            return self.order.pop(now_s)
        if account is not None and account.heap is not None:
            return heappop(account.heap) if account.heap else None
        best = self.heap if self.heap else None
        for other in self.own:
            heap = other.heap
            if heap and (best is None or heap[0] < best[0]) and not (shared_only and other.dedicated):
                best = heap
        return heappop(best) if best is not None else None

    def _moved(self, rec: ObjectRecord, now_s: float) -> bool:
        """Whether a popped candidate should now go later than its heap entry said."""
        if self.order is not None:
            return self.order.moved(rec, now_s)
        return rec.last_access_s != rec.heap_access_s

    def _watermarks(self) -> tuple[int, int, int]:
        """(used, high, low) in bytes; past the high watermark, eviction goes on down to the low one."""
        segments = self.index.segments
        capacity, used = segments.capacity_bytes, segments.used_bytes
        high = int(capacity * self.index.config.high_watermark)
        if used > high:
            self.descending = True
        return used, high, int(capacity * self.index.config.low_watermark)

    def evict_over_high(self, now_s: float, extra_bytes: int) -> int:
        """A put's share: above the high watermark, evict back under it and `extra_bytes` more (never
        past the low one); the rest of the way is left to `evict_slice`. Returns the bytes freed."""
        used, high, low = self._watermarks()
        if used <= high:
            return 0
        return self._descend(now_s, used, low, min(used - low, used - high + extra_bytes))

    def evict_slice(self, now_s: float, slice_bytes: int, max_objects: int = EVICTION_SLICE_OBJECTS) -> int:
        """One slice of the way down to the low watermark, once the pool went above the high one:
        `slice_bytes` or `max_objects` evictions, whichever comes first. Returns the bytes freed."""
        used, _, low = self._watermarks()
        if not self.descending:
            return 0
        return self._descend(now_s, used, low, min(used - low, slice_bytes), max_objects)

    def _descend(self, now_s: float, used: int, low: int, to_free: int, max_objects: int | None = None) -> int:
        stop_at = None if max_objects is None else self.evictions + max_objects
        freed = self._evict(now_s, lambda freed: freed >= to_free or (stop_at is not None and self.evictions >= stop_at))
        counted_out = stop_at is not None and self.evictions >= stop_at  # the count ended it: the next slice goes on
        if freed >= used - low or (freed < to_free and not counted_out):
            self.descending = False  # there, or nothing more can go now (leased, pending): the next put above
        return freed                  # the high watermark starts again

    def evict_for(self, size_bytes: int, now_s: float, eligible: "Iterable[Segment] | None" = None,
                  account: "TenantAccount | None" = None) -> bool:
        """An allocation failed: evict down to the low watermark, then on until some segment has a
        free range for `size_bytes` (LRU frees space anywhere; a fit needs it in one range).
        `eligible`: the segments the object may go to (None: all); `account`: evict only this tenant's
        objects (it places on its dedicated segments, or is at its quota), and only until it fits."""
        segments = self.index.segments
        candidates = list(segments.by_id.values() if eligible is None else eligible)
        capacity = sum(s.capacity_bytes for s in candidates)
        used = sum(s.used_bytes for s in candidates)
        shared_only = eligible is not None and account is None and bool(segments.dedicated_tenants)
        # only records with a replica where the room is needed (when that is not everywhere)
        on_segments = {s.segment_id for s in candidates} if account is not None or shared_only else None
        freed = 0
        if account is None:
            freed = self._evict(now_s, _at_least(max(0, used - int(capacity * self.index.config.low_watermark))),
                                None, shared_only, on_segments)
        step = max(size_bytes, capacity // 100)
        while not any(not s.recovering and s.allocator.can_allocate(size_bytes) for s in candidates):
            more = self._evict(now_s, _at_least(step), account, shared_only, on_segments)
            if more == 0:
                break
            freed += more
        return freed > 0

    def evict_for_quota(self, account: "TenantAccount", size_bytes: int, num_replicas: int, now_s: float) -> bool:
        """The tenant is at its quota: evict its own LRU candidates until one more object of
        `size_bytes` x `num_replicas` fits (quotas.py). False: it still does not."""
        evictions = self.evictions
        self._evict(now_s, lambda _freed: account.fits(size_bytes, num_replicas), account)
        account.quota_evictions += self.evictions - evictions
        return account.fits(size_bytes, num_replicas)

    def evict(self, now_s: float, bytes_to_free: int, account: "TenantAccount | None" = None,
              shared_only: bool = False, on_segments: set[int] | None = None) -> int:
        """Evict LRU candidates until `bytes_to_free` bytes are free; returns the bytes freed.
        `account`: only that tenant's objects; `shared_only`: none of tenants with dedicated segments;
        `on_segments`: only objects with a replica on one of these segments."""
        return self._evict(now_s, _at_least(bytes_to_free), account, shared_only, on_segments)

    def _evict(self, now_s: float, enough: Callable[[int], bool], account: "TenantAccount | None" = None,
               shared_only: bool = False, on_segments: set[int] | None = None) -> int:
        index = self.index
        max_hold_s = index.config.max_lease_hold_s
        freed = 0
        set_aside: list[ObjectRecord] = []
        while not enough(freed):
            rec = self._pop(now_s, account, shared_only)
            if rec is None:
                break
            rec.heaps &= ~IN_HEAP
            if rec.state != COMPLETE or rec.flags & PINNED or rec.num_children:
                continue  # a parent comes back when its last child goes
            if self._moved(rec, now_s):
                self.push(rec)  # used since it was pushed: take its place by the new time
                continue
            owner = rec.space.account
            if ((account is not None and owner is not account) or (shared_only and owner.dedicated)
                    or (on_segments is not None and not _on_any(rec.locations, on_segments))):
                set_aside.append(rec)  # another tenant's (only under the session order), or not where room is needed
                continue
            lease_until = rec.lease_until_s
            if lease_until is not None:
                if lease_until > now_s:
                    if now_s - rec.lease_since_s >= max_hold_s:
                        rec.flags |= DRAINING
                    set_aside.append(rec)
                    continue
                rec.lease_until_s = rec.lease_since_s = None
                index.lease_expiries += 1
            frees, on_recovering = index.space.eviction_frees(unpack_replicas(rec.locations))
            if on_recovering and not frees:
                set_aside.append(rec)  # its space is not the allocator's yet: evicting it frees nothing now
                continue
            freed += frees
            self.evicted_bytes += rec.size_bytes
            self.evictions += 1
            index.evict(rec)  # to its disk tier when it has a copy there (tiers.py), else dropped
        for rec in set_aside:
            self.push(rec)
        return freed

    def compact(self) -> None:
        """Drop dead records from the heap (removed objects leave their entries behind)."""
        if self.order is not None:
            self.order.compact()
            return
        for heap in [self.heap, *(account.heap for account in self.own)]:
            live = [rec for rec in heap if rec.state != GONE]
            if len(live) < len(heap):
                heapify(live)
                heap[:] = live


def _at_least(bytes_to_free: int) -> Callable[[int], bool]:
    return lambda freed: freed >= bytes_to_free


def _on_any(locations: bytes, segment_ids: set[int]) -> bool:
    for start in range(0, len(locations), REPLICA_BYTES):
        if int.from_bytes(locations[start : start + 8], "little", signed=True) in segment_ids:
            return True
    return False


class SessionAwareOrder:
    """An eviction order for agent sessions (opt-in: `Evictor.set_order`), fed session hints.

    Candidates are still chain tails only (a suffix goes before its prefix). Among them it evicts
    first a tail of the session predicted to come back last, where plain LRU evicts the block
    used longest ago. Under a closed loop that cycles through more sessions than fit, LRU evicts
    exactly the session that returns next (every lookup misses); ordering by predicted return
    keeps a stable subset of sessions whole instead, as the offline optimum does.

    Prediction, from hints the serving side sends (`session_arrived` when a turn's lookup comes,
    with the think time that preceded it; `session_wrote` before it writes blocks, saying whether
    the turn is done):
    - a turn in flight returns after about its last service time plus a fresh think time;
    - a session idle for `a` seconds since its last write returns after the mean residual think
      time given `a`: the mean of (T - a) over think times T > a seen (its own once it has 4, else
      the fleet's). Heavy-tailed tool pauses make that grow with `a` (the longer gone, the longer
      still: LRU's order); near-constant cycles make it shrink (the one that just left comes back
      last: MRU's order). With no sample above `a`, it expects `a` again (a finished session never
      comes back, so it drifts to the front).
    Blocks of no known session are ranked as an idle session since their last access (LRU heap).
    Ranking is computed at eviction time (once per clock value and hint change), over sessions
    that have candidates: predictions depend on the time, so keys frozen in a heap would go stale.
    Within a session the last pushed tail goes first (its chain from the tail).
    Admission: while a session's write is being placed (`session_wrote` .. `end_write`), eviction
    on its behalf stops at a candidate predicted back before that session (the put is refused:
    the offline optimum would not cache blocks used after everything it would have to evict).
    Rejected: a TTL pin per session (Continuum): a pool pinned full stops taking new blocks;
    "last write + median think" (ranks a session gone for an hour as due soon); time-dependent
    keys in a lazy heap (entries pushed at different times are not comparable).
    """

    MIN_OWN_SAMPLES = 4

    def __init__(self, admission: bool = True) -> None:
        self.admission = admission
        self.writer_return_s: float | None = None  # set from session_wrote until end_write
        self.refusals = 0
        self.owner: dict[str, str] = {}  # key -> session that wrote it
        self.sessions: dict[str, _SessionHint] = {}
        self.thinks: list[float] = []  # the fleet's recent think times, sorted
        self.anonymous: list[ObjectRecord] = []  # LRU heap of candidates of no known session
        self._ranking: list[tuple[float, str]] = []  # (minus predicted return, session)
        self._ranked_at: float | None = None
        self._dirty = True

    # ---- hints ---------------------------------------------------------------------------------

    def _hint(self, session: str) -> "_SessionHint":
        hint = self.sessions.get(session)
        if hint is None:
            hint = self.sessions[session] = _SessionHint()
        return hint

    def session_arrived(self, session: str, think_s: float, now_s: float) -> None:
        hint = self._hint(session)
        if hint.last_write_s is not None:
            insort(hint.thinks, think_s)
            if len(hint.thinks) > 64:
                hint.thinks.pop(len(hint.thinks) // 2)
            insort(self.thinks, think_s)
            if len(self.thinks) > 512:
                self.thinks.pop(len(self.thinks) // 2)
        hint.arrived_s = now_s
        hint.in_flight = True
        self._dirty = True

    def session_wrote(self, session: str, keys: list[str], now_s: float, turn_done: bool = True) -> None:
        """The session writes these blocks (before their PutStart); `turn_done`: its turn ended (the
        output's blocks), False for the prompt's blocks written while the answer is still coming."""
        hint = self._hint(session)
        owner = self.owner
        for key in keys:
            owner.setdefault(key, session)
        if turn_done:
            if hint.arrived_s is not None:
                hint.service_s = now_s - hint.arrived_s
            hint.last_write_s = now_s
            hint.in_flight = False
        self._dirty = True
        if self.admission:
            self.writer_return_s = self.predicted_return(hint, now_s)

    def end_write(self) -> None:
        """The put that `session_wrote` announced is done: eviction is no longer on its behalf."""
        self.writer_return_s = None

    def _residual(self, samples: list[float], idle_s: float) -> float:
        i = bisect_right(samples, idle_s)
        if i == len(samples):
            return max(idle_s, 1e-3)
        return (sum(samples[i:]) / (len(samples) - i)) - idle_s

    def predicted_return(self, hint: "_SessionHint", now_s: float) -> float:
        samples = hint.thinks if len(hint.thinks) >= self.MIN_OWN_SAMPLES else self.thinks
        if hint.in_flight:
            return (hint.arrived_s if hint.arrived_s is not None else now_s) + hint.service_s + self._residual(samples, 0.0)
        idle = max(0.0, now_s - (hint.last_write_s if hint.last_write_s is not None else now_s))
        return now_s + self._residual(samples, idle)

    # ---- candidates ----------------------------------------------------------------------------

    def push(self, rec: ObjectRecord) -> None:
        session = self.owner.get(rec.key)
        if session is None:
            rec.heap_access_s = rec.last_access_s
            heappush(self.anonymous, rec)
            return
        hint = self._hint(session)
        if not hint.tails and not self._dirty and self._ranked_at is not None:
            # a session with no candidates joins the ranking made at this clock value
            heappush(self._ranking, (-self.predicted_return(hint, self._ranked_at), session))
        hint.tails.append(rec)

    def _rank(self, now_s: float) -> None:
        ranking = []
        for session, hint in self.sessions.items():
            if hint.tails:
                ranking.append((-self.predicted_return(hint, now_s), session))
        heapify(ranking)
        self._ranking = ranking
        self._ranked_at = now_s
        self._dirty = False

    def _anonymous_return(self, now_s: float) -> float | None:
        heap = self.anonymous
        while heap and heap[0].state == GONE:
            heappop(heap)
        if not heap:
            return None
        return now_s + self._residual(self.thinks, max(0.0, now_s - heap[0].heap_access_s))

    def pop(self, now_s: float) -> ObjectRecord | None:
        if self._dirty or self._ranked_at != now_s:
            self._rank(now_s)
        ranking = self._ranking
        while True:
            while ranking and not self.sessions[ranking[0][1]].tails:
                heappop(ranking)
            anonymous = self._anonymous_return(now_s)
            if not ranking and anonymous is None:
                return None
            if ranking and (anonymous is None or -ranking[0][0] >= anonymous):
                return_s, session = -ranking[0][0], ranking[0][1]
                if self._refuse(return_s):
                    return None
                rec = self.sessions[session].tails.pop()
            else:
                if self._refuse(anonymous):
                    return None
                rec = heappop(self.anonymous)
            if rec.heaps & IN_HEAP and rec.state != GONE:
                return rec

    def _refuse(self, candidate_return_s: float) -> bool:
        writer = self.writer_return_s
        if writer is not None and candidate_return_s < writer:
            self.refusals += 1  # needed before the writer's blocks: refuse the put instead
            return True
        return False

    def moved(self, rec: ObjectRecord, now_s: float) -> bool:
        if rec.key in self.owner:
            return False  # ranked at this moment already
        return rec.last_access_s != rec.heap_access_s

    def compact(self) -> None:
        for hint in self.sessions.values():
            hint.tails = [r for r in hint.tails if r.heaps & IN_HEAP and r.state != GONE]
        live = [r for r in self.anonymous if r.state != GONE]
        heapify(live)
        self.anonymous = live


class _SessionHint:
    __slots__ = ("arrived_s", "last_write_s", "service_s", "thinks", "in_flight", "tails")

    def __init__(self) -> None:
        self.arrived_s: float | None = None
        self.last_write_s: float | None = None
        self.service_s = 0.0
        self.thinks: list[float] = []  # its think times, sorted
        self.in_flight = False
        self.tails: list[ObjectRecord] = []  # its candidates, the last pushed goes first
