"""StorageNode: contributes one shared-memory segment to the pool and keeps it mounted.

Rules:
- A node only talks to the master (mount, heartbeat, unmount); clients move the bytes
  one-sidedly, so the node can live inside another process (the vLLM connector embeds one). Its
  one data-path duty: without a credential it serves small transfers over its segment lane
  (transfer/tcp_path.py), announced in the mount at the address that routes to the master.
- Heartbeats acknowledge the directory ops applied so far; the reply brings the next ones
  (directory.py). With a master that parks heartbeats (MountReply.parks_heartbeats) each one goes
  out as soon as the last was answered, with `wait_s`: the master answers it when it has ops, so a
  commit reaches this directory one round trip after it was made, and a writer's put is answered
  only then (master/durability.py). With an older master they go out every `heartbeat_interval_s`
  (at once again while the master says it holds more ops than one reply carries).
- When the master answers that the segment is unknown (it restarted, a standby took over, or it
  declared the node dead past its TTL), the node mounts again, gets a new segment id, and announces
  its directory in chunks (AnnounceObjects) so the master serves those objects again. Until the
  last chunk the master places nothing new in the segment. A master that does not answer is
  retried, not fatal; an announcement cut short is started over with the next mount.
- With a disk tier (disk_path), committed objects are written back to disk in the background and
  promoted back on the master's request (tier.py, disk_store.py); heartbeats then go out every
  `tier_poll_interval_s` (and at once when a promotion finished) and carry the tier's reports. A
  restarted node reopens the disk and announces what it holds after its DRAM directory.
- stop() unmounts (best effort, short timeout) before the memory goes away.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvpool.core.errors import KVPoolError, UnavailableError, UsageError
from kvpool.core.protocol import AnnounceObjects, AnnounceReply, Heartbeat, HeartbeatReply, MountReply, UnmountSegment
from kvpool.node.config import NodeConfig
from kvpool.node.directory import NodeDirectory
from kvpool.node.disk_store import DiskError, DiskStore
from kvpool.node.tier import DiskTierWorker
from kvpool.rpc.zmq_channel import MasterChannel, host_of, parse_addresses
from kvpool.rpc.credentials import ENV_NODE_CREDENTIAL, resolve_credential
from kvpool.transfer.segment import SegmentMemory
from kvpool.transfer.tcp_path import reachable_address

log = logging.getLogger(__name__)

_VALUE_CHUNK_BYTES = 4 << 20  # inline value copies per AnnounceObjects message, at most
_MAX_PARK_S = 0.25  # a parked heartbeat's longest wait: also how long stop() may wait for it


class NodeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.segment_bytes = Gauge("kvpool_node_segment_bytes", "Size of the node's segment", registry=registry)
        self.mounted = Gauge("kvpool_node_mounted", "1 while the segment is mounted on the master", registry=registry)
        self.mounts = Counter("kvpool_node_mounts", "Mounts, first one and remounts", registry=registry)
        self.heartbeats = Counter(
            "kvpool_node_heartbeats", "Heartbeats sent, by outcome (ok, unknown, unavailable, error)",
            ["outcome"], registry=registry,
        )
        self.directory_objects = Gauge(
            "kvpool_node_directory_objects", "Committed objects in the node's directory", registry=registry
        )
        self.announced = Counter(
            "kvpool_node_announced_objects", "Directory entries announced to a master, by outcome (accepted, rejected)",
            ["outcome"], registry=registry,
        )
        self.lane_tags = _LaneTags()
        registry.register(self.lane_tags)


class _LaneTags:
    """The segment lane's tags (transfer/tcp_path_tags.py), read from its TagIndex when scraped."""

    def __init__(self) -> None:
        self.index = None  # the segment's TagIndex, once it has one

    def collect(self):
        index = self.index
        held = GaugeMetricFamily("kvpool_node_lane_tags", "Tags the segment lane holds: where values were last "
                                 "written, for readers that never saw them")
        held.add_metric([], len(index) if index is not None else 0)
        yield held
        reads = CounterMetricFamily("kvpool_node_lane_tag_reads", "READ_TAG requests answered, by outcome "
                                    "(known: the bytes sent, not_known)", labels=["outcome"])
        reads.add_metric(["known"], index.known if index is not None else 0)
        reads.add_metric(["not_known"], index.not_known if index is not None else 0)
        yield reads


