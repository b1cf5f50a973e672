"""Control-plane messages between clients, nodes and the master (msgspec, msgpack on the wire).

Rules:
- Every data call is batch-first: a request carries a list of keys and the reply answers all of
  them in one round trip.
- Requests are a tagged union (`type` field); the master decodes `Request` and answers one `Reply`.
  Anything that does not decode is answered with `ErrorReply(kind="protocol")`, never a crash.
- Keys are plain strings inside a tenant's namespace; the tenant travels with every data request.
- Times on the wire are durations (ttl_s), never absolute clocks: master and client clocks differ.
- Every reply names the master's incarnation (`epoch`, a random 63-bit number chosen at start) in
  its own frame, before the payload (transfer/zmq_channel.py reads it). Ids the master hands out that
  another process keeps (segment ids, lease ids, write tokens) carry the incarnation's random
  prefix in their high 31 bits (master/ids.py), so no id is ever reissued by a restarted master.
- Puts are fenced by write tokens: PutStart returns one per allocation, PutEnd / PutRevoke name it,
  and an end for an allocation that is no longer the writer's (reclaimed, revoked, removed and
  re-put) is refused and reported in PutEndReply.refused, never applied to another writer's object.
- A put may end while its bytes travel (PutEnd.landing): the master checks and renames as for any
  end but keeps the objects unreadable until the writer's one-way PutLanded says the bytes are in.
  Only masters that say so in their PutStartReply (`lands`) are asked.
- Objects carry an end-to-end checksum (client/checksum.py; 0 means none): the writer sends it
  with PutEnd, the master keeps it and returns it with every leased hit, readers verify it.
- Nodes keep a directory of their committed objects (DirEntry), fed by heartbeat replies
  (DirectoryDelta, acknowledged by sequence number), and announce it to a new master
  (AnnounceObjects) so a master restart keeps the cache.
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


class DirEntry(Struct, array_like=True, frozen=True, gc=False):
    """One committed object in a node's directory, self-describing: enough for a new master to
    rebuild its record. `size` 0 is a removal of whatever the directory holds at `offset`."""

    offset: int
    size: int
    tenant: str = ""
    key: str = ""
    parent: str | None = None
    checksum: int = 0
    op: int = 0  # DIR_* below: what the op asks of the node beyond recording it (0: nothing more)


DIR_COMMIT = 0  # an object committed in DRAM at `offset` (or, with size 0, a removal there)
DIR_PROMOTE = 1  # read the node's disk copy of (tenant, key) into `offset`, then report it (TierReport)
DIR_DISK_DROP = 2  # forget the disk copy of (tenant, key); `offset` means nothing


class DiskEntry(Struct, array_like=True, frozen=True, gc=False):
    """One object in a node's disk tier: enough for a master to rebuild its record."""

    tenant: str
    key: str
    size: int
    checksum: int
    parent: str | None = None
    age_s: float = 0.0  # since its last use, as the node saw it (a new master's LRU order)


class TierReport(Struct, array_like=True, frozen=True):
    """What a node's disk tier did since its last acknowledged heartbeat, for one segment. Resent
    until a heartbeat reply comes back: the master applies each item idempotently."""

    segment_id: int
    written: list[DiskEntry] = []  # now on disk (write-back done, checksum verified)
    lost: list[DiskEntry] = []  # no longer on disk (corrupt, unreadable): forget the disk copy
    promoted: list[int] = []  # offsets whose DIR_PROMOTE finished: the bytes are there, verified
    failed: list[int] = []  # offsets whose DIR_PROMOTE failed: the range holds nothing useful


class DirectoryDelta(Struct, frozen=True):
    """Directory changes of one segment, in order: ops[i] has sequence number first_seq + i. With
    `reset` the node first forgets its whole directory (the master dropped a log the node did not
    acknowledge in time): it then loses recovery of those objects, never correctness."""

    segment_id: int
    first_seq: int
    ops: list[DirEntry]
    reset: bool = False
    more: bool = False  # the master holds more ops than fit: the node should ask again at once


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
    lane_address: str | None = None  # "host:port" of the segment lane (transfer/tcp_path.py), if served


# ---- requests -------------------------------------------------------------------------------


class MountSegment(Struct, tag="mount", frozen=True):
    node_id: str
    host_id: str
    size_bytes: int
    base_addr: int
    agent_name: str
    agent_metadata: bytes
    shm_path: str | None = None
    recovering: bool = False  # the node will announce objects (AnnounceObjects) before new puts land here
    disk_bytes: int = 0  # the node's disk tier (0: none): DRAM evictions go there, lookups promote back
    tenant: str = ""  # "": shared; a name: the segment holds only that tenant's objects (`kvpool node --tenant`)
    lane_address: str | None = None  # "host:port" of the node's segment lane (small transfers), if it serves one


