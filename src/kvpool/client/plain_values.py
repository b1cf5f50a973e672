"""Plain values: `put` and `get` of bytes, numpy arrays and CPU tensors (the Client's, as a mixin).

Rules:
- A value up to the master's inline limit put without a parent is sent inside one PutValue and
  kept by the master (master/inline.py); `get` asks with one GetValue, answered with the bytes, or
  with a leased lookup when a node holds the value (then read as get_into reads). So a small value
  costs one round trip each way. Every reply names the master's limit (0: inline values off),
  which the client follows from then on; a value over it goes to a node, and so does one the
  master has no room for (pinned values fill it). A master that cannot decode PutValue / GetValue
  (older) is asked no more until a new master incarnation answers.
- A larger value moves without the staging buffer where its replicas' routes carry memory the
  data plane never registered (shared memory, the segment lane: DataPlane.carries_unregistered):
  `put` writes straight from the caller's value, `get` / `get_array` read straight into the
  object they return, its pages faulted in while the node sends (fresh_memory.prefault as the
  plane's `before_landing`). Over NIXL both go through the registered staging buffer as before.
  A 1 MiB plain get across hosts 1.01 -> 0.61 ms, a put 1.10 -> 0.87 ms (fixes.md 26).
- A larger value put without a parent, unpinned, from host memory and with checksums on is
  written into the allocation held ahead (ahead.py), when there is one for its size, and ended
  under its key with one PutEnd that asks for the next: its write and one round trip instead of
  three. Otherwise it goes the usual way (PutStart, write, PutEnd), its PutEnd asking for an
  allocation ahead unless its route needs the staging buffer (nothing gained then). Either way its
  PutEnd travels while its bytes are written, where the lane allows (landing.py); a put into the
  slot held ahead then hashes its value only once the write's bytes are on their way (the data
  plane's `sent`) and sends the checksum with PutLanded (fixes.md 32).
- The mixin uses the Client's channel, staging buffer, metrics and leased reads (client.py); it
  holds `_max_inline`, the master's limit as its last reply said (-1: a master without them), and
  `_ahead` (ahead.AheadSlots).
"""

from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import dataclass

import msgspec

from kvpool.client import fresh_memory
from kvpool.client.ahead import AheadSlot
from kvpool.client.checksum import NO_CHECKSUM, checksum_regions
from kvpool.client.known_places import EarlyRead, MakeOutput
from kvpool.client.memory import copy_bytes, region_of
from kvpool.client.statuses import PUT_FAILED, PUT_STATUS_NAMES
from kvpool.core import protocol
from kvpool.core.errors import CapacityError, KVPoolError, ProtocolError, TransferError, UsageError
from kvpool.core.protocol import PUT_ALLOCATED, PUT_EXISTS, PUT_NO_SPACE
from kvpool.transfer.tcp_path_tags import tag_of

log = logging.getLogger(__name__)