def _value_chunks(values: list) -> list[list]:
    """Copies of inline values in messages of about _VALUE_CHUNK_BYTES."""
    chunks, part, size = [], [], 0
    for op in values:
        part.append(op)
        size += op.size + len(op.key) + 64
        if size >= _VALUE_CHUNK_BYTES:
            chunks.append(part)
            part, size = [], 0
    if part:
        chunks.append(part)
    return chunks


class StorageNode:
    def __init__(
        self,
        config: NodeConfig,
        *,
        registry: CollectorRegistry | None = None,
        on_mount: Callable[[int], None] | None = None,
    ) -> None:
        self.config = config
        self.node_id = config.node_id or f"{socket.gethostname()}-{os.getpid()}"
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = NodeMetrics(self.registry)
        self._on_mount = on_mount
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()  # the heartbeat loop's sleep: stop, or a promotion to report
        self.tier: DiskTierWorker | None = None
        self._thread: threading.Thread | None = None
        self._segment: SegmentMemory | None = None
        self._channel: MasterChannel | None = None
        self.segment_id: int | None = None
        self.heartbeat_interval_s: float | None = None
        self.node_ttl_s: float | None = None
        self.mounted = False
        self._started = False
        self.directory = NodeDirectory()
        self._more_ops = False  # the last heartbeat reply carried ops: ask again soon
        self._parks = False  # the master holds our heartbeats until it has ops (MountReply.parks_heartbeats)
        self._failed = False  # the last heartbeat got no answer: wait an interval before the next

    @property
    def segment(self) -> SegmentMemory | None:
        return self._segment

    def start(self) -> "StorageNode":
        """Create the segment and mount it; raises UnavailableError when the master does not
        accept the mount within `mount_timeout_s`."""
        if self._started:
            raise UsageError("StorageNode.start() was already called; make a new StorageNode")
        self._started = True
        credential = resolve_credential(self.config.credential, ENV_NODE_CREDENTIAL)
        lane_host = None
        if self.config.segment_lane and credential is None:  # the lane has no keys: never beside CURVE
            master_host = host_of(parse_addresses(self.config.master_address)[0])
            try:
                lane_host = reachable_address(master_host)
            except OSError as e:  # no route to the master's host yet: serve NIXL only, say so
                log.warning("node %s serves no segment lane: no local address reaches %s (%s)", self.node_id,
                            master_host, e)
        self._segment = SegmentMemory(self.config.memory_bytes, name=self.node_id, lane_host=lane_host)
        if self._segment.lane_address is not None:
            log.info("node %s serves its segment lane (plain TCP, small transfers) on %s", self.node_id,
                     self._segment.lane_address)
        self.metrics.segment_bytes.set(self.config.memory_bytes)
        self.metrics.lane_tags.index = self._segment.lane_tags
        self._channel = MasterChannel(self.config.master_address, timeout_s=self.config.timeout_s,
                                      credential=credential, fallback_role="node")
        try:
            if self.config.disk_path is not None:
                self._open_disk_tier()
            self._mount_with_retries(time.monotonic() + self.config.mount_timeout_s)
        except BaseException:
            self._release()
            raise
        self._thread = threading.Thread(target=self._heartbeat_loop, name=f"kvpool-node-{self.node_id}", daemon=True)
        self._thread.start()
        return self

    def _open_disk_tier(self) -> None:
        store = DiskStore(Path(self.config.disk_path), self.config.disk_bytes)
        try:
            found = store.open()
        except DiskError as e:
            raise UsageError(str(e)) from None
        self.tier = DiskTierWorker(store, self._segment.base_addr, self.config.memory_bytes, self.registry,
                                   self.config.writeback_queue, on_done=self._wake.set)
        self.tier.metrics.capacity.labels("dram").set(self.config.memory_bytes)
        self.tier.start()
        log.info("node %s disk tier %s: %d objects (%d of %d bytes), %s I/O", self.node_id, self.config.disk_path,
                 len(found), store.used_bytes, store.capacity_bytes, "O_DIRECT" if store.direct else "buffered")

    def _mount_with_retries(self, deadline: float) -> None:
        while True:
            try:
                self._mount()
                return
            except UnavailableError:
                if time.monotonic() >= deadline or self._stop.is_set():
                    raise
                self._stop.wait(0.2)

    def _mount(self) -> None:
        remaining_s = max(0.1, self.config.timeout_s)
        recovering = len(self.directory) > 0 or bool(self.directory.values) or (self.tier is not None and len(self.tier.store.objects) > 0)
        request = self._segment.mount_request(self.node_id, recovering=recovering)
        if self.tier is not None:
            request = msgspec.structs.replace(request, disk_bytes=self.config.disk_bytes)
        if self.config.tenant:
            request = msgspec.structs.replace(request, tenant=self.config.tenant)
        reply = self._channel.call(request, timeout_s=remaining_s)
        if not isinstance(reply, MountReply):
            raise KVPoolError(f"master answered a mount with {type(reply).__name__}")
        with self._lock:
            self.segment_id = reply.segment_id
            self.heartbeat_interval_s = reply.heartbeat_interval_s
            self.node_ttl_s = reply.node_ttl_s
            self._parks = reply.parks_heartbeats
            self._failed = False
            self.directory.new_mount()
        if self.tier is not None:
            self.tier.new_mount(reply.segment_id)
        if recovering:
            self._announce(reply.segment_id)
        with self._lock:
            self.mounted = True
        self.metrics.mounts.inc()
        self.metrics.mounted.set(1)
        log.info("node %s mounted segment %x (%d bytes)", self.node_id, reply.segment_id, self.config.memory_bytes)
        if self._on_mount is not None:
            self._on_mount(reply.segment_id)

    def _announce(self, segment_id: int) -> None:
        """Tell the new master what the segment holds, oldest first, in chunks; then the disk tier."""
        started = time.monotonic()
        entries, ages = self.directory.oldest_first(started)
        disk = self.tier.disk_entries(time.time()) if self.tier is not None else []
        chunk = self.config.announce_chunk
        accepted = rejected = 0
        for part in _value_chunks(list(self.directory.values.values())):  # before the last chunk ends recovery
            reply = self._channel.call(AnnounceObjects(segment_id, [], [], values=part),
                                       timeout_s=max(self.config.timeout_s, 1.0))
            if not isinstance(reply, AnnounceReply):
                raise KVPoolError(f"master answered an announcement with {type(reply).__name__}")
            accepted += reply.accepted
        total = len(entries) + len(disk)
        for start in range(0, max(total, 1), chunk):
            if self._stop.is_set():
                raise UnavailableError("node stopping: announcement cut short")
            end = start + chunk
            disk_part = disk[max(0, start - len(entries)) : max(0, end - len(entries))]
            reply = self._channel.call(
                AnnounceObjects(segment_id, entries[start:end], ages[start:end], last=end >= total,
                                disk_entries=disk_part),
                timeout_s=max(self.config.timeout_s, 1.0),
            )
            if not isinstance(reply, AnnounceReply):
                raise KVPoolError(f"master answered an announcement with {type(reply).__name__}")
            self.directory.forget(reply.rejected_offsets)
            accepted += reply.accepted
            rejected += len(reply.rejected_offsets)
        self.metrics.announced.labels("accepted").inc(accepted)
        self.metrics.announced.labels("rejected").inc(rejected)
        self.metrics.directory_objects.set(len(self.directory))
        log.info("node %s announced %d objects to the master (%d rejected) in %.2f s", self.node_id, accepted,
                 rejected, time.monotonic() - started)

    def _heartbeat_loop(self) -> None:
        while True:
            poll_s = self.heartbeat_interval_s
            if self.tier is not None:
                poll_s = min(poll_s, self.config.tier_poll_interval_s)
            parked = self._parks and not self._failed
            if parked:
                interval_s = 0.0  # the master holds the heartbeat instead
            elif self._more_ops:
                interval_s = 0.01
            else:
                interval_s = poll_s
            if interval_s > 0:
                self._wake.wait(interval_s)
                self._wake.clear()
            if self._stop.is_set():
                break
            if not self.mounted:
                self._remount()
                continue
            segment_id = self.segment_id
            wait_s = min(poll_s, _MAX_PARK_S) if self._parks else 0.0  # after a failure too: it waited above
            # a heartbeat unanswered for two intervals (past its wait) is lost (its master may have died
            # with it): the next one goes out then, so a restarted master hears from us within ~2 intervals
            timeout_s = wait_s + min(self.config.timeout_s, max(0.1, 2 * (self.heartbeat_interval_s or 1.0)))
            report = self.tier.take_report(segment_id) if self.tier is not None else None
            try:
                reply = self._channel.call(
                    Heartbeat(self.node_id, [segment_id], [self.directory.applied_seq],
                              [report] if report is not None else [], wait_s), timeout_s=timeout_s
                )
                self._failed = False
            except UnavailableError:
                self.metrics.heartbeats.labels("unavailable").inc()
                self._more_ops = False
                self._failed = True
                continue
            except KVPoolError as e:
                self.metrics.heartbeats.labels("error").inc()
                log.warning("heartbeat of node %s rejected: %s", self.node_id, e)
                self._failed = True
                continue
            if isinstance(reply, HeartbeatReply) and segment_id in reply.unknown_segment_ids:
                self.metrics.heartbeats.labels("unknown").inc()
                self.metrics.mounted.set(0)
                self.mounted = False
                self._more_ops = False
                log.warning("master forgot segment %x of node %s; mounting again with %d objects to announce",
                            segment_id, self.node_id, len(self.directory))
                self._remount()
                continue
            self.metrics.heartbeats.labels("ok").inc()
            if isinstance(reply, HeartbeatReply):
                now_s = time.monotonic()
                if report is not None:
                    # before this reply's ops: a later op at the same offset (its eviction) must win
                    for op in self.tier.sent(report):
                        self.directory.record(op, now_s)
                mine = [d for d in reply.deltas if d.segment_id == segment_id]
                on_ops = self.tier.on_ops if self.tier is not None else None
                for delta in mine:
                    self.directory.apply(delta, now_s, on_ops)
                self._more_ops = any(d.more for d in mine)  # a backlog: acknowledge it at once
                self.metrics.directory_objects.set(len(self.directory))

    def _remount(self) -> None:
        try:
            self._mount()
        except KVPoolError as e:
            self._failed = True  # the next try waits an interval
            log.warning("remount of node %s failed (will retry): %s", self.node_id, e)

    def request_stop(self) -> None:
        """Ask a start() still retrying its mount, and the heartbeat loop, to end (safe from a
        signal handler); stop() still releases everything."""
        self._stop.set()
        self._wake.set()

    def stop(self, unmount_timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._channel is not None and self.segment_id is not None and self.mounted:
            try:
                self._channel.call(UnmountSegment(self.segment_id), timeout_s=min(unmount_timeout_s, self.config.timeout_s))
            except KVPoolError as e:
                log.warning("unmount of segment %x failed (the master will drop it after its TTL): %s",
                            self.segment_id, e)
        self.mounted = False
        self.metrics.mounted.set(0)
        self._release()

    def _release(self) -> None:
        if self.tier is not None:
            self.tier.stop()  # before the segment it copies from is unmapped
            self.tier = None
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._segment is not None:
            self.metrics.lane_tags.index = None
            self._segment.close()
            self._segment = None

    def __enter__(self) -> "StorageNode":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
