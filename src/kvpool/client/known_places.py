"""Where this client last saw its plain values: a `get` reads there while its GetValue travels.

Why: a plain get of a value on a node is otherwise two exchanges one after the other, GetValue
to the master, then the read from the node; Redis answers a GET in one. Values a client wrote or
read lately are often read again by it (a connector reading back what its instance stored, a
retry), and it knows where they were put. Such a get sends its
GetValue and, without waiting for the answer, reads the value from where it was; the master's
answer, taken after the read, says whether those bytes are the value. A get of a value the
client never saw (another instance wrote it) does the same with what the nodes hold under the
key's tag, where its writer last wrote it (transfer/tcp_path_tags.py). Measurements:
docs/design/client.md.

Rules:
- The bytes are taken only when the master's leased answer lists the place read among the
  value's replicas now, with the same size, and the bytes read match the checksum it recorded
  for the value: whatever happened to that range meanwhile (evicted, written by another put, a
  new master), bytes that match the checksum of the value the master holds under the key now
  are that value. Otherwise the value is read again as any get reads it, under the lease the same
  answer brought (metric `kvpool_client_early_reads{outcome}`: `used`, `read_again`). So only a
  client that checksums (`checksums=True`, the default) reads early, and only a read whose route
  takes memory the data plane never registered (the segment lane, shared memory: the value is
  read straight into the object returned). The answer is taken with the channel's begin / finish
  (the lane's, or the ZMQ channel's for a client with a CURVE credential).
- Places are noted after a plain put into an allocation held ahead (ahead.py) and after a plain
  get read from a node, forgotten on `remove` and on a miss; a place noted under another master
  incarnation is never used. At most MAX_PLACES keys, the least recently used forgotten first.
- Tag reads, under the same rule (metric `kvpool_client_tag_reads{outcome}`: also `unknown`, no
  node asked knew the tag, and `failed`): a get with no known place asks the segments this
  client knows on other hosts (all of them with path "lane"), at most MAX_TAG_ASKS, at once over
  their lanes; it learns segments from the replies that name them. Only while at least one of
  the last 16 tag reads found a node that knew the tag, else once in 16 gets (TagGuesses): values
  the master holds (up to its inline limit, 64 KiB by default) or written without a tag would pay
  the nodes' round trips for nothing. Writes tag a put of one object on its lane (a plain put,
  a put_from of one key); values written by NIXL (large jobs where RDMA is present) carry no tag
  and are read the usual way.
- `KnownPlaces` and `TagGuesses` are bookkeeping, no I/O (TagGuesses without a lock: a lost
  update between threads only shifts a guess). `EarlyReads` does the read and the round trip;
  it owns its TagGuesses and is given the master link, the data plane, the segment cache, the
  transfers, MasterValues (which reads GetValue's answer) and the client's KnownPlaces.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from kvpool.client import fresh_memory, plan
from kvpool.client.checksum import checksum_regions
from kvpool.client.rounds import fence
from kvpool.core import protocol
from kvpool.core.errors import KVPoolError, ProtocolError, TransferError, UnavailableError
from kvpool.core.protocol import Replica
from kvpool.transfer.tcp_path_tags import tag_of

MAX_PLACES = 4096
MAX_TAG_ASKS = 4  # nodes a get of a value its client never saw asks for the value's tag at once


@dataclass(frozen=True)
class Place:
    replicas: tuple[Replica, ...]
    epoch: int  # the master incarnation that placed it

    @property
    def size(self) -> int:
        return self.replicas[0].size


class KnownPlaces:
    def __init__(self, max_places: int = MAX_PLACES) -> None:
        self._max = max_places
        self._lock = threading.Lock()
        self._places: OrderedDict[str, Place] = OrderedDict()

    def note(self, key: str, replicas, epoch: int | None) -> None:
        if epoch is None or not replicas:
            return
        place = Place(tuple(replicas), epoch)
        with self._lock:
            self._places[key] = place
            self._places.move_to_end(key)
            while len(self._places) > self._max:
                self._places.popitem(last=False)

    def get(self, key: str, epoch: int | None) -> Place | None:
        """Where `key` was seen under master incarnation `epoch`, or None."""
        with self._lock:
            place = self._places.get(key)
            if place is None:
                return None
            if place.epoch != epoch:
                del self._places[key]
                return None
            self._places.move_to_end(key)
            return place

    def forget(self, keys) -> None:
        with self._lock:
            for key in keys:
                self._places.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._places.clear()

    def __len__(self) -> int:
        return len(self._places)


@dataclass(frozen=True)
class EarlyRead:
    """A value a get read where it was known to be, and the master's answer vouched for."""

    value: object


MakeOutput = Callable[[int], tuple[object, int]]  # size -> (the object returned, its buffer's address)


class TagGuesses:
    """Whether a get of a value this client never saw should read by tag meanwhile: while at least
    one of the last WINDOW tag reads found a node that knew the tag, and otherwise once every
    WINDOW gets, to notice when that changes. Values the master holds (small ones) and values
    written without a tag (by NIXL) gain nothing from the asks and would pay their round trips."""

    WINDOW = 16

    def __init__(self) -> None:
        self._recent: deque[bool] = deque(maxlen=self.WINDOW)
        self._skipped = 0

    def should_try(self) -> bool:
        if len(self._recent) < self.WINDOW or any(self._recent):
            return True
        self._skipped += 1
        if self._skipped >= self.WINDOW:
            self._skipped = 0
            return True
        return False

    def record(self, on_node: bool) -> None:
        self._recent.append(on_node)


