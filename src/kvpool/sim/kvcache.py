"""One instance's KV memory at block granularity: blocks held by requests plus a local prefix cache.

Rules (vLLM's block pool, reduced to counts and keys):
- `capacity` blocks in all. A block is held (by one or more requests) or free; a free block may
  still hold a cached prefix block (`lru`, oldest first) until it is needed for something new.
- A cached block is named by its chain key (an int: equal key = equal prefix up to and including
  the block). Requests hold keyed blocks by reference count and anonymous blocks (being computed,
  or the partial last block, or decode growth) by number only.
- A request's computed full blocks get their keys when its prefill ends (`register`); a key that
  another request registered meanwhile is shared and the duplicate block freed.
- Release gives keyed blocks back tail first, so the LRU evicts a chain's tail before its head
  (vLLM frees a request's blocks in reverse order for the same reason).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence


class BlockCache:
    __slots__ = ("capacity", "ref", "lru", "used", "evictions")

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self.ref: dict[int, int] = {}  # key -> requests holding it (0: free but cached, in lru)
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.used = 0  # blocks held by requests (keyed, counted once, and anonymous)
        self.evictions = 0

    @property
    def free_blocks(self) -> int:
        return self.capacity - self.used

    def prefix_hit(self, keys: Sequence[int], limit: int) -> int:
        """How many leading keys (at most `limit`) are cached here."""
        ref = self.ref
        n = 0
        for key in keys:
            if n >= limit or key not in ref:
                break
            n += 1
        return n

    def probe(self, keys: Sequence[int]) -> int:
        """Leading cached keys by binary search (a router's cheap estimate: assumes a cached block's
        prefix is cached, which tail-first eviction keeps true almost always)."""
        ref = self.ref
        lo, hi = 0, len(keys)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if keys[mid - 1] in ref:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def acquire(self, keys: Sequence[int]) -> None:
        """Hold cached blocks (a prefix hit). The caller checked they are cached."""
        ref, lru = self.ref, self.lru
        for key in keys:
            r = ref[key]
            if r == 0:
                del lru[key]
                self.used += 1
            ref[key] = r + 1

    def can_allocate(self, num_blocks: int) -> bool:
        return self.capacity - self.used >= num_blocks

    def allocate(self, num_blocks: int) -> None:
        """Take `num_blocks` anonymous blocks, evicting cached free blocks, oldest first."""
        if num_blocks > self.capacity - self.used:
            raise ValueError(f"{num_blocks} blocks asked, {self.capacity - self.used} free")
        self.used += num_blocks
        self._trim()

    def _trim(self) -> None:
        lru, ref = self.lru, self.ref
        over = self.used + len(lru) - self.capacity
        while over > 0:
            key, _ = lru.popitem(last=False)
            del ref[key]
            self.evictions += 1
            over -= 1

    def register(self, keys: Sequence[int]) -> None:
        """The holder's anonymous blocks now hold these computed keys."""
        ref, lru = self.ref, self.lru
        for key in keys:
            r = ref.get(key)
            if r is None:
                ref[key] = 1
            elif r == 0:
                del lru[key]  # cached meanwhile and free: take it, drop our duplicate
                ref[key] = 1
            else:
                ref[key] = r + 1
                self.used -= 1  # someone holds the same block: share it, free ours

    def release(self, keys: Sequence[int], num_anonymous: int) -> None:
        """Give back held blocks: keyed ones tail first into the LRU, anonymous ones free."""
        ref, lru = self.ref, self.lru
        for key in reversed(keys):
            r = ref[key] - 1
            ref[key] = r
            if r == 0:
                lru[key] = None
                self.used -= 1
        self.used -= num_anonymous

    def insert_free(self, keys: Sequence[int]) -> None:
        """Cache blocks computed without a holder's registration (a finished turn's output KV,
        named once the next turn shows its block ids)."""
        ref, lru = self.ref, self.lru
        for key in keys:
            if key in ref:
                if ref[key] == 0:
                    lru.move_to_end(key)
                continue
            if self.capacity - self.used <= 0:
                return
            ref[key] = 0
            lru[key] = None
        self._trim()
