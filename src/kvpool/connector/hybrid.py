"""The scheduler side's plans for a hybrid model: several KV-cache groups, one object per (group,
block) (groups.py). What to look up, load and save; the scheduler pins and sends what this returns.

Rules:
- A hybrid model's pool objects are single blocks (`tokens_per_object` unset), and its hits are
  vLLM's rule (hit_rule.py): both are refused at construction otherwise.
- Full-attention groups come first in every list this makes: a load's leading objects are the prefix.
- One lookup is one `Exists` round trip per rank namespace, answering every group; a block counts
  as present only where every rank has it.
- One place builds a save's keys and parents (`keys_and_parents`), for window, state and
  full-attention objects alike: a full-attention block's parent is the block before it, any other
  block's the full-attention block at its place, so it is evicted before the prefix it extends.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.connector.groups import (
    BlockObject,
    GroupRule,
    blocks_to_load,
    blocks_to_save,
    group_block_key,
    intersect_present,
    lookup_keys,
    present_blocks,
)
from kvpool.connector.plan import Geometry, LoadSpec
from kvpool.connector.request_state import RequestState


class GroupQuery:
    """A hybrid model's lookup: the window's block hashes and every group's keys for them."""

    __slots__ = ("hashes", "keys", "groups")

    def __init__(self, hashes, keys: list[str], groups: list[int]) -> None:
        self.hashes, self.keys, self.groups = list(hashes), keys, groups

    def __len__(self) -> int:
        return len(self.hashes)


class HybridPlans:
    def __init__(self, geom: Geometry, rules: dict[int, GroupRule], hit_rule) -> None:
        if geom.blocks_per_object != 1:
            raise ValueError("a hybrid model's pool objects are single blocks: leave tokens_per_object unset")
        if hit_rule is None:
            raise ValueError("a hybrid model needs vLLM's hit rule")
        self.rules = rules
        self.order = sorted(rules, key=lambda g: rules[g].kind != "full")
        self.full_rules = {g: r for g, r in rules.items() if r.kind == "full"}
        self.first_full = next(iter(self.full_rules), None)
        self._hit_rule = hit_rule
        self._block_size = geom.block_size

    def query(self, block_hashes, window: int) -> GroupQuery:
        return GroupQuery(block_hashes[:window], lookup_keys(block_hashes, self.order, window), self.order)

    def hit_blocks(self, client, query: GroupQuery, namespaces: Sequence[str]) -> int:
        """Which (group, block) objects exist, in one round trip per rank namespace; then the hit
        every group can serve, in blocks, by vLLM's rule."""
        num_blocks = len(query.hashes)
        answers = [present_blocks(query.groups, num_blocks, client.exists(query.keys, namespace=namespace))
                   for namespace in (namespaces or [None])]
        hit_tokens = self._hit_rule.longest_hit(query.hashes, num_blocks, intersect_present(answers))
        return hit_tokens // self._block_size

    def mark_saved(self, state: RequestState, num_objects: int) -> None:
        """Objects [0, num_objects) need no save, nor the groups' windows or states at that
        boundary, which the hit needed."""
        state.mark_saved(num_objects, self.rules)

    def load(self, request, block_tables, num_local: int, num_external_tokens: int) -> LoadSpec:
        """Read every block vLLM allocated between the local hit and the pool hit."""
        bs = self._block_size
        objects = blocks_to_load(block_tables, self.order, num_local // bs, (num_local + num_external_tokens) // bs)
        hashes = request.block_hashes
        return LoadSpec(request.request_id, [group_block_key(o.group, hashes[o.index]) for o in objects],
                        [[o.block_id] for o in objects], [o.group for o in objects])

    def save(self, state: RequestState, boundary: int, block_tables,
             rules: dict[int, GroupRule]) -> list[BlockObject]:
        """Each group's blocks for a save at `boundary` blocks (groups.py); advances the state's progress."""
        objects, state.saved_until = blocks_to_save(block_tables, rules, state.saved_until, boundary)
        if self.first_full is not None:
            state.next_save = state.saved_until.get(self.first_full, 0)
        return objects

    def keys_and_parents(self, block_hashes, objects: Sequence[BlockObject]) -> tuple[list[str], list[str | None]]:
        first_full = self.first_full
        keys, parents = [], []
        for o in objects:
            keys.append(group_block_key(o.group, block_hashes[o.index]))
            if self.rules[o.group].kind == "full":
                parents.append(group_block_key(o.group, block_hashes[o.index - 1]) if o.index else None)
            else:
                parents.append(group_block_key(first_full, block_hashes[o.index]) if first_full is not None else None)
        return keys, parents
