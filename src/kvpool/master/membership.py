"""Nodes and their segments: mounts, unmounts, heartbeats with their directory deltas, and the
announcements of a recovering node (core.py routes these calls here).

Rules:
- Sizes are checked before anything changes: a segment within 1..MAX_SEGMENT_BYTES (its disk tier
  0..), the pool's DRAM within MAX_POOL_BYTES, so every sum the master reports stays a 64-bit integer.
- A heartbeat applies the node's tier reports, then its acknowledgements, then cuts the deltas
  (directory.py), so the ops the reports caused go out at once. It says whether the node parks
  heartbeats (durability.py).
- An announcement is taken only while its segment recovers; objects go to the index, copies of
  inline values to InlineCopies, disk entries to the tiers; the last chunk ends the recovery.
- Pure: no I/O, times passed in.
"""

from __future__ import annotations

from kvpool.core import protocol as p
from kvpool.core.errors import UsageError
from kvpool.master.config import MasterConfig
from kvpool.master.index import ObjectIndex
from kvpool.master.inline import InlineValues
from kvpool.master.inline_copies import InlineCopies
from kvpool.master.segments import SegmentTable

MAX_SEGMENT_BYTES = 1 << 60  # per segment
MAX_POOL_BYTES = 1 << 62  # all mounted DRAM together: every sum the master reports stays a 64-bit integer


class Membership:
    def __init__(self, config: MasterConfig, segments: SegmentTable, index: ObjectIndex, inline: InlineValues,
                 copies: InlineCopies) -> None:
        self.config = config
        self.segments = segments
        self.index = index
        self.inline = inline
        self.copies = copies

    def mount(self, req: p.MountSegment, now_s: float) -> p.MountReply:
        if not req.node_id:
            raise UsageError("node_id must be a non-empty string")
        # sums over segments (capacity, usage) must stay inside the wire's 64-bit integers
        if not 0 < req.size_bytes <= MAX_SEGMENT_BYTES or not 0 <= req.disk_bytes <= MAX_SEGMENT_BYTES:
            raise UsageError(f"segment and disk sizes must be within 1..{MAX_SEGMENT_BYTES} bytes (disk: 0..), got "
                             f"{req.size_bytes} and {req.disk_bytes}")
        if not 0 <= req.base_addr <= (1 << 64) - 1 - req.size_bytes:
            raise UsageError(f"base_addr {req.base_addr} + size must be a 64-bit address")
        if self.segments.capacity_bytes + req.size_bytes > MAX_POOL_BYTES:
            raise UsageError(f"mounting {req.size_bytes} bytes would take the pool past {MAX_POOL_BYTES} bytes "
                             f"({self.segments.capacity_bytes} mounted)")
        try:
            segment, replaced = self.segments.mount(req, now_s)
        except ValueError as e:
            raise UsageError(str(e)) from None
        for old in replaced:
            self.index.drop_segment(old.segment_id)
        if req.disk_bytes:
            self.index.tiers.mount(segment, req.disk_bytes)
        return p.MountReply(
            segment_id=segment.segment_id,
            heartbeat_interval_s=self.config.heartbeat_interval_s,
            node_ttl_s=self.config.node_ttl_s,
            parks_heartbeats=self.config.confirm_timeout_s > 0,
        )

    def unmount(self, req: p.UnmountSegment, now_s: float) -> p.OkReply:
        if self.segments.unmount(req.segment_id) is None:
            return p.OkReply(count=0)
        self.index.drop_segment(req.segment_id)
        return p.OkReply(count=1)

    def heartbeat(self, req: p.Heartbeat, now_s: float) -> p.HeartbeatReply:
        unknown = self.segments.heartbeat(req.node_id, req.segment_ids, now_s)
        by_id = self.segments.by_id
        for report in req.tier_reports:
            segment = by_id.get(report.segment_id)
            if segment is not None and segment.node_id == req.node_id:
                self.index.apply_tier_report(segment, report, now_s)
        parks = req.wait_s > 0  # once a node parks, it always may: a hiccup must not turn confirmation off
        for i, segment_id in enumerate(req.segment_ids):
            segment = by_id.get(segment_id)
            if segment is not None and segment.node_id == req.node_id:
                segment.parks = segment.parks or parks
                if i < len(req.directory_seqs):
                    segment.log.ack(req.directory_seqs[i])
        return p.HeartbeatReply(unknown_segment_ids=unknown, deltas=self.directory_deltas(req.node_id, req.segment_ids))

    def directory_deltas(self, node_id: str, segment_ids: list[int]) -> list[p.DirectoryDelta]:
        """The directory ops these segments of `node_id` have not acknowledged yet."""
        deltas = []
        by_id = self.segments.by_id
        for segment_id in segment_ids:
            segment = by_id.get(segment_id)
            if segment is None or segment.node_id != node_id:
                continue
            delta = segment.log.delta(segment_id, self.config.directory_ops_per_reply)
            if delta is not None:
                deltas.append(delta)
        return deltas

    def announce(self, req: p.AnnounceObjects, now_s: float) -> p.AnnounceReply:
        segment = self.segments.by_id.get(req.segment_id)
        if segment is None:
            raise UsageError(f"segment {req.segment_id} is not mounted on this master: mount again")
        if not segment.recovering:
            # its recovery was ended (timeout): what was not announced by then is not taken, and the
            # node, told so, forgets it rather than mounting again (which would drop what was taken)
            self.copies.refused(segment, req.values)
            return p.AnnounceReply(accepted=0, rejected_offsets=[e.offset for e in req.entries])
        segment.last_heartbeat_s = now_s  # a long announcement must not look like a dead node
        segment.mounted_s = now_s  # the recovery timeout counts silence, not the announcement's length
        accepted, rejected = self.index.announce(segment, req.entries, req.ages_s, now_s)
        if len(self.inline):  # one namespace: a key a node brings back replaces one put inline meanwhile
            for entry in req.entries:
                if entry.size and self.inline.holds_any(entry.tenant) and self.index.holds(entry.tenant, entry.key):
                    self.inline.remove(entry.tenant, [entry.key])
        if req.values:
            accepted += self.copies.announced(segment, req.values, self.index.holds, self._byte_quota)
        if req.disk_entries:
            accepted += len(req.disk_entries) - self.index.announce_disk(segment, req.disk_entries, now_s)
        if req.last:
            self.index.finish_recovery(segment)
        return p.AnnounceReply(accepted=accepted, rejected_offsets=rejected)

    def _byte_quota(self, owner: str) -> int | None:
        quota = self.config.quotas.quota_of(owner)
        return quota.max_bytes if quota is not None else None
