"""TTL retention: objects an agent asked to keep (a request's `ttl_s`) are not evicted before their
time, within the tenant's share. Pure: records and times in, answers out.

Rules:
- A grant keeps one object until `until_s` (later grants extend, never shorten). Eviction passes
  over a retained candidate (eviction.py); nothing else changes for it (a removal still removes).
- A tenant's retained bytes never exceed its share: its quota's `max_bytes` when it has one, else
  `max_fraction` of the pool's DRAM. A grant that would pass the share is refused (counted), so a
  pool can never be retained full and every tenant's TTLs together stay below the pool.
- Expiry is lazy: `expire(now_s)` releases what is due (the eviction path calls it before choosing),
  a gone record's retention is released when it is found.
- One entry per object (`until` by record); a heap of (until_s, seq, record) per tenant finds
  the due ones; an extended entry leaves a stale heap item behind that is skipped when popped.
"""

from __future__ import annotations

from collections.abc import Callable
from heapq import heappop, heappush
from itertools import count

from kvpool.master.records import GONE, ObjectRecord


class Retention:
    def __init__(self, max_fraction: float, pool_bytes: Callable[[], int]) -> None:
        if not 0 <= max_fraction < 1:
            raise ValueError(f"max_retained_fraction must be in [0, 1), got {max_fraction}")
        self.max_fraction = max_fraction
        self._pool_bytes = pool_bytes
        self.until: dict[ObjectRecord, float] = {}
        self._heap: list[tuple[float, int, ObjectRecord]] = []
        self._seq = count()
        self.bytes_by_tenant: dict[str, int] = {}
        self._size: dict[ObjectRecord, int] = {}  # the bytes a record was counted with
        self.granted = 0
        self.refused = 0  # grants past the tenant's share
        self.kept = 0  # eviction candidates passed over because retained

    def share_bytes(self, account) -> int:
        quota = account.quota
        if quota is not None and quota.max_bytes is not None:
            return quota.max_bytes
        return int(self.max_fraction * self._pool_bytes())

    def grant(self, rec: ObjectRecord, until_s: float, now_s: float) -> bool:
        """Retain `rec` until `until_s` if its tenant's share allows; False: refused (or gone)."""
        if rec.state == GONE or until_s <= now_s:
            return False
        held = self.until.get(rec)
        if held is not None:
            if until_s > held:
                self.until[rec] = until_s
                heappush(self._heap, (until_s, next(self._seq), rec))
            return True
        account = rec.space.account
        size = max(rec.size_bytes, 1)
        used = self.bytes_by_tenant.get(account.name, 0)
        if used + size > self.share_bytes(account):
            self.expire(now_s)
            used = self.bytes_by_tenant.get(account.name, 0)
            if used + size > self.share_bytes(account):
                self.refused += 1
                return False
        self.until[rec] = until_s
        self._size[rec] = size
        self.bytes_by_tenant[account.name] = used + size
        heappush(self._heap, (until_s, next(self._seq), rec))
        self.granted += 1
        return True

    def holds(self, rec: ObjectRecord, now_s: float) -> bool:
        """Whether eviction must pass over `rec` now."""
        until = self.until.get(rec)
        if until is None:
            return False
        if until > now_s and rec.state != GONE:
            self.kept += 1
            return True
        self.release(rec)
        return False

    def release(self, rec: ObjectRecord) -> None:
        if self.until.pop(rec, None) is None:
            return
        name = rec.space.account.name
        left = self.bytes_by_tenant.get(name, 0) - self._size.pop(rec)
        if left > 0:
            self.bytes_by_tenant[name] = left
        else:
            self.bytes_by_tenant.pop(name, None)

    def expire(self, now_s: float) -> int:
        """Release every retention due by `now_s` (and of gone records met on the way)."""
        heap, until = self._heap, self.until
        released = 0
        while heap and heap[0][0] <= now_s:
            at, _, rec = heappop(heap)
            if until.get(rec) == at:
                self.release(rec)
                released += 1
        return released

    @property
    def retained_bytes(self) -> int:
        return sum(self.bytes_by_tenant.values())

    @property
    def num_retained(self) -> int:
        return len(self.until)