class AnnounceObjects(Struct, tag="announce", frozen=True):
    """A remounted node's directory, in chunks, oldest commit first; `ages_s[i]` is how long ago
    entries[i] was committed (the new master's LRU order). `last` ends the recovery: the segment
    takes new objects from then on. Answered with AnnounceReply."""

    segment_id: int
    entries: list[DirEntry]
    ages_s: list[float]
    last: bool = False
    disk_entries: list[DiskEntry] = []  # what the node's disk tier holds (sent after the DRAM entries)


class UnmountSegment(Struct, tag="unmount", frozen=True):
    segment_id: int


class Heartbeat(Struct, tag="heartbeat", frozen=True):
    """`directory_seqs[i]`: the last directory op of segment_ids[i] the node has applied."""

    node_id: str
    segment_ids: list[int]
    directory_seqs: list[int] = []
    tier_reports: list[TierReport] = []  # nodes with a disk tier: write-backs and promotions done



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
    """Make written objects readable. `tokens[i]` is keys[i]'s token from PutStartReply;
    `checksums[i]` its bytes' checksum (0: none). Answered with PutEndReply.

    `as_keys` (empty, or one per key): the allocation pending under keys[i] becomes readable under
    as_keys[i] instead, unless that key exists (then it stays pending under keys[i], its token
    unchanged, and i is in the reply's `existed`). `ahead`: keys to allocate afresh once these
    ended, as a PutStart of `ahead_sizes` without parents (`ahead_replicas` each) would; the
    reply's `ahead` answers it. Together they let a writer hold an allocation ahead of its next
    put (client/ahead.py): that put is then its write and one PutEnd.

    `landing`: sent while the bytes are still being written (client/landing.py). The master does
    all of the above but leaves the ended objects pending, unreadable, until a PutLanded names
    them; one never landed is reclaimed as any pending put is, and PutRevoke still frees it."""

    tenant: str
    keys: list[str]
    tokens: list[int]
    checksums: list[int]
    as_keys: list[str] = []
    ahead: list[str] = []
    ahead_sizes: list[int] = []
    ahead_replicas: int = 1
    landing: bool = False


class PutLanded(Struct, tag="put_landed", frozen=True):
    """The bytes of these objects, ended by a PutEnd with `landing`, are written: make them readable.
    Sent one way (no reply); keys are the ones they were ended under (as_keys where given).
    `checksums` (empty, or one per key; 0: keep the PutEnd's): the objects' checksums, for a writer
    that hashed its bytes while they travelled and sent the PutEnd without them."""

    tenant: str
    keys: list[str]
    tokens: list[int]
    checksums: list[int] = []


class PutRevoke(Struct, tag="put_revoke", frozen=True):
    """Give back allocations whose write failed. `in_flight` lists indices into keys whose transfer
    may still land (it missed its deadline and could not be cancelled): their space is quarantined,
    not reused, until EndQuarantine names their tokens (or the quarantine's time limit passes)."""

    tenant: str
    keys: list[str]
    tokens: list[int]
    in_flight: list[int] = []


class EndQuarantine(Struct, tag="end_quarantine", frozen=True):
    """The writes of these tokens are over (done or failed): their quarantined space may be reused."""

    tenant: str
    tokens: list[int]


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


class PutValue(Struct, tag="put_value", frozen=True):
    """Store a small plain value in the master itself, in one round trip (master/inline.py).
    Answered with PutValueReply; a value over the master's inline limit is PUT_TOO_LARGE (put it
    on a node with PutStart instead)."""

    tenant: str
    key: str
    value: bytes
    pinned: bool = False


class GetValue(Struct, tag="get_value", frozen=True):
    """Read one plain value: ValueReply with the bytes when the master holds them inline, else
    with a leased lookup of the key (as LookupPrefix([key]) would answer) to read it from a node."""

    tenant: str
    key: str


class Stats(Struct, tag="stats", frozen=True):
    pass


class LaneQuery(Struct, tag="lane_query", frozen=True):
    """Does the master serve the plain TCP lane (transfer/tcp_channel.py)? Answered by its service shell."""




