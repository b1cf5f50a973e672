"""Is the pool reachable? A small state machine with exponential back-off (pure but for the clock).

    available --(`failures_to_degrade` UnavailableErrors in a row)--> degraded (retry at now + backoff,
                                                                   backoff doubles up to max)
    available --(a success)--> available, the count of failures in a row back at 0
    degraded  --(a try after the back-off succeeds)--> available

One slow reply is a slow reply (that call is a miss or an unsaved block), not "no pool": only
repeated failures switch the pool off, and each switch is logged at WARNING with its reason.

While degraded the connector behaves as "no pool": lookups report misses, loads are not planned,
saves are dropped. vLLM keeps serving from its own cache; nothing waits on a dead master.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class PoolHealth:
    def __init__(
        self, what: str, initial_s: float, max_s: float, clock: Callable[[], float] = time.monotonic,
        failures_to_degrade: int = 3,
    ) -> None:
        if failures_to_degrade < 1:
            raise ValueError(f"failures_to_degrade must be >= 1, got {failures_to_degrade}")
        self._what = what
        self._failures_to_degrade = failures_to_degrade
        self._failures_in_a_row = 0
        self._initial_s = initial_s
        self._max_s = max_s
        self._clock = clock
        self._lock = threading.Lock()
        self._backoff_s: float | None = None  # None: available
        self._retry_at = 0.0
        self.degradations = 0  # times it went from available to degraded

    @property
    def available(self) -> bool:
        return self._backoff_s is None

    def should_try(self) -> bool:
        with self._lock:
            return self._backoff_s is None or self._clock() >= self._retry_at

    def record_success(self) -> None:
        with self._lock:
            self._failures_in_a_row = 0
            if self._backoff_s is None:
                return
            self._backoff_s = None
        log.warning("kvpool: %s reachable again; the connector uses the pool again", self._what)

    def record_unavailable(self, reason: BaseException | str) -> None:
        with self._lock:
            self._failures_in_a_row += 1
            if self._backoff_s is None and self._failures_in_a_row < self._failures_to_degrade:
                log.info("kvpool: %s did not answer in time (%s); %d more in a row switch the pool off",
                         self._what, reason, self._failures_to_degrade - self._failures_in_a_row)
                return
            first = self._backoff_s is None
            self._backoff_s = self._initial_s if first else min(self._backoff_s * 2, self._max_s)
            self._retry_at = self._clock() + self._backoff_s
            backoff_s = self._backoff_s
            if first:
                self.degradations += 1
        if first:
            log.warning(
                "kvpool: %s unreachable (%d failures in a row, last: %s); running without the pool, retrying in %.1f s",
                self._what, self._failures_in_a_row, reason, backoff_s,
            )
