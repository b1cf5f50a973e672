"""Plain values: `put` and `get` of bytes, numpy arrays and CPU tensors.

Rules:
- A value up to the master's inline limit put without a parent is kept by the master
  (master_values.py): a small value costs one round trip each way. A value over the limit goes to
  a node, and so does one the master has no room for (pinned values fill it).
- A larger value moves without the staging buffer where its replicas' routes carry memory the
  data plane never registered (shared memory, the segment lane: DataPlane.carries_unregistered):
  `put` writes straight from the caller's value, `get` / `get_array` read straight into the
  object they return, its pages faulted in while the node sends (fresh_memory.prefault as the
  plane's `before_landing`). Over NIXL both go through the registered staging buffer.
- A larger value put without a parent, unpinned, from host memory and with checksums on is
  written into the allocation held ahead (ahead.py), when there is one for its size, and ended
  under its key with one PutEnd that asks for the next: its write and one round trip instead of
  three. Otherwise it goes the usual way (PutStart, write, PutEnd), its PutEnd asking for an
  allocation ahead unless its route needs the staging buffer (nothing gained then). Either way its
  PutEnd travels while its bytes are written, where the lane allows (landing.py); a put into the
  slot held ahead then hashes its value only once the write's bytes are on their way (the data
  plane's `sent`) and sends the checksum with PutLanded.
- `PlainValues` holds no state of its own: it composes the other parts (puts, reads, the
  allocation ahead, landings, the master's values, early reads, known places).
"""

from __future__ import annotations

import ctypes
import logging
import time

import msgspec

from kvpool.client import fresh_memory
from kvpool.client.checks import check_keys
from kvpool.client.checksum import NO_CHECKSUM, checksum_regions
from kvpool.client.known_places import EarlyRead, MakeOutput
from kvpool.client.master_values import Found
from kvpool.client.memory import copy_bytes, region_of
from kvpool.client.statuses import PUT_FAILED, PUT_STATUS_NAMES
from kvpool.core import protocol
from kvpool.core.errors import CapacityError, ProtocolError, TransferError, UsageError
from kvpool.core.protocol import PUT_ALLOCATED, PUT_EXISTS, PUT_NO_SPACE
from kvpool.transfer.tcp_path_tags import tag_of

log = logging.getLogger(__name__)


