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
- Leased objects are skipped. One leased for longer than `max_lease_hold_s` without a break is
  marked DRAINING when eviction wants it: it takes no new lease, so it becomes evictable within one
  lease TTL. Rejected: capping every object's continuous lease (hot objects would turn into misses
  every cap period even with free memory); letting lookups renew leases unconditionally (the
  Mooncake complaint: eviction finds nothing and the pool stays full).
"""

from __future__ import annotations

from heapq import heapify, heappop, heappush
from typing import TYPE_CHECKING

from kvpool.core.protocol import REPLICA_BYTES, Replica, unpack_replicas

if TYPE_CHECKING:
    from kvpool.master.index import ObjectIndex

# record flags
COMPLETE = 1  # put_end arrived: readable
PINNED = 2  # never evicted (removed only explicitly)
IN_HEAP = 4  # has an entry in the eviction heap
DEAD = 8  # gone from the index; an old heap entry or a child may still point at it
DRAINING = 16  # eviction waits for its lease to end: no new lease

NO_CHECKSUM = bytes(8)


class ObjectRecord:
    __slots__ = (
        "space",  # the tenant's dict that holds this record
        "key",
        "locations",  # bytes: its replicas packed (protocol.pack_replicas), sent as-is by leased lookups
        "flags",
        "parent",  # ObjectRecord | None
        "num_children",
        "last_access_s",
        "heap_access_s",  # last_access_s when pushed onto the eviction heap
        "lease_until_s",  # float | None
        "lease_since_s",  # start of the current unbroken lease, float | None
        "lease_count",  # leased lookups holding it and not yet released nor expired (index._leases)
        "token",  # the write token of its allocation (PutStart): PutEnd / PutRevoke must name it
        "checksum",  # bytes: the writer's checksum, little-endian uint64 (all zeros: none)
    )

    def __init__(self, space: dict, key: str, locations: bytes, flags: int, now_s: float, token: int = 0) -> None:
        self.space = space
        self.key = key
        self.locations = locations
        self.flags = flags
        self.parent: ObjectRecord | None = None
        self.num_children = 0
        self.last_access_s = now_s
        self.heap_access_s = now_s
        self.lease_until_s: float | None = None
        self.lease_since_s: float | None = None
        self.lease_count = 0
        self.token = token
        self.checksum = NO_CHECKSUM

    def __lt__(self, other: "ObjectRecord") -> bool:
        return self.heap_access_s < other.heap_access_s

    @property
    def replicas(self) -> list[Replica]:
        """Unpacked (cold paths: freeing space, dropping a segment, tests)."""
        return unpack_replicas(self.locations)

    @property
    def size_bytes(self) -> int:
        loc = self.locations
        return int.from_bytes(loc[16:REPLICA_BYTES], "little") if loc else 0


class Evictor:
    def __init__(self, index: "ObjectIndex") -> None:
        self.index = index
        self.heap: list[ObjectRecord] = []
        self.evictions = 0
        self.evicted_bytes = 0
        self.order: SessionAwareOrder | None = None  # None: LRU over tails (the default)

    def set_order(self, order: "SessionAwareOrder | None") -> None:
        """Choose among tails by another order (the records now in the heap move over)."""
        waiting = [rec for rec in self.heap if not rec.flags & DEAD] if self.order is None else []
        self.order = order
        self.heap = []
        for rec in waiting:
            self.push(rec)

    def push(self, rec: ObjectRecord) -> None:
        rec.flags |= IN_HEAP
        if self.order is not None:
            self.order.push(rec)
            return
        rec.heap_access_s = rec.last_access_s
        heappush(self.heap, rec)

    def _pop(self, now_s: float) -> ObjectRecord | None:
        if self.order is not None:
            return self.order.pop(now_s)
        return heappop(self.heap) if self.heap else None

    def _moved(self, rec: ObjectRecord, now_s: float) -> bool:
        """Whether a popped candidate should now go later than its heap entry said."""
        if self.order is not None:
            return self.order.moved(rec, now_s)
        return rec.last_access_s != rec.heap_access_s

    def maybe_evict(self, now_s: float) -> int:
        """Above the high watermark: evict down to the low watermark."""
        segments = self.index.segments
        capacity = segments.capacity_bytes
        used = segments.used_bytes
        if capacity == 0 or used <= capacity * self.index.config.high_watermark:
            return 0
        return self.evict(now_s, used - int(capacity * self.index.config.low_watermark))

    def evict_for(self, size_bytes: int, now_s: float) -> bool:
        """An allocation failed: evict down to the low watermark, then on until some segment has a
        free range for `size_bytes` (LRU frees space anywhere; a fit needs it in one range)."""
        segments = self.index.segments
        capacity = segments.capacity_bytes
        freed = self.evict(now_s, max(0, segments.used_bytes - int(capacity * self.index.config.low_watermark)))
        step = max(size_bytes, capacity // 100)
        while not any(not s.recovering and s.allocator.can_allocate(size_bytes) for s in segments.by_id.values()):
            more = self.evict(now_s, step)
            if more == 0:
                break
            freed += more
        return freed > 0

    def evict(self, now_s: float, bytes_to_free: int) -> int:
        """Evict LRU candidates until `bytes_to_free` bytes are free; returns the bytes freed."""
        index = self.index
        max_hold_s = index.config.max_lease_hold_s
        freed = 0
        set_aside: list[ObjectRecord] = []
        while freed < bytes_to_free:
            rec = self._pop(now_s)
            if rec is None:
                break
            flags = rec.flags & ~IN_HEAP
            rec.flags = flags
            if flags & (DEAD | PINNED) or not flags & COMPLETE or rec.num_children:
                continue  # a parent comes back when its last child goes
            if self._moved(rec, now_s):
                self.push(rec)  # used since it was pushed: take its place by the new time
                continue
            lease_until = rec.lease_until_s
            if lease_until is not None:
                if lease_until > now_s:
                    if now_s - rec.lease_since_s >= max_hold_s:
                        rec.flags = flags | DRAINING
                    set_aside.append(rec)
                    continue
                rec.lease_until_s = rec.lease_since_s = None
                index.lease_expiries += 1
            frees = 0
            on_recovering = False
            for replica in unpack_replicas(rec.locations):
                segment = index.segments.by_id.get(replica.segment_id)
                if segment is not None:
                    if segment.recovering:
                        on_recovering = True
                    else:
                        frees += segment.allocator.aligned(replica.size)
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
        live = [rec for rec in self.heap if not rec.flags & DEAD]
        if len(live) < len(self.heap):
            heapify(live)
            self.heap = live


class SessionAwareOrder:
    """An eviction order for agent sessions (opt-in: `Evictor.set_order`), fed session hints.

    Candidates are still chain tails only (a suffix goes before its prefix). Among them it evicts
    first the block whose session is predicted to come back last, where plain LRU evicts the one
    used longest ago. Under a closed loop that cycles through more sessions than fit, LRU evicts
    exactly the session that returns next (every lookup misses); ordering by predicted return
    keeps a stable subset of sessions whole instead, as the offline optimum does.

    Prediction, per session, from hints the serving side sends (`session_arrived` when a turn's
    lookup comes, with the think time that preceded it; `session_wrote` when it writes blocks):
    - a turn in flight returns after about its last service time plus its typical think time;
    - a session that wrote its last blocks at t returns at t + its median think time so far
      (the fleet's median for a new session);
    - a session overdue (not back by its predicted time) is expected to stay away about as long
      again as it has been gone (heavy-tailed tool pauses; a finished session never returns), so
      its prediction doubles each time it is overdue.
    Blocks with no known session fall back to their last access plus the fleet's median think.
    The heap holds (priority, seq, record) with immutable keys; a record's current key is kept
    in `heap_access_s`, so older entries of a re-keyed record are skipped when popped.
    Admission: while a session's write is being placed (`session_wrote` .. `end_write`), eviction
    on its behalf stops at candidates predicted back before that session (the put is refused, as
    the offline optimum would not cache blocks used after everything it would have to evict).
    Rejected: a TTL pin per session (Continuum): a pinned pool that cannot hold every session
    stops taking new blocks, while predicted-return order degrades gracefully.
    """

    def __init__(self, default_think_s: float = 0.0, admission: bool = True) -> None:
        self.admission = admission
        self.writer_return_s: float | None = None  # set from session_wrote until end_write
        self.refusals = 0
        self.heap: list[tuple[float, int, ObjectRecord]] = []
        self.seq = 0
        self.owner: dict[str, str] = {}  # key -> session that wrote it
        self.sessions: dict[str, _SessionHint] = {}
        self.due: list[tuple[float, int, str]] = []  # (predicted return, seq, session) to check for overdue
        self.thinks: list[float] = []  # every think time seen (fleet median)
        self.default_think_s = default_think_s

    # ---- hints ---------------------------------------------------------------------------------

    def session_arrived(self, session: str, think_s: float, now_s: float) -> None:
        hint = self.sessions.get(session)
        if hint is None:
            hint = self.sessions[session] = _SessionHint()
        elif hint.last_write_s is not None:
            hint.thinks.append(think_s)
            self.thinks.append(think_s)
        hint.arrived_s = now_s
        self._rekey(session, hint, now_s + hint.service_s + self._think(hint))

    def session_wrote(self, session: str, keys: list[str], now_s: float) -> None:
        hint = self.sessions.get(session)
        if hint is None:
            hint = self.sessions[session] = _SessionHint()
        owner = self.owner
        for key in keys:
            owner.setdefault(key, session)
        if keys:
            hint.tails.append(keys[-1])
            if len(hint.tails) > 8:
                del hint.tails[:-8]
        if hint.arrived_s is not None:
            hint.service_s = now_s - hint.arrived_s
        hint.last_write_s = now_s
        self._rekey(session, hint, now_s + self._think(hint))
        if self.admission:
            self.writer_return_s = hint.return_s

    def end_write(self) -> None:
        """The put that `session_wrote` announced is done: eviction is no longer on its behalf."""
        self.writer_return_s = None

    def _think(self, hint: "_SessionHint") -> float:
        thinks = hint.thinks or self.thinks
        if not thinks:
            return self.default_think_s
        ordered = sorted(thinks[-32:])
        return ordered[len(ordered) // 2]

    def _rekey(self, session: str, hint: "_SessionHint", return_s: float) -> None:
        hint.return_s = return_s
        hint.version += 1
        self.seq += 1
        heappush(self.due, (return_s, self.seq, session))
        self._repush_tails(session, hint)

    def _repush_tails(self, session: str, hint: "_SessionHint") -> None:
        # its tails' keys changed: push fresh entries (the old ones are skipped when popped)
        space_get = self._space_get
        if space_get is None:
            return
        for key in hint.tails:
            rec = space_get(key)
            if rec is not None and rec.flags & IN_HEAP and not rec.flags & DEAD:
                self.push(rec)

    _space_get = None  # set by `attach`: finds a record by key (the tenant's dict)

    def attach(self, find) -> None:
        """Give the order a way to find records by key (for re-keying a session's tails)."""
        self._space_get = find

    # ---- the heap ------------------------------------------------------------------------------

    def priority(self, rec: ObjectRecord) -> float:
        """Smaller goes first: minus the predicted next use."""
        session = self.owner.get(rec.key)
        hint = self.sessions.get(session) if session is not None else None
        if hint is None or hint.return_s is None:
            return -(rec.last_access_s + self._think_fleet())
        return -hint.return_s

    def _think_fleet(self) -> float:
        if not self.thinks:
            return self.default_think_s
        ordered = sorted(self.thinks[-256:])
        return ordered[len(ordered) // 2]

    def push(self, rec: ObjectRecord) -> None:
        key = self.priority(rec)
        rec.heap_access_s = key
        self.seq += 1
        heappush(self.heap, (key, self.seq, rec))
        if len(self.heap) > 4 * len(self.owner) + 4096:
            self.compact()

    def pop(self, now_s: float) -> ObjectRecord | None:
        self._mark_overdue(now_s)
        heap = self.heap
        writer = self.writer_return_s
        while heap:
            key, _, rec = heap[0]
            if rec.heap_access_s != key or rec.flags & DEAD:
                heappop(heap)
                continue
            if writer is not None and -key < writer and self.priority(rec) == key:
                # every candidate is needed before the writer's blocks would be: evicting one to
                # admit them loses more than it gains (what the offline optimum does: no admission)
                self.refusals += 1
                return None
            heappop(heap)
            return rec
        return None

    def moved(self, rec: ObjectRecord, now_s: float) -> bool:
        return self.priority(rec) > rec.heap_access_s

    def _mark_overdue(self, now_s: float) -> None:
        due = self.due
        while due and due[0][0] < now_s:
            return_s, _, session = heappop(due)
            hint = self.sessions[session]
            if hint.return_s != return_s:
                continue  # re-keyed since
            gone_s = now_s - (hint.last_write_s if hint.last_write_s is not None else now_s)
            self._rekey(session, hint, now_s + max(gone_s, now_s - return_s, 1e-3))

    def compact(self) -> None:
        live = [(k, s, rec) for k, s, rec in self.heap if rec.heap_access_s == k and not rec.flags & DEAD]
        heapify(live)
        self.heap = live


class _SessionHint:
    __slots__ = ("arrived_s", "last_write_s", "service_s", "thinks", "return_s", "version", "tails")

    def __init__(self) -> None:
        self.arrived_s: float | None = None
        self.last_write_s: float | None = None
        self.service_s = 0.0
        self.thinks: list[float] = []
        self.return_s: float | None = None
        self.version = 0
        self.tails: list[str] = []  # its most recent chain tails (keys), re-keyed with it
