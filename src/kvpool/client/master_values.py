"""Values the master keeps itself, and its answers to GetValue.

Rules:
- A value up to the master's inline limit put without a parent is sent inside one PutValue and
  kept by the master (master/inline.py); `get` asks with one GetValue, answered with the bytes, or
  with a leased lookup when a node holds the value (a `Found`, read as get_into reads). Every
  reply names the master's limit (0: inline values off), which the client follows from then on.
- A master that cannot decode PutValue / GetValue (older) is asked no more (`max_inline` -1)
  until a new master incarnation answers (`on_new_epoch`).
- Only this class changes `max_inline`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvpool.client.checks import check_keys
from kvpool.client.statuses import PUT_STATUS_NAMES
from kvpool.core import protocol
from kvpool.core.errors import ProtocolError, UsageError
from kvpool.core.protocol import PUT_ALLOCATED, PUT_NO_SPACE

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Found:
    """A value GetValue found on nodes: its leased lookup, to be read once."""

    key: str
    reply: protocol.LookupReply
    replicas: list
    t0: float  # monotonic, before GetValue was sent (the lease clock)
    started: float  # perf_counter, for the get's latency

    @property
    def size(self) -> int:
        return self.replicas[0][0].size


class MasterValues:
    def __init__(self, config, link, reads, metrics) -> None:
        self._config = config  # client.ClientConfig
        self._link = link  # master_link.MasterLink
        self._reads = reads  # reads.Reads
        self._metrics = metrics
        self.max_inline = protocol.DEFAULT_MAX_INLINE_BYTES  # the master's, as its last reply said (-1: none)

    def put(self, key: str, data: bytes, pinned: bool) -> bool | None:
        """Put a small value inside one PutValue; None: the master keeps no value this large."""
        check_keys([key], unique=False)
        if self._config.read_only:
            raise UsageError("this client is read-only (read_only=True): it cannot put")
        started = time.perf_counter()
        try:
            reply = self._link.call(protocol.PutValue(self._config.tenant, key, data, bool(pinned)),
                                    protocol.PutValueReply)
        except ProtocolError:
            self.master_without_values()
            return None
        self.max_inline = reply.max_inline_bytes
        if reply.status in (protocol.PUT_TOO_LARGE, PUT_NO_SPACE):
            return None  # a node takes it (pinned values or the tenant's inline share fill the master's room)
        self._metrics.put_keys[PUT_STATUS_NAMES.get(reply.status, str(reply.status))].inc()
        if reply.status == PUT_ALLOCATED:
            self._metrics.put_bytes.inc(len(data))
        self._metrics.latency_s["put"].observe(time.perf_counter() - started)
        return reply.status == PUT_ALLOCATED

    def on_new_epoch(self, old_epoch: int | None) -> None:
        if old_epoch is not None and self.max_inline < 0:
            self.max_inline = protocol.DEFAULT_MAX_INLINE_BYTES  # a new master: ask it again

    def master_without_values(self) -> None:
        """The master could not take PutValue / GetValue (it predates them): plain values go
        through nodes from now on (until a reply from a new master incarnation says otherwise)."""
        if self.max_inline >= 0:
            log.info("kvpool: master %s keeps no small values itself (an older master?): plain values go "
                     "through nodes", self._config.master_address)
        self.max_inline = -1

    def answered(self, key: str, answer: protocol.ValueReply, t0: float, started: float) -> bytes | Found | None:
        """What GetValue's answer holds: the inline bytes, a Found to read (leased), or None (a miss)."""
        self.max_inline = answer.max_inline_bytes
        if answer.inline:
            self.count_hit(len(answer.value), started)
            return answer.value
        reply = answer.lookup
        if reply is None:
            raise ProtocolError("the master answered GetValue with neither a value nor a lookup")
        replicas = self._reads.leased_replicas(reply)
        if not replicas:
            self._link.release(reply.lease_id)
            self._metrics.get_keys.inc()
            self._metrics.latency_s["get"].observe(time.perf_counter() - started)
            return None
        return Found(key, reply, replicas, t0, started)

    def count_hit(self, size: int, started: float) -> None:
        """Metrics of a plain get that returned a value without a leased read (inline, or read early)."""
        self._metrics.get_keys.inc()
        self._metrics.hit_keys.inc()
        self._metrics.get_bytes.inc(size)
        self._metrics.latency_s["get"].observe(time.perf_counter() - started)
