"""The master's logic behind one entry point: `handle(request, now_s) -> reply`, plus `tick(now_s)`.

Rules:
- It builds the master's parts and routes each request to the one that owns its state
  (docs/design/master.md): puts to `writes`, lookups, releases and removals to `reads`, segments,
  announcements and tier reports to the index, watermark eviction to `pressure`.
- No I/O and no clock: the ZMQ service passes `time.monotonic()`, tests and the simulator pass
  their own clock. Decoding bytes is the service's job; this takes decoded protocol structs.
- Bad requests raise UsageError here and become ErrorReply(kind="usage") in `handle`; nothing a
  caller sends can leave the index half-updated (validation happens before any change).
- PutStart replies carry Replica lists; leased lookups carry the records' packed replica bytes,
  joined (protocol.LookupReply), plus a lease id the reader hands back in ReleaseLeases.
- `tick` runs the timed work: unmount silent segments, reclaim pending puts whose writer died,
  drop expired lease entries, free removed-but-leased space once the lease ends, end quarantines
  past their limit, end recoveries whose node went quiet, and evict if above the high watermark.
- Disk tiers (tiers.py): a mount with disk_bytes gets one; heartbeats carry the node's tier
  reports (applied before the reply's directory delta is cut, so the ops they cause go out at once).
- `epoch` names this incarnation (ids.py); the service sends it with every reply.
- Every request arrives with its caller's `Principal` (access.py): a call its role may not make is
  refused before any work; a tenant's namespace is rewritten to its own before the handler sees it;
  node calls act only on node ids the same identity mounted.
"""

from __future__ import annotations

from functools import partial

import msgspec

from kvpool.core import protocol as p
from kvpool.core.errors import ForbiddenError, KVPoolError, UsageError
from kvpool.core.types import MAX_KEY_LENGTH, MAX_TENANT_LENGTH, NodeId
from kvpool.master.access import OPEN, TENANT_CALLS, Principal, namespace_owner, refusal, scoped_tenant
from kvpool.master.config import MasterConfig
from kvpool.master.eviction import EVICTION_SLICE_BYTES, Evictor
from kvpool.master.hints import SessionHints, check_ttl
from kvpool.master.ids import IdSource, new_epoch
from kvpool.master.index import ObjectIndex
from kvpool.master.inline import InlineValues
from kvpool.master.inline_copies import InlineCopies
from kvpool.master.leases import LeaseTable
from kvpool.master.membership import MAX_POOL_BYTES, MAX_SEGMENT_BYTES, Membership  # noqa: F401 - the limits, re-exported
from kvpool.master.pressure import Pressure
from kvpool.master.reads import Reads
from kvpool.master.segments import SegmentTable
from kvpool.master.space import SegmentSpace
from kvpool.master.writes import Writes


_UNBOUNDED = 1 << 62  # a byte limit that never binds (a counting lookup sends no values)


def _check_tenant(tenant: str) -> None:
    if not tenant:
        raise UsageError("tenant must be a non-empty string")
    if len(tenant) > MAX_TENANT_LENGTH:
        raise UsageError(f"tenant is {len(tenant)} characters, the limit is {MAX_TENANT_LENGTH}")


def _check_keys(keys: list[str]) -> None:
    if keys and (max(map(len, keys)) > MAX_KEY_LENGTH or min(map(len, keys)) == 0):
        raise UsageError(f"keys must be 1..{MAX_KEY_LENGTH} characters long")


def _check_same_length(what: str, keys: list, *others: list) -> None:
    if any(len(other) != len(keys) for other in others):
        raise UsageError(f"{what} got {len(keys)} keys and lists of {[len(o) for o in others]} entries: they must match")


def _check_checksums(checksums: list[int]) -> None:
    if checksums and (min(checksums) < 0 or max(checksums) >= 1 << 64):
        raise UsageError("checksums must be unsigned 64-bit integers (0: none)")


