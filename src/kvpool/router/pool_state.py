"""What the shared pool holds, exactly, as the router's own chain hashes. Pure: no I/O.

Rules:
- Two feeds meet here. The master's pool events (protocol/events.py) name the pool keys held per
  namespace: a key is the hex of vLLM's hash of an object's last block (connector/keys.py). The
  backends' BlockStored events (kv_events.py) say which engine hash stands for which router hash
  (prefix_index.chain): the router never computes vLLM's hashes, it learns them.
- `prefix_blocks(chain)` is how many leading blocks of a prompt the pool holds, counted in whole
  objects of `object_blocks` blocks: object i is held when the key of its last block,
  chain[(i + 1) * object_blocks - 1], is held in a followed namespace.
- Keys meet as the low 64 bits of vLLM's block hash: vLLM's KV events carry exactly that by
  default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES: the hash as a big-endian int, masked to 64 bits),
  the pool's keys the whole hash in hex; bytes hashes (events sent with the setting off) are cut the
  same way. A key that is not hex (a hybrid model's per-group key) is not followed.
- Races: a key held before any backend's event named it stays pending (held, not placed) and is
  placed when its mapping arrives; a mapping learned before the pool holds its key waits among the
  `recent` ones. A snapshot (`reset`) replaces what is held, keeping the mappings.
- `apply` takes batches in sequence within one epoch; anything else (a gap, another incarnation)
  is refused, and the caller resyncs from a snapshot. Batches at or before the snapshot are skipped.
- Bounded memory: a mapping is kept for each held key (the pool bounds those) and for at most
  `max_recent` keys learned but not held, least recently learned dropped first; a key the pool
  forgets moves its mapping back there (the engine may store it again).
- Disk-only objects count as held (a lookup promotes them); a counting LookupPrefix stops at them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

from kvpool.core.protocol import PoolEventBatch, PoolEventsOffer
from kvpool.router.prefix_index import RouterHash

PoolKey = int  # the low 64 bits of vLLM's block hash
_MASK = (1 << 64) - 1


def pool_key(engine_hash: Hashable) -> PoolKey | None:
    """The key an engine's KV event names a block by, as the router matches it with the pool's keys;
    None for a hash no connector could have used."""
    if isinstance(engine_hash, (bytes, bytearray, memoryview)):
        return int.from_bytes(bytes(engine_hash)[-8:], "big")
    if isinstance(engine_hash, int) and not isinstance(engine_hash, bool):
        return engine_hash & _MASK
    return None


def stored_key(key: str) -> PoolKey | None:
    """A pool key as the master names it (connector/keys.hash_hex), matched as `pool_key` does."""
    try:
        return int(key[-16:], 16) if key else None
    except ValueError:
        return None  # not a hash's hex: a key the router cannot place


class PoolIndex:
    def __init__(self, object_blocks: int = 1, namespaces: Iterable[str] = (), max_recent: int = 1_000_000) -> None:
        if object_blocks < 1:
            raise ValueError(f"object_blocks must be >= 1, got {object_blocks}")
        if max_recent < 1:
            raise ValueError(f"max_recent must be >= 1, got {max_recent}")
        self.object_blocks = object_blocks
        self.namespaces = frozenset(namespaces)  # empty: every namespace
        self.max_recent = max_recent
        self.epoch: int | None = None  # of the snapshot; None: none taken yet
        self.seq = 0  # the last batch applied (or the snapshot's)
        self._held: dict[str, set[PoolKey]] = {}  # namespace -> keys it holds
        self._placed: dict[PoolKey, RouterHash] = {}  # held keys whose router hash is known
        self._recent: OrderedDict[PoolKey, RouterHash] = OrderedDict()  # learned, not held
        # router hashes of held, placed keys -> how many (two deployments' keys may name one prefix)
        self._present: dict[RouterHash, int] = {}

    # ---- the backends' side ------------------------------------------------------------------------

    def learn(self, engine_hashes: Sequence[Hashable], router_hashes: Sequence[RouterHash]) -> None:
        """A BlockStored event, placed in the router's chain: engine_hashes[i] is router_hashes[i]."""
        for engine_hash, ours in zip(engine_hashes, router_hashes):
            key = pool_key(engine_hash)
            if key is None:
                continue
            if self._is_held(key):
                if key not in self._placed:
                    self._place(key, ours)
                continue
            self._recent[key] = ours
            self._recent.move_to_end(key)
        while len(self._recent) > self.max_recent:
            self._recent.popitem(last=False)

    # ---- the master's side -------------------------------------------------------------------------

    def follows(self, tenant: str) -> bool:
        return not self.namespaces or tenant in self.namespaces

    def reset(self, offer: PoolEventsOffer) -> None:
        """Take a snapshot: what it says is held replaces everything held before."""
        known = self._recent
        for key, ours in self._placed.items():
            known[key] = ours
        self._held = {}
        self._placed = {}
        self._present = {}
        self.epoch, self.seq = offer.epoch, offer.seq
        for entry in offer.held:
            if self.follows(entry.tenant):
                self._stored(entry.tenant, entry.keys)
        while len(known) > self.max_recent:
            known.popitem(last=False)

    def clear(self) -> None:
        """Forget what is held (the master restarted): nothing is held until the next snapshot."""
        self.reset(PoolEventsOffer("", 0, 0))
        self.epoch = None

    def apply(self, batch: PoolEventBatch) -> bool:
        """Apply the next batch; False when it cannot be (not taken a snapshot, another epoch, a
        gap): then nothing changed and a snapshot is needed."""
        if self.epoch is None or batch.epoch != self.epoch or batch.seq > self.seq + 1:
            return False
        if batch.seq <= self.seq:
            return True  # in the snapshot already
        self.seq = batch.seq
        for change in batch.changes:
            if self.follows(change.tenant):
                self._removed(change.tenant, change.removed)
                self._stored(change.tenant, change.stored)
        return True

    def _stored(self, tenant: str, names: Iterable[str]) -> None:
        held = self._held.get(tenant)
        if held is None:
            held = self._held[tenant] = set()
        for name in names:
            key = stored_key(name)
            if key is None or key in held:
                continue
            held.add(key)
            if key in self._placed:
                continue  # held in another namespace too
            ours = self._recent.pop(key, None)
            if ours is not None:
                self._place(key, ours)

    def _removed(self, tenant: str, names: Iterable[str]) -> None:
        held = self._held.get(tenant)
        if held is None:
            return
        for name in names:
            key = stored_key(name)
            if key is None or key not in held:
                continue
            held.discard(key)
            if self._is_held(key):
                continue
            ours = self._placed.pop(key, None)
            if ours is not None:
                left = self._present[ours] - 1
                if left:
                    self._present[ours] = left
                else:
                    del self._present[ours]
                self._recent[key] = ours
        while len(self._recent) > self.max_recent:
            self._recent.popitem(last=False)

    def _place(self, key: PoolKey, ours: RouterHash) -> None:
        self._placed[key] = ours
        self._present[ours] = self._present.get(ours, 0) + 1

    def _is_held(self, key: PoolKey) -> bool:
        return any(key in held for held in self._held.values())

    # ---- the answer --------------------------------------------------------------------------------

    def prefix_blocks(self, chain: Sequence[RouterHash]) -> int:
        """Leading blocks of `chain` the pool holds, in whole objects."""
        step = self.object_blocks
        present = self._present
        n = 0
        for last in range(step - 1, len(chain), step):
            if chain[last] not in present:
                break
            n += step
        return n

    @property
    def num_held(self) -> int:
        return sum(len(held) for held in self._held.values())

    @property
    def num_pending(self) -> int:
        """Keys held whose block no backend's event has placed yet."""
        if len(self._held) == 1:
            return self.num_held - len(self._placed)
        return len(set().union(*self._held.values())) - len(self._placed)

    @property
    def num_recent(self) -> int:
        return len(self._recent)