class PlainValues:
    def __init__(self, config, link, memory, staging, transfers, puts, reads, landings, ahead, values, early,
                 places, metrics) -> None:
        self._config = config  # client.ClientConfig
        self._link = link  # master_link.MasterLink
        self._memory = memory  # memory.Registrations
        self._staging = staging  # memory.StagingBuffer
        self._transfers = transfers  # rounds.Transfers
        self._puts = puts  # puts.Puts
        self._reads = reads  # reads.Reads
        self._landings = landings  # landing.Landings
        self._ahead = ahead  # ahead.Ahead
        self._values = values  # master_values.MasterValues
        self._early = early  # known_places.EarlyReads
        self._places = places  # known_places.KnownPlaces
        self._metrics = metrics

    def put(self, key: str, value, parent: str | None = None, *, pinned: bool = False) -> bool:
        """Store bytes, a numpy array or a CPU tensor. True: stored; False: the key existed.
        Raises CapacityError when the pool cannot hold it, TransferError when the write failed."""
        region = None if type(value) is bytes else region_of(value, writable=False)  # bytes need no address
        size = len(value) if region is None else region.size_bytes
        if size <= 0:
            raise UsageError(f"cannot put an empty value under {key!r}")
        if parent is None and size <= self._values.max_inline and (region is None or region.device is None):
            stored = self._values.put(key, value if region is None else ctypes.string_at(region.addr, size), pinned)
            if stored is not None:
                return stored
        if region is None:
            region = region_of(value, writable=False)
        registered = self._memory.contains(region.addr, region.size_bytes)
        ahead = parent is None and not pinned and self._config.checksums and region.device is None
        if ahead:
            stored = self._put_ahead(key, region.addr, size, unregistered=not registered)
            if stored is not None:
                return stored
        else:
            self._ahead.give_back_held()  # a chained or pinned put: the next is likely one too
        if registered:
            statuses, message = self._puts.put_batch([key], [[region.addr]], [[region.size_bytes]], [parent], pinned,
                                                    ahead=ahead)
        elif region.device is None:  # written straight from the value where its route allows, else staged
            statuses, message = self._puts.put_batch([key], [[region.addr]], [[region.size_bytes]], [parent], pinned,
                                                    unregistered=True, ahead=ahead)
        else:
            with self._staging.lock:
                self._staging.ensure(region.size_bytes)
                copy_bytes(self._staging.addr, region.addr, region.size_bytes)
                statuses, message = self._puts.put_batch(
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
        slot = self._ahead.take(size, time.monotonic())
        if slot is None:
            return None
        check_keys([key], unique=False)  # (a read-only client never holds a slot: it never put)
        started = time.perf_counter()
        choices = [(0, replica) for replica in slot.replicas]
        if unregistered and not self._transfers.carried_unregistered("WRITE", choices, [size]):
            self._ahead.give_back(slot)
            return None
        tenant = self._config.tenant
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
            later = self._landings.may_land(slot.lands, choices)
            checksum = NO_CHECKSUM if later else checksum_regions([addr], [size])
            end = protocol.PutEnd(tenant, [slot.key], [slot.token], [checksum], as_keys=[key])
            ending = self._landings.send(end, size) if later else None
            failed, in_flight = self._transfers.run_round(
                "WRITE", choices, [[addr]], [[size]], max(1e-3, slot.deadline_s - time.monotonic()),
                unregistered=unregistered, sent=sent if ending is not None else None, tags=[tag_of(tenant, key)])
        except BaseException:
            if ending is not None:
                self._landings.abandon(ending, names, tokens)
            else:
                self._link.revoke_quietly([slot.key], [slot.token])
            raise
        reply = self._landings.finish(ending, names, tokens) if ending is not None else None
        if failed or time.monotonic() > slot.deadline_s:
            gone = names if ending is not None else [slot.key]
            flight = list(range(len(gone))) if in_flight else []
            self._link.call(protocol.PutRevoke(tenant, gone, [slot.token] * len(gone), flight), protocol.OkReply)
            if in_flight:
                self._puts.end_quarantine_later(in_flight, [slot.token])
            return None
        if reply is None:
            if checksum == NO_CHECKSUM:  # landing was meant, but there was no lane to send the end on
                end = msgspec.structs.replace(end, checksums=[value_checksum()])
            reply = self._ahead.end_asking(end, size)
        if reply.refused:
            log.info("kvpool: the master no longer held the allocation put ahead for %r (reclaimed, or a new "
                     "master); putting it again", key)
            return None
        stored = not reply.existed
        if reply.existed:
            self._ahead.give_back(slot)  # written for nothing: the key was there
        elif ending is not None and not self._landings.land([key], [slot.token], [value_checksum()]):
            raise TransferError(f"{key!r} was written but could not be made readable (PutLanded not sent); retry it")
        else:
            self._metrics.put_bytes.inc(size * len(slot.replicas))
            self._places.note(key, slot.replicas, slot.epoch)
        self._metrics.puts_ahead.inc()
        self._metrics.put_keys[PUT_STATUS_NAMES[PUT_ALLOCATED if stored else PUT_EXISTS]].inc()
        self._metrics.latency_s["put"].observe(time.perf_counter() - started)
        return stored

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

    def _find_value(self, key: str, make: MakeOutput | None = None) -> bytes | Found | EarlyRead | None:
        """GetValue: the value's bytes (held by the master), or where it is on nodes (leased: read
        it with _read_found, which releases the lease), or None on a miss. With `make` (size ->
        (a new output, its address)) and a place this client knows for the key, the value is read
        there while GetValue travels (known_places.py): EarlyRead when those bytes were it; for a
        key it knows no place of, what a node holds under the key's tag (transfer/tcp_path_tags.py), alike."""
        check_keys([key], unique=False)
        started = time.perf_counter()
        if make is not None and self._config.checksums and self._values.max_inline >= 0:
            place = self._places.get(key, self._link.epoch) if self._config.known_places else None
            if place is not None and place.size > self._values.max_inline:
                found = self._early.read_early(key, place, make, started)
                if found is not NotImplemented:
                    return found
            elif place is None and self._config.read_by_tag:
                found = self._early.read_by_tag(key, make, started)
                if found is not NotImplemented:
                    return found
        t0 = time.monotonic()  # before sending: our lease deadline is never later than the master's
        answer = None
        if self._values.max_inline >= 0:
            try:
                answer = self._link.call(protocol.GetValue(self._config.tenant, key), protocol.ValueReply)
            except ProtocolError:
                self._values.master_without_values()
        if answer is None:  # a master from before inline values: the leased lookup as it knows it
            answer = protocol.ValueReply(False, b"", self._link.call(
                protocol.LookupPrefix(self._config.tenant, [key], lease=True), protocol.LookupReply),
                max_inline_bytes=self._values.max_inline)
        return self._values.answered(key, answer, t0, started)

    def _reads_unregistered(self, found: Found) -> bool:
        """Whether every replica of a found value is read by a route that takes unregistered memory
        (the lane, shared memory); on an error the lease is released and the error raised."""
        try:
            return self._transfers.carried_unregistered("READ", [(0, r) for r in found.replicas[0]], [found.size])
        except BaseException:
            self._link.release(found.reply.lease_id)
            raise

    def _read_fresh(self, found: Found, addr: int) -> bool:
        """Read a found value straight into fresh memory the caller returns (not registered), its
        pages faulted in while the node sends (fresh_memory.py): no staging buffer, no copy after."""
        return self._read_found(found, addr, unregistered=True, before_landing=fresh_memory.prefault)

    def _read_staged(self, found: Found):
        """Read a found value into the staging buffer (the caller holds its lock): a view of it, or None."""
        self._staging.ensure(found.size)
        return self._staging.array[: found.size] if self._read_found(found, self._staging.addr) else None

    def _read_found(self, found: Found, addr: int, **how) -> bool:
        """Read a found value into [addr, addr + size) and release its lease; True if it was read
        (and matched its checksum). `how`: Reads.read_leased's options."""
        try:
            count = self._reads.read_leased([found.key], found.replicas, found.reply, found.t0, [[addr]],
                                            [[found.size]], **how)
        finally:
            self._link.release(found.reply.lease_id)
        self._metrics.latency_s["get"].observe(time.perf_counter() - found.started)
        if count == 1:
            self._places.note(found.key, found.replicas[0], self._link.epoch)
        return count == 1


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
