"""An embedded storage node: the vLLM worker contributes memory to the pool itself, so one vLLM
instance plus `kvpool master` is a complete pool (standalone `kvpool node`s add more).

Rules:
- The node is a `kvpool node` child process, not a thread of the worker: a busy engine (its GIL,
  its cores) can never delay the node's heartbeats, so the master does not drop the memory of an
  engine that is merely busy (it did, with a thread, past a 5 s TTL on 2 cores). The memory is the
  child's memfd; the worker's client maps it like any same-host segment.
- vLLM's start-up never waits for it: the child mounts in the background and keeps retrying a
  master that is down (mount timeout: an hour per try, then it exits and is started again).
- The child exits with the worker: it watches its parent (`--exit-with-parent`), so even a
  SIGKILLed worker leaves no node behind; `stop()` sends SIGTERM (the node unmounts and exits 0).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

_MOUNT_ATTEMPT_S = 3600.0
_STOP_GRACE_S = 5.0


class EmbeddedNode:
    def __init__(self, master_address: str, memory_bytes: int, node_id: str, *,
                 timeout_s: float, retry_initial_s: float, retry_max_s: float, credential: str | None = None) -> None:
        self._argv = [
            sys.executable, "-m", "kvpool", "node", "--master", master_address, "--memory", str(memory_bytes),
            "--node-id", node_id, "--timeout-s", str(timeout_s), "--mount-timeout-s", str(_MOUNT_ATTEMPT_S),
            "--exit-with-parent", *(("--credential", credential) if credential else ()),
        ]
        self._node_id = node_id
        self._memory_bytes = memory_bytes
        self._retry = (retry_initial_s, retry_max_s)
        self._dir = Path(tempfile.mkdtemp(prefix="kvpool-embedded-"))
        self._ready_file = self._dir / "node.ready.json"
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._thread = threading.Thread(target=self._run, name="kvpool-embedded-node", daemon=True)

    def start(self) -> "EmbeddedNode":
        self._thread.start()
        return self

    @property
    def mounted(self) -> bool:
        proc = self._proc
        return proc is not None and proc.poll() is None and self._ready_file.exists()

    def wait_mounted(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.mounted:
                return True
            time.sleep(0.02)
        return self.mounted

    def _run(self) -> None:
        delay_s, max_s = self._retry
        log_path = self._dir / "node.log"
        while not self._stop.is_set():
            with self._lock:
                if self._stop.is_set():
                    return
                with open(log_path, "ab") as out:
                    self._proc = subprocess.Popen(
                        [*self._argv, "--ready-file", str(self._ready_file)], stdout=out, stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                    )
            log.info("kvpool: embedded node %s (%d bytes) started as pid %d; its log: %s",
                     self._node_id, self._memory_bytes, self._proc.pid, log_path)
            started = time.monotonic()
            code = self._proc.wait()
            if self._stop.is_set():
                return
            if time.monotonic() - started > 60.0:
                delay_s = self._retry[0]  # it ran fine for long: a new failure starts the back-off over
            self._ready_file.unlink(missing_ok=True)
            log.warning("kvpool: embedded node %s exited with %s; starting it again in %.1f s (log: %s)",
                        self._node_id, code, delay_s, log_path)
            self._stop.wait(delay_s)
            delay_s = min(delay_s * 2, max_s)

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                log.warning("kvpool: embedded node %s did not stop within %.0f s; killing it",
                            self._node_id, _STOP_GRACE_S)
                proc.kill()
                proc.wait()
        self._thread.join(1.0)
        for path in (self._ready_file, self._dir / "node.log"):
            path.unlink(missing_ok=True)
        try:
            os.rmdir(self._dir)
        except OSError:
            pass
