"""The Python client: batch-first, zero-copy put_from/get_into, plus put/get for plain values.

Rules:
- One master round trip per batch call: PutStart for a put batch, one leased LookupPrefix for a
  get batch. Then one-sided transfers, one job per segment, all segments at once (transfer_many).
- Put: allocated replicas are written, then PutEnd makes written keys readable and PutRevoke frees
  keys whose write failed (their status becomes PUT_FAILED). PUT_EXISTS keys are never written.
  Both name each allocation's write token; keys whose token the master refused (the put outlived
  put_timeout_s and was reclaimed) are PUT_FAILED too. The write's deadline is derived from the
  master's put_timeout_s, counted from before PutStart was sent: the writer gives up (and revokes)
  a margin before the master would reclaim. A write that missed its deadline and may still land
  (data_plane's in_flight) is revoked into quarantine and the quarantine ended once the transfer
  is known to be over. Over the lane the PutEnd goes out before the write, with `landing`, and a
  one-way PutLanded after it makes the objects readable (landing.py): the end's round trip is
  hidden behind the write; failed writes are revoked the same way.
- Checksums (client/checksum.py): the writer sends one per object with PutEnd (a put of one
  object computes it while its PutStart travels: the channel's `meanwhile`); a reader verifies
  every hit against the one its lookup returned before counting it, and a mismatch ends the hits
  there (a miss, a metric and a log line). `checksums=False` neither sends nor verifies.
- Get: the lease clock starts BEFORE the lookup is sent (t0), so the client's deadline t0 + ttl
  is never later than the master's. A read finishing after it counts as failed: its bytes are never
  reported. A failed read falls back to the object's next replica (same-host replicas first).
- Leases are released as soon as the reads end, read or failed (ReleaseLeases with the lookup's
  lease id, sent without waiting for the answer: the channel drops that late reply; over the lane
  lazily, riding with our next request or sent within 200 ms), so removed or evicted space is
  freed within that rather than at the lease TTL. A lost release costs nothing but
  that wait: the master still ends the lease at its TTL.
- Segment descriptions are cached by id (segments.py): unknown ids are fetched with GetSegments,
  ids the master no longer knows are forgotten by the data plane. A reply from a new master
  incarnation empties the cache (and the data plane's routes) before it is used.
- Plain values (`put`, `get`, plain_values.py): small ones in one round trip to the master; a
  larger one into the allocation the previous plain put of its size asked for with its PutEnd
  (ahead.py): its write and one round trip. A plain get of a value this client put or read
  lately reads it where it was while GetValue travels (known_places.py), and keeps those bytes
  only when the master's answer still places the value there and they match its checksum.
- Thread-safe: the channel and caches have locks, the staging buffer has its own; no lock is held
  across a transfer except the staging buffer's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent import futures
from dataclasses import dataclass

from kvpool.client import plan
from kvpool.client.ahead import AheadSlots, end_margin_s
from kvpool.client.checksum import NO_CHECKSUM, checksum_after, checksum_objects
from kvpool.client.known_places import EarlyReads, KnownPlaces
from kvpool.client.landing import Landings
from kvpool.client.memory import RegisteredRanges, StagingBuffer, copy_bytes, region_of
from kvpool.client.metrics import TenantMetrics, client_metrics
from kvpool.client.plain_values import PlainValues
from kvpool.client.segments import SegmentCache
from kvpool.client.statuses import PUT_FAILED, PUT_STATUS_NAMES
from kvpool.core import protocol
from kvpool.core.errors import KVPoolError, ProtocolError, UsageError
from kvpool.core.protocol import PUT_ALLOCATED, PUT_EXISTS, Replica
from kvpool.core.types import MAX_KEY_LENGTH, MAX_TENANT_LENGTH
from kvpool.transfer.control import MasterChannel, parse_addresses
from kvpool.transfer.fence import all_of
from kvpool.transfer.lane import LaneChannel

log = logging.getLogger(__name__)

_PATHS = ("auto", "nixl", "shm", "lane")


class _Once:
    """Calls `fn` the first time it is called, never again (None: nothing to call)."""

    __slots__ = ("_fn",)

    def __init__(self, fn) -> None:
        self._fn = fn

    def __call__(self) -> None:
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()


class _Early:
    """`fn(*args)` run while a request travels (as a channel's `meanwhile`), at most once; its
    result, or its exception re-raised, from `result()` (which runs it if it never ran)."""

    __slots__ = ("_call", "_outcome")

    def __init__(self, fn, *args) -> None:
        self._call = (fn, args)
        self._outcome = None

    def __call__(self) -> None:
        if self._outcome is None:
            fn, args = self._call
            try:
                self._outcome = (True, fn(*args))
            except Exception as e:  # re-raised by result(), where the caller can still revoke
                self._outcome = (False, e)

    def result(self):
        self()
        ok, value = self._outcome
        if not ok:
            raise value
        return value


_PROMOTION_POLL_S = 0.02  # how often a lookup asks again while its keys are promoted from disk
# a same-host read or put this large checksums each object right after its copy (memcopy.copy_objects)
CHECKSUM_DURING_COPY_BYTES = 8 << 20
# a put batch this large is checksummed on another thread while it is written (fixes.md 26)
CHECKSUM_BESIDE_WRITE_BYTES = 4 << 20
_checksum_pool: futures.ThreadPoolExecutor | None = None
_checksum_pool_lock = threading.Lock()


def _checksum_runner() -> futures.ThreadPoolExecutor:
    """The kept thread that checksums large put batches beside their writes (xxh3 lets other
    threads run while it hashes regions of 256 KiB and more)."""
    global _checksum_pool
    with _checksum_pool_lock:
        if _checksum_pool is None:
            _checksum_pool = futures.ThreadPoolExecutor(1, thread_name_prefix="kvpool-put-checksum")
        return _checksum_pool


def _forget_checksum_runner_after_fork() -> None:
    global _checksum_pool
    _checksum_pool = None


os.register_at_fork(after_in_child=_forget_checksum_runner_after_fork)


@dataclass(frozen=True)
class ClientConfig:
    master_address: str
    tenant: str = "default"
    timeout_s: float = 5.0  # master round trips and each transfer round
    path: str = "auto"  # auto: same-host shared memory, else NIXL (small jobs: the segment lane); nixl|shm|lane force one
    num_replicas: int = 1
    staging_bytes: int = 1 << 20  # initial bounce buffer for put/get of unregistered values
    checksums: bool = True  # send a checksum per object and verify every hit (see the module rules)
    credential: str | None = None  # CURVE credential file (kvpool auth add); None: $KVPOOL_CREDENTIAL or none
    lane: bool = True  # without a credential: master round trips over its plain TCP lane when it offers one
    read_only: bool = False  # a reader: puts refused, same-host segments mapped read-only (PROT_READ)
    landing: bool = True  # over the lane, a put's PutEnd travels while its bytes are written (landing.py)
    known_places: bool = True  # a plain get reads where this client saw the value while GetValue travels

    def __post_init__(self) -> None:
        parse_addresses(self.master_address)  # ValueError naming the malformed one
        if not self.tenant or len(self.tenant) > MAX_TENANT_LENGTH:
            raise ValueError(f"tenant must be 1..{MAX_TENANT_LENGTH} characters, got {self.tenant!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.path not in _PATHS:
            raise ValueError(f"path must be one of {_PATHS}, got {self.path!r}")
        if not 1 <= self.num_replicas <= protocol.MAX_REPLICAS:
            raise ValueError(f"num_replicas must be in 1..{protocol.MAX_REPLICAS}, got {self.num_replicas}")
        if self.staging_bytes < 4096:
            raise ValueError(f"staging_bytes must be >= 4096, got {self.staging_bytes}")


class Client(PlainValues, Landings, EarlyReads):
    def __init__(
        self,
        master_address: str,
        tenant: str = "default",
        *,
        timeout_s: float = 5.0,
        path: str = "auto",
        num_replicas: int = 1,
        staging_bytes: int = 1 << 20,
        checksums: bool = True,
        credential: str | None = None,
        lane: bool = True,
        read_only: bool = False,
        plane=None,
        landing: bool = True,
        known_places: bool = True,
    ) -> None:
        self.config = ClientConfig(master_address, tenant, timeout_s, path, num_replicas, staging_bytes, checksums,
                                   credential, lane, read_only, landing, known_places)
        from kvpool.transfer import DataPlane, host_id  # lazy: NIXL loads only when a client is made
        from kvpool.transfer.credentials import resolve_credential

        self._owns_plane = plane is None
        self.plane = DataPlane(path=path, read_only=read_only) if plane is None else plane
        resolved = resolve_credential(credential)
        self._channel = MasterChannel(master_address, timeout_s=timeout_s, credential=resolved)
        if lane and resolved is None:  # the lane has no CURVE: an authenticated master offers none anyway
            self._channel = LaneChannel(self._channel)
        self._registered = RegisteredRanges()
        self._device_memory = RegisteredRanges()  # the GPU part of _registered
        self._kept_alive: list[object] = []  # registered objects must outlive their registration
        self._register_lock = threading.Lock()
        self._segments = SegmentCache(self._call, self.plane, host_id())
        self._channel.add_epoch_listener(self._segments.on_new_epoch)
        self._metrics = TenantMetrics(client_metrics(), self.config.tenant)
        self._staging = StagingBuffer(self._register_region, staging_bytes)
        self._max_inline = protocol.DEFAULT_MAX_INLINE_BYTES  # the master's, as its last reply said (-1: none)
        self._ahead = AheadSlots()  # the allocation held for the next plain put (ahead.py)
        self._places = KnownPlaces()  # where plain values were put or read lately (known_places.py)
        self._channel.add_epoch_listener(self._on_new_epoch)
        self._closed = False

    # ---- memory -----------------------------------------------------------------------------

    def register(self, memory) -> None:
        """Register memory (CPU or CUDA tensor, numpy array, bytearray, (addr, size_bytes), or
        (addr, size_bytes, cuda_device)) as a source or destination of put_from/get_into. The
        object is kept alive by the client. GPU memory is neither checksummed nor verified (the
        checksum is computed on the CPU): objects written from it carry none."""
        region = region_of(memory, writable=False)
        if region.size_bytes <= 0:
            raise UsageError("cannot register empty memory")
        self._register_region(region.addr, region.size_bytes, region.device)
        if not isinstance(memory, tuple):
            self._kept_alive.append(memory)

    def _register_region(self, addr: int, size_bytes: int, device: int | None = None) -> None:
        with self._register_lock:
            if self._registered.contains(addr, size_bytes):
                return
            self.plane.register(addr, size_bytes, device)
            self._registered.add(addr, size_bytes)
            if device is not None:
                self._device_memory.add(addr, size_bytes)

    def _check_registered(self, addrs: list[list[int]], sizes: list[list[int]]) -> None:
        # the data plane checks too, but per job; here the message names the object
        outside = self._registered.first_outside(addrs, sizes)
        if outside is not None:
            i, addr, size = outside
            raise UsageError(
                f"object {i}: region at 0x{addr:x} ({size} bytes) is not inside registered "
                f"memory; call client.register(buffer) first"
            )

    # ---- batch put / get --------------------------------------------------------------------

    def put_from(
        self,
        keys: list[str],
        addrs: list,
        sizes: list,
        parents: list[str | None] | None = None,
        *,
        pinned: bool = False,
        on_written=None,
    ) -> list[int]:
        """Store objects given as scatter-gather regions. Returns PUT_ALLOCATED (stored now),
        PUT_EXISTS, PUT_NO_SPACE or PUT_FAILED (write failed, revoked) per key. `pinned` objects
        are never evicted (remove them explicitly). `on_written()` is called once the source
        memory is no longer needed (after the copy, before the master is told; also when the call
        fails early), so a caller can reuse it without waiting for the last round trip."""
        statuses, _ = self._put_from(keys, addrs, sizes, parents, pinned, on_written)
        return statuses

    def _put_from(self, keys, addrs, sizes, parents, pinned: bool = False, on_written=None,
                  unregistered: bool = False, ahead: bool = False) -> tuple[list[int], str]:
        """`unregistered`: one object whose host memory is not registered (a plain value's
        bytes): written straight from it where its replicas' routes carry such memory, else from
        a copy in the staging buffer. `ahead`: its PutEnd also asks for an allocation of the
        object's size for the next plain put (client/ahead.py)."""
        once = _Once(on_written)
        if self.config.read_only:
            once()
            raise UsageError("this client is read-only (read_only=True): it cannot put")
        try:
            return self._put_from_inner(keys, addrs, sizes, parents, pinned, once, unregistered, ahead)
        finally:
            once()

    def _put_from_inner(self, keys, addrs, sizes, parents, pinned, written: "_Once",
                        unregistered: bool = False, ahead: bool = False) -> tuple[list[int], str]:
        started = time.perf_counter()
        self._check_keys(keys, unique=True)
        addrs, sizes = self._regions(len(keys), addrs, sizes)
        if parents is None:
            parents = [None] + list(keys[:-1])
        elif len(parents) != len(keys) or not all(p is None or isinstance(p, str) for p in parents):
            raise UsageError(f"parents must be None or a list of {len(keys)} keys/None, got {parents!r}")
        if not keys:
            return [], ""
        if unregistered and len(keys) != 1:
            raise UsageError("an unregistered source is one object")
        if not unregistered:
            self._check_registered(addrs, sizes)
        totals = [sum(s) for s in sizes]
        tenant = self.config.tenant
        # one object: checksummed while PutStart travels (a batch checksums only what is
        # allocated, after: most of a prefix chain usually exists already)
        early = _Early(self._checksums, addrs, sizes) if len(keys) == 1 else None
        t0 = time.monotonic()  # before sending: our deadline is never later than the master's reclaim
        reply = self._call(
            protocol.PutStart(tenant, list(keys), totals, list(parents), self.config.num_replicas, bool(pinned)),
            protocol.PutStartReply, meanwhile=early,
        )
        statuses = list(reply.statuses)
        allocated = [i for i, st in enumerate(statuses) if st == PUT_ALLOCATED]
        tokens = list(reply.tokens) if len(reply.tokens) == len(keys) else None
        if allocated and tokens is None:
            raise ProtocolError(f"the master answered PutStart with {len(reply.tokens)} tokens for {len(keys)} keys")
        write_deadline = t0 + reply.put_timeout_s - end_margin_s(reply.put_timeout_s)
        choices = [(i, r) for i in allocated for r in reply.replicas[i]]
        alloc_keys, alloc_tokens = [keys[i] for i in allocated], [tokens[i] for i in allocated] if allocated else []
        ending = None  # the PutEnd sent before the write (landing.py), if it was
        try:
            beside = None  # a large batch's checksums, computed on another thread while it is written
            during = None  # or, copied on this host, each object's right after its copy (memcopy.copy_objects)
            if early is not None:
                checksums = early.result() if allocated else []
            elif self.config.checksums and sum(totals[i] for i in allocated) >= CHECKSUM_BESIDE_WRITE_BYTES:
                if self._checksummed_during_copy(choices, [addrs[i] for i in allocated], totals):
                    during = {}
                else:
                    beside = _checksum_runner().submit(self._checksums, [addrs[i] for i in allocated],
                                                       [sizes[i] for i in allocated])
            else:
                checksums = self._checksums([addrs[i] for i in allocated], [sizes[i] for i in allocated])
            with contextlib.ExitStack() as staged:
                if beside is not None:  # it reads the source: over before the source is the caller's again
                    staged.callback(futures.wait, [beside])
                if unregistered and not self._carried_unregistered("WRITE", choices, totals):
                    staged.enter_context(self._staging.lock)  # copied into the staging buffer, written from it
                    self._staging.ensure(totals[0])
                    copy_bytes(self._staging.addr, addrs[0][0], totals[0])
                    addrs, unregistered = [[self._staging.addr]], False
                    ahead = False  # the next plain put would be staged too: it gains nothing ahead
                if allocated and beside is None and during is None:
                    ending = self._begin_ending(protocol.PutEnd(tenant, alloc_keys, alloc_tokens, checksums),
                                                reply.lands, choices, totals[0] if ahead else None)
                failed, in_flight = self._run_round(
                    "WRITE", choices, addrs, sizes, max(1e-3, write_deadline - time.monotonic()),
                    (during, [1] * len(keys)) if during is not None else None, unregistered=unregistered,
                )
            if beside is not None:
                checksums = beside.result()
            elif during is not None:  # objects of jobs too small to be checksummed during their copy: now
                missing = [i for i in allocated if i not in during]
                during.update(zip(missing, self._checksums([addrs[i] for i in missing], [sizes[i] for i in missing])))
                checksums = [during[i] for i in allocated]
        except BaseException:
            if ending is not None:
                self._abandon_ending(ending, alloc_keys, alloc_tokens)
            else:
                self._revoke_quietly(alloc_keys, alloc_tokens)
            raise
        # The source is free now. A write still in flight may read it later, but only into its
        # quarantined range, which is never served: reusing the source cannot corrupt an object.
        try:
            written()
        finally:  # the end's reply is taken whatever the caller's callback did
            ended = self._finish_ending(ending, alloc_keys, alloc_tokens) if ending is not None else None
        if allocated and time.monotonic() > write_deadline:
            failed = set(allocated)  # too late to end safely: the master may reclaim any moment now
        if ended is not None:  # ended already: what was refused is not ours, what failed is revoked
            refused = {allocated[n] for n in ended.refused}
            failed -= refused
        if failed:
            gone = sorted(failed)
            flight = [n for n, i in enumerate(gone) if i in in_flight]
            self._call(protocol.PutRevoke(tenant, [keys[i] for i in gone], [tokens[i] for i in gone], flight),
                       protocol.OkReply)
            if flight:
                self._end_quarantine_later(in_flight, [tokens[i] for i in gone if i in in_flight])
            for i in failed:
                statuses[i] = PUT_FAILED
        if ended is not None:
            landed = [i for i in allocated if i not in failed and i not in refused]
            if not self._land([keys[i] for i in landed], [tokens[i] for i in landed]):
                for i in landed:
                    statuses[i] = PUT_FAILED
            self._count_refused(refused, statuses, len(allocated))
        else:
            written = [i for i in allocated if i not in failed]
            if written:
                by_index = dict(zip(allocated, checksums))
                end = protocol.PutEnd(tenant, [keys[i] for i in written], [tokens[i] for i in written],
                                      [by_index[i] for i in written])
                ended = self._end_asking_ahead(end, totals[0]) if ahead else self._call(end, protocol.PutEndReply)
                self._count_refused({written[n] for n in ended.refused}, statuses, len(written))
        # counted per batch, not per key: two labels().inc() per key were a quarter of a small put
        for st in set(statuses):
            self._metrics.put_keys[PUT_STATUS_NAMES.get(st, str(st))].inc(statuses.count(st))
        stored_bytes = sum(totals[i] * len(reply.replicas[i]) for i, st in enumerate(statuses) if st == PUT_ALLOCATED)
        if stored_bytes:
            self._metrics.put_bytes.inc(stored_bytes)
        self._metrics.latency_s["put"].observe(time.perf_counter() - started)
        return statuses, reply.message

    def _checksummed_during_copy(self, choices: list[tuple[int, Replica]], addrs: list[list[int]],
                                 totals: list[int]) -> bool:
        """Whether a put batch's objects are checksummed each right after its copy, from the CPU's
        caches (the source just read), instead of on another thread beside the write: a batch of
        CHECKSUM_DURING_COPY_BYTES or more from host memory whose every replica is a same-host copy.
        Beside it, the second pass over the source competed with the copy for memory bandwidth
        (fixes.md 36)."""
        return (sum(totals) >= CHECKSUM_DURING_COPY_BYTES and len(self._on_host(addrs)) == len(addrs)
                and self._copies_locally(choices))

    def _count_refused(self, refused: set[int], statuses: list[int], num_ended: int) -> None:
        """Objects whose end the master refused are PUT_FAILED (counted, and said in the log)."""
        for i in refused:
            statuses[i] = PUT_FAILED
        if refused:
            self._metrics.put_keys["refused"].inc(len(refused))
            log.warning("kvpool: the master refused %d of %d put ends (their allocation was reclaimed or "
                        "is no longer ours); those keys were not stored", len(refused), num_ended)

    def _on_host(self, addrs: list[list[int]]) -> list[int]:
        """Indices of the objects whose regions are host memory (one transfer's regions lie in one
        memory, so the first region tells)."""
        if not len(self._device_memory):
            return list(range(len(addrs)))
        return [i for i, a in enumerate(addrs) if a and not self._device_memory.contains(a[0], 1)]

    def _checksums(self, addrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        out = [NO_CHECKSUM] * len(addrs)
        if not self.config.checksums or not addrs:
            return out
        host = self._on_host(addrs)
        for i, value in zip(host, checksum_objects([addrs[i] for i in host], [sizes[i] for i in host])):
            out[i] = value
        return out

    def _end_quarantine_later(self, transfers: dict, tokens: list[int]) -> None:
        """Tell the master once every write of these tokens is over (done or failed)."""
        tenant = self.config.tenant

        def settled(_transfer) -> None:
            if not self._closed:
                # off the reaper's thread: the channel's lock may be held by a call waiting on a slow
                # master, and the reaper must go on ending other transfers meanwhile
                threading.Thread(target=self._send_quietly, args=(protocol.EndQuarantine(tenant, tokens),),
                                 name="kvpool-end-quarantine", daemon=True).start()

        all_of(list({id(t): t for t in transfers.values()}.values())).add_done_callback(settled)

    def _revoke_quietly(self, keys: list[str], tokens: list[int]) -> None:
        """Free allocations whose write never happened; if the master is unreachable too, its put
        timeout reclaims them, and the error that brought us here is the one worth raising."""
        if keys:
            try:
                self._call(protocol.PutRevoke(self.config.tenant, keys, tokens), protocol.OkReply)
            except KVPoolError:
                pass

    def get_into(self, keys: list[str], addrs: list, sizes: list, *, lookup_timeout_s: float | None = None) -> int:
        """Read the leading hits of `keys` into the given regions (object i = its regions
        concatenated). Returns how many leading keys were read completely within their lease.
        `lookup_timeout_s` bounds the master round trip alone (default: timeout_s), for callers
        that must not wait long on a slow master but may on a long copy (a vLLM step's load)."""
        started = time.perf_counter()
        self._check_keys(keys, unique=False)
        addrs, sizes = self._regions(len(keys), addrs, sizes)
        if not keys:
            return 0
        self._check_registered(addrs, sizes)
        t0, reply, replicas = self._lookup_leased(keys, lookup_timeout_s)
        try:
            held = [rs[0].size for rs in replicas] + [len(value) for value in reply.inline_values]
            for i, size in enumerate(held):
                if size != sum(sizes[i]):
                    raise UsageError(f"key {keys[i]!r} holds {size} bytes but its regions total {sum(sizes[i])} bytes")
            count = self._read_leased(keys, replicas, reply, t0, addrs, sizes)
        finally:
            self._release(reply.lease_id)
        self._metrics.latency_s["get"].observe(time.perf_counter() - started)
        return count

    def _lookup_leased(
        self, keys: list[str], timeout_s: float | None = None
    ) -> tuple[float, protocol.LookupReply, list[list[Replica]]]:
        """(t0, the reply, per hit its replicas). The caller must `_release(reply.lease_id)`."""
        t0 = time.monotonic()  # before sending: our deadline is never later than the master's
        reply = self._call(protocol.LookupPrefix(self.config.tenant, list(keys), lease=True), protocol.LookupReply,
                           timeout_s)
        return t0, reply, self._leased_replicas(reply)

    def _leased_replicas(self, reply: protocol.LookupReply) -> list[list[Replica]]:
        """Per hit, its replicas; a malformed reply is released and raises ProtocolError."""
        try:
            on_nodes = reply.num_hit - len(reply.inline_values)
            if on_nodes < 0:
                raise ValueError(f"{reply.num_hit} hits but {len(reply.inline_values)} inline values")
            replicas = plan.split_replicas(reply.replica_locations, reply.replica_counts, on_nodes)
            if reply.checksums and len(reply.checksums) != protocol.CHECKSUM_BYTES * on_nodes:
                raise ValueError(f"{on_nodes} hits on nodes but {len(reply.checksums)} bytes of checksums")
        except ValueError as e:
            self._release(reply.lease_id)
            raise ProtocolError(f"malformed lookup reply from the master: {e}") from None
        return replicas

    def _send_quietly(self, request) -> None:
        try:
            self._channel.send(request)
        except KVPoolError:
            pass  # the master's quarantine limit ends it instead

    def _release(self, lease_id: int) -> None:
        """Hand a leased lookup back (fire-and-forget; the lease TTL covers a lost message)."""
        if lease_id and not self._closed:
            try:
                self._channel.send(protocol.ReleaseLeases(self.config.tenant, [lease_id]), lazy=True)
            except KVPoolError:
                pass

    def _read_leased(self, keys, replicas: list[list[Replica]], reply: protocol.LookupReply, t0: float, addrs,
                     sizes, *, unregistered: bool = False, before_landing=None) -> int:
        deadline = t0 + reply.lease_ttl_s
        num_hit = len(replicas)
        if num_hit:
            self._segments.get({r.segment_id for rs in replicas for r in rs})
        local_ids = self._segments.local_ids()
        untried = [plan.order_replicas(rs, local_ids) for rs in replicas]
        completed_at: list[float | None] = [None] * num_hit
        pending = list(range(num_hit))
        first_round = True
        # what the writers checksummed, and what a shared-memory copy checksummed as it went
        expected = protocol.unpack_checksums(reply.checksums) if self.config.checksums and reply.checksums else None
        digests: dict[int, int] | None = {} if expected else None
        while pending and time.monotonic() <= deadline:
            choices = [(i, untried[i].pop(0)) for i in pending if untried[i]]
            if not first_round:
                self._metrics.replica_fallbacks.inc(len(choices))
            first_round = False
            # waiting past the lease is pointless: such a read would be discarded anyway
            failed, in_flight = self._run_round("READ", choices, addrs, sizes, max(1e-3, deadline - time.monotonic()),
                                                (digests, expected) if digests is not None else None,
                                                unregistered=unregistered, before_landing=before_landing)
            if digests:
                for i in failed:
                    digests.pop(i, None)  # a copy that failed: what it checksummed is no longer the read
            if in_flight:
                self._fence_reads(in_flight)
            now = time.monotonic()
            for i, _ in choices:
                if i not in failed:
                    completed_at[i] = now
            # only a leading run is useful: drop everything after the first key that cannot be read
            retry = []
            for i in pending:
                if completed_at[i] is not None:
                    continue
                if not untried[i]:
                    break
                retry.append(i)
            pending = retry
        count = plan.leading_within_lease(completed_at, deadline)
        # expired: read too late, or never tried because the lease ran out first
        expired = sum(1 for t in completed_at if t is not None and t > deadline) + len(pending)
        if expired:
            self._metrics.lease_expiries.inc(expired)
        if count and expected:
            count = self._verified(keys, count, expected, addrs, sizes, digests)
        if count == num_hit and reply.inline_values:
            count += self._copy_inline(reply.inline_values, addrs[count:], sizes[count:])
        self._metrics.get_keys.inc(len(keys))
        self._metrics.hit_keys.inc(count)
        self._metrics.get_bytes.inc(sum(sum(sizes[i]) for i in range(count)))
        return count

    def _copy_inline(self, values: list[bytes], addrs, sizes) -> int:
        """Copy values the master sent inline into their regions; how many leading ones were copied
        (host memory only: one bound for GPU memory ends the hits there, a miss the caller recomputes)."""
        import numpy as np

        device = self._device_memory
        for n, value in enumerate(values):
            if len(device) and any(device.contains(a, 1) for a in addrs[n]):
                return n
            src, offset = np.frombuffer(value, dtype=np.uint8), 0
            base = int(src.ctypes.data)
            for addr, size in zip(addrs[n], sizes[n]):
                copy_bytes(addr, base + offset, size)
                offset += size
        return len(values)

    def _verified(self, keys, count: int, expected: list[int], addrs, sizes, digests: dict[int, int]) -> int:
        """How many of the first `count` objects read hold the bytes their writer checksummed
        (`digests`: objects already checksummed while they were copied)."""
        host = set(self._on_host(addrs[:count]))
        todo = [i for i in range(count) if expected[i] and i in host]
        if not todo:
            return count
        left = [i for i in todo if i not in digests]
        got = dict(zip(left, checksum_objects([addrs[i] for i in left], [sizes[i] for i in left]))) if left else {}
        for i in todo:
            value = digests[i] if i in digests else got[i]
            if value != expected[i]:
                self._metrics.checksum_mismatches.inc()
                log.warning("kvpool: checksum mismatch on %r (read %016x, written %016x): treated as a miss",
                            keys[i], value, expected[i])
                return i
        return count

    def _fence_reads(self, in_flight: dict) -> None:
        """A read that missed its deadline may still write into the caller's memory: return only
        once every such transfer is over (the data plane ends it at its peer's death at the latest)."""
        for transfer in {id(t): t for t in in_flight.values()}.values():
            transfer.wait()

    def _carried_unregistered(self, op: str, choices: list[tuple[int, Replica]], totals: list[int]) -> bool:
        """Whether every chosen replica's route carries memory that is not registered (plane.py)."""
        infos = self._segments.get({r.segment_id for _, r in choices})
        return all(r.segment_id in infos and self.plane.carries_unregistered(op, infos[r.segment_id], totals[i])
                   for i, r in choices)

    def _run_round(
        self, op: str, choices: list[tuple[int, Replica]], addrs, sizes, timeout_s: float | None = None,
        checksum_into: tuple[dict, list[int]] | None = None, *, unregistered: bool = False, before_landing=None,
        sent=None,
    ) -> tuple[set[int], dict]:
        """One round of transfers, one job per segment; returns (the object indices that failed,
        object index -> the data plane's StuckTransfer for failed ones whose transfer may still land).
        `checksum_into` (digests, expected): a shared-memory READ or WRITE of CHECKSUM_DURING_COPY_BYTES or
        more checksums each object with a non-zero expected checksum right after its copy, into
        digests[object index] (a smaller job is still in the CPU's last-level cache after its copy:
        checksummed after it in one call, without a call per object). `sent`: the data plane's
        hook, called once a WRITE's bytes are on their way (it must not raise)."""
        in_flight: dict = {}
        if not choices:
            return set(), in_flight
        infos = self._segments.get({r.segment_id for _, r in choices})
        failed = {i for i, r in choices if r.segment_id not in infos}
        jobs = plan.group_by_segment([(i, r) for i, r in choices if r.segment_id in infos], addrs, sizes)
        if not jobs:
            return failed, in_flight
        errors = self.plane.transfer_many(
            op,
            [(infos[j.segment_id], j.local_addrs, j.remote_offsets, j.sizes) for j in jobs],
            self.config.timeout_s if timeout_s is None else min(timeout_s, self.config.timeout_s),
            [checksum_after(j.object_indices, addrs, sizes, *checksum_into)
             if sum(j.sizes) >= CHECKSUM_DURING_COPY_BYTES else None for j in jobs] if checksum_into else None,
            unregistered=unregistered, before_landing=before_landing, sent=sent,
        )
        broken_segments = []
        for job, error in zip(jobs, errors):
            if error is not None:
                failed.update(job.object_indices)
                broken_segments.append(job.segment_id)
                if error.in_flight is not None:
                    in_flight.update(dict.fromkeys(job.object_indices, error.in_flight))
        if broken_segments:
            self._metrics.transfer_failures[op].inc(len(broken_segments))
            self._segments.recheck(broken_segments)
        return failed, in_flight

    # ---- control-plane only -----------------------------------------------------------------

    def lookup_prefix(self, keys: list[str], *, namespace: str | None = None, promotion_wait_s: float = 0.0) -> int:
        """How many leading keys are complete in the pool (one round trip, nothing leased), in this
        client's namespace or in `namespace` (a connector's scheduler asks for each TP rank's).
        A lookup that reaches keys on a node's disk starts their promotion to DRAM and counts them
        as misses; with `promotion_wait_s` > 0 it asks again (every 20 ms) while the master says
        keys are being promoted, for at most that long, so a disk hit can count as a hit now."""
        self._check_keys(keys, unique=False)
        if not keys:
            return 0
        started = time.perf_counter()
        tenant = self.config.tenant if namespace is None else namespace
        request = protocol.LookupPrefix(tenant, list(keys), lease=False)
        reply = self._call(request, protocol.LookupReply)
        give_up = started + promotion_wait_s
        while reply.num_promoting and reply.num_hit < len(keys) and time.perf_counter() + _PROMOTION_POLL_S < give_up:
            time.sleep(_PROMOTION_POLL_S)
            reply = self._call(request, protocol.LookupReply)
        self._metrics.latency_s["lookup"].observe(time.perf_counter() - started)
        return reply.num_hit

    def exists(self, keys: list[str]) -> list[bool]:
        self._check_keys(keys, unique=False)
        if not keys:
            return []
        return list(self._call(protocol.Exists(self.config.tenant, list(keys)), protocol.ExistsReply).exists)

    def remove(self, keys: list[str]) -> int:
        self._check_keys(keys, unique=False)
        if not keys:
            return 0
        self._places.forget(keys)
        return self._call(protocol.Remove(self.config.tenant, list(keys)), protocol.OkReply).count

    def ping(self) -> None:
        """One round trip to the master that changes nothing there (connects the lane where the
        master offers one). Raises UnavailableError when the master does not answer in time."""
        self._call(protocol.LaneQuery(), protocol.LaneOffer)

    def stats(self) -> protocol.StatsReply:
        return self._call(protocol.Stats(), protocol.StatsReply)

    # ---- internals --------------------------------------------------------------------------

    @property
    def epoch(self) -> int | None:
        """The master incarnation that answered last (None before the first answer)."""
        return self._channel.epoch

    def _call(self, request, reply_type, timeout_s: float | None = None, meanwhile=None):
        if self._closed:
            raise UsageError("the client is closed")
        reply = self._channel.call(request, timeout_s, meanwhile) if meanwhile is not None else \
            self._channel.call(request, timeout_s)
        if not isinstance(reply, reply_type):
            raise ProtocolError(f"master answered {type(request).__name__} with {type(reply).__name__}")
        return reply

    def _check_keys(self, keys, *, unique: bool) -> None:
        if isinstance(keys, (str, bytes)) or not isinstance(keys, (list, tuple)):
            raise UsageError(f"keys must be a list of strings, got {type(keys).__name__}")
        for key in keys:
            if not isinstance(key, str) or not key or len(key) > MAX_KEY_LENGTH:
                raise UsageError(f"each key must be a string of 1..{MAX_KEY_LENGTH} characters, got {key!r:.80}")
        if unique and len(set(keys)) != len(keys):
            raise UsageError("a put batch names the same key twice")

    @staticmethod
    def _regions(num_keys: int, addrs, sizes) -> tuple[list[list[int]], list[list[int]]]:
        try:
            return plan.normalize_regions(num_keys, addrs, sizes)
        except (ValueError, TypeError) as e:
            raise UsageError(str(e)) from None

    def close(self) -> None:
        if self._closed:
            return
        self._give_back(self._ahead.drop(), lazy=False)
        self._closed = True
        self._channel.close()
        if self._owns_plane:
            self.plane.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

