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
    """Bytes of `tensor` if its elements fill one dense region in some dimension order, else None.
    A permuted view counts (vLLM's HND FlashInfer layout is a permuted NHD view: one block's
    bytes are still one region), so does a view with size-1 dimensions of any stride."""
    dims = sorted((st, sz) for st, sz in zip(tensor.stride(), tensor.shape) if sz != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return None
        expected *= size
    return tensor.numel() * tensor.element_size()


def describe_kv_caches(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> KVLayout:
    if not kv_caches:
        raise ValueError("vLLM registered no KV cache tensors")
    names = tuple(sorted(kv_caches, key=_layer_index))
    parts: list[tuple[tuple[int, int], ...]] = []
    region_bytes: int | None = None
    for name in names:
        t = kv_caches[name]
        if not isinstance(t, torch.Tensor):  # e.g. a Mamba layer's (conv, ssm) views on some backends
            raise ValueError(
                f"layer {name}'s KV cache is a {type(t).__name__}, not one tensor: the pool reads one block of a "
                "layer as one region; run this model without KVPoolConnector on this backend"
            )
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


def kv_device(kv_caches: dict[str, torch.Tensor]) -> torch.device:
    devices = {t.device for t in kv_caches.values()}
    if len(devices) != 1:
        raise ValueError(f"KV caches on several devices: {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"KV cache on {device}: the kvpool data plane moves host (CPU) and CUDA memory")
    return device


def register_kv_memory(client, kv_caches: dict[str, torch.Tensor]) -> int:
    """Register vLLM's KV memory with the data plane (host memory, or CUDA memory as NIXL VRAM);
    returns the bytes registered."""
    device = kv_device(kv_caches)
    total = 0
    for addr, size in kv_memory_regions(kv_caches):
        client.register((addr, size) if device.type == "cpu" else (addr, size, device.index or 0))
        total += size
    return total


class _NoFence:
    def wait(self) -> None:
        return  # the CPU forward pass is synchronous: its KV writes are done when the step returns


class _CudaFence:
    """A CUDA event recorded on the compute stream after the step's KV writes: the saver thread
    waits for it alone (not a device-wide or compute-stream synchronize on vLLM's thread)."""

    def __init__(self) -> None:
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream())

    def wait(self) -> None:
        self._event.synchronize()


def kv_writes_fence(device: torch.device | None):
    """Call on vLLM's thread after the step's forward was launched; `.wait()` on the saver's thread
    returns once this step's KV writes are in memory."""
    return _CudaFence() if device is not None and device.type == "cuda" else _NoFence()


def scratch_region(size_bytes: int, device: torch.device) -> torch.Tensor:
    """Memory on the KV cache's device that absorbs reads of blocks vLLM already has (see
    plan.plan_load): one transfer's local regions all lie in one device's memory."""
    return torch.empty(max(size_bytes, 1), dtype=torch.uint8, device=device)
