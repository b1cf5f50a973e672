"""Mounted segments, their allocators and their health.

Rules:
- Segment ids come from the master's IdSource (ids.py) and are never reused, not even by a
  restarted master: a node that remounts gets a new id, so a stale replica or a client's cached
  description can never point into other memory.
- A segment mounted with `recovering` takes no new objects until its node has announced its
  directory (AnnounceObjects, last=True) or `recovery_timeout_s` has passed; meanwhile the ranges
  of announced objects are collected in `recovered` and the allocator is built from them at the
  end, so no new object can be placed over an announced one.
- A segment is `alive` while heartbeats arrive, `suspect` once silent for more than two heartbeat
  intervals, and unmounted (gone from this table) once silent for `node_ttl_s`.
- A node that mounts again under the same node_id replaces its earlier segments at once rather
  than after the TTL: with another NIXL agent it is a restarted process (that memory is gone), with
  the same agent it is the same memory mounted again (recovering), which must never be described
  as two segments whose allocators would hand out the same bytes twice.
- A segment mounted with a tenant (`kvpool node --tenant`) is dedicated: it holds only that
  tenant's objects, and a tenant that has had a dedicated segment in this incarnation places only
  on its dedicated segments (`dedicated_tenants` is sticky: when the last one goes its puts are
  refused rather than spilled onto shared memory that other tenants may read). Shared segments
  (tenant "") take the other tenants. `placeable(tenant)` answers where a tenant may go: a
  placement group per tenant kept at mount/unmount (placement.py), which also keeps its segments
  in free-ratio order as their allocators change (no scan on the put path).
- `used_bytes` (the whole pool's) is a running total kept from every allocator's changes, as the
  placement order is: the watermark check of every put reads it.
- No I/O and no clock: every time is passed in as `now_s`.
"""

from __future__ import annotations

from kvpool.core.protocol import MountSegment, SegmentInfo
from kvpool.core.types import MAX_TENANT_LENGTH, NodeId, SegmentId
from kvpool.master.allocator import RangeAllocator
from kvpool.master.directory import DirectoryLog
from kvpool.master.ids import IdSource
from kvpool.master.placement import PlacementGroup

ALIVE = "alive"
SUSPECT = "suspect"
RECOVERING = "recovering"


class Segment:
    __slots__ = ("info", "allocator", "last_heartbeat_s", "num_objects", "log", "recovering", "recovered",
                 "mounted_s", "tenant", "parks")

    def __init__(self, info: SegmentInfo, alignment_bytes: int, now_s: float, max_log_ops: int,
                 recovering: bool = False, tenant: str = "") -> None:
        self.info = info
        self.tenant = tenant  # "": shared; else the one tenant whose objects it holds
        self.allocator = RangeAllocator(info.size_bytes, alignment_bytes)
        self.last_heartbeat_s = now_s
        self.mounted_s = now_s  # and, while recovering, the time of its last announcement
        self.num_objects = 0
        self.log = DirectoryLog(max_log_ops)
        self.recovering = recovering
        self.recovered: dict[int, tuple[int, object]] = {}  # offset -> (size, record), while recovering
        self.parks = False  # its node sends heartbeats the master may hold (durability.py)

    @property
    def segment_id(self) -> SegmentId:
        return SegmentId(self.info.segment_id)

    @property
    def node_id(self) -> NodeId:
        return NodeId(self.info.node_id)

    @property
    def capacity_bytes(self) -> int:
        return self.allocator.size_bytes

    @property
    def used_bytes(self) -> int:
        return self.allocator.used_bytes

    def free_ratio(self) -> float:
        return self.allocator.free_bytes / self.allocator.size_bytes


