"""Batch puts (`put_from`): PutStart, the writes, then PutEnd (or, over the lane, a PutEnd sent
before the write and a PutLanded after it, landing.py), PutRevoke for what failed. The rules are
client.py's. `Puts` is given the master link, registered memory, the transfers, the staging
buffer, the landings and the allocation ahead; its only state is the process's checksum thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent import futures

from kvpool.client.ahead import end_margin_s
from kvpool.client.checksum import NO_CHECKSUM, checksum_objects
from kvpool.client.checks import check_keys, regions
from kvpool.client.memory import copy_bytes
from kvpool.client.rounds import CHECKSUM_DURING_COPY_BYTES
from kvpool.client.statuses import PUT_FAILED, PUT_STATUS_NAMES
from kvpool.core import protocol
from kvpool.core.errors import ProtocolError, UsageError
from kvpool.core.protocol import PUT_ALLOCATED, Replica
from kvpool.transfer.fence import all_of
from kvpool.transfer.tcp_path_tags import tag_of

log = logging.getLogger(__name__)


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


# a put batch this small is checksummed whole while its PutStart travels, allocated or not (an
# agent's new tail of a few hundred KiB); a batch of keys that all exist wastes at most this much
# hashing
EARLY_CHECKSUM_BYTES = 1 << 20
# a put batch this large is checksummed on another thread while it is written
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


class Puts:
    def __init__(self, config, link, memory, transfers, staging, landings, ahead, metrics) -> None:
        self._config = config  # client.ClientConfig
        self._link = link  # master_link.MasterLink
        self._memory = memory  # memory.Registrations
        self._transfers = transfers  # rounds.Transfers
        self._staging = staging  # memory.StagingBuffer
        self._landings = landings  # landing.Landings
        self._ahead = ahead  # ahead.Ahead
        self._metrics = metrics

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
        """Client.put_from: the statuses of put_batch."""
        statuses, _ = self.put_batch(keys, addrs, sizes, parents, pinned, on_written, session=session, ttl_s=ttl_s)
        return statuses

    def put_batch(self, keys, addrs, sizes, parents, pinned: bool = False, on_written=None,
                  unregistered: bool = False, ahead: bool = False, session: str = "",
                  ttl_s: float = 0.0) -> tuple[list[int], str]:
        """`unregistered`: one object whose host memory is not registered (a plain value's
        bytes): written straight from it where its replicas' routes carry such memory, else from
        a copy in the staging buffer. `ahead`: its PutEnd also asks for an allocation of the
        object's size for the next plain put (client/ahead.py). Returns (statuses, the master's message)."""
        once = _Once(on_written)
        if self._config.read_only:
            once()
            raise UsageError("this client is read-only (read_only=True): it cannot put")
        try:
            return self._put(keys, addrs, sizes, parents, pinned, once, unregistered, ahead, session, ttl_s)
        finally:
            once()

    def _put(self, keys, addrs, sizes, parents, pinned, written: "_Once", unregistered: bool = False,
             ahead: bool = False, session: str = "", ttl_s: float = 0.0) -> tuple[list[int], str]:
        started = time.perf_counter()
        check_keys(keys, unique=True)
        addrs, sizes = regions(len(keys), addrs, sizes)
        if parents is None:
            parents = [None] + list(keys[:-1])
        elif len(parents) != len(keys) or not all(p is None or isinstance(p, str) for p in parents):
            raise UsageError(f"parents must be None or a list of {len(keys)} keys/None, got {parents!r}")
        if not keys:
            return [], ""
        if unregistered and len(keys) != 1:
            raise UsageError("an unregistered source is one object")
        if not unregistered:
            self._memory.check(addrs, sizes)
        totals = [sum(s) for s in sizes]
        tenant = self._config.tenant
        # one object, or a batch of at most EARLY_CHECKSUM_BYTES (an agent's new tail): checksummed
        # while PutStart travels; a larger batch checksums only what is allocated, after (most of a
        # prefix chain usually exists already)
        early = _Early(self.checksums, addrs, sizes) \
            if len(keys) == 1 or sum(totals) <= EARLY_CHECKSUM_BYTES else None
        t0 = time.monotonic()  # before sending: our deadline is never later than the master's reclaim
        reply = self._link.call(
            protocol.PutStart(tenant, list(keys), totals, list(parents), self._config.num_replicas, bool(pinned),
                              session, ttl_s),
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
                every = early.result() if allocated else []
                checksums = [every[i] for i in allocated]
            elif self._config.checksums and sum(totals[i] for i in allocated) >= CHECKSUM_BESIDE_WRITE_BYTES:
                if self._checksummed_during_copy(choices, [addrs[i] for i in allocated], totals):
                    during = {}
                else:
                    beside = _checksum_runner().submit(self.checksums, [addrs[i] for i in allocated],
                                                       [sizes[i] for i in allocated])
            else:
                checksums = self.checksums([addrs[i] for i in allocated], [sizes[i] for i in allocated])
            with contextlib.ExitStack() as staged:
                if beside is not None:  # it reads the source: over before the source is the caller's again
                    staged.callback(futures.wait, [beside])
                if unregistered and not self._transfers.carried_unregistered("WRITE", choices, totals):
                    staged.enter_context(self._staging.lock)  # copied into the staging buffer, written from it
                    self._staging.ensure(totals[0])
                    copy_bytes(self._staging.addr, addrs[0][0], totals[0])
                    addrs, unregistered = [[self._staging.addr]], False
                    ahead = False  # the next plain put would be staged too: it gains nothing ahead
                if allocated and beside is None and during is None:
                    ending = self._landings.begin(protocol.PutEnd(tenant, alloc_keys, alloc_tokens, checksums),
                                                reply.lands, choices, totals[0] if ahead else None)
                failed, in_flight = self._transfers.run_round(
                    "WRITE", choices, addrs, sizes, max(1e-3, write_deadline - time.monotonic()),
                    (during, [1] * len(keys)) if during is not None else None, unregistered=unregistered,
                    tags=[tag_of(tenant, keys[0])] if len(keys) == 1 else None,  # a plain get may come by tag
                )
            if beside is not None:
                checksums = beside.result()
            elif during is not None:  # objects of jobs too small to be checksummed during their copy: now
                missing = [i for i in allocated if i not in during]
                during.update(zip(missing, self.checksums([addrs[i] for i in missing], [sizes[i] for i in missing])))
                checksums = [during[i] for i in allocated]
        except BaseException:
            if ending is not None:
                self._landings.abandon(ending, alloc_keys, alloc_tokens)
            else:
                self._link.revoke_quietly(alloc_keys, alloc_tokens)
            raise
        # The source is free now. A write still in flight may read it later, but only into its
        # quarantined range, which is never served: reusing the source cannot corrupt an object.
        try:
            written()
        finally:  # the end's reply is taken whatever the caller's callback did
            ended = self._landings.finish(ending, alloc_keys, alloc_tokens) if ending is not None else None
        if allocated and time.monotonic() > write_deadline:
            failed = set(allocated)  # too late to end safely: the master may reclaim any moment now
        if ended is not None:  # ended already: what was refused is not ours, what failed is revoked
            refused = {allocated[n] for n in ended.refused}
            failed -= refused
        if failed:
            gone = sorted(failed)
            flight = [n for n, i in enumerate(gone) if i in in_flight]
            self._link.call(protocol.PutRevoke(tenant, [keys[i] for i in gone], [tokens[i] for i in gone], flight),
                       protocol.OkReply)
            if flight:
                self.end_quarantine_later(in_flight, [tokens[i] for i in gone if i in in_flight])
            for i in failed:
                statuses[i] = PUT_FAILED
        if ended is not None:
            landed = [i for i in allocated if i not in failed and i not in refused]
            if not self._landings.land([keys[i] for i in landed], [tokens[i] for i in landed]):
                for i in landed:
                    statuses[i] = PUT_FAILED
            self._count_refused(refused, statuses, len(allocated))
        else:
            written = [i for i in allocated if i not in failed]
            if written:
                by_index = dict(zip(allocated, checksums))
                end = protocol.PutEnd(tenant, [keys[i] for i in written], [tokens[i] for i in written],
                                      [by_index[i] for i in written])
                ended = self._ahead.end_asking(end, totals[0]) if ahead else self._link.call(end, protocol.PutEndReply)
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
        Beside it, the second pass over the source competes with the copy for memory bandwidth."""
        return (sum(totals) >= CHECKSUM_DURING_COPY_BYTES and len(self._transfers.on_host(addrs)) == len(addrs)
                and self._transfers.copies_locally(choices))

    def _count_refused(self, refused: set[int], statuses: list[int], num_ended: int) -> None:
        """Objects whose end the master refused are PUT_FAILED (counted, and said in the log)."""
        for i in refused:
            statuses[i] = PUT_FAILED
        if refused:
            self._metrics.put_keys["refused"].inc(len(refused))
            log.warning("kvpool: the master refused %d of %d put ends (their allocation was reclaimed or "
                        "is no longer ours); those keys were not stored", len(refused), num_ended)

    def checksums(self, addrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        """Each object's checksum (NO_CHECKSUM for GPU memory, and for all without `checksums`)."""
        out = [NO_CHECKSUM] * len(addrs)
        if not self._config.checksums or not addrs:
            return out
        host = self._transfers.on_host(addrs)
        for i, value in zip(host, checksum_objects([addrs[i] for i in host], [sizes[i] for i in host])):
            out[i] = value
        return out

    def end_quarantine_later(self, transfers: dict, tokens: list[int]) -> None:
        """Tell the master once every write of these tokens is over (done or failed)."""
        link = self._link
        tenant = link.tenant

        def settled(_transfer) -> None:
            if not link.closed:
                # off the reaper's thread: the channel's lock may be held by a call waiting on a slow
                # master, and the reaper must go on ending other transfers meanwhile
                threading.Thread(target=link.send_quietly, args=(protocol.EndQuarantine(tenant, tokens),),
                                 name="kvpool-end-quarantine", daemon=True).start()

        all_of(list({id(t): t for t in transfers.values()}.values())).add_done_callback(settled)
