"""A put_from batch written into allocations held ahead: its write and one PutEnd, no PutStart.

Why (issue 14): a writer that puts batches of the same sizes again and again (an agent's few new
KV chunks per turn, the peers benchmark's agent loop: 2 x 256 KiB) paid two master exchanges per
batch, PutStart and PutEnd; with four writers on two vCPUs they queue at the master's one thread,
and the same-host loop's put phase had a P99 0.60x Mooncake IPC's (peers_same_host_stop38.md).
What plain puts do for one value (ahead.py, plain_values.py), this does for a batch: its PutEnd
asks for allocations of the batch's sizes for the next one, which then ends them under its keys
(PutEnd.as_keys, and as_parents for its chain).

Rules:
- Taken by a put_from of registered host memory, unpinned, with checksums on (a reader verifies
  every object: a write into an allocation that went elsewhere is a miss, never wrong bytes),
  whose sizes are exactly the held batch's, within AheadBatches' freshness rules (ahead.py). A
  batch naming parents needs a master that links them at the end (`parents_ahead`).
- Asked for by a batch that repeats the sizes of the last one, all of whose keys were new; from
  then on each batch put this way asks for the next. A batch of other sizes gives it back.
- The end goes as any put's: with `landing` before the write where the lane allows (landing.py:
  the checksums then travel with PutLanded, hashed once the write's bytes are out), else after it
  with the checksums. A key that existed leaves its allocation pending under the held name: given
  back, the key reported PUT_EXISTS. A refused end (the master reclaimed the batch) or a failed or
  late write revokes the batch under both names and the put goes the usual way; the caller's
  `on_written` has not been called then, so its source is still the batch's.
- A mixin of the Client (client.py): its channel, plane, ahead slots' key names, `_run_round`,
  landing.py's helpers, `_checksums`, `_revoke_quietly`, `_count_refused` and metrics.
"""

from __future__ import annotations

import logging
import time

import msgspec

from kvpool.client.ahead import AheadBatch
from kvpool.client.checksum import NO_CHECKSUM
from kvpool.client.statuses import PUT_FAILED, PUT_STATUS_NAMES
from kvpool.core import protocol
from kvpool.core.errors import KVPoolError
from kvpool.core.protocol import PUT_ALLOCATED, PUT_EXISTS

log = logging.getLogger(__name__)


