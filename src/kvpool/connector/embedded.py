"""An embedded storage node: the vLLM worker contributes memory to the pool itself, so one vLLM
instance plus `kvpool master` is a complete pool (standalone `kvpool node`s add more).

The node mounts in a background thread: vLLM's start-up never waits on the master, and a master
that is down at start-up is retried with back-off until it answers (the node itself remounts when
the master restarts later).
"""

from __future__ import annotations

import logging
import threading

from kvpool.core.errors import KVPoolError

log = logging.getLogger(__name__)

# One StorageNode.start() keeps trying to mount this long (it allocates the segment first, so a
# failed attempt is not cheap: do not make attempts short).
_MOUNT_ATTEMPT_S = 30.0


class EmbeddedNode:
    def __init__(self, master_address: str, memory_bytes: int, node_id: str, *,
                 timeout_s: float, retry_initial_s: float, retry_max_s: float) -> None:
        self._args = (master_address, memory_bytes, node_id, timeout_s)
        self._retry = (retry_initial_s, retry_max_s)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._node = None
        self._thread = threading.Thread(target=self._run, name="kvpool-embedded-node", daemon=True)

    def start(self) -> "EmbeddedNode":
        self._thread.start()
        return self

    @property
    def mounted(self) -> bool:
        return self._node is not None

    def wait_mounted(self, timeout_s: float) -> bool:
        self._thread.join(timeout_s)
        return self.mounted

    def _run(self) -> None:
        from kvpool.node import NodeConfig, StorageNode

        master_address, memory_bytes, node_id, timeout_s = self._args
        delay_s, max_s = self._retry
        config = NodeConfig(master_address=master_address, memory_bytes=memory_bytes, node_id=node_id,
                            timeout_s=timeout_s, mount_timeout_s=_MOUNT_ATTEMPT_S)
        while not self._stop.is_set():
            node = StorageNode(config)
            try:
                node.start()
            except KVPoolError as exc:
                log.warning("kvpool: embedded node %s could not mount (%s); retrying in %.1f s", node_id, exc, delay_s)
                node.stop()
                self._stop.wait(delay_s)
                delay_s = min(delay_s * 2, max_s)
                continue
            with self._lock:
                if self._stop.is_set():
                    node.stop()
                    return
                self._node = node
            log.info("kvpool: embedded node %s contributes %d bytes to the pool", node_id, memory_bytes)
            return

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            node, self._node = self._node, None
        if node is not None:
            node.stop()
