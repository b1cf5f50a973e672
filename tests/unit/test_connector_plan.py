"""Pure planning of the vLLM connector: keys, namespaces, load and save plans, health back-off."""

import pytest

from kvpool.connector.health import PoolHealth
from kvpool.connector.keys import derive_namespace, object_keys
from kvpool.connector.plan import (
    Geometry,
    external_tokens,
    failed_block_ids,
    lookup_window,
    plan_load,
    savable_objects,
)
from kvpool.core.types import MAX_TENANT_LENGTH

HASHES = [bytes([i]) * 32 for i in range(1, 9)]  # stand-ins for vLLM's chained block hashes


def test_object_key_is_the_last_block_hash_of_the_group():
    assert object_keys(HASHES, 1, 0, 3) == [HASHES[0].hex(), HASHES[1].hex(), HASHES[2].hex()]
    assert object_keys(HASHES, 2, 1, 3) == [HASHES[3].hex(), HASHES[5].hex()]
    with pytest.raises(ValueError, match="need 8 block hashes"):
        object_keys(HASHES[:7], 2, 0, 4)


def test_namespace_fits_the_tenant_limit_and_separates_deployments():
    base = {"model": "/models/x", "dtype": "bfloat16", "block_size": 128, "tp": [0, 1], "tenant": None}
    ns = derive_namespace("Llama-3-8B-Instruct" * 20, base)
    assert len(ns) <= MAX_TENANT_LENGTH and ns.startswith("vllm-llama-3-8b-instruct")
    assert derive_namespace("Llama-3-8B-Instruct" * 20, dict(base)) == ns  # deterministic
    for change in ({"dtype": "float16"}, {"block_size": 64}, {"tp": [1, 2]}, {"tenant": "a"}):
        assert derive_namespace("Llama-3-8B-Instruct" * 20, {**base, **change}) != ns


def test_lookup_window_leaves_the_last_token_to_compute():
    g = Geometry(block_size=32, blocks_per_object=2)
    assert lookup_window(g, num_tokens=128, num_block_hashes=4) == 1  # 2 objects would cover all 128
    assert lookup_window(g, num_tokens=129, num_block_hashes=4) == 2
    assert lookup_window(g, num_tokens=200, num_block_hashes=3) == 1  # hashes limit it
    assert lookup_window(g, num_tokens=1, num_block_hashes=0) == 0


def test_load_plan_reads_shared_local_blocks_into_scratch():
    g = Geometry(block_size=32, blocks_per_object=2)
    # local hit: 3 blocks (96 tokens); pool: 3 objects (192 tokens) -> load 96 tokens
    assert external_tokens(g, num_hit_objects=3, num_local_tokens=96) == 96
    spec = plan_load(g, "r", ["k1", "k2"], 1, 96, 96, block_ids=[7, 8, 9, 10, 11, 12, 13])
    assert spec.block_ids == [[None, 10], [11, 12]]  # block 9 (local, shared) is never written
    assert spec.real_block_ids == [10, 11, 12]
    assert failed_block_ids(spec, 1) == {11, 12}
    assert failed_block_ids(spec, 2) == set()
    with pytest.raises(ValueError, match="object boundary"):
        plan_load(g, "r", ["k1"], 1, 96, 64, block_ids=[1, 2, 3, 4, 5])


def test_savable_objects_needs_computed_kv_and_hashes():
    g = Geometry(block_size=32, blocks_per_object=1)
    assert savable_objects(g, num_computed_tokens=100, num_block_hashes=3) == 3
    assert savable_objects(g, num_computed_tokens=63, num_block_hashes=3) == 1  # block 2 not computed yet
    assert savable_objects(g, num_computed_tokens=128, num_block_hashes=2) == 2  # hash not known yet
    assert savable_objects(g, num_computed_tokens=128, num_block_hashes=4, limit_tokens=70) == 2


def test_health_backs_off_and_recovers():
    now = [0.0]
    health = PoolHealth("pool", initial_s=1.0, max_s=4.0, clock=lambda: now[0])
    assert health.available and health.should_try()
    health.record_unavailable("slow")
    health.record_success()  # one slow reply is not "no pool", and a success starts the count again
    health.record_unavailable("slow")
    health.record_unavailable("slow")
    assert health.available and health.should_try() and health.degradations == 0
    health.record_unavailable("down")  # the third in a row
    assert not health.available and not health.should_try()
    now[0] = 1.0
    assert health.should_try()
    health.record_unavailable("still down")  # back-off doubles
    now[0] = 2.5
    assert not health.should_try()
    now[0] = 3.0
    assert health.should_try()
    health.record_success()
    assert health.available and health.degradations == 1


def test_a_per_process_hash_seed_is_refused_with_what_to_set():
    from kvpool.connector.keys import unshareable_hash_reason

    assert unshareable_hash_reason("sha256", None) is None
    assert unshareable_hash_reason("sha256_cbor", None) is None
    assert unshareable_hash_reason("xxhash", "0") is None  # a shared seed: keys agree across instances
    for algo in ("xxhash", "xxhash_cbor"):
        reason = unshareable_hash_reason(algo, None)
        assert "PYTHONHASHSEED" in reason and "sha256" in reason
