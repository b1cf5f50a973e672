"""Hybrid models in the connector: what each KV-cache group stores and loads (groups.py), and the
hit every group can serve, decided by vLLM's own hybrid coordinator (hit_rule.py), on exact blocks."""

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.kv_cache_interface import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from kvpool.connector.groups import (
    GroupRule,
    blocks_to_load,
    blocks_to_save,
    group_block_key,
    intersect_present,
    lookup_keys,
    present_blocks,
    state_saves,
)
from kvpool.connector.health import PoolHealth
from kvpool.connector.hit_rule import HitRule, kv_group_rules
from kvpool.connector.plan import Geometry
from kvpool.connector.scheduler import SchedulerSide

BS = 4
HASHES = [bytes([i]) * 32 for i in range(1, 40)]


def full() -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)


def window(tokens: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32, sliding_window=tokens)


def mamba(mode: str = "align") -> MambaSpec:
    return MambaSpec(block_size=BS, shapes=((2, 4),), dtypes=(torch.float32,), mamba_cache_mode=mode)


def config(*specs) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"model.layers.{i}.attn"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def vllm_config() -> SimpleNamespace:
    return SimpleNamespace(speculative_config=None, model_config=SimpleNamespace(max_model_len=4096),
                           max_in_flight_tokens=2048, num_prefill_lookahead_tokens=0)


def rule_for(*specs) -> HitRule:
    return HitRule(vllm_config(), config(*specs), BS)


# ---- what is stored -------------------------------------------------------------------------------

def test_rules_follow_vllms_managers_and_refuse_what_cannot_be_served():
    rules = kv_group_rules(config(full(), window(8), window(9), mamba()), BS)
    # a window of 8 tokens needs cdiv(7, 4) = 2 blocks before the hit, of 9 tokens cdiv(8, 4) = 2
    assert rules == {0: GroupRule("full"), 1: GroupRule("window", 2), 2: GroupRule("window", 2),
                     3: GroupRule("state", 1)}  # fmt: skip
    with pytest.raises(ValueError, match="--mamba-cache-mode align"):
        kv_group_rules(config(full(), mamba("all")), BS)
    with pytest.raises(ValueError, match="does not serve"):
        kv_group_rules(config(full(), CrossAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8,
                                                          dtype=torch.float32)), BS)
    with pytest.raises(ValueError, match="same block size"):
        kv_group_rules(config(full(), window(8)), 2 * BS)


def test_a_window_group_stores_what_hits_at_the_boundary_and_one_block_before_need():
    rules = {0: GroupRule("full"), 1: GroupRule("window", 2), 2: GroupRule("state", 1)}
    tables = [list(range(10, 20)), [0, 0, 0, 0, 0, 25, 26, 27, 28, 29], [0, 0, 0, 0, 0, 0, 0, 0, 38, 39]]
    objects, after = blocks_to_save(tables, rules, {0: 0, 1: 0, 2: 0}, boundary=9)
    assert [(o.group, o.index, o.block_id) for o in objects] == [
        *((0, i, 10 + i) for i in range(9)),  # every full-attention block
        (1, 6, 26), (1, 7, 27), (1, 8, 28),  # the window of a 9-block hit (7, 8) and of an 8-block one (6, 7)
    ]  # never a state from the table: they come from vLLM's hand-offs (state_saves)
    assert after == {0: 9, 1: 9, 2: 0}
    # the next boundary stores only what is new; a window with a hole (a null block) stores nothing
    objects, after = blocks_to_save(tables, rules, after, boundary=10)
    assert [(o.group, o.index) for o in objects] == [(0, 9), (1, 9)]
    holes = [list(range(10, 20)), [0, 0, 0, 0, 0, 0, 0, 0, 28, 29], [0] * 10]
    objects, after = blocks_to_save(holes, rules, {0: 9, 1: 0, 2: 0}, boundary=10)
    assert [(o.group, o.index) for o in objects] == [(0, 9)] and after == {0: 10, 1: 0, 2: 0}


def test_states_are_saved_from_vllms_hand_offs_at_whole_block_boundaries():
    rules = {0: GroupRule("full"), 1: GroupRule("window", 2), 2: GroupRule("state", 1)}
    offloads = [(2, 40, 36), (2, 41, 30), (2, 0, 32), (1, 42, 36), (2, 43, 48), (2, 44, 4)]
    # the state after 9 blocks sits in block 40 and is keyed by block 8's hash; a partial tail (30
    # tokens), the null block, another kind's block and a boundary past the known hashes are not
    assert [(o.group, o.index, o.block_id) for o in state_saves(offloads, rules, BS, 10)] == [
        (2, 8, 40), (2, 0, 44)]


