"""What agents tell the pool about their sessions, applied to eviction. Pure: messages in, state out.

Rules:
- Eviction order, in this order: objects under a TTL (retention.py) are passed over while their
  tenant's share allows; among the rest the session-aware order (session_order.py) when the master
  runs with `eviction_order="session"`, else LRU over chain tails (eviction.py).
- Every hint is scoped to the tenant that sends it: session ids are qualified by the tenant
  (`SessionAwareOrder.owner_key`), TTLs are granted only to objects found in that tenant's own
  namespace, within its share. A client cannot order, keep or release another tenant's objects.
- A turn's arrival and end come as `SessionEvents` (one way); a put names its session and TTL
  (PutStart.session / ttl_s) so its objects are ranked with their session and retained; a lookup
  with `ttl_s` renews the retention of what it hit.
- A session that ended ranks first under the session-aware order; TTLs it was granted still run
  out at their time (the end of a session is not a release of what it asked to keep).
- The index tells the evictor when an object leaves (`Evictor.forget`): its retention and its
  session ownership go with it.
"""

from __future__ import annotations

from collections.abc import Callable

from kvpool.core import protocol as p
from kvpool.core.errors import UsageError
from kvpool.master.eviction import Evictor
from kvpool.master.records import COMPLETE, PENDING
from kvpool.master.retention import Retention
from kvpool.master.session_order import SessionAwareOrder

EVICTION_ORDERS = ("lru", "session")


def check_ttl(ttl_s: float) -> None:
    if not 0 <= ttl_s <= p.MAX_TTL_S or ttl_s != ttl_s:
        raise UsageError(f"ttl_s must be in [0, {p.MAX_TTL_S:.0f}] seconds, got {ttl_s}")


def check_session(session: str) -> None:
    if len(session) > p.MAX_SESSION_LENGTH:
        raise UsageError(f"a session id is at most {p.MAX_SESSION_LENGTH} characters, got {len(session)}")


class SessionHints:
    def __init__(self, order: str, max_retained_fraction: float, evictor: Evictor,
                 pool_bytes: Callable[[], int]) -> None:  # fmt: skip
        if order not in EVICTION_ORDERS:
            raise ValueError(f"eviction_order must be one of {', '.join(EVICTION_ORDERS)}, got {order!r}")
        self.order = SessionAwareOrder() if order == "session" else None
        if self.order is not None:
            evictor.set_order(self.order)
        self.retention = Retention(max_retained_fraction, pool_bytes)
        evictor.retention = self.retention
        self.events = {name: 0 for name in p.EVENT_NAMES.values()}
        self.ttl_hits = 0  # lookup hits on objects a TTL kept
        self.session_puts = 0  # objects put with a session named

    def stats(self) -> p.HintStats:
        retention, order = self.retention, self.order
        return p.HintStats(
            eviction_order="session" if order is not None else "lru",
            retained_bytes=retention.retained_bytes, retained_objects=retention.num_retained,
            retention_refused=retention.refused, retention_kept=retention.kept, ttl_hits=self.ttl_hits,
            turns_arrived=self.events["arrived"], turns_done=self.events["done"], sessions_ended=self.events["end"],
            session_objects=self.session_puts, admission_refusals=order.refusals if order is not None else 0,
            retained_by_tenant=dict(retention.bytes_by_tenant),
        )

    # ---- messages ------------------------------------------------------------------------------

    def session_events(self, req: p.SessionEvents, now_s: float) -> p.OkReply:
        order = self.order
        for event in req.events:
            check_session(event.session)
            if event.kind not in p.EVENT_NAMES:
                raise UsageError(f"unknown session event kind {event.kind}")
            check_ttl(event.ttl_s)
            self.events[p.EVENT_NAMES[event.kind]] += 1
            if order is None:
                continue
            session = order.owner_key(req.tenant, event.session)
            if event.kind == p.TURN_ARRIVED:
                order.session_arrived(session, None, now_s, event.request)
            elif event.kind == p.TURN_DONE:
                order.session_wrote(session, [], now_s, turn_done=True)
                order.end_write()
            else:
                order.session_ended(session)
        return p.OkReply(count=len(req.events))

    def before_put(self, req: p.PutStart, now_s: float) -> None:
        """Name the put's objects as its session's (before they are placed: its admission)."""
        if not req.session:
            check_ttl(req.ttl_s)
            return
        check_session(req.session)
        check_ttl(req.ttl_s)
        self.session_puts += len(req.keys)
        order = self.order
        if order is not None:
            tenant = req.tenant
            order.session_wrote(order.owner_key(tenant, req.session), [order.owner_key(tenant, k) for k in req.keys],
                                now_s, turn_done=False)

    def after_put(self, space: dict | None, req: p.PutStart, now_s: float) -> None:
        if self.order is not None:
            self.order.end_write()
        if req.ttl_s > 0 and space is not None:
            self._retain(space, req.keys, req.ttl_s, now_s, (PENDING, COMPLETE))

    def after_lookup(self, space: dict | None, keys: list[str], num_hit: int, ttl_s: float, now_s: float) -> None:
        if space is None or not num_hit:
            return
        until = self.retention.until
        if until:
            get = space.get
            self.ttl_hits += sum(1 for key in keys[:num_hit] if get(key) in until)
        if ttl_s > 0:
            self._retain(space, keys[:num_hit], ttl_s, now_s, (COMPLETE,))

    def _retain(self, space: dict, keys: list[str], ttl_s: float, now_s: float, states: tuple[int, ...]) -> None:
        grant, until_s = self.retention.grant, now_s + ttl_s
        for key in keys:
            rec = space.get(key)
            if rec is not None and rec.state in states:
                grant(rec, until_s, now_s)