class SegmentTable:
    def __init__(self, alignment_bytes: int, heartbeat_interval_s: float, node_ttl_s: float, ids: IdSource,
                 max_log_ops: int = 2_000_000) -> None:
        self.alignment_bytes = alignment_bytes
        self.heartbeat_interval_s = heartbeat_interval_s
        self.node_ttl_s = node_ttl_s
        self.by_id: dict[SegmentId, Segment] = {}
        self._ids = ids
        self._max_log_ops = max_log_ops
        self.capacity_bytes = 0
        self.used_bytes = 0  # allocated over all segments, kept by `_allocator_changed`
        self.by_tenant: dict[str, PlacementGroup] = {"": PlacementGroup()}  # "" -> shared segments
        self.dedicated_tenants: set[str] = set()  # tenants that had a dedicated segment (sticky)

    def placeable(self, tenant: str) -> PlacementGroup:
        """The segments that may take `tenant`'s new objects: its dedicated ones if it has had any,
        else the shared ones."""
        if tenant in self.dedicated_tenants:
            return self.by_tenant.get(tenant) or PlacementGroup()
        return self.by_tenant[""]

    def mount(self, msg: MountSegment, now_s: float) -> tuple[Segment, list[Segment]]:
        """Mount a new segment; returns it and the segments it replaced (same node, old process)."""
        if len(msg.tenant) > MAX_TENANT_LENGTH:
            raise ValueError(f"a segment's tenant is {len(msg.tenant)} characters, the limit is {MAX_TENANT_LENGTH}")
        if msg.lane_address is not None and not 0 < len(msg.lane_address) <= 300:
            raise ValueError(f"a segment lane address must be 1..300 characters, got {len(msg.lane_address)}")
        if msg.size_bytes < self.alignment_bytes:
            raise ValueError(f"a segment must hold at least {self.alignment_bytes} bytes, got {msg.size_bytes}")
        replaced = [s for s in self.by_id.values() if s.node_id == msg.node_id]
        for s in replaced:
            self.unmount(s.segment_id)
        info = SegmentInfo(
            segment_id=SegmentId(self._ids.next()),
            node_id=msg.node_id,
            host_id=msg.host_id,
            size_bytes=msg.size_bytes,
            base_addr=msg.base_addr,
            agent_name=msg.agent_name,
            agent_metadata=msg.agent_metadata,
            shm_path=msg.shm_path,
            lane_address=msg.lane_address,
        )
        segment = Segment(info, self.alignment_bytes, now_s, self._max_log_ops, msg.recovering, msg.tenant)
        self.by_id[info.segment_id] = segment
        group = self.by_tenant.get(msg.tenant)
        if group is None:
            group = self.by_tenant[msg.tenant] = PlacementGroup()
        group.add(segment)
        segment.allocator.on_change = lambda used_change: self._allocator_changed(segment, group, used_change)
        if msg.tenant:
            self.dedicated_tenants.add(msg.tenant)
        self.capacity_bytes += segment.capacity_bytes
        return segment, replaced

    def unmount(self, segment_id: SegmentId) -> Segment | None:
        segment = self.by_id.pop(segment_id, None)
        if segment is not None:
            segment.allocator.on_change = None  # whatever it does now is no longer the pool's
            self.capacity_bytes -= segment.capacity_bytes
            self.used_bytes -= segment.used_bytes
            group = self.by_tenant[segment.tenant]
            group.remove(segment)
            if not group and segment.tenant:
                del self.by_tenant[segment.tenant]
        return segment

    def _allocator_changed(self, segment: Segment, group: PlacementGroup, used_change: int) -> None:
        self.used_bytes += used_change
        group.changed(segment)

    def heartbeat(self, node_id: NodeId, segment_ids: list[SegmentId], now_s: float) -> list[SegmentId]:
        """Refresh the node's segments; returns the ids this table does not know (mount again)."""
        unknown = []
        for segment_id in segment_ids:
            segment = self.by_id.get(segment_id)
            if segment is None or segment.node_id != node_id:
                unknown.append(segment_id)
            else:
                segment.last_heartbeat_s = now_s
        return unknown

    def expired(self, now_s: float) -> list[Segment]:
        """Segments silent for longer than node_ttl_s (the caller unmounts them)."""
        deadline = now_s - self.node_ttl_s
        return [s for s in self.by_id.values() if s.last_heartbeat_s < deadline]

    def state(self, segment: Segment, now_s: float) -> str:
        if segment.recovering:
            return RECOVERING
        return SUSPECT if now_s - segment.last_heartbeat_s > 2 * self.heartbeat_interval_s else ALIVE

    @property
    def largest_segment_bytes(self) -> int:
        return max((s.capacity_bytes for s in self.by_id.values()), default=0)

    def fragmentation(self) -> float:
        """1 - largest free range / total free, over all segments."""
        free = sum(s.allocator.free_bytes for s in self.by_id.values())
        if free == 0:
            return 0.0
        return 1.0 - max(s.allocator.largest_free_bytes for s in self.by_id.values()) / free
