"""The node's disk-tier worker: write-back of committed objects, promotions, drops, reports.

Rules:
- Fed by the directory ops the master sends (node/directory.py hands them over): every committed
  object with a checksum is queued for write-back (bounded queue: past `max_queue` the newest is
  not queued, counted, and the object is simply not on disk); DIR_PROMOTE ops and DIR_DISK_DROP ops
  are done before any queued write-back, so a reader waiting on a promotion does not wait behind
  the write-back backlog.
- One thread does all disk I/O (disk_store.py is single-caller). A write-back copies the object
  out of the segment and writes it only when the copy has the checksum the writer committed: an
  object evicted and overwritten meanwhile is skipped, never written wrong.
- What was done is reported to the master in the next heartbeat (TierReport), resent until a
  heartbeat reply came back (`take_report` / `sent`), for the segment id it was done under; after a
  remount the old reports are void (the new master learns the disk's content from the announcement).
- A full disk or an I/O error is logged (at most once per 10 s per kind) and counted; the object
  stays uncached on disk. A failed promotion is reported so the master frees the range.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvpool.core.protocol import DIR_COMMIT, DIR_DISK_DROP, DIR_PROMOTE, DirEntry, DiskEntry, TierReport
from kvpool.node.disk_store import DiskError, DiskFull, DiskStore

log = logging.getLogger(__name__)


class TierMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.bytes = Gauge("kvpool_node_tier_bytes", "Bytes held, by tier (dram: the segment's size)", ["tier"],
                           registry=registry)
        self.capacity = Gauge("kvpool_node_tier_capacity_bytes", "Capacity by tier", ["tier"], registry=registry)
        self.objects = Gauge("kvpool_node_tier_objects", "Objects held, by tier (dram: committed in the directory)",
                             ["tier"], registry=registry)
        self.queue_depth = Gauge("kvpool_node_writeback_queue_depth", "Objects waiting to be written to disk",
                                 registry=registry)
        self.writebacks = Counter("kvpool_node_writebacks", "Write-backs to disk by outcome (written, changed: "
                                  "overwritten before the copy, queue_full, disk_full, error)", ["outcome"],
                                  registry=registry)
        self.promotions = Counter("kvpool_node_promotions", "Disk-to-DRAM promotions by outcome (ok, failed)",
                                  ["outcome"], registry=registry)
        self.disk_errors = Counter("kvpool_node_disk_errors", "Disk tier errors by kind (full, io, corrupt)", ["kind"],
                                   registry=registry)
        self.io_bytes = Counter("kvpool_node_disk_io_bytes", "Payload bytes moved, by direction (read, write)",
                                ["direction"], registry=registry)
        self.io_seconds = Counter("kvpool_node_disk_io_seconds", "Seconds in disk I/O, by direction", ["direction"],
                                  registry=registry)


class DiskTierWorker:
    def __init__(self, store: DiskStore, base_addr: int, segment_bytes: int, registry: CollectorRegistry,
                 max_queue: int = 4096, on_done: Callable[[], None] | None = None) -> None:
        self.store = store
        self.base_addr = base_addr
        self.segment_bytes = segment_bytes
        self.metrics = TierMetrics(registry)
        self.metrics.capacity.labels("disk").set(store.capacity_bytes)
        self.max_queue = max_queue
        self._on_done = on_done
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._urgent: deque[tuple[int, DirEntry]] = deque()  # (segment id, promote / drop op)
        self._writebacks: deque[tuple[int, DirEntry]] = deque()
        self._reports: dict[int, TierReport] = {}  # segment id -> what is not yet acknowledged
        self._promoted_ops: dict[int, DirEntry] = {}  # offset -> the promotion op done there, until reported
        self._segment_id = 0
        self._thread: threading.Thread | None = None
        self._last_warned: dict[str, float] = {}
        self.busy = False
        self._publish()

    def start(self) -> "DiskTierWorker":
        self._thread = threading.Thread(target=self._run, name="kvpool-disk-tier", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.store.close()

    # ---- from the heartbeat loop ---------------------------------------------------------------

    def new_mount(self, segment_id: int) -> None:
        """Mounted again: reports and promotions for the old segment id are void (its master is gone
        or forgot it). Queued write-backs are kept and reported under the new id: the new master
        checks each against its own record (checksum, size, a replica here) before it counts."""
        with self._lock:
            self._segment_id = segment_id
            self._reports.clear()
            self._promoted_ops.clear()
            self._writebacks = deque((segment_id, op) for _, op in self._writebacks)
            self._urgent = deque((s, op) for s, op in self._urgent if op.op == DIR_DISK_DROP)
        self._publish()

    def on_ops(self, segment_id: int, ops: list[DirEntry]) -> None:
        dropped = 0
        with self._lock:
            for op in ops:
                if op.op == DIR_COMMIT:
                    if op.size > 0 and op.checksum:
                        if len(self._writebacks) >= self.max_queue:
                            dropped += 1
                        else:
                            self._writebacks.append((segment_id, op))
                elif op.op in (DIR_PROMOTE, DIR_DISK_DROP):
                    self._urgent.append((segment_id, op))
        if dropped:
            self.metrics.writebacks.labels("queue_full").inc(dropped)
        self._wake.set()
        self.metrics.queue_depth.set(len(self._writebacks))

    def take_report(self, segment_id: int) -> TierReport | None:
        with self._lock:
            report = self._reports.get(segment_id)
        if report is None or not (report.written or report.lost or report.promoted or report.failed):
            return None
        return report

    def sent(self, report: TierReport) -> list[DirEntry]:
        """The master answered a heartbeat carrying `report`: drop what it held from the pending one.
        Returns the promotions it reported (the node's directory records them now)."""
        with self._lock:
            done = [op for op in map(self._promoted_ops.pop, report.promoted, [None] * len(report.promoted))
                    if op is not None]
            now = self._reports.get(report.segment_id)
            if now is None:
                return done
            self._reports[report.segment_id] = TierReport(
                report.segment_id, now.written[len(report.written):], now.lost[len(report.lost):],
                now.promoted[len(report.promoted):], now.failed[len(report.failed):])
        return done

    def disk_entries(self, now_wall_s: float) -> list[DiskEntry]:
        """What the disk holds, oldest use first (for the announcement after a remount)."""
        return [DiskEntry(o.tenant, o.key, o.size, o.checksum, o.parent, max(0.0, now_wall_s - o.last_use_s))
                for o in sorted(self.store.objects.values(), key=lambda o: o.last_use_s)]

    # ---- the worker thread ---------------------------------------------------------------------

    def _report(self, segment_id: int, **items: list) -> None:
        with self._lock:
            if segment_id != self._segment_id:
                return  # done for a mount that is over: its master no longer waits for it
            old = self._reports.get(segment_id) or TierReport(segment_id)
            self._reports[segment_id] = TierReport(
                segment_id, old.written + items.get("written", []), old.lost + items.get("lost", []),
                old.promoted + items.get("promoted", []), old.failed + items.get("failed", []))

    def _next(self) -> tuple[int, DirEntry] | None:
        with self._lock:
            if self._urgent:
                return self._urgent.popleft()
            if self._writebacks:
                return self._writebacks.popleft()
        return None

    def _run(self) -> None:
        while not self._stop.is_set():
            job = self._next()
            if job is None:
                self.busy = False
                self._publish()
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            self.busy = True
            segment_id, op = job
            if op.op != DIR_DISK_DROP and not (0 <= op.offset and 0 < op.size <= self.segment_bytes - op.offset):
                log.warning("disk tier ignores an op outside the segment: %s", op)
                continue
            try:
                if op.op == DIR_PROMOTE:
                    self._promote(segment_id, op)
                elif op.op == DIR_DISK_DROP:
                    self.store.forget(op.tenant, op.key, op.checksum)
                else:
                    self._write_back(segment_id, op)
            except Exception:  # a bug here must not end the tier; the object just is not cached on disk
                log.exception("disk tier failed on %s", op)
            self.metrics.queue_depth.set(len(self._writebacks))
            self._publish()
            if op.op == DIR_PROMOTE and self._on_done is not None:
                self._on_done()  # a reader waits on it: report at once, not at the next poll

    def _write_back(self, segment_id: int, op: DirEntry) -> None:
        started = time.perf_counter()
        try:
            ok = self.store.write_from(op.tenant, op.key, op.parent, op.checksum, self.base_addr + op.offset, op.size)
        except DiskFull as e:
            self.metrics.writebacks.labels("disk_full").inc()
            self.metrics.disk_errors.labels("full").inc()
            self._warn("full", f"disk tier full, object {op.key!r} stays uncached on disk: {e}")
            return
        except DiskError as e:
            self.metrics.writebacks.labels("error").inc()
            self.metrics.disk_errors.labels("io").inc()
            self._warn("io", f"disk tier write of {op.key!r} failed: {e}")
            return
        if not ok:
            self.metrics.writebacks.labels("changed").inc()
            return
        self.metrics.io_seconds.labels("write").inc(time.perf_counter() - started)
        self.metrics.io_bytes.labels("write").inc(op.size)
        self.metrics.writebacks.labels("written").inc()
        self._report(self._segment_id, written=[DiskEntry(op.tenant, op.key, op.size, op.checksum, op.parent)])

    def _promote(self, segment_id: int, op: DirEntry) -> None:
        started = time.perf_counter()
        try:
            ok = self.store.read_into(op.tenant, op.key, op.checksum, self.base_addr + op.offset)
        except DiskError as e:
            self.metrics.disk_errors.labels("corrupt" if e.errno == 5 else "io").inc()
            self._warn("read", f"disk tier read of {op.key!r} failed: {e}")
            ok = False
            self._report(segment_id, lost=[DiskEntry(op.tenant, op.key, op.size, op.checksum)])
        if ok:
            self.metrics.io_seconds.labels("read").inc(time.perf_counter() - started)
            self.metrics.io_bytes.labels("read").inc(op.size)
            self.metrics.promotions.labels("ok").inc()
            with self._lock:
                if segment_id != self._segment_id:
                    return  # mounted again meanwhile: the master that asked is gone
                self._promoted_ops[op.offset] = DirEntry(op.offset, op.size, op.tenant, op.key, op.parent, op.checksum)
            self._report(segment_id, promoted=[op.offset])
        else:
            self.metrics.promotions.labels("failed").inc()
            self._report(segment_id, failed=[op.offset])

    def _warn(self, kind: str, message: str) -> None:
        now = time.monotonic()
        if now - self._last_warned.get(kind, -1e9) >= 10.0:
            self._last_warned[kind] = now
            log.warning("%s", message)

    def _publish(self) -> None:
        self.metrics.bytes.labels("disk").set(self.store.used_bytes)
        self.metrics.objects.labels("disk").set(len(self.store.objects))
