"""StorageNode: contributes one shared-memory segment to the pool and keeps it mounted.

Rules:
- A node only talks to the master (mount, heartbeat, unmount); clients move the bytes
  one-sidedly, so the node needs no data-path thread and can live inside another process
  (the vLLM connector embeds one).
- Heartbeats go out every `heartbeat_interval_s` from the MountReply. When the master answers that
  the segment is unknown (it declared the node dead past its TTL, or it restarted), the node mounts
  again and gets a new segment id: the master has dropped the old objects, so nothing stale is
  ever served under the new id. A master that does not answer is retried, not fatal.
- stop() unmounts (best effort, short timeout) before the memory goes away.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvpool.core.errors import KVPoolError, UnavailableError, UsageError
from kvpool.core.protocol import Heartbeat, HeartbeatReply, MountReply, UnmountSegment
from kvpool.node.config import NodeConfig
from kvpool.transfer.control import MasterChannel
from kvpool.transfer.segment import SegmentMemory

log = logging.getLogger(__name__)


class NodeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.segment_bytes = Gauge("kvpool_node_segment_bytes", "Size of the node's segment", registry=registry)
        self.mounted = Gauge("kvpool_node_mounted", "1 while the segment is mounted on the master", registry=registry)
        self.mounts = Counter("kvpool_node_mounts", "Mounts, first one and remounts", registry=registry)
        self.heartbeats = Counter(
            "kvpool_node_heartbeats", "Heartbeats sent, by outcome (ok, unknown, unavailable, error)",
            ["outcome"], registry=registry,
        )


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
        self._thread: threading.Thread | None = None
        self._segment: SegmentMemory | None = None
        self._channel: MasterChannel | None = None
        self.segment_id: int | None = None
        self.heartbeat_interval_s: float | None = None
        self.node_ttl_s: float | None = None
        self.mounted = False
        self._started = False

    @property
    def segment(self) -> SegmentMemory | None:
        return self._segment

    def start(self) -> "StorageNode":
        """Create the segment and mount it; raises UnavailableError when the master does not
        accept the mount within `mount_timeout_s`."""
        if self._started:
            raise UsageError("StorageNode.start() was already called; make a new StorageNode")
        self._started = True
        self._segment = SegmentMemory(self.config.memory_bytes, name=self.node_id)
        self.metrics.segment_bytes.set(self.config.memory_bytes)
        self._channel = MasterChannel(self.config.master_address, timeout_s=self.config.timeout_s)
        try:
            self._mount_with_retries(time.monotonic() + self.config.mount_timeout_s)
        except BaseException:
            self._release()
            raise
        self._thread = threading.Thread(target=self._heartbeat_loop, name=f"kvpool-node-{self.node_id}", daemon=True)
        self._thread.start()
        return self

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
        reply = self._channel.call(self._segment.mount_request(self.node_id), timeout_s=remaining_s)
        if not isinstance(reply, MountReply):
            raise KVPoolError(f"master answered a mount with {type(reply).__name__}")
        with self._lock:
            self.segment_id = reply.segment_id
            self.heartbeat_interval_s = reply.heartbeat_interval_s
            self.node_ttl_s = reply.node_ttl_s
            self.mounted = True
        self.metrics.mounts.inc()
        self.metrics.mounted.set(1)
        log.info("node %s mounted segment %d (%d bytes)", self.node_id, reply.segment_id, self.config.memory_bytes)
        if self._on_mount is not None:
            self._on_mount(reply.segment_id)

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_interval_s):
            segment_id = self.segment_id
            # a heartbeat that takes longer than the TTL is useless: the master has given up already
            timeout_s = min(self.config.timeout_s, max(0.1, self.node_ttl_s or self.config.timeout_s))
            try:
                reply = self._channel.call(Heartbeat(self.node_id, [segment_id]), timeout_s=timeout_s)
            except UnavailableError:
                self.metrics.heartbeats.labels("unavailable").inc()
                continue
            except KVPoolError as e:
                self.metrics.heartbeats.labels("error").inc()
                log.warning("heartbeat of node %s rejected: %s", self.node_id, e)
                continue
            if isinstance(reply, HeartbeatReply) and segment_id in reply.unknown_segment_ids:
                self.metrics.heartbeats.labels("unknown").inc()
                self.metrics.mounted.set(0)
                self.mounted = False
                log.warning("master forgot segment %d of node %s; mounting again", segment_id, self.node_id)
                try:
                    self._mount()
                except KVPoolError as e:
                    log.warning("remount of node %s failed (will retry): %s", self.node_id, e)
            else:
                self.metrics.heartbeats.labels("ok").inc()

    def request_stop(self) -> None:
        """Ask a start() still retrying its mount, and the heartbeat loop, to end (safe from a
        signal handler); stop() still releases everything."""
        self._stop.set()

    def stop(self, unmount_timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._channel is not None and self.segment_id is not None and self.mounted:
            try:
                self._channel.call(UnmountSegment(self.segment_id), timeout_s=min(unmount_timeout_s, self.config.timeout_s))
            except KVPoolError as e:
                log.warning("unmount of segment %d failed (the master will drop it after its TTL): %s",
                            self.segment_id, e)
        self.mounted = False
        self.metrics.mounted.set(0)
        self._release()

    def _release(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._segment is not None:
            self._segment.close()
            self._segment = None

    def __enter__(self) -> "StorageNode":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
