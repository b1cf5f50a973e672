"""Which hit every KV-cache group of a hybrid model can serve from the pool: vLLM's own answer.

Rules:
- The hit length is what vLLM's hybrid coordinator (v1/core/kv_cache_coordinator.py) finds over
  the blocks the pool holds: the same code that decides local prefix-cache hits, with its
  per-kind finders (full attention from the left, sliding window from the right needing
  cdiv(window - 1, block_size) contiguous blocks, Mamba the last state), its fixed-point
  reconciliation across groups and its alignment. We build one coordinator for the model's
  groups and point its managers at `PresentBlocks`, a stand-in for vLLM's block pool that answers
  from a set of (group, block index) the pool reported, so the rule is never re-invented here.
- `kv_group_rules` says what each group stores (groups.GroupRule) and refuses, with the setting
  to change, what the pool cannot serve bit-exact: cross-attention and encoder-only groups,
  groups outside prefix caching, Mamba in a cache mode other than "align", block sizes that
  differ between groups or from the hash block size.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.single_type_kv_cache_manager import (
    FullAttentionManager,
    MambaManager,
    SinkFullAttentionManager,
    SlidingWindowManager,
)
from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from kvpool.connector.groups import GroupRule


def kv_group_rules(kv_cache_config, hash_block_size: int) -> dict[int, GroupRule]:
    """group index -> what it stores; ValueError naming the setting for what cannot be served."""
    rules: dict[int, GroupRule] = {}
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        name = f"KV-cache group {g} ({type(spec).__name__}, layers {group.layer_names[:2]}...)"
        if not spec.prefix_cacheable or not group.enable_kv_transfer:
            raise ValueError(f"KVPoolConnector: {name} is outside vLLM's prefix caching or KV transfer; the pool "
                             "cannot serve it (run this model without --kv-transfer-config KVPoolConnector)")
        if spec.block_size != hash_block_size:
            raise ValueError(
                f"KVPoolConnector: {name} has block size {spec.block_size}, vLLM hashes blocks of "
                f"{hash_block_size}; give every group the same block size (--block-size)"
            )
        manager = KVCacheSpecRegistry.get_manager_class(spec, group.role)  # the manager vLLM runs it with
        if isinstance(spec, MambaSpec) and manager is MambaManager:
            if spec.mamba_cache_mode != "align":
                raise ValueError(
                    f"KVPoolConnector: {name} uses mamba_cache_mode={spec.mamba_cache_mode!r}; the pool stores "
                    "Mamba states at block boundaries, which needs --mamba-cache-mode align"
                )
            rules[g] = GroupRule("state", 1)
        elif isinstance(spec, SlidingWindowSpec) and manager is SlidingWindowManager:
            rules[g] = GroupRule("window", cdiv(spec.sliding_window - 1, spec.block_size)
                                 + cdiv(getattr(spec, "extra_retained_tokens", 0), spec.block_size))
        elif manager in (FullAttentionManager, SinkFullAttentionManager):
            rules[g] = GroupRule("full")
        else:
            raise ValueError(
                f"KVPoolConnector: {name} is a kind the pool does not serve (full attention, sliding window "
                "and Mamba align groups are); run this model without --kv-transfer-config KVPoolConnector"
            )
    return rules


class PresentBlocks:
    """What vLLM's cache-hit finders ask of a block pool, answered from the pool's blocks."""

    def __init__(self, hash_block_size: int) -> None:
        self.hash_block_size = hash_block_size
        self.null_block = KVCacheBlock(0)
        self._held = KVCacheBlock(1)  # any non-null block: only the hit length is read back
        self._index: dict[bytes, int] = {}
        self._present: dict[int, set[int]] = {}

    def set(self, block_hashes: Sequence[bytes], present: dict[int, set[int]]) -> None:
        self._index = {bytes(h): i for i, h in enumerate(block_hashes)}
        self._present = present

    def get_cached_block(self, block_hash, kv_cache_group_ids: list[int]) -> list[KVCacheBlock] | None:
        i = self._index.get(bytes(block_hash))
        if i is None or any(i not in self._present.get(g, ()) for g in kv_cache_group_ids):
            return None
        return [self._held] * len(kv_cache_group_ids)


class HitRule:
    """longest_hit(block_hashes, present) -> tokens every group can serve (vLLM's coordinator)."""

    def __init__(self, vllm_config, kv_cache_config, hash_block_size: int) -> None:
        spec_config = vllm_config.speculative_config
        use_eagle = bool(spec_config is not None and spec_config.use_eagle())
        # the coordinator allocates a block pool of num_blocks entries we never use: keep it small
        small = dataclasses.replace(kv_cache_config, num_blocks=2)
        self._coordinator = HybridKVCacheCoordinator(
            small, max_model_len=vllm_config.model_config.max_model_len,
            max_in_flight_tokens=vllm_config.max_in_flight_tokens, use_eagle=use_eagle, enable_caching=True,
            enable_kv_cache_events=False, dcp_world_size=1, pcp_world_size=1,
            scheduler_block_size=hash_block_size, hash_block_size=hash_block_size,
            num_prefill_lookahead=vllm_config.num_prefill_lookahead_tokens,
        )
        self._blocks = PresentBlocks(hash_block_size)
        for manager in self._coordinator.single_type_managers:
            manager.block_pool = self._blocks
        self._lock = threading.Lock()  # one PresentBlocks answers one lookup at a time
        self.block_size = hash_block_size

    def longest_hit(self, block_hashes: Sequence[bytes], num_blocks: int, present: dict[int, set[int]]) -> int:
        """Tokens of the longest hit within blocks [0, num_blocks) that every group can serve."""
        if num_blocks <= 0:
            return 0
        hashes = list(block_hashes[:num_blocks])
        with self._lock:
            self._blocks.set(hashes, present)
            _, hit_tokens, _ = self._coordinator.find_longest_cache_hit(hashes, num_blocks * self.block_size)
        return hit_tokens
