"""The master's one configuration object, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.core.protocol import DEFAULT_MAX_INLINE_BYTES, MAX_MESSAGE_BYTES
from kvpool.master.quotas import QuotaTable


@dataclass(frozen=True)
class MasterConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: the OS chooses
    metrics_port: int | None = None  # None: no Prometheus endpoint; 0: the OS chooses
    # used / capacity above this after a put starts eviction towards low_watermark: the put evicts
    # back under it (and at most twice its bytes more), slices while the master idles and one per
    # tick the rest (pressure.py).
    # Close together: the pool's average fill is between them, and every point of it is hit rate
    # once the pool is full (the long e2e trace: 0.95 / 0.85 -> 0.99 / 0.98 simulate 73.5 -> 79.4 %
    # pool hits, benchmarks/results/e2e_capacity_bound/2026-12-02-unknown-long.md); a burst evicts
    # 1 % of the pool, not 10 %, on the master's one thread. An allocation that does not fit
    # evicts on demand either way (evict_for).
    high_watermark: float = 0.99
    low_watermark: float = 0.98
    # among eviction candidates: "lru" (chain tails by last use) or "session" (by predicted return of
    # their agent session, from the hints serving sends; master/session_order.py)
    eviction_order: str = "lru"
    max_retained_fraction: float = 0.5  # TTL hints keep at most this share of DRAM per tenant without a quota
    lease_ttl_s: float = 5.0  # a read lease granted by lookup_prefix(lease=True)
    max_lease_hold_s: float = 15.0  # past this much continuous leasing, eviction may drain an object
    node_ttl_s: float = 10.0  # a segment not heartbeated for this long is unmounted (tolerates seconds of stall)
    heartbeat_interval_s: float = 1.0  # told to nodes at mount
    put_timeout_s: float = 30.0  # a pending put never ended within this is reclaimed (writer died)
    # an allocation held for a writer's next put (PutEnd.ahead, client/ahead.py) and not used within
    # this (or put_timeout_s, if shorter) is reclaimed: an idle writer holds no space for long
    ahead_timeout_s: float = 1.0
    alignment_bytes: int = 64  # object offsets and sizes are rounded to this
    max_message_bytes: int = MAX_MESSAGE_BYTES  # larger control frames get ErrorReply(kind="protocol")
    tick_interval_s: float = 0.2  # health checks, pending reclaim and metric snapshots run this often
    quarantine_max_s: float = 300.0  # space of a write that may still land is held at most this long
    recovery_timeout_s: float = 30.0  # a remounted segment takes new objects after this even if unannounced
    directory_max_ops: int = 2_000_000  # unacknowledged directory ops kept per segment (directory.py)
    directory_ops_per_reply: int = 50_000  # directory ops in one heartbeat reply
    # a reply that committed objects waits at most this for their nodes to have them in their
    # directories (durability.py); 0: answer at once (a crash may then lose the last commits)
    confirm_timeout_s: float = 1.0
    max_promotions_per_lookup: int = 256  # disk-only keys one lookup may start copying back to DRAM
    quotas: QuotaTable = field(default_factory=QuotaTable)  # per-tenant bytes / objects (quotas.py)
    rate_limit_keys_per_s: float = 2_000_000.0  # per identity: keys named in lookups, puts, checks, removals
    rate_limit_burst_keys: float = 1_000_000.0  # what one identity may ask at once after a quiet spell
    # small plain values (no parent) kept in the master itself, one round trip each (inline.py); 0: off
    inline_capacity_bytes: int = 64 << 20
    max_inline_bytes: int = DEFAULT_MAX_INLINE_BYTES  # capped at the capacity and half of max_message_bytes
    auth_dir: str | None = None  # CURVE keys and trusted identities (rpc/credentials.py); None: insecure

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 0..65535 (or None for no endpoint), got {self.metrics_port}")
        if not 0 < self.low_watermark < self.high_watermark <= 1:
            raise ValueError(
                "watermarks must satisfy 0 < low_watermark < high_watermark <= 1, got "
                f"low={self.low_watermark} high={self.high_watermark}"
            )
        if self.eviction_order not in ("lru", "session"):
            raise ValueError(f"eviction_order must be lru or session, got {self.eviction_order!r}")
        if not 0 <= self.max_retained_fraction < 1:
            raise ValueError(f"max_retained_fraction must be in [0, 1), got {self.max_retained_fraction}")
        for name in ("lease_ttl_s", "node_ttl_s", "heartbeat_interval_s", "put_timeout_s", "ahead_timeout_s",
                     "tick_interval_s",
                     "quarantine_max_s", "recovery_timeout_s", "directory_max_ops", "directory_ops_per_reply",
                     "max_promotions_per_lookup", "rate_limit_keys_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_lease_hold_s < self.lease_ttl_s:
            raise ValueError(
                f"max_lease_hold_s ({self.max_lease_hold_s}) must be >= lease_ttl_s ({self.lease_ttl_s}): "
                "otherwise a single read lease would already exceed the cap"
            )
        if self.heartbeat_interval_s >= self.node_ttl_s:
            raise ValueError(
                f"heartbeat_interval_s ({self.heartbeat_interval_s}) must be < node_ttl_s ({self.node_ttl_s}), "
                "or live nodes would be declared dead between two heartbeats"
            )
        if not 0 <= self.confirm_timeout_s <= 60:
            raise ValueError(f"confirm_timeout_s must be in [0, 60] seconds, got {self.confirm_timeout_s}")
        if self.alignment_bytes <= 0 or self.alignment_bytes & (self.alignment_bytes - 1):
            raise ValueError(f"alignment_bytes must be a power of two, got {self.alignment_bytes}")
        if not isinstance(self.quotas, QuotaTable):
            raise ValueError(f"quotas must be a QuotaTable, got {type(self.quotas).__name__}")
        if self.rate_limit_burst_keys < 1:
            raise ValueError(f"rate_limit_burst_keys must be >= 1, got {self.rate_limit_burst_keys}")
        if self.inline_capacity_bytes < 0 or self.max_inline_bytes < 0:
            raise ValueError("inline_capacity_bytes and max_inline_bytes must be >= 0, got "
                             f"{self.inline_capacity_bytes} and {self.max_inline_bytes}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
