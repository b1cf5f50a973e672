"""The Python client: batch-first, zero-copy put_from/get_into, plus put/get for plain values.

Parts (docs/design/client.md): `Client` builds them once and hands each public call to one of
them; each owns its state and is given, at construction, what it uses (the master link, the data
plane, the segment cache, the other parts it calls). None holds a reference back to the Client.
  MasterLink (master_link.py)      the control channel: calls, quiet one-way clean-ups, `closed`
  Registrations (memory.py)        registered memory; StagingBuffer, the bounce buffer
  Transfers (rounds.py)            rounds of one-sided transfers, one job per segment
  Ahead (ahead.py)                 the allocation held ahead of the next plain put
  Landings (landing.py)            PutEnd sent before the write, PutLanded after it
  Puts (puts.py), Reads (reads.py) put_from and get_into
  MasterValues (master_values.py)  values the master keeps, its answers to GetValue, its inline limit
  EarlyReads (known_places.py)     a plain get's read beside its GetValue; KnownPlaces, TagGuesses
  PlainValues (plain_values.py)    put / get / get_array / get_tensor

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
- Checksums (checksum.py): the writer sends one per object with PutEnd (a put of one object, or
  of a batch of at most 1 MiB, computes them while its PutStart travels: the channel's
  `meanwhile`); a reader verifies every hit against the one its lookup returned before counting
  it, and a mismatch ends the hits there (a miss, a metric and a log line). `checksums=False`
  neither sends nor verifies.
- Get: the lease clock starts BEFORE the lookup is sent (t0), so the client's deadline t0 + ttl
  is never later than the master's. A read finishing after it counts as failed: its bytes are never
  reported. A failed read falls back to the object's next replica (same-host replicas first).
- Leases are released as soon as the reads end, read or failed (ReleaseLeases with the lookup's
  lease id, sent without waiting for the answer; over the lane lazily, riding with the next
  request or sent within 200 ms), so removed or evicted space is freed within that rather than at
  the lease TTL. A lost release costs nothing but that wait: the master still ends the lease at
  its TTL.
- Segment descriptions are cached by id (segments.py): unknown ids are fetched with GetSegments,
  ids the master no longer knows are forgotten by the data plane. A reply from a new master
  incarnation empties the cache (and the data plane's routes) before it is used, and drops the
  known places and the allocation held ahead.
- Plain values (`put`, `get`): small ones in one round trip to the master (master_values.py); a
  larger one into the allocation the previous plain put of its size asked for with its PutEnd
  (ahead.py): its write and one round trip. A plain get of a value this client put or read
  lately reads it where it was while GetValue travels (known_places.py), and keeps those bytes
  only when the master's answer still places the value there and they match its checksum. A get
  of a value it never saw reads, meanwhile, what a node holds under the value's tag (where its
  writer last wrote it, transfer/tcp_path_tags.py), under the same rule.
- Thread-safe: the channel and caches have locks, the staging buffer has its own; no lock is held
  across a transfer except the staging buffer's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvpool.client.ahead import Ahead
from kvpool.client.checks import check_keys
from kvpool.client.known_places import EarlyReads, KnownPlaces
from kvpool.client.landing import Landings
from kvpool.client.master_link import MasterLink
from kvpool.client.master_values import MasterValues
from kvpool.client.memory import Registrations, StagingBuffer
from kvpool.client.metrics import TenantMetrics, client_metrics
from kvpool.client.plain_values import PlainValues
from kvpool.client.puts import Puts
from kvpool.client.reads import Reads
from kvpool.client.rounds import Transfers
from kvpool.client.segments import SegmentCache
from kvpool.client.statuses import PUT_FAILED  # noqa: F401 - kvpool.client.PUT_FAILED
from kvpool.core import protocol
from kvpool.core.types import MAX_TENANT_LENGTH
from kvpool.rpc.tcp_channel import LaneChannel
from kvpool.rpc.zmq_channel import MasterChannel, parse_addresses

log = logging.getLogger(__name__)

_PATHS = ("auto", "nixl", "shm", "lane")
_PROMOTION_POLL_S = 0.02  # how often a lookup asks again while its keys are promoted from disk


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
    read_by_tag: bool = True  # a plain get of a value never seen reads its node's tag meanwhile (transfer/tcp_path_tags.py)

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


class Client:
    """The pool's client: holds its parts (see the module rules and docs/design/client.md) and
    hands each call to the part that serves it."""

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
        read_by_tag: bool = True,
    ) -> None:
        self.config = config = ClientConfig(master_address, tenant, timeout_s, path, num_replicas, staging_bytes,
                                            checksums, credential, lane, read_only, landing, known_places,
                                            read_by_tag)
        from kvpool.transfer import DataPlane, host_id  # lazy: NIXL loads only when a client is made
        from kvpool.rpc.credentials import resolve_credential

        self._owns_plane = plane is None
        self.plane = DataPlane(path=path, read_only=read_only) if plane is None else plane
        resolved = resolve_credential(credential)
        self._channel = MasterChannel(master_address, timeout_s=timeout_s, credential=resolved,
                                      fallback_role="tenant:default")
        if lane and resolved is None:  # the lane has no CURVE: an authenticated master offers none anyway
            self._channel = LaneChannel(self._channel)
        self._link = link = MasterLink(self._channel, config.tenant)
        self._memory = memory = Registrations(self.plane)
        self._segments = SegmentCache(link.call, self.plane, host_id())
        self._channel.add_epoch_listener(self._segments.on_new_epoch)
        self._metrics = metrics = TenantMetrics(client_metrics(), config.tenant)
        self._staging = StagingBuffer(memory.register_region, staging_bytes)
        self._places = KnownPlaces()  # where plain values were put or read lately (known_places.py)
        self._transfers = Transfers(self.plane, self._segments, memory.device, timeout_s, metrics)
        self._ahead = Ahead(link, num_replicas)  # the allocation held for the next plain put (ahead.py)
        self._landings = Landings(link, self._transfers, self._ahead, metrics, landing)
        self._puts = Puts(config, link, memory, self._transfers, self._staging, self._landings, self._ahead, metrics)
        self._reads = Reads(config, link, memory, self._transfers, self._segments, metrics)
        self._values = MasterValues(config, link, self._reads, metrics)
        self._early = EarlyReads(config, link, self.plane, self._segments, self._transfers, self._values,
                                 self._places, metrics)
        self._plain = PlainValues(config, link, memory, self._staging, self._transfers, self._puts, self._reads,
                                  self._landings, self._ahead, self._values, self._early, self._places, metrics)
        self._channel.add_epoch_listener(self._on_new_epoch)

    # ---- memory -----------------------------------------------------------------------------

    def register(self, memory) -> None:
        """Register memory (CPU or CUDA tensor, numpy array, bytearray, (addr, size_bytes), or
        (addr, size_bytes, cuda_device)) as a source or destination of put_from/get_into. The
        object is kept alive by the client. GPU memory is neither checksummed nor verified (the
        checksum is computed on the CPU): objects written from it carry none."""
        self._memory.register(memory)

    # ---- batches ----------------------------------------------------------------------------

    def put_from(
        self,
        keys: list[str],
        addrs: list,
        sizes: list,
        parents: list[str | None] | None = None,
        *,
        pinned: bool = False,
        on_written=None,
        session: str = "",
        ttl_s: float = 0.0,
    ) -> list[int]:
        """Store objects given as scatter-gather regions. Returns PUT_ALLOCATED (stored now),
        PUT_EXISTS, PUT_NO_SPACE or PUT_FAILED (write failed, revoked) per key. `pinned` objects
        are never evicted (remove them explicitly). `on_written()` is called once the source
        memory is no longer needed (after the copy, before the master is told; also when the call
        fails early), so a caller can reuse it without waiting for the last round trip. `session`
        and `ttl_s` are hints for the pool's eviction (core/protocol/sessions.py)."""
        return self._puts.put_from(keys, addrs, sizes, parents, pinned=pinned, on_written=on_written,
                                   session=session, ttl_s=ttl_s)

    def get_into(self, keys: list[str], addrs: list, sizes: list, *, lookup_timeout_s: float | None = None) -> int:
        """Read the leading hits of `keys` into the given regions (object i = its regions
        concatenated). Returns how many leading keys were read completely within their lease.
        `lookup_timeout_s` bounds the master round trip alone (default: timeout_s), for callers
        that must not wait long on a slow master but may on a long copy (a vLLM step's load)."""
        return self._reads.get_into(keys, addrs, sizes, lookup_timeout_s=lookup_timeout_s)

    # ---- plain values -----------------------------------------------------------------------

    def put(self, key: str, value, parent: str | None = None, *, pinned: bool = False) -> bool:
        """Store bytes, a numpy array or a CPU tensor. True: stored; False: the key existed.
        Raises CapacityError when the pool cannot hold it, TransferError when the write failed."""
        return self._plain.put(key, value, parent, pinned=pinned)

    def get(self, key: str) -> bytes | None:
        """The value stored under `key`, or None on a miss (or when no replica could be read)."""
        return self._plain.get(key)

    def get_array(self, key: str, dtype="uint8", shape: tuple[int, ...] | None = None):
        """A fresh numpy array with the value's bytes viewed as `dtype` (and `shape`), or None."""
        return self._plain.get_array(key, dtype, shape)

    def get_tensor(self, key: str, dtype, shape: tuple[int, ...] | None = None):
        """A fresh CPU torch tensor with the value's bytes viewed as `dtype`, or None."""
        return self._plain.get_tensor(key, dtype, shape)

    # ---- control-plane only -----------------------------------------------------------------

    def lookup_prefix(self, keys: list[str], *, namespace: str | None = None, promotion_wait_s: float = 0.0,
                      ttl_s: float = 0.0) -> int:
        """How many leading keys are complete in the pool (one round trip, nothing leased), in this
        client's namespace or in `namespace` (a connector's scheduler asks for each TP rank's).
        A lookup that reaches keys on a node's disk starts their promotion to DRAM and counts them
        as misses; with `promotion_wait_s` > 0 it asks again (every 20 ms) while the master says
        keys are being promoted, for at most that long, so a disk hit can count as a hit now.
        `ttl_s` > 0: keep the hits at least that long (a hint, within the tenant's share)."""
        check_keys(keys, unique=False)
        if not keys:
            return 0
        started = time.perf_counter()
        tenant = self.config.tenant if namespace is None else namespace
        request = protocol.LookupPrefix(tenant, list(keys), lease=False, ttl_s=ttl_s)
        reply = self._link.call(request, protocol.LookupReply)
        give_up = started + promotion_wait_s
        while reply.num_promoting and reply.num_hit < len(keys) and time.perf_counter() + _PROMOTION_POLL_S < give_up:
            time.sleep(_PROMOTION_POLL_S)
            reply = self._link.call(request, protocol.LookupReply)
        self._metrics.latency_s["lookup"].observe(time.perf_counter() - started)
        return reply.num_hit

    def exists(self, keys: list[str], *, namespace: str | None = None) -> list[bool]:
        """Complete or not, per key, in one round trip (nothing leased, recency untouched), in this
        client's namespace or in `namespace`."""
        check_keys(keys, unique=False)
        if not keys:
            return []
        tenant = self.config.tenant if namespace is None else namespace
        return list(self._link.call(protocol.Exists(tenant, list(keys)), protocol.ExistsReply).exists)

    def remove(self, keys: list[str]) -> int:
        check_keys(keys, unique=False)
        if not keys:
            return 0
        self._places.forget(keys)
        return self._link.call(protocol.Remove(self.config.tenant, list(keys)), protocol.OkReply).count

    def ping(self) -> None:
        """One round trip to the master that changes nothing there (connects the lane where the
        master offers one). Raises UnavailableError when the master does not answer in time."""
        self._link.call(protocol.LaneQuery(), protocol.LaneOffer)

    def send_session_events(self, events: list[protocol.SessionEvent], *, namespace: str | None = None) -> None:
        """Tell the master about agent sessions (turns arrived, done, sessions ended), one way:
        hints for its eviction (core/protocol/sessions.py); a lost message only loses the hint."""
        if events:
            tenant = self.config.tenant if namespace is None else namespace
            self._link.send_quietly(protocol.SessionEvents(tenant, list(events)))

    def stats(self) -> protocol.StatsReply:
        return self._link.call(protocol.Stats(), protocol.StatsReply)

    @property
    def epoch(self) -> int | None:
        """The master incarnation that answered last (None before the first answer)."""
        return self._link.epoch

    # ---- where objects lie (tools and tests that inspect replicas) -----------------------------

    def _lookup_leased(self, keys: list[str], timeout_s: float | None = None):
        """(t0, the leased lookup's reply, per hit its replicas); release it with `_release`."""
        return self._reads.lookup_leased(keys, timeout_s)

    def _release(self, lease_id: int) -> None:
        self._link.release(lease_id)

    # ---- life -------------------------------------------------------------------------------

    def _on_new_epoch(self, old_epoch: int | None, new_epoch: int) -> None:
        self._places.clear()  # (a place noted under another epoch is never used anyway)
        self._ahead.drop()  # the old master's allocation: the new one does not know it
        self._values.on_new_epoch(old_epoch)

    def close(self) -> None:
        if self._link.closed:
            return
        self._ahead.give_back_held(lazy=False)
        self._link.close()
        if self._owns_plane:
            self.plane.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