class BatchAhead:
    def _put_batch_ahead(self, keys: list[str], addrs, sizes, parents: list, totals: list[int]) -> list[int] | None:
        """Put a batch into the allocations held ahead for its sizes; its statuses, or None: not
        done (none held, a write or end that failed; nothing stored) and the caller puts it the usual way."""
        slot, stale = self._batch_ahead.take(tuple(totals), self._channel.epoch, time.monotonic())
        self._give_back_pairs(_pairs(stale))
        if slot is None:
            return None
        named = any(p is not None for p in parents)
        if named and not slot.parents_ahead:
            self._give_back_pairs(_pairs(slot))
            return None
        started = time.perf_counter()
        n, tenant = len(keys), self.config.tenant
        choices = [(i, r) for i in range(n) for r in slot.replicas[i]]
        names, name_tokens = list(slot.keys) + list(keys), list(slot.tokens) * 2  # pending under either once ended
        later = self._may_land(slot.lands, choices)
        checksums = [NO_CHECKSUM] * n if later else self._checksums(addrs, sizes)
        end = protocol.PutEnd(tenant, list(slot.keys), list(slot.tokens), checksums, as_keys=list(keys),
                              as_parents=list(parents) if named else [])
        ask = self._batch_asker(totals)
        hashed: list[list[int]] = []

        def sent() -> None:  # the data plane's hook must not raise: the write's answer is still unread
            try:
                hashed.append(self._checksums(addrs, sizes))
            except Exception:  # noqa: BLE001 - hashed again after the write
                pass

        ending = None
        try:
            ending = self._send_ending(end, ask) if later else None
            failed, in_flight = self._run_round("WRITE", choices, addrs, sizes,
                                                max(1e-3, slot.deadline_s - time.monotonic()),
                                                sent=sent if ending is not None else None)
        except BaseException:
            if ending is not None:
                self._abandon_ending(ending, names, name_tokens)
            else:
                self._revoke_quietly(list(slot.keys), list(slot.tokens))
            raise
        reply = self._finish_ending(ending, names, name_tokens) if ending is not None else None
        if failed or time.monotonic() > slot.deadline_s:
            self._revoke_batch(slot, keys, in_flight, ended=ending is not None)
            return None
        if reply is None:
            reply = self._end_asking(end, ask)
        if len(reply.refused) == n:
            log.info("kvpool: the master no longer held the %d allocations put ahead for a batch (reclaimed, or a "
                     "new master); putting it again", n)
            return None
        statuses = [PUT_ALLOCATED] * n
        for i in reply.existed:
            statuses[i] = PUT_EXISTS
        self._give_back_pairs([(slot.keys[i], slot.tokens[i]) for i in reply.existed])  # written for nothing
        refused = set(reply.refused)
        if ending is not None:
            landed = [i for i in range(n) if statuses[i] == PUT_ALLOCATED and i not in refused]
            values = hashed[0] if hashed else self._checksums(addrs, sizes)
            if not self._land([keys[i] for i in landed], [slot.tokens[i] for i in landed], [values[i] for i in landed]):
                for i in landed:
                    statuses[i] = PUT_FAILED
        self._count_refused(refused, statuses, n)
        for st in set(statuses):
            self._metrics.put_keys[PUT_STATUS_NAMES.get(st, str(st))].inc(statuses.count(st))
        stored = sum(totals[i] * len(slot.replicas[i]) for i, st in enumerate(statuses) if st == PUT_ALLOCATED)
        if stored:
            self._metrics.put_bytes.inc(stored)
        self._metrics.puts_ahead.inc()
        self._metrics.latency_s["put"].observe(time.perf_counter() - started)
        return statuses

    def _revoke_batch(self, slot: AheadBatch, keys: list[str], in_flight: dict, ended: bool) -> None:
        """A write that failed or ended late: free the batch under every name it may be pending
        under (both, once its end was sent), its ranges still being written quarantined."""
        n = len(keys)
        gone = list(slot.keys) + (list(keys) if ended else [])
        tokens = list(slot.tokens) * (2 if ended else 1)
        flight = [k for k in range(len(gone)) if (k % n) in in_flight]
        self._call(protocol.PutRevoke(self.config.tenant, gone, tokens, flight), protocol.OkReply)
        if in_flight:
            self._end_quarantine_later(in_flight, [slot.tokens[i] for i in range(n) if i in in_flight])

    def _batch_asker(self, totals: list[int]):
        """`ask` for a batch's end (landing.py): allocations of the batch's sizes ahead."""
        sizes = tuple(totals)

        def ask(end: protocol.PutEnd):
            next_keys = [self._ahead.new_key() for _ in sizes]
            sent_s, epoch = time.monotonic(), self._channel.epoch

            def grant(reply: protocol.PutEndReply) -> None:
                self._give_back_pairs(self._batch_ahead.grant(next_keys, sizes, reply.ahead, sent_s, epoch,
                                                              self._channel.epoch))

            return msgspec.structs.replace(end, ahead=next_keys, ahead_sizes=list(sizes),
                                           ahead_replicas=self.config.num_replicas), grant

        return ask

    def _give_back_pairs(self, pairs: list[tuple[str, int]], lazy: bool = True) -> None:
        """Free allocations held ahead that will not be used, waiting for no reply (the master
        reclaims them after its ahead timeout if this is lost)."""
        if pairs:
            try:
                self._channel.send(protocol.PutRevoke(self.config.tenant, [k for k, _ in pairs], [t for _, t in pairs]),
                                   lazy=lazy)
            except KVPoolError:
                pass


def _pairs(slot: AheadBatch | None) -> list[tuple[str, int]]:
    return [] if slot is None else list(zip(slot.keys, slot.tokens))
