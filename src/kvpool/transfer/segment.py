"""Node side of the data plane: the memory a storage node contributes to the pool.

Rules:
- One SegmentMemory is one memfd mapping (see shm.py) registered with its own NIXL agent, so
  other hosts reach it with one-sided UCX READ/WRITE and same-host clients map it directly.
- The node never touches object bytes: clients write and read; the master decides offsets. With
  `lane_host` it also serves small transfers over its TCP path (tcp_path.py: one TCP round
  trip instead of UCX's emulated one-sided ops); the caller offers it only without authentication.
- Agent names are unique per segment (node id, pid, random suffix): a restarted node must never
  be mistaken for its previous life by a client that cached the old agent.
"""

from __future__ import annotations

import os
import uuid

from kvpool.core.protocol import MountSegment, SegmentInfo
from kvpool.transfer.config import NixlConfig
from kvpool.transfer.hostinfo import host_id
from kvpool.transfer.nixlio import NixlEndpoint
from kvpool.transfer.tcp_path_server import TcpPathServer
from kvpool.transfer.shm import SharedSegmentFile


class SegmentMemory:
    def __init__(self, size_bytes: int, name: str = "segment", lane_host: str | None = None,
                 nixl: NixlConfig | None = None) -> None:
        """`lane_host`: serve the TCP path, announced at this address (None: none). `nixl`: the
        agent's settings (None: NixlConfig.from_env(), read once now)."""
        if size_bytes <= 0:
            raise ValueError(f"size_bytes must be > 0, got {size_bytes}")
        nixl = NixlConfig.from_env() if nixl is None else nixl
        self.size_bytes = size_bytes
        self.agent_name = f"kvpool-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._file: SharedSegmentFile | None = SharedSegmentFile(size_bytes, self.agent_name)
        try:
            self._endpoint: NixlEndpoint | None = NixlEndpoint(self.agent_name,
                                                               progress_delay_us=nixl.progress_delay_us)
            self._registration = self._endpoint.register(self._file.base_addr, size_bytes)
            self.agent_metadata = self._endpoint.metadata()
        except BaseException:
            self._file.close()
            raise
        self.base_addr = self._file.base_addr
        self.shm_path: str | None = self._file.path
        self._lane = TcpPathServer(self.base_addr, size_bytes, lane_host) if lane_host is not None else None
        self.lane_address: str | None = self._lane.address if self._lane is not None else None

    @property
    def lane_tags(self):
        """The TCP path's TagIndex (tcp_path_tags.py), or None without one."""
        return self._lane.tags if self._lane is not None else None

    def mount_request(self, node_id: str, recovering: bool = False) -> MountSegment:
        return MountSegment(
            node_id=node_id,
            host_id=host_id(),
            size_bytes=self.size_bytes,
            base_addr=self.base_addr,
            agent_name=self.agent_name,
            agent_metadata=self.agent_metadata,
            shm_path=self.shm_path,
            recovering=recovering,
            lane_address=self.lane_address,
        )

    def segment_info(self, segment_id: int, node_id: str) -> SegmentInfo:
        """What the master would hand clients for this segment (tests and benchmarks use it
        to transfer without a master)."""
        m = self.mount_request(node_id)
        return SegmentInfo(
            segment_id=segment_id,
            node_id=node_id,
            host_id=m.host_id,
            size_bytes=m.size_bytes,
            base_addr=m.base_addr,
            agent_name=m.agent_name,
            agent_metadata=m.agent_metadata,
            shm_path=m.shm_path,
            lane_address=m.lane_address,
        )

    @property
    def closed(self) -> bool:
        return self._file is None

    def close(self) -> None:
        """Deregister and unmap. Clients that mapped the segment keep their pages until they
        forget it; the kernel frees the memory after the last one."""
        if self._lane is not None:
            self._lane.close()  # first: its threads read and write the mapping
            self._lane = None
        if self._endpoint is not None:
            try:
                self._endpoint.deregister(self._registration)
            finally:
                self._endpoint.close()
                self._endpoint = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "SegmentMemory":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
