"""Storage node configuration (the size parser its CLI uses lives in core/sizes.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvpool.core.sizes import format_size, parse_size
from kvpool.core.types import MAX_TENANT_LENGTH

__all__ = ["NodeConfig", "format_size", "parse_size"]

MIN_MEMORY_BYTES = 1 << 20


@dataclass(frozen=True)
class NodeConfig:
    """master_address: the master's ZMQ endpoint (tcp://host:port).
    memory_bytes: the DRAM segment this node contributes (shared memory, pre-faulted).
    node_id: a name for the node in stats; None picks hostname-pid.
    timeout_s: how long one control call to the master may take.
    mount_timeout_s: how long start() keeps trying to mount (the master may still be starting).
    announce_chunk: directory entries per AnnounceObjects message after a remount.
    master_address may name standbys too, comma-separated (tried in turn when one does not answer).
    disk_path: a directory for the disk tier (None: DRAM only); disk_bytes bounds its files' size.
    writeback_queue: committed objects waiting to be written to disk, at most (more are not cached on disk).
    tier_poll_interval_s: with a disk tier, how often the node asks the master for work (promotions wait on it).
    tenant: "" (shared: any tenant's objects) or a tenant name: the segment holds only that tenant's
    objects, and that tenant's objects go only to segments dedicated to it (hard isolation).
    segment_lane: without a credential, also serve small transfers over a plain TCP port (one round
    trip instead of UCX's emulated one-sided ops; transfer/tcp_path.py).
    """

    master_address: str
    memory_bytes: int
    node_id: str | None = None
    timeout_s: float = 5.0
    mount_timeout_s: float = 30.0
    announce_chunk: int = 5_000  # the master handles one chunk in ~30 ms: other requests wait no longer
    disk_path: str | None = None
    disk_bytes: int = 0
    writeback_queue: int = 4096
    tier_poll_interval_s: float = 0.05
    tenant: str = ""
    credential: str | None = None  # CURVE credential file of a `node` identity; None: $KVPOOL_NODE_CREDENTIAL or none
    segment_lane: bool = True  # without a credential: serve small transfers over the segment lane (TCP)

    def __post_init__(self) -> None:
        if not isinstance(self.master_address, str) or not (re.match(r"^etcd://.+", self.master_address.strip()) or all(
            re.match(r"^(tcp|ipc|inproc)://.+", a.strip()) for a in self.master_address.split(",")
        )):
            raise ValueError(
                f"master_address must look like tcp://HOST:PORT (or several, comma-separated) or "
                f"etcd://HOST:PORT[,...]/NAME, got {self.master_address!r}"
            )
        if not isinstance(self.announce_chunk, int) or self.announce_chunk < 1:
            raise ValueError(f"announce_chunk must be a positive int, got {self.announce_chunk!r}")
        if not isinstance(self.memory_bytes, int) or self.memory_bytes < MIN_MEMORY_BYTES:
            raise ValueError(f"memory_bytes must be an int >= {MIN_MEMORY_BYTES} (1 MiB), got {self.memory_bytes!r}")
        if self.node_id is not None and (
            not isinstance(self.node_id, str) or not re.match(r"^[A-Za-z0-9._:-]{1,128}$", self.node_id)
        ):
            raise ValueError(
                f"node_id must be 1-128 characters of letters, digits, '.', '_', ':' or '-', got {self.node_id!r}"
            )
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if self.disk_path is not None and (not isinstance(self.disk_bytes, int) or self.disk_bytes < 1 << 20):
            raise ValueError(f"disk_bytes must be an int >= 1 MiB with a disk tier, got {self.disk_bytes!r}")
        if self.disk_path is None and self.disk_bytes:
            raise ValueError("disk_bytes needs disk_path (the directory of the disk tier)")
        if not isinstance(self.writeback_queue, int) or self.writeback_queue < 1:
            raise ValueError(f"writeback_queue must be a positive int, got {self.writeback_queue!r}")
        if not self.tier_poll_interval_s > 0:
            raise ValueError(f"tier_poll_interval_s must be > 0, got {self.tier_poll_interval_s!r}")
        if not isinstance(self.tenant, str) or len(self.tenant) > MAX_TENANT_LENGTH:
            raise ValueError(f"tenant must be a string of at most {MAX_TENANT_LENGTH} characters (\"\": shared), "
                             f"got {self.tenant!r}")
        if not self.mount_timeout_s > 0:
            raise ValueError(f"mount_timeout_s must be > 0, got {self.mount_timeout_s!r}")
