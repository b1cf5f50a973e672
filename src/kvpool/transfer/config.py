"""The data plane's settings: frozen configs, read from the environment only by `from_env()`.

Rules:
- Nothing else in kvpool.transfer reads the environment: DataPlane and SegmentMemory take these
  configs (made with `from_env()` when the caller passes none), so a bad value is a ValueError
  naming its variable when the component is made, never in the middle of a transfer.
- `rdma_available` looks at the machine (RDMA devices) and at UCX_TLS, because UCX, not kvpool,
  decides which transport NIXL uses: it is part of the data plane's settings, read with them.
- The defaults and the measurements behind them: docs/design/data-plane.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvpool.core.settings import env_bytes, env_int_in, env_microseconds

TCP_MAX_BYTES_ENV = "KVPOOL_SEGMENT_LANE_MAX_BYTES"
TCP_SPLIT_BYTES_ENV = "KVPOOL_SEGMENT_LANE_SPLIT_BYTES"
TCP_SPIN_ENV = "KVPOOL_SEGMENT_LANE_SPIN_US"
PROGRESS_DELAY_ENV = "KVPOOL_NIXL_PROGRESS_DELAY_US"

RDMA_TCP_MAX_BYTES = 256 << 10  # with RDMA, NIXL takes every larger job
TCP_MAX_BYTES = 4 << 20  # without: UCX runs on TCP and the TCP path takes jobs up to this size
TCP_REGION_BYTES = 256 << 10  # ... and, without RDMA, a job of any size whose regions average this or less
WRITE_SPLIT_BYTES = 2 << 20  # a TCP-path WRITE this large runs as two halves on two connections
READ_SPLIT_BYTES = 2 << 20  # a READ likewise
DEFAULT_TCP_SPIN_US = 200.0  # how long beyond its bytes' share a whole TCP-path job spins
DEFAULT_PROGRESS_DELAY_US = 100_000  # NIXL's progress thread's fallback poll period
MIN_PROGRESS_DELAY_US, MAX_PROGRESS_DELAY_US = 1_000, 10_000_000

_RDMA_TLS = ("all", "rc", "ud", "dc", "ib", "rdma", "srd", "gga")


def rdma_available(env: Mapping[str, str] | None = None) -> bool:
    """Whether NIXL's UCX can move bytes across hosts by RDMA from here: an RDMA device exists and
    UCX_TLS (if set to a list) names an RDMA transport. Without, UCX runs cross-host on TCP."""
    env = os.environ if env is None else env
    tls = env.get("UCX_TLS", "").strip()
    if tls and not tls.startswith("^"):
        names = [t.strip().lower() for t in tls.split(",")]
        if not any(n == r or n.startswith(r + "_") for n in names for r in _RDMA_TLS):
            return False
    try:
        with os.scandir("/sys/class/infiniband") as devices:
            return any(True for _ in devices)
    except OSError:
        return False


@dataclass(frozen=True)
class NixlConfig:
    """NIXL agents' settings (DataPlane's and SegmentMemory's)."""

    progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US  # $KVPOOL_NIXL_PROGRESS_DELAY_US

    def __post_init__(self) -> None:
        if not MIN_PROGRESS_DELAY_US <= self.progress_delay_us <= MAX_PROGRESS_DELAY_US:
            raise ValueError(f"progress_delay_us must be from {MIN_PROGRESS_DELAY_US} (1 ms) to "
                             f"{MAX_PROGRESS_DELAY_US} (10 s), got {self.progress_delay_us}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> NixlConfig:
        env = os.environ if env is None else env
        return cls(env_int_in(env, PROGRESS_DELAY_ENV, DEFAULT_PROGRESS_DELAY_US, MIN_PROGRESS_DELAY_US,
                              MAX_PROGRESS_DELAY_US, "microseconds"))


@dataclass(frozen=True)
class DataPlaneConfig:
    """Which jobs take the TCP path to a node, and how they run there (tcp_path.py)."""

    rdma: bool = False  # NIXL can use RDMA across hosts (rdma_available())
    tcp_max_bytes: int | None = None  # the largest job the TCP path takes (None: by `rdma`; 0: never)
    write_split_bytes: int = WRITE_SPLIT_BYTES  # 0: never split
    read_split_bytes: int = READ_SPLIT_BYTES
    tcp_spin_s: float = DEFAULT_TCP_SPIN_US * 1e-6  # 0: never spin
    nixl: NixlConfig = field(default_factory=NixlConfig)

    def __post_init__(self) -> None:
        for name in ("tcp_max_bytes", "write_split_bytes", "read_split_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a number of bytes >= 0, got {value!r}")
        if not self.tcp_spin_s >= 0:
            raise ValueError(f"tcp_spin_s must be >= 0, got {self.tcp_spin_s!r}")

    @property
    def max_bytes(self) -> int:
        """The TCP path's size limit, its default resolved."""
        if self.tcp_max_bytes is not None:
            return self.tcp_max_bytes
        return RDMA_TCP_MAX_BYTES if self.rdma else TCP_MAX_BYTES

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> DataPlaneConfig:
        """$KVPOOL_SEGMENT_LANE_MAX_BYTES, $KVPOOL_SEGMENT_LANE_SPLIT_BYTES (both splits),
        $KVPOOL_SEGMENT_LANE_SPIN_US, $KVPOOL_NIXL_PROGRESS_DELAY_US, and UCX_TLS for `rdma`."""
        env = os.environ if env is None else env
        rdma = rdma_available(env)
        max_bytes = env_bytes(env, TCP_MAX_BYTES_ENV, RDMA_TCP_MAX_BYTES if rdma else TCP_MAX_BYTES)
        return cls(
            rdma=rdma,
            tcp_max_bytes=max_bytes,
            write_split_bytes=env_bytes(env, TCP_SPLIT_BYTES_ENV, WRITE_SPLIT_BYTES),
            read_split_bytes=env_bytes(env, TCP_SPLIT_BYTES_ENV, READ_SPLIT_BYTES),
            tcp_spin_s=env_microseconds(env, TCP_SPIN_ENV, DEFAULT_TCP_SPIN_US),
            nixl=NixlConfig.from_env(env),
        )
