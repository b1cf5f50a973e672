"""An allocation held ahead of a writer's next plain put: that put is its write and one PutEnd.

Why: a plain value on a node would cost a writer three exchanges, PutStart, the write and PutEnd,
where Redis answers a SET in one (measurements: docs/design/client.md).
A plain put that goes to a node asks, inside its own PutEnd, for one more allocation of its size
under a key of this client's (`ahead`); the next plain put of that size writes into it and ends it
under its real key (PutEnd.as_keys), asking for the next one in the same message. The master's
work per put is the same (one allocation, one end); one exchange is gone.

Rules:
- One slot at most (the size of the last such put). A slot is used only while all of these hold:
  the master incarnation that granted it is the one the channel last heard from; it was granted
  less than FRESH_S ago; the write fits within its deadline, counted like any put's from before
  its request was sent (client.py). FRESH_S bounds how stale a slot can be when a master restarts
  unseen: before a new master can hand the range to another writer it must start (a process: more
  than that alone) or, a standby, wait for the node to find the old one gone (a failed heartbeat,
  1 s apart by default), take the segment back and end its recovery. And a reader verifies every
  object's checksum, so a slot is only used by a client that sends checksums: a write that did land
  on another object makes that object a miss, never wrong bytes.
- A slot that cannot be used (too old, another size, another master, the key existed), or that a
  plain put with a parent or pinned passes by, is given back with a PutRevoke that waits for no
  reply; one the master already reclaimed costs nothing. The master itself reclaims a slot not
  used within its `--ahead-timeout-s` (1 s; the reply's put_timeout_s), so an idle writer holds
  no space for long (master metric `kvpool_master_ahead_expired`).
- The master gives an allocation ahead free space only: nothing is evicted for a put that may
  never come (master/index.py), so a full pool just grants none and the put goes the usual way.
- `AheadSlots` is bookkeeping with a lock, no I/O; `Ahead` owns it and sends the ask (inside a
  PutEnd) and the give-back (a PutRevoke); plain_values.py does the writes.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from kvpool.core.errors import KVPoolError
from kvpool.core.protocol import PUT_ALLOCATED, PutEnd, PutEndReply, PutRevoke, PutStartReply, Replica

FRESH_S = 0.1
KEY_PREFIX = "kvpool:ahead:"  # + a per-client id + a sequence number; never a lookup's hit while pending


def end_margin_s(put_timeout_s: float) -> float:
    """How long before the master's reclaim a writer stops: room for PutEnd to travel and be handled
    (every put's deadline, client.py's and this module's)."""
    return min(max(0.2 * put_timeout_s, 0.05), 5.0)


@dataclass(frozen=True)
class AheadSlot:
    key: str
    token: int
    size: int
    replicas: tuple[Replica, ...]
    sent_s: float  # monotonic, before the request that granted it was sent
    epoch: int | None  # the master incarnation that granted it
    put_timeout_s: float
    lands: bool = False  # that master takes PutEnd.landing (landing.py)

    @property
    def deadline_s(self) -> float:
        """Monotonic time by which its write must be over (then PutEnd still arrives in time)."""
        return self.sent_s + self.put_timeout_s - end_margin_s(self.put_timeout_s)


class AheadSlots:
    def __init__(self) -> None:
        self._prefix = f"{KEY_PREFIX}{os.getpid():x}.{os.urandom(6).hex()}:"
        self._numbers = itertools.count()
        self._lock = threading.Lock()
        self._slot: AheadSlot | None = None

    def new_key(self) -> str:
        return f"{self._prefix}{next(self._numbers)}"

    def take(self, size: int, epoch: int | None, now_s: float) -> tuple[AheadSlot | None, AheadSlot | None]:
        """(the slot, if a put of `size` may use it now; the slot held, if it must be given back).
        Either way the slot leaves the holder."""
        with self._lock:
            slot, self._slot = self._slot, None
        if slot is None:
            return None, None
        if slot.size == size and slot.epoch == epoch and epoch is not None and now_s - slot.sent_s < FRESH_S:
            return slot, None
        return None, slot

    def grant(self, key: str, size: int, reply: PutStartReply | None, sent_s: float, epoch: int | None,
              epoch_after: int | None) -> AheadSlot | None:
        """Keep the allocation a PutEnd's `ahead` got; returns the slot it replaces (to give back),
        or the new one itself when it cannot be trusted (no allocation, or the master changed
        while the request travelled)."""
        if reply is None or len(reply.statuses) != 1 or reply.statuses[0] != PUT_ALLOCATED \
                or len(reply.tokens) != 1 or len(reply.replicas) != 1 or not reply.replicas[0]:
            return None
        slot = AheadSlot(key, reply.tokens[0], size, tuple(reply.replicas[0]), sent_s, epoch, reply.put_timeout_s,
                         reply.lands)
        if epoch is None or epoch != epoch_after:
            return slot
        with self._lock:
            old, self._slot = self._slot, slot
        return old

    def drop(self) -> AheadSlot | None:
        """The slot held (a new master, or the client closing): the caller gives it back."""
        with self._lock:
            slot, self._slot = self._slot, None
        return slot


class Ahead:
    """The round trips of allocations held ahead: the ask inside a plain put's PutEnd, and the
    give-back of a slot that will not be used. Owns the client's AheadSlots."""

    def __init__(self, link, num_replicas: int) -> None:
        self._link = link  # master_link.MasterLink
        self._num_replicas = num_replicas
        self._slots = AheadSlots()

    def take(self, size: int, now_s: float) -> AheadSlot | None:
        """The slot, if a put of `size` may use it now; a slot held that it may not use is given back."""
        slot, stale = self._slots.take(size, self._link.epoch, now_s)
        self.give_back(stale)
        return slot

    def asking(self, end: PutEnd, size: int) -> tuple[PutEnd, Callable[[PutEndReply], None]]:
        """(`end` asking for an allocation of `size` bytes for the next plain put, a function that
        keeps what its reply grants)."""
        next_key, sent_s, epoch = self._slots.new_key(), time.monotonic(), self._link.epoch

        def grant(reply: PutEndReply) -> None:
            self.give_back(self._slots.grant(next_key, size, reply.ahead, sent_s, epoch, self._link.epoch))

        return msgspec.structs.replace(end, ahead=[next_key], ahead_sizes=[size],
                                       ahead_replicas=self._num_replicas), grant

    def end_asking(self, end: PutEnd, size: int) -> PutEndReply:
        """Send a plain put's PutEnd asking for an allocation of `size` bytes for the next one."""
        end, grant = self.asking(end, size)
        reply = self._link.call(end, PutEndReply)
        grant(reply)
        return reply

    def give_back(self, slot: AheadSlot | None, lazy: bool = True) -> None:
        """Free an allocation held ahead that will not be used, waiting for no reply (the master
        reclaims it after its ahead timeout if this is lost)."""
        if slot is not None:
            try:
                self._link.channel.send(PutRevoke(self._link.tenant, [slot.key], [slot.token]), lazy=lazy)
            except KVPoolError:
                pass

    def drop(self) -> AheadSlot | None:
        """The slot held, out of the holder (a new master: forgotten; the client closing: given back)."""
        return self._slots.drop()

    def give_back_held(self, lazy: bool = True) -> None:
        self.give_back(self._slots.drop(), lazy=lazy)
