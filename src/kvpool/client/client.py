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
  object, or of a batch of at most 1 MiB, computes them while its PutStart travels: the
  channel's `meanwhile`); a reader verifies
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
  only when the master's answer still places the value there and they match its checksum. A get
  of a value it never saw reads, meanwhile, what a node holds under the value's tag (where its
  writer last wrote it, lane_tags.py), under the same rule.
- Thread-safe: the channel and caches have locks, the staging buffer has its own; no lock is held
  across a transfer except the staging buffer's.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from kvpool.client import plan
from kvpool.client.ahead import AheadSlots
from kvpool.client.known_places import EarlyReads, KnownPlaces, TagGuesses
from kvpool.client.landing import Landings
from kvpool.client.memory import RegisteredRanges, StagingBuffer, region_of
from kvpool.client.metrics import TenantMetrics, client_metrics
from kvpool.client.plain_values import PlainValues
from kvpool.client.puts import Puts
from kvpool.client.reads import Reads
from kvpool.client.rounds import Rounds
from kvpool.client.segments import SegmentCache
from kvpool.client.statuses import PUT_FAILED  # noqa: F401 - kvpool.client.PUT_FAILED
from kvpool.core import protocol
from kvpool.core.errors import ProtocolError, UsageError
from kvpool.core.types import MAX_KEY_LENGTH, MAX_TENANT_LENGTH
from kvpool.rpc.zmq_channel import MasterChannel, parse_addresses
from kvpool.rpc.tcp_channel import LaneChannel

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
    read_by_tag: bool = True  # a plain get of a value it never saw reads its node's tag meanwhile (lane_tags.py)

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


class Client(PlainValues, Landings, EarlyReads, Puts, Reads, Rounds):
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
        self.config = ClientConfig(master_address, tenant, timeout_s, path, num_replicas, staging_bytes, checksums,
                                   credential, lane, read_only, landing, known_places, read_by_tag)
        from kvpool.transfer import DataPlane, host_id  # lazy: NIXL loads only when a client is made
        from kvpool.rpc.credentials import resolve_credential

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
        self._tag_guesses = TagGuesses()  # whether a cold plain get reads by tag (known_places.py)
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

    def exists(self, keys: list[str], *, namespace: str | None = None) -> list[bool]:
        """Complete or not, per key, in one round trip (nothing leased, recency untouched), in this
        client's namespace or in `namespace`."""
        self._check_keys(keys, unique=False)
        if not keys:
            return []
        tenant = self.config.tenant if namespace is None else namespace
        return list(self._call(protocol.Exists(tenant, list(keys)), protocol.ExistsReply).exists)

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

