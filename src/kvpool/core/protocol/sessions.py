"""Messages that carry what serving knows about agent sessions to the master's eviction.

Rules:
- Hints are advice, never authority: a session id and a TTL only order and retain objects of the
  sending tenant's own namespace, within that tenant's share (master/retention.py); a hint about a
  key the tenant does not hold does nothing.
- `SessionEvents` is sent one way (no reply), batched: a turn arrived (its lookup is coming), a turn
  is done (its last blocks are written), a session ended (it will not come back).
- TTLs are durations (`ttl_s`), as every time on the wire; 0 means none.
"""

from __future__ import annotations

from msgspec import Struct

TURN_ARRIVED = 0
TURN_DONE = 1
SESSION_END = 2
EVENT_NAMES = {TURN_ARRIVED: "arrived", TURN_DONE: "done", SESSION_END: "end"}
MAX_SESSION_LENGTH = 256  # longer session ids are refused (UsageError)
MAX_TTL_S = 24 * 3600.0  # longer TTLs are refused


class SessionEvent(Struct, array_like=True, frozen=True):
    session: str
    request: str  # the serving engine's request id: a retried lookup of one turn is one arrival
    kind: int  # TURN_ARRIVED | TURN_DONE | SESSION_END
    ttl_s: float = 0.0  # TURN_ARRIVED: keep what the session's turns use for this long (0: no TTL)


class SessionEvents(Struct, tag="session_events", frozen=True):
    tenant: str
    events: list[SessionEvent]
