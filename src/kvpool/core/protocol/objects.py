"""Messages between a client and the master about objects: puts, lookups, leases, plain values.

Rules:
- Every data call is batch-first: a request carries a list of keys and the reply answers all of
  them in one round trip. Keys are plain strings inside a tenant's namespace; the tenant travels
  with every data request.
- Puts are fenced by write tokens: PutStart returns one per allocation, PutEnd / PutRevoke name it,
  and an end for an allocation that is no longer the writer's (reclaimed, revoked, removed and
  re-put) is refused and reported in PutEndReply.refused, never applied to another writer's object.
- A put may end while its bytes travel (PutEnd.landing): the master checks and renames as for any
  end but keeps the objects unreadable until the writer's one-way PutLanded says the bytes are in.
  Only masters that say so in their PutStartReply (`lands`) are asked.
- Objects carry an end-to-end checksum (client/checksum.py; 0 means none): the writer sends it
  with PutEnd, the master keeps it and returns it with every leased hit, readers verify it.
"""

from __future__ import annotations

from msgspec import Struct

from kvpool.core.protocol.records import Replica, SegmentInfo, unpack_replicas


# ---- requests --------------------------------------------------------------------------------


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
    session: str = ""  # the agent session these objects belong to ("": none; protocol/sessions.py)
    ttl_s: float = 0.0  # keep them at least this long after their last use, within the tenant's share


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
    ttl_s: float = 0.0  # hits are kept at least this long from now, within the tenant's share (0: no TTL)


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


# ---- replies --------------------------------------------------------------------------------


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
