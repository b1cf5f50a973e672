"""Everything that depends on where vLLM keeps its KV cache (CPU tensors here, CUDA memory on GPUs).

Facts this relies on (vLLM 0.32):
- `register_kv_caches(kv_caches)` gets one tensor per attention layer. On the CPU backend all
  layers are views over ONE allocation (`KVCacheTensor(layers=[...], layer_stride=...)`) and each
  view is `[num_blocks, num_kv_heads, block_size, 2 * head_size]` (K and V packed in the last
  dimension), so one block of one layer is one contiguous region. CUDA FlashAttention uses
  `[2, num_blocks, block_size, num_kv_heads, head_size]`: one block of one layer is two regions.
- Block ids are rows of those tensors; block 0 is vLLM's null block and never holds KV.

A pool object is its blocks' regions in the order (block, layer, K/V part); every deployment in the
same namespace (which includes the layout and device kind) uses the same order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """Byte addresses of blocks inside vLLM's KV cache."""

    layer_names: tuple[str, ...]
    # per layer, per part (1 on CPU, 2 for a [2, num_blocks, ...] layout): (base_addr, block_stride_bytes)
    parts: tuple[tuple[tuple[int, int], ...], ...]
    region_bytes: int  # contiguous bytes of one block of one layer part
    num_blocks: int

    @property
    def regions_per_block(self) -> int:
        return sum(len(p) for p in self.parts)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers: what one block of an object weighs."""
        return self.regions_per_block * self.region_bytes

    def block_addrs(self, block_id: int) -> list[int]:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} outside the KV cache (0..{self.num_blocks - 1})")
        return [base + block_id * stride for layer in self.parts for base, stride in layer]


def _layer_index(name: str) -> tuple:
    # 'model.layers.10.self_attn.attn' sorts after '...layers.9...'
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def _contiguous_bytes(tensor: torch.Tensor) -> int | None:
    """Bytes of `tensor` if it is one dense region, else None."""
    return tensor.numel() * tensor.element_size() if tensor.is_contiguous() else None


def describe_kv_caches(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> KVLayout:
    if not kv_caches:
        raise ValueError("vLLM registered no KV cache tensors")
    names = tuple(sorted(kv_caches, key=_layer_index))
    parts: list[tuple[tuple[int, int], ...]] = []
    region_bytes: int | None = None
    for name in names:
        t = kv_caches[name]
        es = t.element_size()
        if t.dim() >= 2 and t.shape[0] == num_blocks:  # [num_blocks, ...] (CPU, FlashInfer)
            layer = ((t.data_ptr(), t.stride(0) * es),)
            size = _contiguous_bytes(t[0])
        elif t.dim() >= 3 and t.shape[0] == 2 and t.shape[1] == num_blocks:  # [2, num_blocks, ...]
            layer = tuple((t[kv].data_ptr(), t.stride(1) * es) for kv in (0, 1))
            size = _contiguous_bytes(t[0, 0])
        else:
            raise ValueError(
                f"unsupported KV cache layout for layer {name}: shape {tuple(t.shape)}, expected "
                f"[num_blocks={num_blocks}, ...] or [2, num_blocks, ...]"
            )
        if size is None:
            raise ValueError(f"one block of layer {name} is not contiguous (strides {t.stride()})")
        if region_bytes is not None and size != region_bytes:
            raise ValueError(f"layers differ in block size: {size} vs {region_bytes} bytes ({name})")
        region_bytes = size
        parts.append(layer)
    return KVLayout(names, tuple(parts), int(region_bytes or 0), num_blocks)


def kv_memory_regions(kv_caches: dict[str, torch.Tensor]) -> list[tuple[int, int]]:
    """The distinct allocations behind the KV views, as (addr, size_bytes), to register once."""
    seen: dict[int, int] = {}
    for t in kv_caches.values():
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sorted(seen.items())


def device_kind(kv_caches: dict[str, torch.Tensor]) -> str:
    kinds = {t.device.type for t in kv_caches.values()}
    if len(kinds) != 1:
        raise ValueError(f"KV caches on several device kinds: {sorted(kinds)}")
    return kinds.pop()


def register_kv_memory(client, kv_caches: dict[str, torch.Tensor]) -> int:
    """Register vLLM's KV memory with the data plane; returns the bytes registered."""
    kind = device_kind(kv_caches)
    if kind != "cpu":
        # The kvpool data plane registers host memory today; GPU memory needs NIXL VRAM registration
        # in kvpool.transfer (the connector itself is device-neutral apart from this module).
        raise ValueError(f"KV cache on {kind}: the kvpool data plane only registers host (CPU) memory")
    total = 0
    for addr, size in kv_memory_regions(kv_caches):
        client.register((addr, size))
        total += size
    return total


def wait_for_kv_writes() -> None:
    """Make this step's KV writes visible before a save reads them. The CPU forward pass is
    synchronous, so nothing to wait for; a CUDA build must synchronise the compute stream here."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()


def scratch_region(size_bytes: int) -> torch.Tensor:
    """Host memory that absorbs reads of blocks vLLM already has (see plan.plan_load)."""
    return torch.empty(max(size_bytes, 1), dtype=torch.uint8)
