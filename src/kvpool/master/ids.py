"""Ids that outlive one request, unique across master incarnations.

Rules:
- Each master process draws a random 63-bit `epoch` at start and names it in every reply. Every id
  it hands out that another process keeps (segment ids, lease ids, write tokens) is the epoch's
  high 31 bits, shifted left by 32, plus a 32-bit counter: ids of two incarnations differ unless
  their random prefixes collide (2^-31), so a restarted master can never reissue an id a client
  or node still holds. Rejected: counters from 1 (every restart reissued segment 1, and a client
  read another node's bytes through its cached description of "segment 1"); a persisted counter
  (needs a store the master does not have, and a standby could not share it).
- When the 32-bit counter runs out (a busy master issues a lease id per read), the source draws a
  new random prefix it has not used, so an id is never issued twice by one incarnation either.
- Ids stay within int63: they travel as signed little-endian int64 in packed replicas.
- Pure: the epoch is passed in, so tests choose it.
"""

from __future__ import annotations

import secrets

_COUNTER_MASK = (1 << 32) - 1


def new_epoch() -> int:
    """A random 63-bit incarnation number whose id prefix is never 0."""
    while True:
        epoch = secrets.randbits(63)
        if epoch >> 32:
            return epoch


class IdSource:
    """One counter for every kind of id: an id names one thing, whatever its kind."""

    __slots__ = ("epoch", "_prefix", "_next", "_prefixes")

    def __init__(self, epoch: int) -> None:
        if not 0 < epoch < (1 << 63) or not epoch >> 32:
            raise ValueError(f"epoch must be a 63-bit number with non-zero high 31 bits, got {epoch}")
        self.epoch = epoch
        self._prefix = (epoch >> 32) << 32
        self._prefixes = {epoch >> 32}
        self._next = 0

    def next(self) -> int:
        n = self._next + 1
        if n > _COUNTER_MASK:  # exhausted: a fresh prefix rather than reissuing id 1
            while (fresh := new_epoch() >> 32) in self._prefixes:
                pass
            self._prefixes.add(fresh)
            self._prefix, n = fresh << 32, 1
        self._next = n
        return self._prefix | n

    def issued_here(self, some_id: int) -> bool:
        """Whether an id carries one of this incarnation's prefixes."""
        return some_id >> 32 in self._prefixes
