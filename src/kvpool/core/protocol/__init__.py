"""Control-plane messages between clients, nodes and the master (msgspec, msgpack on the wire).

The messages live by service (nodes.py: a node and the master; objects.py: a client's puts,
lookups and values; stats.py: the master's statistics; events.py: what the pool holds, published;
records.py: the values they carry); this module joins them into the two unions the wire carries
and is what the rest of kvpool imports.

Rules:
- Requests are a tagged union (`type` field); the master decodes `Request` and answers one `Reply`.
  Anything that does not decode is answered with `ErrorReply(kind="protocol")`, never a crash.
- Times on the wire are durations (ttl_s), never absolute clocks: master and client clocks differ.
- Every reply names the master's incarnation (`epoch`, a random 63-bit number chosen at start) in
  its own frame, before the payload (rpc/zmq_channel.py reads it). Ids the master hands out that
  another process keeps (segment ids, lease ids, write tokens) carry the incarnation's random
  prefix in their high 31 bits (master/ids.py), so no id is ever reissued by a restarted master.
- A tag, once used, keeps its meaning: fields are added with defaults, never renamed or reordered.
"""

from __future__ import annotations

import msgspec
from msgspec import Struct

from kvpool.core.protocol.events import (
    POOL_EVENTS_TOPIC, NamespaceChanges, NamespaceKeys, PoolEventBatch, PoolEventsOffer, PoolEventsQuery,
)
from kvpool.core.protocol.nodes import (
    AnnounceObjects, AnnounceReply, Heartbeat, HeartbeatReply, MountReply, MountSegment, UnmountSegment,
)
from kvpool.core.protocol.objects import (
    DEFAULT_MAX_INLINE_BYTES, PUT_ALLOCATED, PUT_EXISTS, PUT_NO_SPACE, PUT_TOO_LARGE, EndQuarantine, Exists,
    ExistsReply, GetSegments, GetValue, LookupPrefix, LookupReply, PutEnd, PutEndReply, PutLanded, PutRevoke,
    PutStart, PutStartReply, PutValue, PutValueReply, ReleaseLeases, Remove, SegmentsReply, ValueReply,
)
from kvpool.core.protocol.records import (
    CHECKSUM_BYTES, DIR_COMMIT, DIR_DISK_DROP, DIR_PROMOTE, DIR_VALUE, VALUE_PINNED, MAX_REPLICAS, REPLICA_BYTES, DirectoryDelta, DirEntry,
    DiskEntry, Replica, SegmentInfo, TierReport, pack_replicas, unpack_checksums, unpack_replicas,
)
from kvpool.core.protocol.sessions import (
    EVENT_NAMES, MAX_SESSION_LENGTH, MAX_TTL_S, SESSION_END, TURN_ARRIVED, TURN_DONE, SessionEvent, SessionEvents,
)
from kvpool.core.protocol.stats import HintStats, KeyGroupStats, NodeStats, Stats, StatsReply, TenantStats, TierStats

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # larger control frames are rejected before decoding


class LaneQuery(Struct, tag="lane_query", frozen=True):
    """Does the master serve the plain TCP channel (rpc/tcp_channel.py)? Answered by its service shell."""


class ErrorReply(Struct, tag="error", frozen=True):
    kind: str  # an error kind from core.errors
    message: str


class OkReply(Struct, tag="ok", frozen=True):
    count: int = 0


class LaneOffer(Struct, tag="lane_offer", frozen=True):
    port: int  # the TCP channel's port on the master's host; 0: none (authentication is on)
    unix: str = ""  # the same channel's abstract Unix socket name (no leading NUL); "": none


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
    | SessionEvents
    | PoolEventsQuery
)

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
    | PoolEventsOffer
)

request_encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
reply_encoder = msgspec.msgpack.Encoder()
reply_decoder = msgspec.msgpack.Decoder(Reply)

__all__ = [
    "MAX_MESSAGE_BYTES", "Request", "Reply", "request_encoder", "request_decoder", "reply_encoder", "reply_decoder",
    "LaneQuery", "LaneOffer", "ErrorReply", "OkReply",
    # nodes
    "MountSegment", "AnnounceObjects", "UnmountSegment", "Heartbeat", "MountReply", "HeartbeatReply", "AnnounceReply",
    # sessions
    "SessionEvent", "SessionEvents", "TURN_ARRIVED", "TURN_DONE", "SESSION_END", "EVENT_NAMES", "MAX_SESSION_LENGTH",
    "MAX_TTL_S",
    # objects
    "GetSegments", "PutStart", "PutEnd", "PutLanded", "PutRevoke", "EndQuarantine", "LookupPrefix", "ReleaseLeases",
    "Exists", "Remove", "PutValue", "GetValue", "SegmentsReply", "PutStartReply", "PutEndReply", "LookupReply",
    "PutValueReply", "ValueReply", "ExistsReply", "PUT_ALLOCATED", "PUT_EXISTS", "PUT_NO_SPACE", "PUT_TOO_LARGE",
    "DEFAULT_MAX_INLINE_BYTES",
    # records
    "Replica", "pack_replicas", "unpack_replicas", "DirEntry", "DiskEntry", "TierReport", "DirectoryDelta",
    "SegmentInfo", "MAX_REPLICAS", "REPLICA_BYTES", "DIR_COMMIT", "DIR_PROMOTE", "DIR_DISK_DROP", "DIR_VALUE", "VALUE_PINNED", "CHECKSUM_BYTES",
    "unpack_checksums",
    # events
    "PoolEventsQuery", "PoolEventsOffer", "PoolEventBatch", "NamespaceChanges", "NamespaceKeys", "POOL_EVENTS_TOPIC",
    # stats
    "Stats", "StatsReply", "TierStats", "NodeStats", "KeyGroupStats", "HintStats", "TenantStats",
]
