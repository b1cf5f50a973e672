"""KV-cache groups of a hybrid model: what each group stores and loads (pure: no I/O, no vLLM).

vLLM's hybrid KV cache manager splits a model's layers into groups of one kind each (full
attention, sliding window, Mamba / linear attention), all with the same block size here, all
indexed by the request's chained block hashes. The pool mirrors vLLM's own prefix cache:

Rules:
- One pool object per (group, block). Its key names the group and the block's chained hash
  (`group_block_key`), so block i of group g holds exactly what vLLM's block i of group g holds
  for that prefix, in any process. Objects are single blocks: a hybrid deployment's
  `tokens_per_object` is its block size.
- A full-attention group stores every block: a hit of L tokens needs blocks [0, L).
- A sliding-window group stores, at each save boundary B (in blocks), only what hits of B and of
  B - 1 blocks need: the last `blocks_for_hit` + 1 blocks before B (vLLM's rule: a hit needs
  cdiv(window - 1, block size) blocks). B - 1 is the hit of a request that re-sends a prompt of
  exactly B blocks (its last token is always computed). Blocks that fall out of the window
  between boundaries are never stored.
- A Mamba group (align mode) stores the states vLLM commits at block boundaries, as vLLM hands
  them over (`boundary_state_offloads`: group, block id, boundary), under the key of the block
  that ends at the boundary: its block table is not append-only (interior states are nulled and
  blocks relocated), so states are not read from it by position, but for one case vLLM hands
  nothing over: a block boundary reached by decoding, whose state the step that reaches it
  writes into the block ending there (`decode_state_saves`), so the agent's output is part of
  the next turn's hit.
- Which hit length every group can serve is vLLM's decision (hit_rule.py asks vLLM's hybrid
  coordinator); what a load reads is what vLLM allocated for it: every non-null block of each
  group between the local hit and the pool hit (vLLM pads blocks outside a window with its null
  block 0). A block that vLLM allocated and the pool lacks fails the load, and vLLM recomputes.
- An object's parent is the full-attention block at the same position (the pool evicts an object
  with children last): a window or state block goes before the prefix it depends on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvpool.connector.keys import hash_hex
from kvpool.core.types import ObjectKey

NULL_BLOCK_ID = 0  # vLLM's placeholder block (v1/attention/backends/utils.py); never holds KV

GroupKind = Literal["full", "window", "state"]


@dataclass(frozen=True)
class GroupRule:
    """What one KV-cache group keeps for a prefix. `blocks_for_hit`: how many blocks right before
    a hit's end the group needs (None: all of them)."""

    kind: GroupKind
    blocks_for_hit: int | None = None

    def __post_init__(self) -> None:
        if (self.kind == "full") != (self.blocks_for_hit is None):
            raise ValueError(f"a {self.kind} group needs blocks_for_hit {'None' if self.kind == 'full' else '>= 1'}")
        if self.blocks_for_hit is not None and self.blocks_for_hit < 1:
            raise ValueError(f"blocks_for_hit must be >= 1, got {self.blocks_for_hit}")

    def blocks_to_store(self, saved_until: int, boundary: int) -> range:
        """Block indices to store for a save boundary of `boundary` blocks, given that this group's
        blocks [.., saved_until) are stored or on their way."""
        if self.kind == "state":
            return range(0)  # from vLLM's hand-offs (state_saves), never from the block table
        if self.blocks_for_hit is None:
            return range(saved_until, boundary)
        span = self.blocks_for_hit + 1 if self.kind == "window" else self.blocks_for_hit
        return range(max(saved_until, boundary - span), boundary)


def group_block_key(group: int, block_hash: object) -> ObjectKey:
    return ObjectKey(f"g{group}-{hash_hex(block_hash)}")


def lookup_keys(block_hashes: Sequence[object], groups: Sequence[int], num_blocks: int) -> list[ObjectKey]:
    """Every group's keys for blocks [0, num_blocks), group by group: one exists-query answers all."""
    return [group_block_key(g, block_hashes[i]) for g in groups for i in range(num_blocks)]


