"""Control-plane messages between clients, nodes and the master (msgspec, msgpack on the wire).

Rules:
- Every data call is batch-first: a request carries a list of keys and the reply answers all of
  them in one round trip.
- Requests are a tagged union (`type` field); the master decodes `Request` and answers one `Reply`.
  Anything that does not decode is answered with `ErrorReply(kind="protocol")`, never a crash.
- Keys are plain strings inside a tenant's namespace; the tenant travels with every data request.
- Times on the wire are durations (ttl_s), never absolute clocks: master and client clocks differ.
- Hot replies are compact: a leased lookup answers replica locations as one bytes field of
  little-endian int64 triples (segment_id, offset, size), hits in order (`pack_replicas` /
  `unpack_replicas`; numpy reads it with `frombuffer(..., "<i8").reshape(-1, 3)`), not one struct
  per hit, whose encoding and decoding cost more than the lookup itself.
"""

from __future__ import annotations

import struct

import msgspec
from msgspec import Struct

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # larger control frames are rejected before decoding
MAX_REPLICAS = 8  # per object; a per-hit replica count travels as one byte
REPLICA_BYTES = 24  # one packed replica: segment_id, offset, size as little-endian int64
_REPLICA = struct.Struct("<qqq")


class Replica(Struct, array_like=True, frozen=True, gc=False):
    """Where one copy of an object lives: `size` bytes at `offset` inside segment `segment_id`.
    gc=False: only ints, so no cycles; untracked structs are 16 bytes smaller (the master holds
    millions) and decode ~30 % faster (a leased 10K-key lookup reply holds 10K of them)."""

    segment_id: int
    offset: int
    size: int


def pack_replicas(replicas) -> bytes:
    """Replicas (or (segment_id, offset, size) triples) as packed little-endian int64 triples."""
    pack = _REPLICA.pack
    return b"".join([pack(*r) if isinstance(r, tuple) else pack(r.segment_id, r.offset, r.size) for r in replicas])


def unpack_replicas(locations: bytes) -> list[Replica]:
    """The inverse of pack_replicas; raises ValueError when the length is not a multiple of 24."""
    if len(locations) % REPLICA_BYTES:
        raise ValueError(f"packed replicas are {len(locations)} bytes, not a multiple of {REPLICA_BYTES}")
    return [Replica(*t) for t in _REPLICA.iter_unpack(locations)]


class SegmentInfo(Struct, frozen=True):
    """What a client needs to reach a segment: NIXL agent metadata, and for same-host clients a
    shared-memory path it can map directly."""

    segment_id: int
    node_id: str
    host_id: str
    size_bytes: int
    base_addr: int
    agent_name: str
    agent_metadata: bytes
    shm_path: str | None = None


# ---- requests -------------------------------------------------------------------------------


class MountSegment(Struct, tag="mount", frozen=True):
    node_id: str
    host_id: str
    size_bytes: int
    base_addr: int
    agent_name: str
    agent_metadata: bytes
    shm_path: str | None = None


class UnmountSegment(Struct, tag="unmount", frozen=True):
    segment_id: int


class Heartbeat(Struct, tag="heartbeat", frozen=True):
    node_id: str
    segment_ids: list[int]


class GetSegments(Struct, tag="get_segments", frozen=True):
    segment_ids: list[int]


class PutStart(Struct, tag="put_start", frozen=True):
    """Allocate space for new objects. `parents[i]` is the key whose prefix keys[i] extends (the
    chain), or None for a chain head. Keys that already exist are answered `exists` without space."""

    tenant: str
    keys: list[str]
    sizes: list[int]
    parents: list[str | None]
    num_replicas: int = 1
    pinned: bool = False


class PutEnd(Struct, tag="put_end", frozen=True):
    tenant: str
    keys: list[str]


class PutRevoke(Struct, tag="put_revoke", frozen=True):
    tenant: str
    keys: list[str]


class LookupPrefix(Struct, tag="lookup_prefix", frozen=True):
    """How many leading keys of a chain are complete. With `lease` the hits are leased for reading
    and their replica locations returned; without it (a scheduler only counting) nothing is leased."""

    tenant: str
    keys: list[str]
    lease: bool = True


