"""Which decode instance continues a prefilled request (P/D mode). Pure: no I/O, no clocks.

Rules:
- A session stays on the decode instance it was last given while that one is eligible (healthy,
  and not excluded for this request after a failed try): "sticky".
- Otherwise the least loaded eligible instance (in-flight tokens) takes it, and becomes the
  session's instance; ties go round-robin from the one after the last assigned, so idle instances
  share new sessions evenly: "new" for a session seen the first time, "moved" for one whose
  instance was not eligible.
- A request without a session (`session_id` None) is never pinned: "unpinned".
- The session map is bounded, least recently used dropped first; a forgotten session is simply
  assigned again. Load always comes in through the views: this object holds only the map and the
  round-robin cursor.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvpool.router.policy import BackendView, Decision, NoHealthyBackend


class DecodePolicy:
    def __init__(self, max_sessions: int = 100_000) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.max_sessions = max_sessions
        self._home: OrderedDict[str, str] = OrderedDict()  # session id -> decode instance name
        self._next = 0

    def home(self, session_id: str) -> str | None:
        return self._home.get(session_id)

    def choose(self, session_id: str | None, instances: Sequence[BackendView]) -> Decision:
        eligible = [i for i, v in enumerate(instances) if v.healthy]
        if not eligible:
            raise NoHealthyBackend(f"none of the {len(instances)} decode instances is healthy")
        home = self._home.get(session_id) if session_id is not None else None
        if home is not None:
            index = next((i for i in eligible if instances[i].name == home), None)
            if index is not None:
                self._home.move_to_end(session_id)
                return Decision(index, "sticky")
        n = len(instances)
        index = min(eligible, key=lambda i: (instances[i].inflight_tokens, (i - self._next) % n))
        self._next = (index + 1) % n
        if session_id is None:
            return Decision(index, "unpinned")
        self._home[session_id] = instances[index].name
        self._home.move_to_end(session_id)
        while len(self._home) > self.max_sessions:
            self._home.popitem(last=False)
        return Decision(index, "new" if home is None else "moved")
