"""The router's exact view of the pool (pool_state.py): the master's keys meet the backends' events;
pending keys, removals, snapshots, gaps, other epochs, objects of several blocks, bounded memory."""

import pytest

from kvpool.connector.keys import hash_hex
from kvpool.core import protocol as p
from kvpool.router.pool_state import PoolIndex, pool_key, stored_key
from kvpool.router.prefix_index import prompt_chain

BS = 4
EPOCH = 77
TOKENS = list(range(100, 100 + 8 * BS))
CHAIN = prompt_chain(TOKENS, BS)  # 8 router hashes
ENGINE = [bytes([i]) * 32 for i in range(8)]  # what vLLM's events name the 8 blocks
KEYS = [h.hex() for h in ENGINE]  # the pool keys the connector gives them


def offer(seq=0, epoch=EPOCH, **held) -> p.PoolEventsOffer:
    return p.PoolEventsOffer("tcp://m:1", epoch, seq, [p.NamespaceKeys(t, keys) for t, keys in held.items()])


def batch(seq, stored=(), removed=(), tenant="t", epoch=EPOCH) -> p.PoolEventBatch:
    return p.PoolEventBatch(epoch, seq, [p.NamespaceChanges(tenant, list(stored), list(removed))])


def test_engine_hashes_meet_the_connectors_keys_as_vllms_events_send_them():
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    for h in (bytes(range(32)), b"\xff" * 32, b"\x00\x01" * 16):
        key = stored_key(hash_hex(h))
        assert pool_key(h) == key  # events with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: bytes
        assert pool_key(maybe_convert_block_hash(h)) == key  # vLLM's default: the hash as a 64-bit int
    assert pool_key(("a", 1)) is None
    assert stored_key("g1-abc") is None and stored_key("") is None


def test_a_prefix_is_held_as_far_as_keys_are_held_and_placed():
    index = PoolIndex()
    index.learn(ENGINE, CHAIN)
    index.reset(offer(t=KEYS[:5]))
    assert index.prefix_blocks(CHAIN) == 5
    assert index.apply(batch(1, removed=[KEYS[2]]))
    assert index.prefix_blocks(CHAIN) == 2  # a hole ends the prefix
    assert index.apply(batch(2, stored=[KEYS[2], KEYS[5]]))
    assert index.prefix_blocks(CHAIN) == 6
    assert index.prefix_blocks([]) == 0 and index.prefix_blocks(prompt_chain([1] * BS, BS)) == 0


def test_a_key_stored_before_any_event_named_it_waits_pending():
    index = PoolIndex()
    index.reset(offer())
    assert index.apply(batch(1, stored=KEYS[:3]))
    assert index.prefix_blocks(CHAIN) == 0 and (index.num_held, index.num_pending) == (3, 3)
    index.learn(ENGINE[:2], CHAIN[:2])  # the backend's event arrives late
    assert index.prefix_blocks(CHAIN) == 2 and index.num_pending == 1
    index.learn(ENGINE[2:], CHAIN[2:])
    assert index.prefix_blocks(CHAIN) == 3 and index.num_pending == 0


def test_a_removed_key_keeps_its_mapping_for_when_it_is_stored_again():
    index = PoolIndex()
    index.learn(ENGINE, CHAIN)
    index.reset(offer(t=KEYS))
    assert index.num_recent == 0
    assert index.apply(batch(1, removed=KEYS))
    assert index.prefix_blocks(CHAIN) == 0 and index.num_recent == 8
    assert index.apply(batch(2, stored=KEYS[:4]))
    assert index.prefix_blocks(CHAIN) == 4


def test_gaps_other_epochs_and_batches_before_the_snapshot():
    index = PoolIndex()
    assert not index.apply(batch(1, stored=KEYS))  # no snapshot yet
    index.learn(ENGINE, CHAIN)
    index.reset(offer(seq=5, t=KEYS[:2]))
    assert index.apply(batch(4, stored=KEYS))  # cut before the snapshot: in it already, skipped
    assert index.prefix_blocks(CHAIN) == 2
    assert not index.apply(batch(7, stored=KEYS))  # 6 was lost: refused, nothing changed
    assert not index.apply(batch(6, stored=KEYS, epoch=EPOCH + 1))  # another incarnation
    assert index.prefix_blocks(CHAIN) == 2 and index.seq == 5
    index.reset(offer(seq=9, epoch=EPOCH + 1, t=KEYS[:7]))  # the resync replaces everything held
    assert index.prefix_blocks(CHAIN) == 7 and index.apply(batch(10, removed=[KEYS[0]], epoch=EPOCH + 1))
    assert index.prefix_blocks(CHAIN) == 0
    index.clear()
    assert (index.epoch, index.num_held, index.prefix_blocks(CHAIN)) == (None, 0, 0)


def test_namespaces_followed_and_a_key_held_in_two():
    index = PoolIndex(namespaces=["t", "u"])
    index.learn(ENGINE, CHAIN)
    index.reset(offer(t=KEYS[:3], u=KEYS[:3], other=KEYS))
    assert index.prefix_blocks(CHAIN) == 3 and index.num_held == 6
    assert index.apply(batch(1, removed=[KEYS[0]], tenant="t"))
    assert index.prefix_blocks(CHAIN) == 3  # u still holds it
    assert index.apply(batch(2, removed=[KEYS[0]], tenant="u"))
    assert index.prefix_blocks(CHAIN) == 0
    assert index.apply(batch(3, stored=KEYS, tenant="other"))  # not followed
    assert index.prefix_blocks(CHAIN) == 0


def test_objects_of_several_blocks_are_keyed_by_their_last_block():
    index = PoolIndex(object_blocks=3)
    index.learn(ENGINE, CHAIN)
    index.reset(offer(t=[KEYS[2], KEYS[5]]))  # objects 0 and 1 (blocks 0-2, 3-5); 6-7 is no whole object
    assert index.prefix_blocks(CHAIN) == 6
    assert index.prefix_blocks(CHAIN[:5]) == 3
    with pytest.raises(ValueError):
        PoolIndex(object_blocks=0)


def test_mappings_for_keys_not_held_are_bounded():
    index = PoolIndex(max_recent=3)
    index.reset(offer())
    index.learn(ENGINE, CHAIN)
    assert index.num_recent == 3  # the 3 learned last
    assert index.apply(batch(1, stored=KEYS))
    assert index.prefix_blocks(CHAIN) == 0 and index.num_pending == 5
    index.learn(ENGINE[:5], CHAIN[:5])  # learned again: placed now, whatever was dropped
    assert index.prefix_blocks(CHAIN) == 8 and index.num_pending == 0
