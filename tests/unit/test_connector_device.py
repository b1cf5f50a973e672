"""Block addresses inside vLLM's KV cache layouts, exact, on CPU tensors with the CUDA backends'
shapes and strides (FlashAttention's K/V-split, FlashInfer's blocks-first NHD and HND, MLA)."""

from __future__ import annotations

import pytest
import torch

from kvpool.connector.device import describe_kv_caches, kv_device, kv_memory_regions, kv_writes_fence

NB, BS, H, D = 6, 16, 4, 8  # blocks, block size, KV heads, head dim
ES = 2  # bfloat16


def layers(make, n: int = 2) -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.self_attn.attn": make() for i in range(n)}


def test_flash_attention_k_v_split_is_two_regions_per_block_and_layer():
    caches = layers(lambda: torch.zeros(2, NB, BS, H, D, dtype=torch.bfloat16))
    layout = describe_kv_caches(caches, NB)
    region = BS * H * D * ES
    assert layout.region_bytes == region
    assert layout.regions_per_block == 4  # 2 layers x (K, V)
    assert layout.block_bytes == 4 * region
    k0, k1 = (t.data_ptr() for t in caches.values())
    v_offset = NB * region  # V follows all of K
    assert layout.block_addrs(3) == [k0 + 3 * region, k0 + v_offset + 3 * region,
                                     k1 + 3 * region, k1 + v_offset + 3 * region]  # fmt: skip


def test_flashinfer_blocks_first_nhd_is_one_region_per_block_and_layer():
    caches = layers(lambda: torch.zeros(NB, 2, BS, H, D, dtype=torch.bfloat16))
    layout = describe_kv_caches(caches, NB)
    assert layout.region_bytes == 2 * BS * H * D * ES
    base = next(iter(caches.values())).data_ptr()
    assert layout.block_addrs(5)[0] == base + 5 * 2 * BS * H * D * ES


def test_flashinfer_hnd_permuted_view_is_still_one_region_per_block():
    # vLLM allocates HND [blocks, 2, heads, block, dim] and hands the NHD-shaped permuted view
    caches = layers(lambda: torch.zeros(NB, 2, H, BS, D, dtype=torch.bfloat16).permute(0, 1, 3, 2, 4))
    t = next(iter(caches.values()))
    assert t.shape == (NB, 2, BS, H, D) and not t[0].is_contiguous()
    layout = describe_kv_caches(caches, NB)
    assert layout.region_bytes == 2 * BS * H * D * ES
    assert layout.block_addrs(2)[0] == t.data_ptr() + 2 * t.stride(0) * ES


def test_mla_latent_cache_is_one_region_per_block():
    caches = layers(lambda: torch.zeros(NB, BS, 576, dtype=torch.bfloat16), n=3)
    layout = describe_kv_caches(caches, NB)
    assert layout.region_bytes == BS * 576 * ES and layout.regions_per_block == 3


def test_layers_in_numeric_order_and_one_shared_allocation_registered_once():
    big = torch.zeros(11, NB, 2 * BS * H * D, dtype=torch.bfloat16)  # one allocation behind 11 views
    caches = {f"model.layers.{i}.self_attn.attn": big[i] for i in [10, 9, *range(9)]}
    layout = describe_kv_caches(caches, NB)
    assert layout.layer_names[-2:] == ("model.layers.9.self_attn.attn", "model.layers.10.self_attn.attn")
    assert [base for ((base, _),) in layout.parts] == [big[i].data_ptr() for i in range(11)]
    assert kv_memory_regions(caches) == [(big.data_ptr(), big.numel() * ES)]


def test_a_block_that_is_not_one_dense_region_is_refused():
    wide = torch.zeros(NB, BS, 2 * H, D, dtype=torch.bfloat16)
    caches = {"model.layers.0.attn": wide[:, :, :H, :]}  # half the heads of a wider tensor
    with pytest.raises(ValueError, match="not contiguous"):
        describe_kv_caches(caches, NB)


def test_unknown_layout_and_device_are_refused():
    with pytest.raises(ValueError, match="unsupported KV cache layout"):
        describe_kv_caches({"l": torch.zeros(3, NB + 1, 4)}, NB)
    with pytest.raises(ValueError, match="host \\(CPU\\) and CUDA"):
        kv_device({"l": torch.zeros(NB, 4, device="meta")})
    assert kv_device({"l": torch.zeros(NB, 4)}).type == "cpu"


def test_cpu_fence_is_a_no_op():
    kv_writes_fence(torch.device("cpu")).wait()
    kv_writes_fence(None).wait()