# what a read beside GetValue did: (the replica read, or None if the read failed; the output; its
# address; its size), or None when nothing was read
_Beside = tuple  # (Replica | None, object, int, int)


class EarlyReads:
    def __init__(self, config, link, plane, segments, transfers, values, places: KnownPlaces, metrics) -> None:
        self._config = config  # client.ClientConfig
        self._link = link  # master_link.MasterLink
        self._plane = plane
        self._segments = segments  # segments.SegmentCache
        self._transfers = transfers  # rounds.Transfers
        self._values = values  # master_values.MasterValues
        self._places = places
        self._metrics = metrics
        self._tag_guesses = TagGuesses()

    def read_early(self, key: str, place: Place, make: MakeOutput, started: float):
        """Send GetValue, read `place` into a new output while it travels, then take its answer:
        EarlyRead (the bytes were the value), the master's inline bytes, None (a miss) or the
        Found the usual get reads (the place was stale); NotImplemented when nothing was sent (a
        channel that takes no more requests, a route that needs registered memory) or no answer
        came back (the lane broke, a master that cannot read GetValue): the caller gets as usual."""
        local_ids = self._segments.local_ids()
        replica = plan.order_replicas(list(place.replicas), local_ids)[0]
        choices = [(0, replica)]
        try:
            if not self._transfers.carried_unregistered("READ", choices, [place.size]):
                return NotImplemented
        except KVPoolError:
            return NotImplemented

        def read() -> _Beside:
            out, addr = make(place.size)
            failed, in_flight = self._transfers.run_round("READ", choices, [[addr]], [[place.size]], unregistered=True,
                                                          before_landing=fresh_memory.prefault)
            if in_flight:
                fence(in_flight)
            return (None if failed else replica), out, addr, place.size

        return self._beside_get_value(key, read, started, self._metrics.early_reads)

    def read_by_tag(self, key: str, make: MakeOutput, started: float):
        """A get of a value this client has no place for: GetValue, and meanwhile what the nodes
        hold under the key's tag (transfer/tcp_path_tags.py), kept under read_early's rule. Asked: the
        segments this client knows on other hosts, at most MAX_TAG_ASKS of them (picked by the
        tag); a node that knows no such tag answers at once, and with none the get goes on as
        usual. NotImplemented when none is asked (no such segment known, or no node knew the tags
        of recent such gets: TagGuesses). A segment whose node failed to answer is asked about at
        the master after the get (a dead node's is forgotten once the master dropped it)."""
        segments = self._segments.lane_segments(include_local=self._config.path == "lane")
        if not segments or not self._tag_guesses.should_try():
            return NotImplemented
        tag = tag_of(self._config.tenant, key)
        if len(segments) > MAX_TAG_ASKS:
            first = int.from_bytes(tag[:8], "little") % len(segments)
            segments = (segments[first:] + segments[:first])[:MAX_TAG_ASKS]

        failed: list[int] = []

        def read() -> _Beside | None:
            try:
                got = self._plane.read_tagged(segments, tag, make, self._config.timeout_s, fresh_memory.prefault)
            except TransferError as e:
                failed.extend(getattr(e, "segment_ids", ()))
                self._metrics.tag_reads["failed"].inc()
                got = None
            else:
                if got is None:
                    self._metrics.tag_reads["unknown"].inc()
            self._tag_guesses.record(got is not None)
            if got is None:
                return None
            segment, offset, size, out, addr = got
            return Replica(segment.segment_id, offset, size), out, addr, size

        try:
            return self._beside_get_value(key, read, started, self._metrics.tag_reads)
        finally:
            if failed:
                try:
                    self._segments.recheck(failed)
                except KVPoolError:  # the master unreachable now: asked again after the next failure
                    pass

    def _beside_get_value(self, key: str, read, started: float, outcomes):
        """Send GetValue, call `read()` while it travels, take the answer and keep what was read
        when the answer vouches for it (the module rules); `outcomes`: the metric counting used /
        read_again. See read_early for what is returned."""
        t0 = time.monotonic()  # before sending: the lease's clock
        call = self._link.channel.begin(protocol.GetValue(self._config.tenant, key))
        if call is None:
            return NotImplemented
        try:
            early = read()
        except BaseException:
            self._link.channel.abandon(call)  # its lease, if granted, ends with its TTL
            raise
        try:
            answer = self._link.channel.finish(call)
        except UnavailableError:  # the lane broke: the usual get goes over ZMQ (a lease granted ends with its TTL)
            return NotImplemented
        except ProtocolError:  # a master from before GetValue (restarted older): asked as it knows
            self._values.master_without_values()
            return NotImplemented
        if not isinstance(answer, protocol.ValueReply):
            raise ProtocolError(f"master answered GetValue with {type(answer).__name__}")
        found = self._values.answered(key, answer, t0, started)
        if found is None or isinstance(found, bytes):
            self._places.forget([key])
            return found
        if early is None:
            return found  # nothing was read: the usual get reads it, under this answer's lease
        replica, out, addr, size = early
        expected = protocol.unpack_checksums(found.reply.checksums)[0] if found.reply.checksums else 0
        if (replica is not None and expected and found.size == size and replica in found.replicas[0]
                and checksum_regions([addr], [size]) == expected):
            self._link.release(found.reply.lease_id)
            outcomes["used"].inc()
            self._values.count_hit(size, started)
            self._places.note(key, found.replicas[0], self._link.epoch)
            return EarlyRead(out)
        outcomes["read_again"].inc()
        return found
