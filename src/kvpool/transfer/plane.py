"""DataPlane: one per process; moves bytes between registered local memory and pool segments.

Rules:
- The path is chosen per segment and cached: `auto` maps a same-host segment's memfd and copies
  through the mapping, and uses NIXL one-sided READ/WRITE otherwise. `shm` / `nixl` / `lane`
  force one path, for benchmarks and tests. Which job takes which path, and why:
  docs/design/data-plane.md.
- NIXL requests are progressed by the thread that waits for them, without NIXL's progress thread.
- A cross-host host-memory job goes over the node's TCP path (tcp_path.py) when the node serves
  one and `_lane_wanted` says so (its size against `lane_max_bytes`, its regions against
  `lane_region_bytes`, and without RDMA every READ and every split WRITE), unless all of that
  path's connections are in use right then: it goes to NIXL instead of waiting. GPU jobs never do.
- A TCP-path WRITE of `lane_split_bytes` or more, a READ of `lane_read_split_bytes` or more, runs
  as two halves on two connections at once when a second one is free (tcp_path_halves.py); the
  call returns only when both have ended.
- The NIXL agent starts lazily on the first job that needs it, so a client that only talks to
  same-host segments, or over the TCP path, never pays for it; memory registered before is
  registered with the agent then.
- Every region is checked before any byte moves (local_memory.py). A call made with
  `unregistered=True` moves host memory the caller owns but did not register (a plain value's
  bytes), which shared memory and the TCP path carry (the TCP path waits for a free connection
  then) and NIXL does not: `carries_unregistered` says beforehand whether a segment's job would go
  where such memory can; one that could not fails with a TransferError, nothing moved.
- `before_landing(addr, size)`, when given, is called for each local region of a READ before its
  bytes land: on the TCP path once its request is sent, before they are received (a caller
  reading into fresh memory faults its pages in while the node sends: client/fresh_memory.py), by
  shared memory before the copy; NIXL jobs never call it. A bad list is the caller's bug
  (UsageError, nothing moved); a failed transfer is a TransferError, per job in `transfer_many`,
  never a hang (deadline).
- Thread-safe: routes are created under a lock, transfers run concurrently.
- GPU memory: `register(addr, size, device=N)` registers CUDA device N's memory (NIXL VRAM). A
  job's local regions all lie in one kind of memory (host, or one GPU). To a same-host segment a
  GPU job copies with the copy engines (cuda_copy.py, the mapping page-locked once per route);
  across hosts NIXL/UCX moves it.
- Settings come from a DataPlaneConfig (config.py), read from the environment once, when the
  plane is made, if the caller passes none.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvpool.core.errors import TransferError, UsageError
from kvpool.core.protocol import SegmentInfo
from kvpool.transfer.config import TCP_REGION_BYTES, DataPlaneConfig
from kvpool.transfer.hostinfo import host_id
from kvpool.transfer.local_memory import CheckedJob, Region, RegisteredMemory, validate_region
from kvpool.transfer.shm import PeerMapping
from kvpool.transfer.tag_reads import TagReader
from kvpool.transfer.tcp_path import TcpPath
from kvpool.transfer.tcp_path_halves import run_on_lane

PATHS = ("auto", "nixl", "shm", "lane")
OPS = ("READ", "WRITE")

Job = tuple[SegmentInfo, Sequence[int], Sequence[int], Sequence[int]]


@dataclass
class Route:
    agent_name: str
    mapping: PeerMapping | None = None  # the shm path
    peer: str | None = None  # the nixl path: remote agent name, once a NIXL job needed it (DataPlane._peer)
    lane: TcpPath | None = None  # the TCP path, for small jobs (or all, with path "lane")
    metadata: bytes | None = None  # the remote agent's NIXL metadata: the route has a nixl path

    @property
    def nixl(self) -> bool:
        return self.peer is not None or self.metadata is not None


class DataPlane:
    def __init__(self, name: str | None = None, path: str = "auto", *, nixl_progress_thread: bool = False,
                 read_only: bool = False, lane_max_bytes: int | None = None,
                 config: DataPlaneConfig | None = None) -> None:
        """`nixl_progress_thread`: also run NIXL's UCX progress thread (off: this process only
        initiates transfers and progresses them while it waits; see NixlEndpoint). `read_only`:
        WRITE is refused and same-host segments are mapped read-only (a reader-only client).
        `lane_max_bytes`: the largest job the TCP path takes, over `config`'s (0: never the TCP path
        unless `path` is "lane"). `config`: the data plane's settings (None: DataPlaneConfig.from_env(),
        read once now)."""
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        config = DataPlaneConfig.from_env() if config is None else config
        if lane_max_bytes is not None:
            config = dataclasses.replace(config, tcp_max_bytes=lane_max_bytes)  # validated there
        self.config = config
        self.lane_max_bytes = config.max_bytes
        # writes, then reads, of this many bytes or more run as two halves (0: never)
        self.lane_split_bytes = config.write_split_bytes
        self.lane_read_split_bytes = config.read_split_bytes
        self.lane_spin_s = config.tcp_spin_s  # how long a whole job on the TCP path spins beyond its bytes' share
        # scatter-gather jobs (many small regions) cost UCX per region: without RDMA they take the TCP path
        self.lane_region_bytes = TCP_REGION_BYTES if self.lane_max_bytes and not config.rdma else 0
        self.jobs_by_path = {"shm": 0, "nixl": 0, "lane": 0}  # jobs run, for benchmarks and tests
        self.name = name or f"kvpool-client-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.path = path
        self.nixl_progress_thread = nixl_progress_thread
        self.read_only = read_only
        self._lock = threading.Lock()
        self._memory = RegisteredMemory()  # the registered local memory, and the checks of jobs against it
        self._endpoint = None  # NixlEndpoint, created on first need
        self._routes: dict[int, Route] = {}
        self._tag_reader = TagReader(self._tag_lane)  # reads by tag (tag_reads.py)
        self._closed = False

    # ---- local memory ------------------------------------------------------------------------

    def register(self, addr: int, size_bytes: int, device: int | None = None) -> None:
        """Register local memory: host memory, or CUDA device `device`'s memory."""
        validate_region(addr, size_bytes, device)
        with self._lock:
            self._check_open()
            if not self._memory.is_new(addr, size_bytes, device):
                return  # registering the same memory twice is harmless
            region = Region(size_bytes, device)
            if self._endpoint is not None:
                region.registration = self._endpoint.register(addr, size_bytes, device)
            self._memory.add(addr, region)

    def unregister(self, addr: int) -> None:
        with self._lock:
            region = self._memory.remove(addr)
            if region.registration is not None:
                self._endpoint.deregister(region.registration)

    # ---- routes ------------------------------------------------------------------------------

    def path_for(self, segment: SegmentInfo) -> str:
        """'shm', 'nixl' or 'lane': the path transfers to this segment take (creates the route);
        'nixl' routes send their small jobs over the TCP path where the node serves one."""
        return _path_of(self._route(segment))

    def paths(self) -> dict[int, str]:
        """segment id -> 'shm', 'nixl' or 'lane' for every route made so far (what tests assert on)."""
        with self._lock:
            return {sid: _path_of(r) for sid, r in self._routes.items()}

    def _route(self, segment: SegmentInfo) -> Route:
        route = self._routes.get(segment.segment_id)
        if route is not None and route.agent_name == segment.agent_name:
            return route
        with self._lock:
            self._check_open()
            route = self._routes.get(segment.segment_id)
            if route is not None and route.agent_name == segment.agent_name:
                return route
            if route is not None:  # same id, another agent: the old route is stale
                self._drop_route(route)
            route = self._new_route(segment)
            self._routes[segment.segment_id] = route
            return route

    def _new_route(self, segment: SegmentInfo) -> Route:
        why_not_shm = "the segment has no shared-memory path"
        if self.path in ("auto", "shm") and segment.shm_path is not None:
            if segment.host_id != host_id():
                why_not_shm = f"segment is on host {segment.host_id}, this is {host_id()}"
            else:
                try:
                    mapping = PeerMapping(segment.shm_path, segment.size_bytes, segment.agent_name,
                                          writable=not self.read_only)
                    return Route(segment.agent_name, mapping=mapping)
                except (OSError, ValueError) as e:
                    why_not_shm = f"cannot map {segment.shm_path}: {e}"
        if self.path == "shm":
            raise TransferError(f"segment {segment.segment_id} of node {segment.node_id}: {why_not_shm}")
        lane = TcpPath(segment.lane_address, spin_s=self.lane_spin_s) \
            if segment.lane_address and self.path != "nixl" else None
        if self.path == "lane":
            if lane is None:
                raise TransferError(f"segment {segment.segment_id} of node {segment.node_id} serves no TCP path")
            return Route(segment.agent_name, lane=lane)
        # the NIXL agent and its peer are made by the first job that needs them (_peer): without
        # RDMA the TCP path carries every host-memory job, and loading NIXL takes ~0.5 s
        return Route(segment.agent_name, lane=lane, metadata=segment.agent_metadata)

    def _peer(self, route: Route) -> str:
        """The route's NIXL peer, made now (and the NIXL agent with it) if no job needed it yet;
        TransferError if it cannot be made."""
        if route.peer is None:
            with self._lock:
                self._check_open()
                if route.peer is None:
                    endpoint = self._nixl()
                    shared = next((r.peer for r in self._routes.values() if r.peer and r.agent_name == route.agent_name),
                                  None)
                    route.peer = shared or endpoint.add_peer(route.metadata)
        return route.peer

    def _nixl(self):
        if self._endpoint is None:
            from kvpool.transfer.nixlio import NixlEndpoint  # lazy: 0.4 s and 130 MB of libraries

            endpoint = NixlEndpoint(self.name, progress_thread=self.nixl_progress_thread,
                                    progress_delay_us=self.config.nixl.progress_delay_us)
            for addr, region in self._memory.regions.items():
                region.registration = endpoint.register(addr, region.size_bytes, region.device)
            self._endpoint = endpoint
        return self._endpoint

    def _drop_route(self, route: Route) -> None:
        if route.mapping is not None:
            route.mapping.close()
        if route.lane is not None:
            route.lane.close()
        # one agent can back two routes (a node remounted with the same memory under a new segment
        # id): its peer goes only with the last of them
        if route.peer is not None and self._endpoint is not None and not any(
            r is not route and r.peer == route.peer for r in self._routes.values()
        ):
            self._endpoint.remove_peer(route.peer)

    def forget_segment(self, segment_id: int) -> None:
        with self._lock:
            route = self._routes.pop(segment_id, None)
            if route is not None:
                self._drop_route(route)

    # ---- transfers ---------------------------------------------------------------------------

    def transfer(
        self,
        op: str,
        segment: SegmentInfo,
        local_addrs: Sequence[int],
        remote_offsets: Sequence[int],
        sizes: Sequence[int],
        timeout_s: float,
    ) -> None:
        error = self.transfer_many(op, [(segment, local_addrs, remote_offsets, sizes)], timeout_s)[0]
        if error is not None:
            raise error

    def carries_unregistered(self, op: str, segment: SegmentInfo, num_bytes: int) -> bool:
        """Whether a host job of `num_bytes` to this segment goes by shared memory or its lane, so
        that its local memory need not be registered (`transfer_many(..., unregistered=True)`);
        False also when no route can be made (the transfer would fail anyway)."""
        try:
            route = self._route(segment)
        except TransferError:
            return False
        return route.mapping is not None or (route.lane is not None and self._lane_wanted(op, route, [num_bytes], None))

    def transfer_many(self, op: str, jobs: Sequence[Job], timeout_s: float,
                      after_objects: Sequence | None = None, *, unregistered: bool = False,
                      before_landing=None, sent=None, tags: Sequence | None = None) -> list[TransferError | None]:
        """Run jobs (usually one per segment) concurrently: NIXL requests are all posted first,
        shared-memory copies run while they progress. Returns one error or None per job.
        `after_objects[i]`, None or (counts, after): job i's regions are objects of counts[n]
        regions each, and a host READ or WRITE over shared memory calls after(n) as soon as object n
        is in place (a reader or writer checksums it while it is in the CPU's caches); other paths
        never call it.
        `sent()`: called at most once, from this thread, as soon as a WRITE's bytes are on their
        way (NIXL requests posted, or a lane request's bytes handed to the kernel), before waiting
        for them to land; never for shared-memory copies, nor if nothing was sent.
        `tags[i]`, None or a 16-byte tag: WRITE job i is one value in one region, and if it goes
        over the TCP path the node records the tag for it (tcp_path_tags.py, `read_tagged`)."""
        if op not in OPS:
            raise UsageError(f"op must be READ or WRITE, got {op!r}")
        if op == "WRITE" and self.read_only:
            raise UsageError("this data plane is read-only (a reader-only client): it cannot write segments")
        if not timeout_s > 0:
            raise UsageError(f"timeout_s must be > 0, got {timeout_s!r}")
        deadline = time.monotonic() + timeout_s
        checked = [self._memory.check(*job, unregistered=unregistered) for job in jobs]  # UsageError before anything moves
        errors: list[TransferError | None] = [None] * len(jobs)
        for i, job in enumerate(checked):
            try:
                job.route = self._route(job.segment)
            except TransferError as e:
                errors[i] = e
        on_lane: list = [None] * len(jobs)  # per job: the lane connection it runs on
        held: dict[int, tuple] = {}  # id(lane) -> (lane, connection): each route's lane taken once per call
        try:
            for i, job in enumerate(checked):
                if errors[i] is not None:
                    continue
                lane = job.route.lane
                if not job.route.nixl and job.route.mapping is None and job.device is not None:
                    errors[i] = TransferError("the TCP path moves host memory only: GPU memory needs the nixl path")
                elif lane is not None and id(lane) in held:
                    if not job.route.nixl or unregistered:  # after the other job, on its connection
                        on_lane[i] = held[id(lane)][1]
                elif self._takes_lane(op, job):
                    conn = lane.acquire() if not job.route.nixl or unregistered else lane.try_acquire()
                    if conn is not None:
                        held[id(lane)] = (lane, conn)
                        on_lane[i] = conn
                if unregistered and on_lane[i] is None and job.route.mapping is None and errors[i] is None:
                    errors[i] = TransferError(f"segment {job.segment.segment_id}: a job from unregistered memory "
                                              "goes by shared memory or the TCP path only, not NIXL")
            return self._run_jobs(op, checked, errors, on_lane, deadline, after_objects, before_landing,
                                  _once(sent) if sent is not None and op == "WRITE" else None,
                                  tags if op == "WRITE" else None)
        finally:
            for lane, conn in held.values():
                lane.release(conn)

    def _run_jobs(self, op: str, checked: list[CheckedJob], errors: list, on_lane: list, deadline: float,
                  after_objects: Sequence | None = None, before_landing=None, sent=None, tags=None) -> list:
        posted, posted_idx = [], []
        for i, job in enumerate(checked):
            if errors[i] is None and on_lane[i] is None and job.route.nixl and len(job.sizes):
                try:
                    posted.append(self._post(op, job))
                    posted_idx.append(i)
                    self.jobs_by_path["nixl"] += 1
                except TransferError as e:
                    errors[i] = e
        if posted and sent is not None:
            sent()
        for i, job in enumerate(checked):
            if errors[i] is None and job.route.mapping is not None:
                try:
                    if before_landing is not None and op == "READ":
                        for addr, size in zip(job.local_addrs, job.sizes):
                            before_landing(addr, size)
                    job.route.mapping.copy(op, job.local_addrs, job.remote_offsets, job.sizes, job.device,
                                           after_objects[i] if after_objects is not None else None)
                    self.jobs_by_path["shm"] += 1
                except TransferError as e:
                    errors[i] = e
        for i, job in enumerate(checked):
            if on_lane[i] is not None:
                try:
                    tag = tags[i] if tags is not None and tags[i] is not None and len(job.sizes) == 1 else None
                    self._lane_transfer(op, job, on_lane[i], deadline, before_landing, sent,
                                        None if tag is None else (tag, job.remote_offsets[0], job.sizes[0]))
                    self.jobs_by_path["lane"] += 1
                except TransferError as e:
                    errors[i] = e
        if posted:
            for i, error in zip(posted_idx, self._endpoint.wait(posted, deadline)):
                errors[i] = error
        return errors

    def _lane_transfer(self, op: str, job: CheckedJob, conn, deadline: float, before_landing=None,
                       sent=None, tag=None) -> None:
        """A job on its lane connection; one of lane_split_bytes or more (READ or WRITE) as two
        halves at once (tcp_path_halves.py). `sent`: called by this thread's half once its bytes are out."""
        split = self.lane_read_split_bytes if op == "READ" else self.lane_split_bytes
        run_on_lane(op, job.route.lane, conn, job.local_addrs, job.remote_offsets, job.sizes, split, deadline,
                    before_landing, sent, tag)

    def read_tagged(self, segments: Sequence[SegmentInfo], tag: bytes, make, timeout_s: float,
                    before_landing=None):
        """What a node holds where `tag` was last written (tcp_path_tags.py), read over its segment's
        lane into `make(size)`'s (output, address): (segment, offset, size, output, address);
        None when none of `segments` knows it (or none could be asked); TransferError, with the
        failed `segment_ids`, when none knew it and an ask failed (tag_reads.py)."""
        self._check_open()
        found = self._tag_reader.read(segments, tag, make, timeout_s, before_landing)
        if found is not None:
            self.jobs_by_path["lane"] += 1
        return found

    def _tag_lane(self, segment: SegmentInfo) -> TcpPath | None:
        """The TCP path a tag read asks (None: shared memory or no lane); TransferError if
        no route can be made."""
        route = self._route(segment)
        return route.lane if route.mapping is None else None

    def _takes_lane(self, op: str, job: CheckedJob) -> bool:
        """Whether the job should go over its segment's TCP path (path "lane": every job; auto: a host-
        memory job of at most lane_max_bytes, or whose regions average at most lane_region_bytes,
        or without RDMA any READ, and any WRITE that is split in two; if a connection is free when
        it is asked for)."""
        return self._lane_wanted(op, job.route, job.sizes, job.device)

    def _lane_wanted(self, op: str, route: Route, sizes: Sequence[int], device: int | None) -> bool:
        if route.lane is None or not len(sizes):
            return False
        if not route.nixl:
            return True
        total = sum(sizes)
        if device is not None:
            return False
        if self.lane_region_bytes and op == "READ":
            return True  # no RDMA: one TCP stream into the caller's memory beat UCX's reads at every size
        if self.lane_region_bytes and self.lane_split_bytes and total >= self.lane_split_bytes:
            return True  # no RDMA: two TCP streams beat UCX's writes (one did not from 4 MiB)
        return total <= self.lane_max_bytes or total <= self.lane_region_bytes * len(sizes)

    def _post(self, op: str, job: CheckedJob):
        from kvpool.transfer.nixlio import descriptors

        peer = self._peer(job.route)
        local = descriptors(job.local_addrs, job.sizes, job.device or 0)
        remote = descriptors(np.array(job.remote_offsets, dtype=np.int64) + job.segment.base_addr, job.sizes)
        return self._endpoint.post(op, local, remote, peer, local_vram=job.device is not None)

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError("DataPlane is closed")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for route in self._routes.values():
                self._drop_route(route)
            self._routes.clear()
            if self._endpoint is not None:
                for region in self._memory.regions.values():
                    if region.registration is not None:
                        try:
                            self._endpoint.deregister(region.registration)
                        except TransferError:
                            pass  # the agent goes away next anyway
                        region.registration = None
                self._endpoint.close()
                self._endpoint = None

    def __enter__(self) -> "DataPlane":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _path_of(route: Route) -> str:
    return "shm" if route.mapping is not None else "nixl" if route.nixl else "lane"


def _once(callback):
    """`callback` made a no-op after its first call."""
    done = False

    def once() -> None:
        nonlocal done
        if not done:
            done = True
            callback()

    return once
