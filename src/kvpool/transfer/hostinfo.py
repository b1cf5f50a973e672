"""Which machine (and which process namespace) this process runs on.

Rules:
- `host_id()` is equal for two processes exactly when one can open the other's /proc/<pid>/fd
  files: same kernel boot and same PID namespace. Two containers on one machine get different
  ids on purpose, so the shared-memory path is only tried where it can work.
- No environment reads: the id comes from the kernel, so nobody has to configure it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket

from kvpool.core.types import HostId


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


@functools.cache
def host_id() -> HostId:
    boot_id = _read("/proc/sys/kernel/random/boot_id")
    try:
        pid_namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_namespace = ""
    digest = hashlib.sha256(f"{boot_id}|{pid_namespace}".encode()).hexdigest()[:12]
    return HostId(f"{socket.gethostname()}-{digest}")
