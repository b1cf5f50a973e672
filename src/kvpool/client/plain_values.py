"""Plain values: `put` and `get` of bytes, numpy arrays and CPU tensors (the Client's, as a mixin).

Rules:
- A value up to the master's inline limit put without a parent is sent inside one PutValue and
  kept by the master (master/inline.py); `get` asks with one GetValue, answered with the bytes, or
  with a leased lookup when a node holds the value (then read as get_into reads). So a small value
  costs one round trip each way. Every reply names the master's limit (0: inline values off),
  which the client follows from then on; a value over it goes to a node, and so does one the
  master has no room for (pinned values fill it). A master that cannot decode PutValue / GetValue
  (older) is asked no more until a new master incarnation answers.
- The mixin uses the Client's channel, staging buffer, metrics and leased reads (client.py); it
  holds only `_max_inline`, the master's limit as its last reply said (-1: a master without them).
"""

from __future__ import annotations

import ctypes
import logging
import time

from kvpool.client import fresh_memory
from kvpool.client.memory import copy_bytes, region_of
from kvpool.client.statuses import PUT_FAILED, PUT_STATUS_NAMES
from kvpool.core import protocol
from kvpool.core.errors import CapacityError, ProtocolError, TransferError, UsageError
from kvpool.core.protocol import PUT_ALLOCATED, PUT_NO_SPACE

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
        if self._registered.contains(region.addr, region.size_bytes):
            statuses, message = self._put_from([key], [[region.addr]], [[region.size_bytes]], [parent], pinned)
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
        with self._staging.lock:
            view = self._get_staged(key)
            return view if view is None or isinstance(view, bytes) else _bytes_of(view)

    def get_array(self, key: str, dtype="uint8", shape: tuple[int, ...] | None = None):
        """A fresh numpy array with the value's bytes viewed as `dtype` (and `shape`), or None."""
        import numpy as np

        with self._staging.lock:
            view = self._get_staged(key)
            if view is None:
                return None
            src = np.frombuffer(view, dtype=np.uint8) if isinstance(view, bytes) else view
            array = np.empty(src.nbytes, dtype=np.uint8)
            fresh_memory.prefault(int(array.ctypes.data), array.nbytes)
            copy_bytes(int(array.ctypes.data), int(src.ctypes.data), src.nbytes)
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

    def _get_staged(self, key: str):
        """The value's bytes (held by the master), or a view of the staging buffer after reading it
        from a node (the caller holds the staging lock), or None."""
        self._check_keys([key], unique=False)
        started = time.perf_counter()
        t0 = time.monotonic()  # before sending: our lease deadline is never later than the master's
        answer = None
        if self._max_inline >= 0:
            try:
                answer = self._call(protocol.GetValue(self.config.tenant, key), protocol.ValueReply)
                self._max_inline = answer.max_inline_bytes
            except ProtocolError:
                self._master_without_values()
        if answer is None:  # a master from before inline values: the leased lookup as it knows it
            answer = protocol.ValueReply(False, b"", self._call(
                protocol.LookupPrefix(self.config.tenant, [key], lease=True), protocol.LookupReply))
        if answer.inline:
            self._metrics.get_keys.inc()
            self._metrics.hit_keys.inc()
            self._metrics.get_bytes.inc(len(answer.value))
            self._metrics.latency_s["get"].observe(time.perf_counter() - started)
            return answer.value
        reply = answer.lookup
        if reply is None:
            raise ProtocolError("the master answered GetValue with neither a value nor a lookup")
        replicas = self._leased_replicas(reply)
        size = 0
        try:
            if not replicas:
                self._metrics.get_keys.inc()
                count = 0
            else:
                size = replicas[0][0].size
                self._staging.ensure(size)
                count = self._read_leased([key], replicas, reply, t0, [[self._staging.addr]], [[size]])
        finally:
            self._release(reply.lease_id)
        self._metrics.latency_s["get"].observe(time.perf_counter() - started)
        return self._staging.array[:size] if count == 1 else None


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