class PlainValues:
    _max_inline: int

    def put(self, key: str, value, parent: str | None = None, *, pinned: bool = False) -> bool:
        """Store bytes, a numpy array or a CPU tensor. True: stored; False: the key existed.
        Raises CapacityError when the pool cannot hold it, TransferError when the write failed."""
        region = None if type(value) is bytes else region_of(value, writable=False)  # bytes need no address
        size = len(value) if region is None else region.size_bytes
        if size <= 0:
            raise UsageError(f"cannot put an empty value under {key!r}")
        if parent is None and size <= self._max_inline and (region is None or region.device is None):
            stored = self._put_inline(key, value if region is None else ctypes.string_at(region.addr, size), pinned)
            if stored is not None:
                return stored
        if region is None:
            region = region_of(value, writable=False)
        registered = self._registered.contains(region.addr, region.size_bytes)
        ahead = parent is None and not pinned and self.config.checksums and region.device is None
        if ahead:
            stored = self._put_ahead(key, region.addr, size, unregistered=not registered)
            if stored is not None:
                return stored
        else:
            self._give_back(self._ahead.drop())  # a chained or pinned put: the next is likely one too
        if registered:
            statuses, message = self._put_from([key], [[region.addr]], [[region.size_bytes]], [parent], pinned,
                                               ahead=ahead)
        elif region.device is None:  # written straight from the value where its route allows, else staged
            statuses, message = self._put_from([key], [[region.addr]], [[region.size_bytes]], [parent], pinned,
                                               unregistered=True, ahead=ahead)
        else:
            with self._staging.lock:
                self._staging.ensure(region.size_bytes)
                copy_bytes(self._staging.addr, region.addr, region.size_bytes)
                statuses, message = self._put_from(
                    [key], [[self._staging.addr]], [[region.size_bytes]], [parent], pinned
                )
        status = statuses[0]
        if status == PUT_NO_SPACE:
            raise CapacityError(message or f"no space for {key!r} ({region.size_bytes} bytes)")
        if status == PUT_FAILED:
            raise TransferError(f"writing {key!r} failed (a node died?); the put was revoked, retry it")
        return status == PUT_ALLOCATED

    def _put_ahead(self, key: str, addr: int, size: int, *, unregistered: bool) -> bool | None:
        """Put one host-memory value into the allocation held ahead (ahead.py): its write, then one
        PutEnd that ends it under `key` and asks for the next. True / False as `put`; None: not
        done (no usable slot, its route needs the staging buffer, its write failed, or the master
        had reclaimed it), and the caller puts the usual way."""
        slot, stale = self._ahead.take(size, self._channel.epoch, time.monotonic())
        self._give_back(stale)
        if slot is None:
            return None
        self._check_keys([key], unique=False)  # (a read-only client never holds a slot: it never put)
        started = time.perf_counter()
        choices = [(0, replica) for replica in slot.replicas]
        if unregistered and not self._carried_unregistered("WRITE", choices, [size]):
            self._give_back(slot)
            return None
        tenant = self.config.tenant
        names, tokens = [slot.key, key], [slot.token, slot.token]  # pending under either once its end is sent
        ending = None
        hashed: list[int] = []  # landing: the checksum, taken while the bytes travel, goes with PutLanded

        def sent() -> None:  # the data plane's hook must not raise: the write's answer is still unread
            try:
                hashed.append(checksum_regions([addr], [size]))
            except Exception:  # noqa: BLE001 - hashed again after the write
                pass

        def value_checksum() -> int:
            return hashed[0] if hashed else checksum_regions([addr], [size])

        try:
            # landing: the end goes before the write, without the checksum (landing.py)
            later = self._may_land(slot.lands, choices)
            checksum = NO_CHECKSUM if later else checksum_regions([addr], [size])
            end = protocol.PutEnd(tenant, [slot.key], [slot.token], [checksum], as_keys=[key])
            ending = self._send_ending(end, size) if later else None
            failed, in_flight = self._run_round("WRITE", choices, [[addr]], [[size]],
                                                max(1e-3, slot.deadline_s - time.monotonic()), unregistered=unregistered,
                                                sent=sent if ending is not None else None, tags=[tag_of(tenant, key)])
        except BaseException:
            if ending is not None:
                self._abandon_ending(ending, names, tokens)
            else:
                self._revoke_quietly([slot.key], [slot.token])
            raise
        reply = self._finish_ending(ending, names, tokens) if ending is not None else None
        if failed or time.monotonic() > slot.deadline_s:
            gone = names if ending is not None else [slot.key]
            flight = list(range(len(gone))) if in_flight else []
            self._call(protocol.PutRevoke(tenant, gone, [slot.token] * len(gone), flight), protocol.OkReply)
            if in_flight:
                self._end_quarantine_later(in_flight, [slot.token])
            return None
        if reply is None:
            if checksum == NO_CHECKSUM:  # landing was meant, but there was no lane to send the end on
                end = msgspec.structs.replace(end, checksums=[value_checksum()])
            reply = self._end_asking_ahead(end, size)
        if reply.refused:
            log.info("kvpool: the master no longer held the allocation put ahead for %r (reclaimed, or a new "
                     "master); putting it again", key)
            return None
        stored = not reply.existed
        if reply.existed:
            self._give_back(slot)  # written for nothing: the key was there
        elif ending is not None and not self._land([key], [slot.token], [value_checksum()]):
            raise TransferError(f"{key!r} was written but could not be made readable (PutLanded not sent); retry it")
        else:
            self._metrics.put_bytes.inc(size * len(slot.replicas))
            self._places.note(key, slot.replicas, slot.epoch)
        self._metrics.puts_ahead.inc()
        self._metrics.put_keys[PUT_STATUS_NAMES[PUT_ALLOCATED if stored else PUT_EXISTS]].inc()
        self._metrics.latency_s["put"].observe(time.perf_counter() - started)
        return stored

    def _end_asking_ahead(self, end: protocol.PutEnd, size: int) -> protocol.PutEndReply:
        """Send a plain put's PutEnd asking for an allocation of `size` bytes for the next one."""
        end, grant = self._asking_ahead(end, size)
        reply = self._call(end, protocol.PutEndReply)
        grant(reply)
        return reply

    def _asking_ahead(self, end: protocol.PutEnd, size: int):
        """(`end` asking for an allocation of `size` bytes for the next plain put, a function that
        keeps what its reply grants)."""
        next_key, sent_s, epoch = self._ahead.new_key(), time.monotonic(), self._channel.epoch

        def grant(reply: protocol.PutEndReply) -> None:
            self._give_back(self._ahead.grant(next_key, size, reply.ahead, sent_s, epoch, self._channel.epoch))

        return msgspec.structs.replace(end, ahead=[next_key], ahead_sizes=[size],
                                       ahead_replicas=self.config.num_replicas), grant

    def _give_back(self, slot: "AheadSlot | None", lazy: bool = True) -> None:
        """Free an allocation held ahead that will not be used, waiting for no reply (the master
        reclaims it after its ahead timeout if this is lost)."""
        if slot is not None:
            try:
                self._channel.send(protocol.PutRevoke(self.config.tenant, [slot.key], [slot.token]), lazy=lazy)
            except KVPoolError:
                pass

    def _put_inline(self, key: str, data: bytes, pinned: bool) -> bool | None:
        """Put a small value inside one PutValue; None: the master keeps no value this large."""
        self._check_keys([key], unique=False)
        if self.config.read_only:
            raise UsageError("this client is read-only (read_only=True): it cannot put")
        started = time.perf_counter()
        try:
            reply = self._call(protocol.PutValue(self.config.tenant, key, data, bool(pinned)), protocol.PutValueReply)
        except ProtocolError:
            self._master_without_values()
            return None
        self._max_inline = reply.max_inline_bytes
        if reply.status in (protocol.PUT_TOO_LARGE, PUT_NO_SPACE):
            return None  # a node takes it (pinned values or the tenant's inline share fill the master's room)
        self._metrics.put_keys[PUT_STATUS_NAMES.get(reply.status, str(reply.status))].inc()
        if reply.status == PUT_ALLOCATED:
            self._metrics.put_bytes.inc(len(data))
        self._metrics.latency_s["put"].observe(time.perf_counter() - started)
        return reply.status == PUT_ALLOCATED

    def _on_new_epoch(self, old_epoch: int | None, new_epoch: int) -> None:
        self._places.clear()  # (a place noted under another epoch is never used anyway)
        self._ahead.drop()  # the old master's allocation: the new one does not know it
        if old_epoch is not None and self._max_inline < 0:
            self._max_inline = protocol.DEFAULT_MAX_INLINE_BYTES  # a new master: ask it again

    def _master_without_values(self) -> None:
        """The master could not take PutValue / GetValue (it predates them): plain values go
        through nodes from now on (until a reply from a new master incarnation says otherwise)."""
        if self._max_inline >= 0:
            log.info("kvpool: master %s keeps no small values itself (an older master?): plain values go "
                     "through nodes", self.config.master_address)
        self._max_inline = -1

    def get(self, key: str) -> bytes | None:
        """The value stored under `key`, or None on a miss (or when no replica could be read)."""
        found = self._find_value(key, fresh_memory.new_bytes if fresh_memory.available() else None)
        if found is None or isinstance(found, bytes):
            return found
        if isinstance(found, EarlyRead):
            return found.value
        if fresh_memory.available() and self._reads_unregistered(found):
            out, addr = fresh_memory.new_bytes(found.size)
            return out if self._read_fresh(found, addr) else None
        with self._staging.lock:
            view = self._read_staged(found)
            return None if view is None else _bytes_of(view)

    def get_array(self, key: str, dtype="uint8", shape: tuple[int, ...] | None = None):
        """A fresh numpy array with the value's bytes viewed as `dtype` (and `shape`), or None."""
        import numpy as np

        found = self._find_value(key, _new_array)
        if found is None:
            return None
        if isinstance(found, bytes):
            array = np.frombuffer(found, dtype=np.uint8).copy()
        elif isinstance(found, EarlyRead):
            array = found.value
        elif self._reads_unregistered(found):
            array, addr = _new_array(found.size)
            if not self._read_fresh(found, addr):
                return None
        else:
            with self._staging.lock:
                view = self._read_staged(found)
                if view is None:
                    return None
                array = np.empty(view.nbytes, dtype=np.uint8)
                fresh_memory.prefault(int(array.ctypes.data), array.nbytes)
                copy_bytes(int(array.ctypes.data), int(view.ctypes.data), view.nbytes)
        array = array.view(dtype)
        return array if shape is None else array.reshape(shape)

    def get_tensor(self, key: str, dtype, shape: tuple[int, ...] | None = None):
        """A fresh CPU torch tensor with the value's bytes viewed as `dtype`, or None."""
        import torch

        array = self.get_array(key)
        if array is None:
            return None
        tensor = torch.from_numpy(array).view(dtype)
        return tensor if shape is None else tensor.reshape(shape)

    def _find_value(self, key: str, make: MakeOutput | None = None) -> "bytes | _Found | EarlyRead | None":
        """GetValue: the value's bytes (held by the master), or where it is on nodes (leased: read
        it with _read_found, which releases the lease), or None on a miss. With `make` (size ->
        (a new output, its address)) and a place this client knows for the key, the value is read
        there while GetValue travels (known_places.py): EarlyRead when those bytes were it; for a
        key it knows no place of, what a node holds under the key's tag (lane_tags.py), alike."""
        self._check_keys([key], unique=False)
        started = time.perf_counter()
        if make is not None and self.config.checksums and self._max_inline >= 0:
            place = self._places.get(key, self._channel.epoch) if self.config.known_places else None
            if place is not None and place.size > self._max_inline:
                found = self._read_early(key, place, make, started)
                if found is not NotImplemented:
                    return found
            elif place is None and self.config.read_by_tag:
                found = self._read_by_tag(key, make, started)
                if found is not NotImplemented:
                    return found
        t0 = time.monotonic()  # before sending: our lease deadline is never later than the master's
        answer = None
        if self._max_inline >= 0:
            try:
                answer = self._call(protocol.GetValue(self.config.tenant, key), protocol.ValueReply)
            except ProtocolError:
                self._master_without_values()
        if answer is None:  # a master from before inline values: the leased lookup as it knows it
            answer = protocol.ValueReply(False, b"", self._call(
                protocol.LookupPrefix(self.config.tenant, [key], lease=True), protocol.LookupReply),
                max_inline_bytes=self._max_inline)
        return self._value_answered(key, answer, t0, started)

    def _value_answered(self, key: str, answer: protocol.ValueReply, t0: float,
                        started: float) -> "bytes | _Found | None":
        """What GetValue's answer holds: the inline bytes, a _Found to read (leased), or None (a miss)."""
        self._max_inline = answer.max_inline_bytes
        if answer.inline:
            self._count_hit(len(answer.value), started)
            return answer.value
        reply = answer.lookup
        if reply is None:
            raise ProtocolError("the master answered GetValue with neither a value nor a lookup")
        replicas = self._leased_replicas(reply)
        if not replicas:
            self._release(reply.lease_id)
            self._metrics.get_keys.inc()
            self._metrics.latency_s["get"].observe(time.perf_counter() - started)
            return None
        return _Found(key, reply, replicas, t0, started)

    def _count_hit(self, size: int, started: float) -> None:
        """Metrics of a plain get that returned a value without a leased read (inline, or read early)."""
        self._metrics.get_keys.inc()
        self._metrics.hit_keys.inc()
        self._metrics.get_bytes.inc(size)
        self._metrics.latency_s["get"].observe(time.perf_counter() - started)

    def _reads_unregistered(self, found: "_Found") -> bool:
        """Whether every replica of a found value is read by a route that takes unregistered memory
        (the lane, shared memory); on an error the lease is released and the error raised."""
        try:
            return self._carried_unregistered("READ", [(0, r) for r in found.replicas[0]], [found.size])
        except BaseException:
            self._release(found.reply.lease_id)
            raise

    def _read_fresh(self, found: "_Found", addr: int) -> bool:
        """Read a found value straight into fresh memory the caller returns (not registered), its
        pages faulted in while the node sends (fresh_memory.py): no staging buffer, no copy after."""
        return self._read_found(found, addr, unregistered=True, before_landing=fresh_memory.prefault)

    def _read_staged(self, found: "_Found"):
        """Read a found value into the staging buffer (the caller holds its lock): a view of it, or None."""
        self._staging.ensure(found.size)
        return self._staging.array[: found.size] if self._read_found(found, self._staging.addr) else None

    def _read_found(self, found: "_Found", addr: int, **how) -> bool:
        """Read a found value into [addr, addr + size) and release its lease; True if it was read
        (and matched its checksum). `how`: _read_leased's options."""
        try:
            count = self._read_leased([found.key], found.replicas, found.reply, found.t0, [[addr]], [[found.size]],
                                      **how)
        finally:
            self._release(found.reply.lease_id)
        self._metrics.latency_s["get"].observe(time.perf_counter() - found.started)
        if count == 1:
            self._places.note(found.key, found.replicas[0], self._channel.epoch)
        return count == 1


@dataclass(frozen=True)
class _Found:
    """A value GetValue found on nodes: its leased lookup, to be read once."""

    key: str
    reply: protocol.LookupReply
    replicas: list
    t0: float  # monotonic, before GetValue was sent (the lease clock)
    started: float  # perf_counter, for the get's latency

    @property
    def size(self) -> int:
        return self.replicas[0][0].size


def _new_array(size: int):
    """An uninitialised uint8 numpy array of `size` bytes and its address (get_array's output)."""
    import numpy as np

    array = np.empty(size, dtype=np.uint8)
    return array, int(array.ctypes.data)


def _bytes_of(view) -> bytes:
    """A new bytes object with the staged value's bytes: its pages faulted in one call, then one
    copy (fresh_memory.py; `tobytes()` faulted them one by one)."""
    size = view.nbytes
    if not fresh_memory.available() or size < fresh_memory.PREFAULT_FROM_BYTES:
        return view.tobytes()
    out, addr = fresh_memory.new_bytes(size)
    fresh_memory.prefault(addr, size)
    copy_bytes(addr, int(view.ctypes.data), size)
    return out