def present_blocks(groups: Sequence[int], num_blocks: int, exists: Sequence[bool]) -> dict[int, set[int]]:
    """The answer to `lookup_keys` as group -> block indices present."""
    if len(exists) != len(groups) * num_blocks:
        raise ValueError(f"{len(exists)} answers for {len(groups)} groups of {num_blocks} blocks")
    return {g: {i for i in range(num_blocks) if exists[n * num_blocks + i]} for n, g in enumerate(groups)}


def intersect_present(answers: Sequence[dict[int, set[int]]]) -> dict[int, set[int]]:
    """Blocks present for every TP / PP rank (each rank stores its shard under its own namespace)."""
    first, *rest = answers
    return {g: set(blocks).intersection(*(a.get(g, set()) for a in rest)) for g, blocks in first.items()}


@dataclass(frozen=True)
class BlockObject:
    """One pool object: block `index` of group `group`, at vLLM block `block_id`."""

    group: int
    index: int
    block_id: int


def blocks_to_load(block_tables: Sequence[Sequence[int]], groups: Sequence[int], first_block: int,
                   end_block: int) -> list[BlockObject]:
    """What a load of blocks [first_block, end_block) reads: every block vLLM allocated there, in
    every stored group (full-attention groups first, as they were listed)."""
    out: list[BlockObject] = []
    for g in groups:
        table = block_tables[g]
        if len(table) < end_block:
            raise ValueError(f"group {g} has {len(table)} blocks, the load needs {end_block}")
        out.extend(BlockObject(g, i, table[i]) for i in range(first_block, end_block) if table[i] != NULL_BLOCK_ID)
    return out


def state_saves(offloads: Sequence[tuple[int, int, int]], rules: dict[int, GroupRule], block_size: int,
                num_block_hashes: int) -> list[BlockObject]:
    """The states of vLLM's hand-offs (group, block id, boundary tokens) the pool can key: a state
    group's, at a whole block boundary whose block hash exists (a partial tail has none)."""
    out: list[BlockObject] = []
    for g, block_id, boundary in offloads:
        rule = rules.get(g)
        if rule is None or rule.kind != "state" or block_id == NULL_BLOCK_ID or boundary <= 0:
            continue
        if boundary % block_size or boundary // block_size > num_block_hashes:
            continue
        out.append(BlockObject(g, boundary // block_size - 1, block_id))
    return out


def decode_state_saves(block_tables: Sequence[Sequence[int]], rules: dict[int, GroupRule],
                       boundary: int) -> list[BlockObject]:
    """The states at `boundary` blocks that a decode step reaching exactly that boundary writes:
    block boundary - 1 of each state group's table."""
    out: list[BlockObject] = []
    for g, rule in rules.items():
        table = block_tables[g]
        if rule.kind == "state" and 0 < boundary <= len(table) and table[boundary - 1] != NULL_BLOCK_ID:
            out.append(BlockObject(g, boundary - 1, table[boundary - 1]))
    return out


def blocks_to_save(block_tables: Sequence[Sequence[int]], rules: dict[int, GroupRule],
                   saved_until: dict[int, int], boundary: int) -> tuple[list[BlockObject], dict[int, int]]:
    """What a save at `boundary` blocks writes, per its group's rule, and each group's new
    `saved_until`. A window or state group whose needed block is already gone from vLLM's table
    (null) stores nothing for this boundary (a window with a hole would be a wrong hit); a
    full-attention group stops its chain at a null block."""
    out: list[BlockObject] = []
    after = dict(saved_until)
    for g, rule in rules.items():
        table = block_tables[g]
        if boundary > len(table):
            continue
        wanted = rule.blocks_to_store(saved_until.get(g, 0), boundary)
        ids = [table[i] for i in wanted]
        if rule.kind == "full":
            ids = ids[: next((n for n, b in enumerate(ids) if b == NULL_BLOCK_ID), len(ids))]
        elif NULL_BLOCK_ID in ids:
            continue
        out.extend(BlockObject(g, i, b) for i, b in zip(wanted, ids))
        if ids:
            after[g] = wanted[0] + len(ids)
    return out, after
