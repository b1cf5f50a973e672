"""Requests waiting in vLLM's queue keep their prefix fresh in the pool (pure: no I/O, no vLLM).

Why: the pool evicts least recently used chain tails, and a request stuck in vLLM's queue is
exactly the one whose prefix was used longest ago: its session's last turn ended, then it waited.
vLLM asks the connector about a waiting request only when it reaches the head of the queue, by
which time its prefix may be evicted and recomputed, queueing everything behind it.

`touch_waiting_s` is off by default: when most sessions wait, keeping all their prefixes fresh
makes LRU evict the blocks the running requests just saved instead (docs/design/client.md).

Rules:
- A request is tracked from `arrived` (vLLM added it) until `admitted` (blocks allocated; its
  load, if any, is planned) or `finished` (done or aborted while waiting).
- `due(now)` lists the requests that have waited `interval_s` since they arrived or were last
  touched, and marks them touched now. The caller touches each one's prefix in the pool (a
  counting lookup: the master refreshes the hit objects' last access, leases nothing), so while it
  waits its prefix is as recent as the freshest sessions' and LRU takes idle sessions' first.
- A request admitted within `interval_s` is never touched (most are): its lookup at admission
  is the only one, as without this. Entries older than `max_age_s` are dropped (a request vLLM
  freed without telling the connector must not be touched forever).
"""

from __future__ import annotations


class _Waiting:
    __slots__ = ("request", "arrived_s", "touched_s")

    def __init__(self, request: object, now_s: float) -> None:
        self.request = request
        self.arrived_s = now_s
        self.touched_s = now_s


class WaitingRequests:
    def __init__(self, interval_s: float, max_age_s: float = 600.0) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.interval_s = interval_s
        self.max_age_s = max_age_s
        self._waiting: dict[str, _Waiting] = {}  # insertion order = arrival order

    def __len__(self) -> int:
        return len(self._waiting)

    def arrived(self, req_id: str, request: object, now_s: float) -> None:
        self._waiting.setdefault(req_id, _Waiting(request, now_s))

    def admitted(self, req_id: str) -> None:
        self._waiting.pop(req_id, None)

    finished = admitted

    def due(self, now_s: float) -> list[object]:
        """The requests whose prefix should be touched now (oldest first). One pass over the
        waiting requests (vLLM's queue: tens), once per engine step."""
        out = []
        stale = []
        for req_id, w in self._waiting.items():
            if now_s - w.arrived_s > self.max_age_s:
                stale.append(req_id)
            elif now_s - w.touched_s >= self.interval_s:
                w.touched_s = now_s
                out.append(w.request)
        for req_id in stale:
            del self._waiting[req_id]
        return out
