"""Object records: one per object, its lifecycle as a table, its fields grouped by their one writer.

Rules:
- Lifecycle (`state`): PENDING -> COMPLETE, PENDING -> LANDING -> COMPLETE, and any state -> GONE.
  `LIFECYCLE` is the table; `ObjectIndex` is the only code that moves a record through it (`move`),
  and a move the table does not list raises (a bug, never a request's fault).
- Policy flags (`flags`), independent of the lifecycle: PINNED (never evicted; set by the index
  when the record is made), DRAINING (eviction waits for its lease to end: no new lease; leases.py),
  PROMOTING (disk-only, a DRAM range reserved and the node asked to fill it; tiers.py).
- Heap membership (`heaps`): IN_HEAP (an entry in a DRAM eviction heap), IN_DISK_HEAP (an entry in
  its disk tier's heap). Written only by the heap that holds the entry (eviction.py, tiers.py).
- Chain fields (`parent`, `num_children`, `disk_children`) are written only by chains.py; lease
  fields (`lease_until_s`, `lease_since_s`, `lease_count`) only by leases.py; disk fields
  (`disk_segment`, `disk_size`, `disk_heap_s`) only by tiers.py.
- Where the bytes are (`locations`) is set when the record is made and changed only by a move
  between tiers (tiers.py), a replica announced or found overlapping (recovery.py), or a replica's
  segment going (replicas.keep_other_replicas, called by the index and the lease table).
- Residency is derived, not stored: `locations` empty means disk-only (the copy is on
  `disk_segment`'s disk); PROMOTING says it is on its way back to DRAM.
- One record per object, with __slots__, sharing what can be shared (a batch's `now_s` float, the
  interned size int), because the master must hold millions of small KV blocks. Its replicas are
  kept packed (24 bytes each, one bytes object): a leased lookup sends them as-is, joined.
"""

from __future__ import annotations

from kvpool.core.protocol import REPLICA_BYTES, Replica, unpack_replicas
from kvpool.core.types import SegmentId

# lifecycle states
PENDING = 0  # space allocated, its writer copying: an existing key for writers, a miss for readers
LANDING = 1  # ended while its bytes travel (PutEnd.landing): readable once PutLanded names it
COMPLETE = 2  # readable
GONE = 3  # out of the index; an old heap entry, a lease or a child may still point at it

LIFECYCLE: dict[int, frozenset[int]] = {
    PENDING: frozenset({LANDING, COMPLETE, GONE}),
    LANDING: frozenset({COMPLETE, GONE}),
    COMPLETE: frozenset({GONE}),
    GONE: frozenset(),
}
STATE_NAMES = {PENDING: "pending", LANDING: "landing", COMPLETE: "complete", GONE: "gone"}

# policy flags
PINNED = 1
DRAINING = 2
PROMOTING = 4

# heap membership
IN_HEAP = 1
IN_DISK_HEAP = 2

NO_CHECKSUM = bytes(8)


class IllegalTransition(RuntimeError):
    """A record was asked to move where the lifecycle table does not go: a bug in the master."""


class ObjectRecord:
    __slots__ = (
        "space",  # the tenant's dict that holds this record (quotas.TenantSpace)
        "key",
        "locations",  # bytes: its replicas packed (protocol.pack_replicas), sent as-is by leased lookups
        "state",  # lifecycle (LIFECYCLE)
        "flags",  # policy flags
        "heaps",  # heap membership
        "parent",  # ObjectRecord | None (chains.py)
        "num_children",  # children holding DRAM or pending (chains.py)
        "disk_children",  # children held on disk only (chains.py)
        "last_access_s",
        "heap_access_s",  # last_access_s when pushed onto a DRAM eviction heap
        "disk_heap_s",  # last_access_s when pushed onto its disk tier's heap
        "lease_until_s",  # float | None (leases.py)
        "lease_since_s",  # start of the current unbroken lease, float | None (leases.py)
        "lease_count",  # leased lookups holding it and not yet released nor expired (leases.py)
        "token",  # the write token of its allocation (PutStart): PutEnd / PutRevoke must name it
        "checksum",  # bytes: the writer's checksum, little-endian uint64 (all zeros: none)
        "disk_segment",  # SegmentId | None: the segment whose node holds a disk copy (tiers.py)
        "disk_size",  # its size on that disk copy
    )

    def __init__(self, space: dict, key: str, locations: bytes, state: int, flags: int, now_s: float,
                 token: int = 0) -> None:
        self.space = space
        self.key = key
        self.locations = locations
        self.state = state
        self.flags = flags
        self.heaps = 0
        self.parent: ObjectRecord | None = None
        self.num_children = 0
        self.disk_children = 0
        self.last_access_s = now_s
        self.heap_access_s = now_s
        self.disk_heap_s = now_s
        self.lease_until_s: float | None = None
        self.lease_since_s: float | None = None
        self.lease_count = 0
        self.token = token
        self.checksum = NO_CHECKSUM
        self.disk_segment: SegmentId | None = None
        self.disk_size = 0

    def __lt__(self, other: "ObjectRecord") -> bool:
        return self.heap_access_s < other.heap_access_s

    def __repr__(self) -> str:
        return f"ObjectRecord({self.key!r}, {STATE_NAMES[self.state]}, flags={self.flags})"

    @property
    def replicas(self) -> list[Replica]:
        """Unpacked (cold paths: freeing space, dropping a segment, tests)."""
        return unpack_replicas(self.locations)

    @property
    def size_bytes(self) -> int:
        loc = self.locations
        return int.from_bytes(loc[16:REPLICA_BYTES], "little") if loc else self.disk_size

    @property
    def disk_only(self) -> bool:
        return not self.locations

    @property
    def gone(self) -> bool:
        return self.state == GONE


def move(rec: ObjectRecord, to: int) -> int:
    """Move `rec` along the lifecycle table; returns the state it left. Only ObjectIndex calls this."""
    was = rec.state
    if to not in LIFECYCLE[was]:
        raise IllegalTransition(f"record {rec.key!r}: {STATE_NAMES[was]} -> {STATE_NAMES[to]} is not in the lifecycle")
    rec.state = to
    return was