def test_a_load_reads_every_block_vllm_allocated_between_local_and_pool_hit():
    tables = [[5, 6, 7, 8, 9, 10], [0, 0, 0, 0, 11, 12], [0, 0, 0, 0, 0, 13]]
    objects = blocks_to_load(tables, [0, 1, 2], first_block=2, end_block=6)
    assert [(o.group, o.index, o.block_id) for o in objects] == [
        (0, 2, 7), (0, 3, 8), (0, 4, 9), (0, 5, 10), (1, 4, 11), (1, 5, 12), (2, 5, 13)]


def test_one_exists_query_answers_every_group():
    keys = lookup_keys(HASHES, [0, 2], 3)
    assert keys == [group_block_key(g, HASHES[i]) for g in (0, 2) for i in range(3)]
    assert group_block_key(2, HASHES[0]) == "g2-" + HASHES[0].hex()
    present = present_blocks([0, 2], 3, [True, True, False, False, True, True])
    assert present == {0: {0, 1}, 2: {1, 2}}
    assert intersect_present([present, {0: {0}, 2: {1, 2}}]) == {0: {0}, 2: {1, 2}}
    with pytest.raises(ValueError):
        present_blocks([0, 2], 3, [True])


# ---- which hit: vLLM's coordinator over the pool's blocks ----------------------------------------

def test_full_and_window_hit_needs_the_window_at_the_hit():
    rule = rule_for(full(), window(8))  # a hit needs the 2 window blocks right before it
    every = set(range(10))
    assert rule.longest_hit(HASHES, 10, {0: every, 1: {8, 9}}) == 10 * BS
    assert rule.longest_hit(HASHES, 10, {0: every, 1: {7, 8}}) == 9 * BS  # the window at 9 only
    assert rule.longest_hit(HASHES, 10, {0: set(range(8)), 1: {7, 8}}) == 0  # no window within 8 blocks
    assert rule.longest_hit(HASHES, 10, {0: set(range(8)), 1: {5, 6}}) == 7 * BS
    # shorter than the window: the leading blocks are a hit even if fewer than the window needs
    assert rule.longest_hit(HASHES, 10, {0: every, 1: {0}}) == 1 * BS
    assert rule.longest_hit(HASHES, 10, {0: every, 1: set()}) == 0


def test_mamba_hit_starts_only_where_a_state_was_saved():
    rule = rule_for(full(), mamba())
    every = set(range(12))
    assert rule.longest_hit(HASHES, 12, {0: every, 1: {3, 7}}) == 8 * BS  # the state after 8 blocks
    assert rule.longest_hit(HASHES, 12, {0: set(range(6)), 1: {3, 7}}) == 4 * BS
    assert rule.longest_hit(HASHES, 12, {0: every, 1: set()}) == 0


def test_three_kinds_reconcile_to_one_length():
    rule = rule_for(full(), window(8), mamba())
    every = set(range(12))
    # the window allows 11 or 7 blocks, the state 7 or 11 -> both at 11; without state 10 -> 7
    assert rule.longest_hit(HASHES, 12, {0: every, 1: {5, 6, 9, 10}, 2: {6, 10}}) == 11 * BS
    assert rule.longest_hit(HASHES, 12, {0: every, 1: {5, 6, 9, 10}, 2: {6}}) == 7 * BS


# ---- the scheduler half of a hybrid model, on vLLM's real BlockPool --------------------------------

class Exists:
    def __init__(self, stored: set[str]) -> None:
        self.stored, self.calls = stored, 0

    def ping(self) -> None:
        pass

    def exists(self, keys: list[str], namespace=None) -> list[bool]:
        self.calls += 1
        return [k in self.stored for k in keys]

    def close(self) -> None:
        pass


def hybrid_side(stored: set[str]) -> tuple[SchedulerSide, BlockPool, Exists]:
    client = Exists(stored)
    rules = {0: GroupRule("full"), 1: GroupRule("window", 2)}
    side = SchedulerSide(Geometry(BS, 1), make_client=lambda: client, health=PoolHealth("test", 60.0, 60.0),
                         num_workers=1, save_decode=True, load_async=True, lookup_answer_wait_s=5.0,
                         group_rules=rules, hit_rule=rule_for(full(), window(8)))  # fmt: skip
    pool = BlockPool(num_gpu_blocks=64, enable_caching=True, hash_block_size=BS)
    side.bind_block_pool(pool)
    return side, pool, client


