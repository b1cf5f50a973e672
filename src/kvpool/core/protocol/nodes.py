"""Messages between a storage node and the master: mounting a segment, heartbeats, and the
directory a node announces to a new master.

Rules:
- Nodes keep a directory of their committed objects (DirEntry), fed by heartbeat replies
  (DirectoryDelta, acknowledged by sequence number), and announce it to a new master
  (AnnounceObjects) so a master restart keeps the cache.
"""

from __future__ import annotations

from msgspec import Struct

from kvpool.core.protocol.records import DirectoryDelta, DirEntry, DiskEntry, TierReport


# ---- requests --------------------------------------------------------------------------------


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
    lane_address: str | None = None  # "host:port" of the node's TCP path (transfer/tcp_path.py), if it serves one


class AnnounceObjects(Struct, tag="announce", frozen=True):
    """A remounted node's directory, in chunks, oldest commit first; `ages_s[i]` is how long ago
    entries[i] was committed (the new master's LRU order). `last` ends the recovery: the segment
    takes new objects from then on. Answered with AnnounceReply."""

    segment_id: int
    entries: list[DirEntry]
    ages_s: list[float]
    last: bool = False
    disk_entries: list[DiskEntry] = []  # what the node's disk tier holds (sent after the DRAM entries)
    values: list[DirEntry] = []  # copies of inline values the node keeps (DIR_VALUE ops; master/inline_copies.py)


class UnmountSegment(Struct, tag="unmount", frozen=True):
    segment_id: int


class Heartbeat(Struct, tag="heartbeat", frozen=True):
    """`directory_seqs[i]`: the last directory op of segment_ids[i] the node has applied."""

    node_id: str
    segment_ids: list[int]
    directory_seqs: list[int] = []
    tier_reports: list[TierReport] = []  # nodes with a disk tier: write-backs and promotions done
    wait_s: float = 0.0  # > 0: the master may hold the reply this long until it has directory ops to send


# ---- replies --------------------------------------------------------------------------------


class MountReply(Struct, tag="mounted", frozen=True):
    segment_id: int
    heartbeat_interval_s: float
    node_ttl_s: float
    parks_heartbeats: bool = False  # the master holds a heartbeat with `wait_s` until it has ops (master/durability.py)


class HeartbeatReply(Struct, tag="heartbeat_ok", frozen=True):
    unknown_segment_ids: list[int]  # the master dropped these: the node must mount again
    deltas: list[DirectoryDelta] = []  # directory ops not yet acknowledged, per known segment


class AnnounceReply(Struct, tag="announced", frozen=True):
    accepted: int
    rejected_offsets: list[int]  # entries the master did not take (conflicts): the node forgets them
