"""Which token prefixes each backend holds in its own KV cache, from vLLM's KV events. Pure: no I/O.

Rules:
- The router never recomputes vLLM's block hashes (their seed and algorithm are the engine's). It
  keeps its own chain over token ids, `chain(parent, tokens)`, and learns from every BlockStored
  event which of the engine's hashes stands for which of its own. A stored block whose parent the
  router has not seen (events lost, router started late) cannot be placed in a prefix and is
  counted in `orphan_blocks`, not guessed.
- One `BackendCache` per backend: engine hash -> router hash, and the set of router hashes present.
  BlockRemoved drops a block; AllBlocksCleared drops them all (the engine reset its cache).
- `PoolLedger` estimates what the shared pool holds: every block any pooled backend stored (the
  connector saves what the engine computes), bounded, least recently stored dropped first. It is
  an estimate; the pool may have evicted more (see the router README section).
- The block size comes from the events; until the first one, prefixes are 0 tokens long.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import NewType


RouterHash = NewType("RouterHash", bytes)
_ROOT = RouterHash(b"")


def chain(parent: RouterHash, tokens: Sequence[int]) -> RouterHash:
    return RouterHash(hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest())


def prompt_chain(tokens: Sequence[int], block_size: int) -> list[RouterHash]:
    """Router hashes of every full block of `tokens`, in order: `chain` block by block, with the
    token ids turned into bytes once (per block, that was most of an 80K-token prompt's cost)."""
    hashes: list[RouterHash] = []
    parent = _ROOT
    data = array("q", tokens).tobytes()
    step = 8 * block_size
    blake2b = hashlib.blake2b
    for start in range(0, len(data) - step + 1, step):
        parent = blake2b(parent + data[start : start + step], digest_size=16).digest()
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class StoredBlocks:
    """A BlockStored event, decoded: consecutive blocks after `parent` (None: at the start)."""

    block_hashes: list[Hashable]
    parent: Hashable | None
    token_ids: list[int]
    block_size: int
    group: int | None = None  # a hybrid model's KV-cache group (None: the model has one)
    kind: str | None = None  # that group's kind ("full_attention", "sliding_window", "mamba", ...)


@dataclass(frozen=True)
class RemovedBlocks:
    block_hashes: list[Hashable]
    group: int | None = None


# Groups whose blocks hold a prefix from its start: a hybrid model's backend holds a prefix as far
# as these do (sliding-window and Mamba groups free older blocks as a request runs, and their
# events would cut prefixes the backend still serves)
PREFIX_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})


@dataclass(frozen=True)
class AllCleared:
    pass


KVEvent = StoredBlocks | RemovedBlocks | AllCleared


@dataclass
class BackendCache:
    engine_to_router: dict[Hashable, RouterHash] = field(default_factory=dict)
    present: set[RouterHash] = field(default_factory=set)
    block_size: int | None = None
    orphan_blocks: int = 0
    num_events: int = 0
    prefix_group: int | None = None  # a hybrid model: the full-attention group whose events count

    def apply(self, event: KVEvent) -> list[RouterHash]:
        """Apply one event; returns the router hashes it stored (for the pool ledger)."""
        self.num_events += 1
        if isinstance(event, AllCleared):
            self.engine_to_router.clear()
            self.present.clear()
            return []
        if not self._counts(event):
            return []
        if isinstance(event, RemovedBlocks):
            for h in event.block_hashes:
                ours = self.engine_to_router.pop(h, None)
                if ours is not None:
                    self.present.discard(ours)
            return []
        if event.block_size < 1 or len(event.token_ids) != len(event.block_hashes) * event.block_size:
            self.orphan_blocks += len(event.block_hashes)  # malformed: nothing can be placed
            return []
        self.block_size = event.block_size
        if event.parent is None:
            parent: RouterHash | None = _ROOT
        else:
            parent = self.engine_to_router.get(event.parent)
        if parent is None:
            self.orphan_blocks += len(event.block_hashes)
            return []
        stored = []
        for k, engine_hash in enumerate(event.block_hashes):
            parent = chain(parent, event.token_ids[k * event.block_size : (k + 1) * event.block_size])
            self.engine_to_router[engine_hash] = parent
            self.present.add(parent)
            stored.append(parent)
        return stored

    def _counts(self, event: StoredBlocks | RemovedBlocks) -> bool:
        """Whether the event is about the blocks this index follows: a model with one group
        publishes no group; a hybrid model's first full-attention group is followed, learned from
        its first store (removals name the group only)."""
        if event.group is None:
            return True
        if self.prefix_group is None and isinstance(event, StoredBlocks) and event.kind in PREFIX_KINDS:
            self.prefix_group = event.group
        return event.group == self.prefix_group

    def prefix_blocks(self, hashes: Sequence[RouterHash]) -> int:
        n = 0
        for h in hashes:
            if h not in self.present:
                break
            n += 1
        return n


class PoolLedger:
    """Blocks the pool is believed to hold, at most `max_blocks`, least recently stored dropped."""

    def __init__(self, max_blocks: int = 1_000_000) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[RouterHash, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def add(self, hashes: Sequence[RouterHash]) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)

    def prefix_blocks(self, hashes: Sequence[RouterHash]) -> int:
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n


def decode_event(raw: object) -> KVEvent | None:
    """One event of vLLM's KVEventBatch as msgpack decodes it: a map tagged by "type" (vLLM 0.32),
    or an array with the tag first (earlier releases). None for kinds the router does not use."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        get = raw.get
    elif isinstance(raw, (list, tuple)) and raw:
        kind = raw[0]
        names = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size"),
                 "BlockRemoved": ("block_hashes",)}.get(kind, ())  # fmt: skip  (no groups before 0.32)
        values = dict(zip(names, raw[1:]))
        get = values.get
    else:
        return None
    group = get("group_idx")
    group = group if isinstance(group, int) and not isinstance(group, bool) else None
    if kind == "BlockStored":
        return StoredBlocks([_key(h) for h in get("block_hashes") or []], _key(get("parent_block_hash")),
                            list(get("token_ids") or []), int(get("block_size") or 0), group,
                            get("kv_cache_spec_kind"))  # fmt: skip
    if kind == "BlockRemoved":
        return RemovedBlocks([_key(h) for h in get("block_hashes") or []], group)
    if kind == "AllBlocksCleared":
        return AllCleared()
    return None


def _key(h: object) -> Hashable | None:
    if h is None:
        return None
    if isinstance(h, (bytes, bytearray, memoryview)):
        return bytes(h)
    if isinstance(h, list):
        return tuple(h)
    return h  # type: ignore[return-value]  # an int (xxhash) or a str