Request = (
    MountSegment
    | AnnounceObjects
    | UnmountSegment
    | Heartbeat
    | GetSegments
    | PutStart
    | PutEnd
    | PutRevoke
    | PutLanded
    | EndQuarantine
    | LookupPrefix
    | ReleaseLeases
    | Exists
    | Remove
    | PutValue
    | GetValue
    | Stats
    | LaneQuery
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
    deltas: list[DirectoryDelta] = []  # directory ops not yet acknowledged, per known segment


class AnnounceReply(Struct, tag="announced", frozen=True):
    accepted: int
    rejected_offsets: list[int]  # entries the master did not take (conflicts): the node forgets them


class SegmentsReply(Struct, tag="segments", frozen=True):
    segments: list[SegmentInfo]  # unknown ids are left out


PUT_ALLOCATED = 0
PUT_EXISTS = 1
PUT_NO_SPACE = 2


class PutStartReply(Struct, tag="put_started", frozen=True):
    """`tokens[i]` names keys[i]'s allocation (0 unless allocated). The master reclaims an
    allocation not ended within `put_timeout_s` of this reply: a writer must end or revoke before."""

    statuses: list[int]  # PUT_* per key
    replicas: list[list[Replica]]  # per key; empty unless allocated
    message: str = ""  # why a key got PUT_NO_SPACE
    tokens: list[int] = []
    put_timeout_s: float = 30.0
    lands: bool = False  # this master takes PutEnd.landing and PutLanded (older ones: False)


class PutEndReply(Struct, tag="put_ended", frozen=True):
    """`refused`: indices of keys whose token no longer names a pending allocation (reclaimed,
    revoked, already ended): nothing was changed for them and the writer's bytes are not served."""

    ended: int
    refused: list[int] = []
    existed: list[int] = []  # indices whose as_keys[i] existed: still pending under keys[i]
    ahead: "PutStartReply | None" = None  # PutEnd.ahead's allocations; None when none were asked


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
    checksums: bytes = b""  # with a lease: one little-endian uint64 per hit (0: none)
    # keys after the hits that sit in a node's disk tier and are being copied back to DRAM: a lookup
    # again in a moment (~ one node poll + the read) hits them; a client that ignores this sees a miss
    num_promoting: int = 0
    # with a lease: the bytes of the last len(inline_values) hits, small values the master holds itself
    # (master/inline.py); the replicas, counts and checksums above describe the hits before them
    inline_values: list[bytes] = []

    def replica_lists(self) -> list[list[Replica]]:
        """Per hit, its replicas (slow path for tests and tools; the client decodes with numpy).
        Raises ValueError when the fields do not agree with num_hit."""
        flat = unpack_replicas(self.replica_locations)
        if not flat:
            return []
        on_nodes = self.num_hit - len(self.inline_values)
        counts = list(self.replica_counts) if self.replica_counts else [1] * on_nodes
        if len(counts) != on_nodes or sum(counts) != len(flat) or (counts and min(counts) < 1):
            raise ValueError(
                f"lookup reply with {self.num_hit} hits has {len(self.replica_counts)} counts "
                f"and {len(flat)} replicas"
            )
        out, start = [], 0
        for n in counts:
            out.append(flat[start : start + n])
            start += n
        return out


PUT_TOO_LARGE = 4  # PutValueReply only: over the master's inline limit (max_inline_bytes)
DEFAULT_MAX_INLINE_BYTES = 64 << 10  # the master's default; a client assumes it until told otherwise


class PutValueReply(Struct, tag="value_put", frozen=True):
    """`max_inline_bytes`: the largest value this master keeps inline (0: none), so a client
    learns where to send the next one."""

    status: int  # PUT_ALLOCATED (stored), PUT_EXISTS, PUT_NO_SPACE or PUT_TOO_LARGE
    message: str = ""
    max_inline_bytes: int = 0


class ValueReply(Struct, tag="value", frozen=True):
    """`inline`: the master held the value and `value` is its bytes. Otherwise `lookup` is a leased
    lookup of the key (num_hit 0: a miss) whose lease the reader releases as after LookupPrefix."""

    inline: bool
    value: bytes = b""
    lookup: LookupReply | None = None
    max_inline_bytes: int = 0


class ExistsReply(Struct, tag="exists_ok", frozen=True):
    exists: list[bool]


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
    inline_values: int = 0  # small plain values held by the master itself (master/inline.py)
    inline_bytes: int = 0
    inline_capacity_bytes: int = 0
    inline_evictions: int = 0



class LaneOffer(Struct, tag="lane_offer", frozen=True):
    port: int  # the lane's TCP port on the master's host; 0: no lane (authentication is on)
    unix: str = ""  # the same lane's abstract Unix socket name (no leading NUL); "": none


Reply = (
    ErrorReply
    | OkReply
    | MountReply
    | HeartbeatReply
    | AnnounceReply
    | SegmentsReply
    | PutStartReply
    | PutEndReply
    | LookupReply
    | PutValueReply
    | ValueReply
    | ExistsReply
    | StatsReply
    | LaneOffer
)

CHECKSUM_BYTES = 8  # one checksum in LookupReply.checksums


def unpack_checksums(packed: bytes) -> list[int]:
    if len(packed) % CHECKSUM_BYTES:
        raise ValueError(f"packed checksums are {len(packed)} bytes, not a multiple of {CHECKSUM_BYTES}")
    return [int.from_bytes(packed[i : i + CHECKSUM_BYTES], "little") for i in range(0, len(packed), CHECKSUM_BYTES)]


request_encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
reply_encoder = msgspec.msgpack.Encoder()
reply_decoder = msgspec.msgpack.Decoder(Reply)
