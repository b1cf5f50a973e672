"""Batch gets (`get_into`): one leased LookupPrefix, the reads (a failed one falls back to the
object's next replica), each hit verified against its writer's checksum, the lease released. The
rules are client.py's. `Reads` is given the master link, registered memory, the transfers and
the segment cache; it keeps no state between calls.
"""

from __future__ import annotations

import logging
import time

from kvpool.client import plan
from kvpool.client.checks import check_keys, regions
from kvpool.client.checksum import checksum_objects
from kvpool.client.memory import copy_bytes
from kvpool.client.rounds import fence
from kvpool.core import protocol
from kvpool.core.errors import ProtocolError, UsageError
from kvpool.core.protocol import Replica

log = logging.getLogger(__name__)


class Reads:
    def __init__(self, config, link, memory, transfers, segments, metrics) -> None:
        self._config = config  # client.ClientConfig
        self._link = link  # master_link.MasterLink
        self._memory = memory  # memory.Registrations
        self._transfers = transfers  # rounds.Transfers
        self._segments = segments  # segments.SegmentCache
        self._metrics = metrics

    def get_into(self, keys: list[str], addrs: list, sizes: list, *, lookup_timeout_s: float | None = None) -> int:
        """Read the leading hits of `keys` into the given regions (object i = its regions
        concatenated). Returns how many leading keys were read completely within their lease.
        `lookup_timeout_s` bounds the master round trip alone (default: timeout_s), for callers
        that must not wait long on a slow master but may on a long copy (a vLLM step's load)."""
        started = time.perf_counter()
        check_keys(keys, unique=False)
        addrs, sizes = regions(len(keys), addrs, sizes)
        if not keys:
            return 0
        self._memory.check(addrs, sizes)
        t0, reply, replicas = self.lookup_leased(keys, lookup_timeout_s)
        try:
            held = [rs[0].size for rs in replicas] + [len(value) for value in reply.inline_values]
            for i, size in enumerate(held):
                if size != sum(sizes[i]):
                    raise UsageError(f"key {keys[i]!r} holds {size} bytes but its regions total {sum(sizes[i])} bytes")
            count = self.read_leased(keys, replicas, reply, t0, addrs, sizes)
        finally:
            self._link.release(reply.lease_id)
        self._metrics.latency_s["get"].observe(time.perf_counter() - started)
        return count

    def lookup_leased(
        self, keys: list[str], timeout_s: float | None = None
    ) -> tuple[float, protocol.LookupReply, list[list[Replica]]]:
        """(t0, the reply, per hit its replicas). The caller must release the lease (MasterLink.release)."""
        t0 = time.monotonic()  # before sending: our deadline is never later than the master's
        reply = self._link.call(protocol.LookupPrefix(self._config.tenant, list(keys), lease=True),
                                protocol.LookupReply, timeout_s)
        return t0, reply, self.leased_replicas(reply)

    def leased_replicas(self, reply: protocol.LookupReply) -> list[list[Replica]]:
        """Per hit, its replicas; a malformed reply is released and raises ProtocolError."""
        try:
            on_nodes = reply.num_hit - len(reply.inline_values)
            if on_nodes < 0:
                raise ValueError(f"{reply.num_hit} hits but {len(reply.inline_values)} inline values")
            replicas = plan.split_replicas(reply.replica_locations, reply.replica_counts, on_nodes)
            if reply.checksums and len(reply.checksums) != protocol.CHECKSUM_BYTES * on_nodes:
                raise ValueError(f"{on_nodes} hits on nodes but {len(reply.checksums)} bytes of checksums")
        except ValueError as e:
            self._link.release(reply.lease_id)
            raise ProtocolError(f"malformed lookup reply from the master: {e}") from None
        return replicas

    def read_leased(self, keys, replicas: list[list[Replica]], reply: protocol.LookupReply, t0: float, addrs,
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
        expected = protocol.unpack_checksums(reply.checksums) if self._config.checksums and reply.checksums else None
        digests: dict[int, int] | None = {} if expected else None
        while pending and time.monotonic() <= deadline:
            choices = [(i, untried[i].pop(0)) for i in pending if untried[i]]
            if not first_round:
                self._metrics.replica_fallbacks.inc(len(choices))
            first_round = False
            # waiting past the lease is pointless: such a read would be discarded anyway
            failed, in_flight = self._transfers.run_round(
                "READ", choices, addrs, sizes, max(1e-3, deadline - time.monotonic()),
                (digests, expected) if digests is not None else None, unregistered=unregistered,
                before_landing=before_landing)
            if digests:
                for i in failed:
                    digests.pop(i, None)  # a copy that failed: what it checksummed is no longer the read
            if in_flight:
                fence(in_flight)
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

        device = self._memory.device
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
        host = set(self._transfers.on_host(addrs[:count]))
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