class ReleaseLeases(Struct, tag="release_leases", frozen=True):
    """The reader is done with these leased lookups (read or failed): their objects may be evicted,
    and removed ones freed, without waiting for the lease TTL. Ids come from LookupReply.lease_id;
    unknown, expired or already released ids are ignored (releasing twice is harmless). Answered
    with OkReply(count = ids released now)."""

    tenant: str
    lease_ids: list[int]


class Exists(Struct, tag="exists", frozen=True):
    tenant: str
    keys: list[str]


class Remove(Struct, tag="remove", frozen=True):
    tenant: str
    keys: list[str]


class Stats(Struct, tag="stats", frozen=True):
    pass


Request = (
    MountSegment
    | UnmountSegment
    | Heartbeat
    | GetSegments
    | PutStart
    | PutEnd
    | PutRevoke
    | LookupPrefix
    | ReleaseLeases
    | Exists
    | Remove
    | Stats
)


# ---- replies --------------------------------------------------------------------------------


class ErrorReply(Struct, tag="error", frozen=True):
    kind: str  # an error kind from core.errors
    message: str


class OkReply(Struct, tag="ok", frozen=True):
    count: int = 0


class MountReply(Struct, tag="mounted", frozen=True):
    segment_id: int
    heartbeat_interval_s: float
    node_ttl_s: float


class HeartbeatReply(Struct, tag="heartbeat_ok", frozen=True):
    unknown_segment_ids: list[int]  # the master dropped these: the node must mount again


class SegmentsReply(Struct, tag="segments", frozen=True):
    segments: list[SegmentInfo]  # unknown ids are left out


PUT_ALLOCATED = 0
PUT_EXISTS = 1
PUT_NO_SPACE = 2


class PutStartReply(Struct, tag="put_started", frozen=True):
    statuses: list[int]  # PUT_* per key
    replicas: list[list[Replica]]  # per key; empty unless allocated
    message: str = ""  # why a key got PUT_NO_SPACE


class LookupReply(Struct, tag="lookup", frozen=True):
    """`num_hit` leading keys are complete. With a lease: `replica_locations` holds every hit's
    replicas, packed (see pack_replicas), hits in order; `replica_counts` has one byte per hit, its
    replica count, or is empty when every hit has exactly one replica (the common case, sent free).
    `lease_id` (0: nothing leased) names this lookup's lease for ReleaseLeases."""

    num_hit: int
    lease_ttl_s: float
    lease_id: int = 0
    replica_locations: bytes = b""
    replica_counts: bytes = b""

    def replica_lists(self) -> list[list[Replica]]:
        """Per hit, its replicas (slow path for tests and tools; the client decodes with numpy).
        Raises ValueError when the fields do not agree with num_hit."""
        flat = unpack_replicas(self.replica_locations)
        if not flat:
            return []
        counts = list(self.replica_counts) if self.replica_counts else [1] * self.num_hit
        if len(counts) != self.num_hit or sum(counts) != len(flat) or (counts and min(counts) < 1):
            raise ValueError(
                f"lookup reply with {self.num_hit} hits has {len(self.replica_counts)} counts "
                f"and {len(flat)} replicas"
            )
        out, start = [], 0
        for n in counts:
            out.append(flat[start : start + n])
            start += n
        return out


class ExistsReply(Struct, tag="exists_ok", frozen=True):
    exists: list[bool]


class NodeStats(Struct, frozen=True):
    node_id: str
    segment_id: int
    host_id: str
    state: str
    capacity_bytes: int
    used_bytes: int
    num_objects: int
    last_heartbeat_age_s: float


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


Reply = (
    ErrorReply
    | OkReply
    | MountReply
    | HeartbeatReply
    | SegmentsReply
    | PutStartReply
    | LookupReply
    | ExistsReply
    | StatsReply
)

request_encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
reply_encoder = msgspec.msgpack.Encoder()
reply_decoder = msgspec.msgpack.Decoder(Reply)
