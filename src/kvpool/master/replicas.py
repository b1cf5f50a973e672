"""Helpers over a record's packed replicas (protocol.pack_replicas: 24 bytes each), for cold paths."""

from __future__ import annotations

import struct

from kvpool.core.protocol import REPLICA_BYTES, pack_replicas

pack_replica = struct.Struct("<qqq").pack  # one replica, as protocol.pack_replicas lays it out


def on_segment(locations: bytes, segment_id: int) -> bool:
    """Whether packed replicas include one on `segment_id` (checked without unpacking them all)."""
    for start in range(0, len(locations), REPLICA_BYTES):
        if int.from_bytes(locations[start : start + 8], "little", signed=True) == segment_id:
            return True
    return False


def keep_other_replicas(rec, segment_id: int, charged: bool = True) -> bool:
    """Forget the record's replica on `segment_id`; False when it had no other (the caller drops it).
    `charged`: the record counts in its tenant's usage (quotas.py), which follows the change."""
    rest = [r for r in rec.replicas if r.segment_id != segment_id]
    if rest:
        if charged:
            rec.space.account.charge(rec, -1)
        rec.locations = pack_replicas(rest)
        if charged:
            rec.space.account.charge(rec, 1)
    return bool(rest)