class MasterCore:
    def __init__(self, config: MasterConfig, epoch: int | None = None) -> None:
        self.config = config
        self.epoch = new_epoch() if epoch is None else epoch
        self.ids = IdSource(self.epoch)
        self.segments = SegmentTable(config.alignment_bytes, config.heartbeat_interval_s, config.node_ttl_s, self.ids,
                                     config.directory_max_ops)
        self.space = SegmentSpace(self.segments)
        self.leases = LeaseTable(self.space)
        self.index = ObjectIndex(config, self.space, Evictor(), self.leases)
        self.pressure = Pressure(config, self.space, self.index.evictor, self.leases, self.index)
        self.hints = SessionHints(config.eviction_order, config.max_retained_fraction, self.index.evictor,
                                  lambda: self.space.capacity_bytes)
        self.reads = Reads(config, self.index, self.leases, self.pressure, self.ids)
        self.writes = Writes(config, self.index, self.pressure, self.ids)
        self._max_inline_reply = config.max_message_bytes // 4  # inline bytes in one lookup reply
        self.inline = InlineValues(config.inline_capacity_bytes,
                                   min(config.max_inline_bytes, config.inline_capacity_bytes, self._max_inline_reply))
        self.copies = InlineCopies(self.space, self.inline, namespace_owner, self.epoch)
        self.membership = Membership(config, self.segments, self.index, self.inline, self.copies)
        self.segments_expired = 0
        self.forbidden = 0  # requests refused by the access policy
        self._node_owners: dict[NodeId, str] = {}  # node id -> public key of the identity that mounted it
        self._handlers = {
            p.MountSegment: self.membership.mount,
            p.AnnounceObjects: self.membership.announce,
            p.EndQuarantine: self._end_quarantine,
            p.UnmountSegment: self.membership.unmount,
            p.Heartbeat: self.membership.heartbeat,
            p.GetSegments: self._get_segments,
            p.PutStart: self._put_start,
            p.PutEnd: self._put_end,
            p.PutRevoke: self._put_revoke,
            p.PutLanded: self._put_landed,
            p.LookupPrefix: self._lookup_prefix,
            p.ReleaseLeases: self._release_leases,
            p.Exists: self._exists,
            p.Remove: self._remove,
            p.PutValue: self._put_value,
            p.GetValue: self._get_value,
            p.Stats: lambda req, now_s: self.stats(now_s),
            p.SessionEvents: self.hints.session_events,
        }

    def handle(self, request: p.Request, now_s: float, principal: Principal = OPEN) -> p.Reply:
        handler = self._handlers.get(type(request))
        if handler is None:
            return p.ErrorReply(kind="protocol", message=f"unknown request type {type(request).__name__}")
        try:
            reason = refusal(principal, request)
            if reason is not None:
                raise ForbiddenError(reason)
            tenant = getattr(request, "tenant", None) if type(request) in TENANT_CALLS else None
            if tenant is not None:
                _check_tenant(tenant)
                if principal.role == "tenant":
                    request = msgspec.structs.replace(request, tenant=scoped_tenant(principal, tenant))
            if principal.role == "node":
                self._check_node_owner(request, principal)
            elif principal.role == "tenant" and type(request) is p.GetSegments:
                return self._get_segments_of(request, principal)
            reply = handler(request, now_s)
            if self.inline.changes:
                self.copies.apply()
            return reply
        except ForbiddenError as e:
            self.forbidden += 1
            return p.ErrorReply(kind=e.kind, message=str(e))
        except KVPoolError as e:
            return p.ErrorReply(kind=e.kind, message=str(e))

    def _check_node_owner(self, request: p.Request, principal: Principal) -> None:
        """A node id belongs to the identity that mounted it while any of its segments is mounted."""
        node_id = getattr(request, "node_id", None)
        if node_id is None:  # UnmountSegment, AnnounceObjects name a segment
            segment = self.segments.by_id.get(request.segment_id)
            if segment is None:
                return
            node_id = segment.node_id
        owner = self._node_owners.get(node_id)
        mounted = owner is not None and any(s.node_id == node_id for s in self.segments.by_id.values())
        if mounted and owner != principal.key:
            raise ForbiddenError(f"node {node_id!r} was mounted by another identity; "
                                 f"{type(request).__name__} refused")
        if type(request) is p.MountSegment:
            self._node_owners[node_id] = principal.key

    def _get_segments_of(self, req: p.GetSegments, principal: Principal) -> p.SegmentsReply:
        """Only segments holding this tenant's objects or pending puts (their metadata makes them reachable)."""
        by_id = self.segments.by_id
        readable = self.index.tenant_segments(principal.name)
        return p.SegmentsReply(segments=[by_id[i].info for i in req.segment_ids if i in by_id and i in readable])

    def _get_segments(self, req: p.GetSegments, now_s: float) -> p.SegmentsReply:
        by_id = self.segments.by_id
        return p.SegmentsReply(segments=[by_id[i].info for i in req.segment_ids if i in by_id])

    # ---- objects -------------------------------------------------------------------------------

    def _put_start(self, req: p.PutStart, now_s: float, ahead: bool = False) -> p.PutStartReply:
        _check_keys(req.keys)
        n = len(req.keys)
        if len(req.sizes) != n or (req.parents and len(req.parents) != n):
            raise UsageError(
                f"put_start got {n} keys, {len(req.sizes)} sizes and {len(req.parents)} parents: "
                "sizes must match keys, parents must match keys or be empty"
            )
        if n and min(req.sizes) <= 0:
            raise UsageError("object sizes must be > 0 bytes")
        if not 1 <= req.num_replicas <= p.MAX_REPLICAS:
            raise UsageError(f"num_replicas must be in 1..{p.MAX_REPLICAS}, got {req.num_replicas}")
        if self.inline.holds_any(req.tenant):
            return self._put_start_beside_inline(req, now_s, ahead)
        hints = self.hints
        hints.before_put(req, now_s)
        try:
            statuses, replicas, message, tokens = self.writes.put_start(
                req.tenant, req.keys, req.sizes, req.parents, req.num_replicas, req.pinned, now_s, ahead
            )
        finally:
            hints.after_put(self.index.tenants.get(req.tenant), req, now_s)
        return p.PutStartReply(statuses=statuses, replicas=replicas, message=message,  # type: ignore[arg-type]
                               tokens=tokens, put_timeout_s=self._put_timeout_s(ahead), lands=True)

    def _put_timeout_s(self, ahead: bool) -> float:
        return self.writes.ahead_timeout_s if ahead else self.config.put_timeout_s

    def _put_start_beside_inline(self, req: p.PutStart, now_s: float, ahead: bool) -> p.PutStartReply:
        """PutStart in a namespace that holds inline values: those keys exist (one namespace)."""
        held = [self.inline.contains(req.tenant, key) for key in req.keys]
        rest = [i for i, h in enumerate(held) if not h]
        statuses, replicas, tokens = [p.PUT_EXISTS] * len(held), [[]] * len(held), [0] * len(held)
        message = ""
        if rest:
            parents = [req.parents[i] for i in rest] if req.parents else []
            got, placed, message, granted = self.writes.put_start(
                req.tenant, [req.keys[i] for i in rest], [req.sizes[i] for i in rest], parents,
                req.num_replicas, req.pinned, now_s, ahead)
            for n, i in enumerate(rest):
                statuses[i], replicas[i], tokens[i] = got[n], placed[n], granted[n]
        return p.PutStartReply(statuses=statuses, replicas=replicas, message=message,  # type: ignore[arg-type]
                               tokens=tokens, put_timeout_s=self._put_timeout_s(ahead), lands=True)

    def _put_value(self, req: p.PutValue, now_s: float) -> p.PutValueReply:
        _check_keys([req.key])
        inline = self.inline
        if not req.value:
            raise UsageError("a value must be at least 1 byte")
        if not inline.accepts(len(req.value)):
            return p.PutValueReply(p.PUT_TOO_LARGE, f"{len(req.value)} bytes is over this master's inline limit of "
                                   f"{inline.max_value_bytes} bytes: put it on a node", inline.max_value_bytes)
        if self.index.holds(req.tenant, req.key):
            return p.PutValueReply(p.PUT_EXISTS, "", inline.max_value_bytes)
        owner = namespace_owner(req.tenant)
        quota = self.config.quotas.quota_of(owner)
        status, message = inline.put(req.tenant, owner, req.key, req.value, req.pinned,
                                     quota.max_bytes if quota is not None else None)
        if status == p.PUT_ALLOCATED:
            self.index.puts += 1  # readable at once, as a node object after its PutEnd
        return p.PutValueReply(status, message, inline.max_value_bytes)

    def _get_value(self, req: p.GetValue, now_s: float) -> p.ValueReply:
        _check_keys([req.key])
        value = self.inline.get(req.tenant, req.key)
        if value is not None:
            self.reads.count_inline_get()
            return p.ValueReply(True, value, None, self.inline.max_value_bytes)
        lookup = self._lookup_prefix(p.LookupPrefix(req.tenant, [req.key], True), now_s)
        return p.ValueReply(False, b"", lookup, self.inline.max_value_bytes)

    def _put_end(self, req: p.PutEnd, now_s: float) -> p.PutEndReply:
        _check_same_length("put_end", req.keys, req.tokens, req.checksums)
        _check_checksums(req.checksums)
        if req.ahead:  # checked before anything ends: a refused PutEnd changes nothing
            _check_keys(req.ahead)
            _check_same_length("put_end's ahead", req.ahead, req.ahead_sizes)
            if min(req.ahead_sizes) <= 0 or not 1 <= req.ahead_replicas <= p.MAX_REPLICAS:
                raise UsageError(f"ahead sizes must be > 0 bytes and ahead_replicas in 1..{p.MAX_REPLICAS}")
        taken = None
        if req.as_keys:
            _check_same_length("put_end", req.keys, req.as_keys)
            _check_keys(req.as_keys)
            if self.inline.holds_any(req.tenant):
                taken = partial(self.inline.contains, req.tenant)
        ended, refused, existed = self.writes.put_end(req.tenant, req.keys, req.tokens, req.checksums, now_s,
                                                     req.as_keys, taken, req.landing)
        ahead = None
        if req.ahead:  # after the ends: the space they leave pending stays the writer's either way
            ahead = self._put_start(p.PutStart(req.tenant, req.ahead, req.ahead_sizes, [], req.ahead_replicas, False),
                                    now_s, ahead=True)
        return p.PutEndReply(ended=ended, refused=refused, existed=existed, ahead=ahead)

    def _put_landed(self, req: p.PutLanded, now_s: float) -> p.OkReply:
        _check_same_length("put_landed", req.keys, req.tokens)
        if req.checksums:
            _check_same_length("put_landed", req.keys, req.checksums)
            _check_checksums(req.checksums)
        return p.OkReply(count=self.writes.put_landed(req.tenant, req.keys, req.tokens, now_s, req.checksums))

    def _put_revoke(self, req: p.PutRevoke, now_s: float) -> p.OkReply:
        _check_same_length("put_revoke", req.keys, req.tokens)
        if req.in_flight and (min(req.in_flight) < 0 or max(req.in_flight) >= len(req.keys)):
            raise UsageError(f"in_flight indices must be within 0..{len(req.keys) - 1}")
        return p.OkReply(count=self.writes.put_revoke(req.tenant, req.keys, req.tokens, req.in_flight, now_s))

    def _end_quarantine(self, req: p.EndQuarantine, now_s: float) -> p.OkReply:
        return p.OkReply(count=self.writes.end_quarantine(req.tenant, req.tokens))

    def _lookup_prefix(self, req: p.LookupPrefix, now_s: float) -> p.LookupReply:
        if req.ttl_s:
            check_ttl(req.ttl_s)
        reads = self.reads
        num_hit, lease_id, locations, counts, checksums = reads.lookup_prefix(req.tenant, req.keys, req.lease, now_s)
        if num_hit and (req.ttl_s or self.hints.retention.until):
            self.hints.after_lookup(self.index.tenants.get(req.tenant), req.keys, num_hit, req.ttl_s, now_s)
        promoting = reads.last_num_promoting
        inline_values: list[bytes] = []
        if num_hit < len(req.keys) and not promoting and self.inline.holds_any(req.tenant):
            before = num_hit
            if req.lease:  # a read: the inline values right after the node hits travel in the reply
                inline_values = self.inline.run(req.tenant, req.keys, num_hit, True, self._max_inline_reply)
                num_hit += len(inline_values)
            else:
                num_hit, promoting = self._count_beside_inline(req, num_hit, now_s)
            reads.count_hits_after(num_hit - before)
        return p.LookupReply(num_hit, self.config.lease_ttl_s, lease_id, locations, counts, checksums,
                             promoting, inline_values)

    def _count_beside_inline(self, req: p.LookupPrefix, num_hit: int, now_s: float) -> tuple[int, int]:
        """A counting lookup walks on through inline and index keys alike: (hits, promoting). The
        index's own counters see one lookup (the caller's), not one per stretch of index keys."""
        reads, keys = self.reads, req.keys
        promoting = 0
        while num_hit < len(keys):
            run = len(self.inline.run(req.tenant, keys, num_hit, False, _UNBOUNDED))
            if not run:
                break
            num_hit += run
            if num_hit < len(keys):
                num_hit += reads.lookup_prefix(req.tenant, keys[num_hit:], False, now_s, counted=False)[0]
                promoting = reads.last_num_promoting
                if promoting:
                    break
        return num_hit, promoting

    def _release_leases(self, req: p.ReleaseLeases, now_s: float) -> p.OkReply:
        return p.OkReply(count=self.reads.release_leases(req.tenant, req.lease_ids))

    def _exists(self, req: p.Exists, now_s: float) -> p.ExistsReply:
        exists = self.reads.exists(req.tenant, req.keys)
        if self.inline.holds_any(req.tenant):
            contains = self.inline.contains
            exists = [e or contains(req.tenant, key) for e, key in zip(exists, req.keys)]
        return p.ExistsReply(exists=exists)

    def _remove(self, req: p.Remove, now_s: float) -> p.OkReply:
        return p.OkReply(count=self.reads.remove(req.tenant, req.keys, now_s) + self.inline.remove(req.tenant, req.keys))

    # ---- timed work and stats ------------------------------------------------------------------

    @property
    def has_idle_work(self) -> bool:
        """Whether `idle_work` has something to do (the service then polls without waiting)."""
        return self.pressure.descending

    def idle_work(self, now_s: float) -> None:
        """One short slice of deferred work, for a master with no request waiting: eviction
        towards the low watermark (pressure.py)."""
        self.pressure.evict_slice(now_s, EVICTION_SLICE_BYTES)

    def tick(self, now_s: float) -> list[str]:
        """The timed work; returns what an operator should read in the log."""
        events = []
        for segment in self.segments.expired(now_s):
            self.segments.unmount(segment.segment_id)
            lost = self.index.drop_segment(segment.segment_id)
            self.segments_expired += 1
            events.append(f"node {segment.node_id} silent for over {self.config.node_ttl_s:g} s: segment "
                          f"{segment.segment_id:x} dropped with {lost} objects that had no other replica")
        self.writes.reclaim_pending(now_s)
        self.leases.expire(now_s)
        self.leases.free_removed(now_s)
        expired = self.space.expire_quarantine(now_s)
        if expired:
            events.append(f"{expired} quarantined writes freed after {self.config.quarantine_max_s:g} s "
                          "without word from their writer")
        for segment in list(self.segments.by_id.values()):
            if segment.recovering and now_s - segment.mounted_s > self.config.recovery_timeout_s:  # since its last chunk
                self.index.finish_recovery(segment)  # its node went quiet mid-announcement: keep what came
                events.append(f"segment {segment.segment_id:x} of node {segment.node_id}: announcement "
                              f"unfinished after {self.config.recovery_timeout_s:g} s; taking new objects")
        self.pressure.evict_slice(now_s, EVICTION_SLICE_BYTES)  # also above the high watermark without a put
        for tier in list(self.index.tiers.by_segment.values()):
            self.index.evict_disk(tier, now_s)
        evictor = self.index.evictor
        if evictor.num_entries > 2 * self.index.num_complete + 1024:
            evictor.compact()
        return events

    def stats(self, now_s: float) -> p.StatsReply:
        index, reads, writes, leases = self.index, self.reads, self.writes, self.leases
        segments = self.segments
        nodes = [
            p.NodeStats(
                node_id=s.node_id,
                segment_id=s.segment_id,
                host_id=s.info.host_id,
                state=segments.state(s, now_s),
                capacity_bytes=s.capacity_bytes,
                used_bytes=s.used_bytes,
                num_objects=s.num_objects,
                last_heartbeat_age_s=max(0.0, now_s - s.last_heartbeat_s),
                tenant=s.tenant,
            )
            for s in segments.by_id.values()
        ]
        return p.StatsReply(
            capacity_bytes=segments.capacity_bytes,
            used_bytes=segments.used_bytes,
            num_objects=index.num_complete,
            num_pending=index.num_pending,
            puts=index.puts,
            gets=reads.gets,
            lookups=reads.lookups,
            hit_keys=reads.hit_keys,
            miss_keys=reads.miss_keys,
            evictions=index.evictor.evictions,
            evicted_bytes=index.evictor.evicted_bytes,
            lease_grants=leases.grants,
            lease_expiries=leases.expiries,
            lease_releases=leases.releases,
            fragmentation=segments.fragmentation(),
            nodes=nodes,
            epoch=self.epoch,
            refused_put_ends=writes.refused_put_ends,
            ahead_expired=writes.ahead_expired,
            landed=writes.landed,
            refused_landings=writes.refused_landings,
            quarantined=self.space.num_quarantined,
            quarantine_expiries=self.space.quarantine_expiries,
            recovered_objects=index.recovery.recovered_objects,
            rejected_announcements=index.recovery.rejected_announcements,
            tiers=index.tiers.stats(),
            forbidden=self.forbidden,
            tenants=index.tenant_stats(),
            inline_values=len(self.inline),
            inline_bytes=self.inline.used_bytes,
            inline_capacity_bytes=self.inline.capacity_bytes,
            inline_evictions=self.inline.evictions,
            inline_copied=self.copies.copied, inline_uncopied=self.copies.uncopied,
            inline_taken_back=self.copies.taken_back,
            hints=self.hints.stats(),
        )
