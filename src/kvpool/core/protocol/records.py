"""Values the messages carry: replica locations, a node's directory and disk-tier entries, a
segment's description, packed checksums.

Rules:
- Hot values are compact: a leased lookup answers replica locations as one bytes field of
  little-endian int64 triples (segment_id, offset, size), hits in order (`pack_replicas` /
  `unpack_replicas`; numpy reads it with `frombuffer(..., "<i8").reshape(-1, 3)`), not one struct
  per hit, whose encoding and decoding cost more than the lookup itself.
- Structs holding only numbers are `gc=False` (no cycles possible): smaller and faster to decode.
"""

from __future__ import annotations

import struct

from msgspec import Struct


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
    value: bytes = b""  # DIR_VALUE only: the value's bytes


DIR_COMMIT = 0  # an object committed in DRAM at `offset` (or, with size 0, a removal there)
DIR_PROMOTE = 1  # read the node's disk copy of (tenant, key) into `offset`, then report it (TierReport)
DIR_DISK_DROP = 2  # forget the disk copy of (tenant, key); `offset` means nothing
# keep a copy of the master's inline value (tenant, key) = `value` (size 0: drop it); `offset` holds
# flags (VALUE_PINNED), names no range (master/inline_copies.py)
DIR_VALUE = 3
VALUE_PINNED = 1


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
    lane_address: str | None = None  # "host:port" of the node's TCP path (transfer/tcp_path.py), if served


CHECKSUM_BYTES = 8  # one checksum in LookupReply.checksums


def unpack_checksums(packed: bytes) -> list[int]:
    if len(packed) % CHECKSUM_BYTES:
        raise ValueError(f"packed checksums are {len(packed)} bytes, not a multiple of {CHECKSUM_BYTES}")
    return [int.from_bytes(packed[i : i + CHECKSUM_BYTES], "little") for i in range(0, len(packed), CHECKSUM_BYTES)]
