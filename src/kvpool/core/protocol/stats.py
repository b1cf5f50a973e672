"""The master's statistics: what `Stats` answers (capacity, usage, per node, tier and tenant)."""

from __future__ import annotations

from msgspec import Struct


class Stats(Struct, tag="stats", frozen=True):
    pass


class TierStats(Struct, frozen=True):
    """A segment's disk tier as the master sees it."""

    segment_id: int
    node_id: str
    capacity_bytes: int
    used_bytes: int
    num_objects: int  # objects with a copy on this disk (in DRAM too or not)
    num_disk_only: int  # objects only on this disk
    demotions: int  # DRAM evictions that kept the object on disk
    promotions: int  # disk-only objects copied back to DRAM, done
    promotions_failed: int
    promoting: int  # in progress now
    disk_hits: int  # lookup keys found on disk only (a promotion started or under way)
    disk_evictions: int  # disk copies dropped to make room


class NodeStats(Struct, frozen=True):
    node_id: str
    segment_id: int
    host_id: str
    state: str
    capacity_bytes: int
    used_bytes: int
    num_objects: int
    last_heartbeat_age_s: float
    tenant: str = ""  # the tenant the segment is dedicated to ("": shared)


class KeyGroupStats(Struct, frozen=True):
    """A tenant's objects of one KV-cache group of a hybrid model (keys 'g<N>-...')."""

    group: str
    num_objects: int
    used_bytes: int


class TenantStats(Struct, frozen=True):
    """One tenant's share of the pool (master/quotas.py): objects holding DRAM, pending or complete."""

    tenant: str
    used_bytes: int  # object bytes x replicas
    num_objects: int
    max_bytes: int = 0  # its quota (0: none)
    max_objects: int = 0
    quota_refusals: int = 0  # keys refused: the quota was full even after evicting the tenant's own objects
    quota_evictions: int = 0  # its objects evicted to make room under its quota
    num_segments: int = 0  # segments holding its objects
    key_groups: list[KeyGroupStats] = []  # a hybrid model's KV-cache groups, by key prefix


class HintStats(Struct, frozen=True):
    """What agents' session hints did to eviction (master/hints.py)."""

    eviction_order: str  # "lru" or "session"
    retained_bytes: int  # object bytes a TTL keeps now
    retained_objects: int
    retention_refused: int  # TTL grants past the tenant's share
    retention_kept: int  # eviction candidates passed over because a TTL kept them
    ttl_hits: int  # lookup hits on objects a TTL kept
    turns_arrived: int
    turns_done: int
    sessions_ended: int
    session_objects: int  # objects put naming their session
    admission_refusals: int  # puts refused: they would evict blocks needed before theirs (session order)
    retained_by_tenant: dict[str, int] = {}


class StatsReply(Struct, tag="stats_ok", frozen=True):
    capacity_bytes: int
    used_bytes: int
    num_objects: int
    num_pending: int
    puts: int
    gets: int  # leased lookups
    lookups: int
    hit_keys: int
    miss_keys: int
    evictions: int
    evicted_bytes: int
    lease_grants: int
    lease_expiries: int
    fragmentation: float  # 1 - largest free range / total free, over all segments
    nodes: list[NodeStats]
    lease_releases: int = 0  # leased lookups released by their reader before the TTL
    epoch: int = 0
    refused_put_ends: int = 0  # PutEnd keys whose token was no longer pending
    ahead_expired: int = 0  # allocations held for a writer's next put (PutEnd.ahead) never used
    landed: int = 0  # objects made readable by PutLanded (ended while their bytes travelled)
    refused_landings: int = 0  # PutLanded keys not pending a landing under that token (reclaimed, revoked)
    quarantined: int = 0  # allocations held because their write may still land
    quarantine_expiries: int = 0  # quarantines ended by their time limit, not by the writer
    recovered_objects: int = 0  # objects taken from nodes' directories after a (re)mount
    rejected_announcements: int = 0  # directory entries refused on recovery (conflicts, overlaps)
    tiers: list[TierStats] = []  # one per segment with a disk tier
    tenants: list[TenantStats] = []  # per tenant: usage and quota
    forbidden: int = 0  # requests refused by the access policy (a role's call it may not make)
    rate_limited: int = 0  # requests refused by an identity's rate limit
    refused_handshakes: int = 0  # connections whose CURVE key the master does not trust
    commits_confirmed: int = 0  # put replies sent once their objects were in their nodes' directories
    commits_unconfirmed: int = 0  # ... sent at --confirm-timeout-s without (a slow or dead node)
    inline_copied: int = 0  # inline values copied to a node (master/inline_copies.py)
    inline_uncopied: int = 0  # inline values stored while no node could keep a copy
    inline_taken_back: int = 0  # inline values a recovering node brought back
    inline_values: int = 0  # small plain values held by the master itself (master/inline.py)
    inline_bytes: int = 0
    inline_capacity_bytes: int = 0
    inline_evictions: int = 0
    hints: HintStats | None = None  # session hints and retention (None: a master without them)