def req(num_tokens: int, num_computed: int = 0) -> SimpleNamespace:
    return SimpleNamespace(request_id="r", num_tokens=num_tokens, num_prompt_tokens=num_tokens,
                           num_computed_tokens=num_computed, block_hashes=HASHES[: num_tokens // BS])  # fmt: skip


def test_hybrid_lookup_load_and_save_plans():
    stored = {group_block_key(0, h) for h in HASHES[:6]} | {group_block_key(1, h) for h in HASHES[3:5]}
    side, pool, client = hybrid_side(stored)
    r = req(30)  # 7 full blocks + 2 tokens
    # the pool holds full blocks 0..5 and the window at 5 (blocks 3, 4): a 5-block hit
    assert side.get_num_new_matched_tokens(r, 0) == (5 * BS, True)
    assert client.calls == 1  # one round trip for both groups
    tables = (list(range(1, 9)), [0, 0, 0, 14, 15, 16, 17, 18])
    side.update_state_after_alloc(r, SimpleNamespace(get_block_ids=lambda: tables), 5 * BS)
    meta = side.build_connector_meta(SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="r", num_computed_tokens=5 * BS)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={"r": 10}, scheduled_spec_decode_tokens={},
        kv_connector_block_state=SimpleNamespace(get_block_ids=lambda rid: tables)))
    (load,) = meta.loads
    assert load.keys == [group_block_key(0, HASHES[i]) for i in range(5)] + \
        [group_block_key(1, HASHES[i]) for i in (3, 4)]
    assert load.block_ids == [[1], [2], [3], [4], [5], [14], [15]] and load.groups == [0] * 5 + [1, 1]
    # the step computes to 30 tokens: full blocks 5, 6 and the window at 7 (blocks 4..6) are saved;
    # block 4 of the window group was loaded, so it is in the pool: only 5, 6
    (save,) = meta.saves
    assert [(g, k) for g, k in zip(save.groups, save.keys)] == [
        (0, group_block_key(0, HASHES[5])), (0, group_block_key(0, HASHES[6])),
        (1, group_block_key(1, HASHES[5])), (1, group_block_key(1, HASHES[6]))]
    assert save.block_ids == [[6], [7], [16], [17]]
    # a window block's parent is the full-attention block at its place: it is evicted first
    assert save.parents == [group_block_key(0, HASHES[4]), group_block_key(0, HASHES[5]),
                            group_block_key(0, HASHES[5]), group_block_key(0, HASHES[6])]
    assert all(pool.blocks[b].ref_cnt == 1 for b in (6, 7, 16, 17))  # pinned until the worker reports


def test_hybrid_state_hand_offs_are_pinned_and_saved_under_the_boundary_blocks_key():
    client = Exists(set())
    rules = {0: GroupRule("full"), 1: GroupRule("state", 1)}
    side = SchedulerSide(Geometry(BS, 1), make_client=lambda: client, health=PoolHealth("test", 60.0, 60.0),
                         num_workers=1, save_decode=True, load_async=True, lookup_answer_wait_s=5.0,
                         group_rules=rules, hit_rule=rule_for(full(), mamba()))  # fmt: skip
    pool = BlockPool(num_gpu_blocks=64, enable_caching=True, hash_block_size=BS)
    side.bind_block_pool(pool)
    r = req(18)
    assert side.get_num_new_matched_tokens(r, 0) == (0, False)
    tables = (list(range(1, 6)), [0, 0, 0, 0, 30])
    side.update_state_after_alloc(r, SimpleNamespace(get_block_ids=lambda: tables), 0)
    meta = side.build_connector_meta(SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="r", num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={"r": 18}, scheduled_spec_decode_tokens={},
        kv_connector_block_state=SimpleNamespace(get_block_ids=lambda rid: tables,
                                                 boundary_state_offloads={"r": [(1, 22, 16)], "gone": [(1, 23, 8)]})))
    full_save, state_save = meta.saves
    assert full_save.keys == [group_block_key(0, HASHES[i]) for i in range(4)] and full_save.groups == [0] * 4
    # the state after 16 tokens (block 22) under block 3's key, its parent the full block at its place
    assert state_save.keys == [group_block_key(1, HASHES[3])] and state_save.block_ids == [[22]]
    assert state_save.groups == [1] and state_save.parents == [group_block_key(0, HASHES[3])]
    assert pool.blocks[22].ref_cnt == 1 and pool.blocks[23].ref_cnt == 0


def test_a_decode_step_reaching_a_boundary_saves_the_state_in_the_block_ending_there():
    from kvpool.connector.groups import decode_state_saves

    rules = {0: GroupRule("full"), 1: GroupRule("window", 2), 2: GroupRule("state", 1)}
    tables = [list(range(10, 17)), [0, 0, 0, 0, 24, 25, 26], [0, 0, 0, 0, 0, 35, 36]]
    assert [(o.group, o.index, o.block_id) for o in decode_state_saves(tables, rules, 6)] == [(2, 5, 35)]
    assert decode_state_saves(tables, rules, 5) == []  # vLLM already dropped that state: nothing
