"""An eviction order for agent sessions (opt-in: `Evictor.set_order`), fed session hints.

Rules:
- Pure: records in, a record out; it holds no reference to the index or the evictor that uses it.
- It chooses among the candidates it was given (chain tails only); whether a candidate may go
  (leases, recovering segments) is decided by the caller, as for LRU.
"""

from __future__ import annotations

from bisect import bisect_right, insort
from heapq import heapify, heappop, heappush

from kvpool.master.records import GONE, IN_HEAP, ObjectRecord


class SessionAwareOrder:
    """An eviction order for agent sessions (opt-in: `Evictor.set_order`), fed session hints.

    Candidates are still chain tails only (a suffix goes before its prefix). Among them it evicts
    first a tail of the session predicted to come back last, where plain LRU evicts the block
    used longest ago. Under a closed loop that cycles through more sessions than fit, LRU evicts
    exactly the session that returns next (every lookup misses); ordering by predicted return
    keeps a stable subset of sessions whole instead, as the offline optimum does.

    Sessions are named within a tenant (`owner_key`): one tenant's hints never rank another's blocks.

    Prediction, from hints the serving side sends (`session_arrived` when a turn's lookup comes,
    with the think time that preceded it, or measured here from its last write; `session_wrote`
    before it writes blocks, saying whether the turn is done; `session_ended` when it will not
    come back, after which its blocks go first):
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
        self.owner: dict[str, str] = {}  # owner_key(tenant, key) -> session that wrote it
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

    @staticmethod
    def owner_key(tenant: str, key: str) -> str:
        return tenant + "/" + key

    def session_arrived(self, session: str, think_s: float | None, now_s: float, request: str | None = None) -> None:
        """A turn of `session` arrived; `think_s` None: the time since its last write. The same
        `request` arriving again (a retried lookup) is one arrival."""
        hint = self._hint(session)
        if request is not None:
            if hint.request == request:
                return
            hint.request = request
        hint.ended = False
        if think_s is None:
            think_s = now_s - hint.last_write_s if hint.last_write_s is not None else 0.0
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
            owner.setdefault(key, session)  # keys given as owner_key(tenant, key)
        if turn_done:
            if hint.arrived_s is not None:
                hint.service_s = now_s - hint.arrived_s
            hint.last_write_s = now_s
            hint.in_flight = False
        self._dirty = True
        if self.admission:
            self.writer_return_s = self.predicted_return(hint, now_s)

    def session_ended(self, session: str) -> None:
        """The session will not come back: its blocks are the first to go."""
        hint = self.sessions.get(session)
        if hint is not None:
            hint.ended = True
            hint.in_flight = False
            self._dirty = True

    def forget(self, tenant: str, key: str) -> None:
        """The object is gone from the pool."""
        self.owner.pop(self.owner_key(tenant, key), None)

    def end_write(self) -> None:
        """The put that `session_wrote` announced is done: eviction is no longer on its behalf."""
        self.writer_return_s = None

    def _residual(self, samples: list[float], idle_s: float) -> float:
        i = bisect_right(samples, idle_s)
        if i == len(samples):
            return max(idle_s, 1e-3)
        return (sum(samples[i:]) / (len(samples) - i)) - idle_s

    def predicted_return(self, hint: "_SessionHint", now_s: float) -> float:
        if hint.ended:
            return float("inf")
        samples = hint.thinks if len(hint.thinks) >= self.MIN_OWN_SAMPLES else self.thinks
        if hint.in_flight:
            return (hint.arrived_s if hint.arrived_s is not None else now_s) + hint.service_s + self._residual(samples, 0.0)
        idle = max(0.0, now_s - (hint.last_write_s if hint.last_write_s is not None else now_s))
        return now_s + self._residual(samples, idle)

    # ---- candidates ----------------------------------------------------------------------------

    def push(self, rec: ObjectRecord) -> None:
        session = self.owner.get(self.owner_key(rec.space.name, rec.key))
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
        if self.owner_key(rec.space.name, rec.key) in self.owner:
            return False  # ranked at this moment already
        return rec.last_access_s != rec.heap_access_s

    def compact(self) -> None:
        for hint in self.sessions.values():
            hint.tails = [r for r in hint.tails if r.heaps & IN_HEAP and r.state != GONE]
        live = [r for r in self.anonymous if r.state != GONE]
        heapify(live)
        self.anonymous = live


class _SessionHint:
    __slots__ = ("arrived_s", "last_write_s", "service_s", "thinks", "in_flight", "tails", "request", "ended")

    def __init__(self) -> None:
        self.arrived_s: float | None = None
        self.last_write_s: float | None = None
        self.service_s = 0.0
        self.thinks: list[float] = []  # its think times, sorted
        self.in_flight = False
        self.tails: list[ObjectRecord] = []  # its candidates, the last pushed goes first
        self.request: str | None = None  # the engine request of its latest arrival
        self.ended = False  # said it will not come back
