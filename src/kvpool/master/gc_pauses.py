"""The garbage collector's pauses in the master process, as metrics.

Why: a collection holds the master's one thread, and so every client queued behind it; with
100 K-256 K records a full one took 82-246 ms before `kvpool master` froze what is alive after
each tick (service.py, docs/performance/changes.md §20). These metrics show an operator
whether that still happens: pauses and their seconds per generation, and the longest one.

Rules:
- Installed only by a service that owns its process (`kvpool master`); `close()` removes it.
- The callback only adds numbers (no logging, no allocation beyond floats): it runs inside the
  collector, on whichever thread triggered it.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class CollectorPauses:
    def __init__(self) -> None:
        self.counts = [0, 0, 0]  # per generation
        self.seconds = [0.0, 0.0, 0.0]
        self.longest_s = 0.0
        self._started = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        took = time.perf_counter() - self._started
        generation = min(2, int(info.get("generation", 2)))
        self.counts[generation] += 1
        self.seconds[generation] += took
        self.longest_s = max(self.longest_s, took)

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def families(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        pauses = CounterMetricFamily("kvpool_master_gc_pauses", "Garbage collections (each holds the master's thread)",
                                     labels=["generation"])
        seconds = CounterMetricFamily("kvpool_master_gc_pause_seconds", "Seconds spent in garbage collections",
                                      labels=["generation"])
        for generation in range(3):
            pauses.add_metric([str(generation)], self.counts[generation])
            seconds.add_metric([str(generation)], self.seconds[generation])
        yield pauses
        yield seconds
        yield GaugeMetricFamily("kvpool_master_gc_pause_max_seconds", "The longest garbage collection since start",
                                value=self.longest_s)
