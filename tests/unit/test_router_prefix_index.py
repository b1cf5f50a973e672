"""The router's per-backend prefix index built from vLLM KV events, the pool ledger, and request
parsing (session identity, prompt size)."""

from kvpool.router.prefix_index import (
    AllCleared,
    BackendCache,
    PoolLedger,
    RemovedBlocks,
    StoredBlocks,
    decode_event,
    prompt_chain,
)
from kvpool.router.sessions import request_info

BS = 4
PROMPT = list(range(100, 116))  # 4 blocks of 4


def stored(hashes, parent, tokens):
    return StoredBlocks(hashes, parent, tokens, BS)


def test_stored_blocks_make_a_prefix_and_removal_cuts_it():
    cache = BackendCache()
    chain = prompt_chain(PROMPT, BS)
    cache.apply(stored([b"e0", b"e1"], None, PROMPT[:8]))
    assert cache.prefix_blocks(chain) == 2
    cache.apply(stored([b"e2"], b"e1", PROMPT[8:12]))  # continues the chain after e1
    assert cache.prefix_blocks(chain) == 3
    cache.apply(RemovedBlocks([b"e1"]))
    assert cache.prefix_blocks(chain) == 1  # e2 is still there but unreachable without e1
    cache.apply(AllCleared())
    assert cache.prefix_blocks(chain) == 0 and cache.engine_to_router == {}


def test_a_block_whose_parent_is_unknown_is_not_guessed():
    cache = BackendCache()
    stored_hashes = cache.apply(stored([b"e9"], b"never-seen", PROMPT[4:8]))
    assert stored_hashes == [] and cache.orphan_blocks == 1
    assert cache.prefix_blocks(prompt_chain(PROMPT, BS)) == 0


def test_other_tokens_do_not_match():
    cache = BackendCache()
    cache.apply(stored([b"e0"], None, [1, 2, 3, 4]))
    assert cache.prefix_blocks(prompt_chain([1, 2, 3, 5, 6, 7, 8, 9], BS)) == 0
    assert cache.prefix_blocks(prompt_chain([1, 2, 3, 4, 6, 7, 8, 9], BS)) == 1


def test_malformed_stored_event_is_counted():
    cache = BackendCache()
    assert cache.apply(StoredBlocks([b"e0", b"e1"], None, [1, 2, 3, 4], BS)) == []  # 2 blocks, 4 tokens
    assert cache.orphan_blocks == 2


def test_decode_event_reads_vllm_032_maps_and_older_arrays():
    as_map = {"type": "BlockStored", "block_hashes": [b"a", b"b"], "parent_block_hash": None,
              "token_ids": [1] * 8, "block_size": 4, "medium": "GPU"}  # fmt: skip
    assert decode_event(as_map) == StoredBlocks([b"a", b"b"], None, [1] * 8, 4)
    as_array = ["BlockStored", [7, 8], 6, [1] * 8, 4, None, "GPU"]
    assert decode_event(as_array) == StoredBlocks([7, 8], 6, [1] * 8, 4)
    assert decode_event({"type": "BlockRemoved", "block_hashes": [b"a"], "medium": "GPU"}) == RemovedBlocks([b"a"])
    assert decode_event({"type": "AllBlocksCleared"}) == AllCleared()
    assert decode_event({"type": "SomethingNew"}) is None
    assert decode_event(42) is None


def test_a_hybrid_models_backend_holds_what_its_full_attention_group_holds():
    cache = BackendCache()
    chain = prompt_chain(PROMPT, BS)
    # vLLM publishes each group's blocks under the same hashes; the window group frees its older
    # blocks as the request runs, which must not cut the prefix the full-attention group still holds
    cache.apply(StoredBlocks([b"e0", b"e1", b"e2"], None, PROMPT[:12], BS, group=1, kind="sliding_window"))
    assert cache.prefix_blocks(chain) == 0 and cache.prefix_group is None
    cache.apply(StoredBlocks([b"e0", b"e1", b"e2"], None, PROMPT[:12], BS, group=0, kind="full_attention"))
    assert cache.prefix_blocks(chain) == 3 and cache.prefix_group == 0
    cache.apply(RemovedBlocks([b"e0", b"e1"], group=1))
    assert cache.prefix_blocks(chain) == 3
    cache.apply(RemovedBlocks([b"e1"], group=0))
    assert cache.prefix_blocks(chain) == 1
    raw = {"type": "BlockRemoved", "block_hashes": [b"e0"], "medium": "GPU", "group_idx": 1}
    assert decode_event(raw) == RemovedBlocks([b"e0"], 1)
    raw = {"type": "BlockStored", "block_hashes": [b"e0"], "parent_block_hash": None, "token_ids": PROMPT[:4],
           "block_size": BS, "group_idx": 2, "kv_cache_spec_kind": "mamba"}
    assert decode_event(raw) == StoredBlocks([b"e0"], None, PROMPT[:4], BS, 2, "mamba")


def test_pool_ledger_is_bounded_and_drops_the_oldest():
    ledger = PoolLedger(max_blocks=3)
    chain = prompt_chain(PROMPT, BS)
    ledger.add(chain[:2])
    assert ledger.prefix_blocks(chain) == 2
    ledger.add(chain[2:4])  # 4 > 3: chain[0] goes
    assert len(ledger) == 3 and ledger.prefix_blocks(chain) == 0


def test_session_identity_header_then_user_then_prefix():
    body = {"prompt": list(range(300)), "max_tokens": 7, "stream": True}
    info = request_info({"X-Session-Id": "abc"}, body)
    assert (info.session_id, info.session_source, info.prompt_tokens, info.max_tokens, info.stream) == (
        "abc", "header", 300, 7, True)  # fmt: skip
    assert request_info({"x-claude-code-session-id": "cc"}, body).session_id == "cc"
    assert request_info({}, {**body, "user": "u1"}).session_source == "user"
    assert request_info({}, {**body, "metadata": {"user_id": "u2"}}).session_id == "u2"
    a = request_info({}, body)
    b = request_info({}, {**body, "prompt": list(range(300)) + [5, 6, 7]})  # a later turn, same start
    c = request_info({}, {**body, "prompt": [9] + list(range(300))})
    assert a.session_source == "prefix" and a.session_id == b.session_id != c.session_id


def test_text_and_chat_prompts_are_estimated():
    chat = {"messages": [{"role": "system", "content": "x" * 400},
                         {"role": "user", "content": [{"type": "text", "text": "y" * 40}]}],
            "max_completion_tokens": 9}  # fmt: skip
    info = request_info({}, chat)
    assert info.prompt_token_ids is None and info.prompt_tokens == (441 + 3) // 4 and info.max_tokens == 9
    assert request_info({}, {"prompt": "abcd" * 10}).prompt_tokens == 10
    assert request_info({}, None).session_id == "anonymous"
