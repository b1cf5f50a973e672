"""Roofline cost of one engine step: max(compute time, memory time) + a fixed step overhead.

Rules:
- A step is a batch of sequences, each computing `new` tokens after `context` tokens already in KV
  (a prefill chunk: new > 1; a decode: new = 1). Only totals enter the formula, so callers pass
  sums: tokens, the attention work sum(new * context + new * (new + 1) / 2) and the KV tokens read
  sum(context + new).
- Compute: 2 x active params FLOPs per token at the linear dtype's peak, plus the attention FLOPs
  (growing with context) at the attention dtype's peak, both times the compute efficiency.
- Memory: the dense weights once per step, the routed experts the batch touches (expected distinct
  experts for `tokens` tokens each choosing k of E: E x (1 - (1 - k/E)^tokens)), the KV read by
  attention and the KV written, at bandwidth x efficiency.
- An instance of n devices has n times the peaks and bandwidth (tensor/expert parallel, ideal).
"""

from __future__ import annotations

from kvpool.sim.hardware import Accelerator, ModelSpec


class StepCost:
    __slots__ = ("lin_s_per_token", "attn_s_per_unit", "kv_s_per_token", "dense_weight_s", "expert_weight_s",
                 "num_experts", "expert_miss", "overhead_s", "request_overhead_s")

    def __init__(self, model: ModelSpec, acc: Accelerator, num_devices: int) -> None:
        eff_flops = acc.compute_efficiency * num_devices
        bandwidth = acc.memory_bandwidth_bytes_s * acc.bandwidth_efficiency * num_devices
        self.lin_s_per_token = 2.0 * model.active_params / (acc.flops(model.linear_dtype) * eff_flops)
        self.attn_s_per_unit = model.attention_flops_per_context_token / (
            acc.flops(model.attention_dtype) * acc.attention_flops_scale * eff_flops)
        self.kv_s_per_token = model.kv_bytes_per_token / bandwidth
        self.dense_weight_s = model.dense_params * model.weight_bytes_per_param / bandwidth
        self.expert_weight_s = model.expert_params * model.weight_bytes_per_param / bandwidth
        self.num_experts = model.num_experts
        self.expert_miss = 1.0 - model.experts_per_token / model.num_experts if model.num_experts else 1.0
        self.overhead_s = acc.step_overhead_s
        self.request_overhead_s = acc.request_overhead_s

    def step_s(self, tokens: int, attention_units: float, kv_tokens_read: int) -> float:
        if tokens == 0:
            return 0.0
        compute = tokens * self.lin_s_per_token + attention_units * self.attn_s_per_unit
        memory = self.dense_weight_s + (kv_tokens_read + tokens) * self.kv_s_per_token
        if self.num_experts:
            memory += self.expert_weight_s * self.num_experts * (1.0 - self.expert_miss ** tokens)
        return (compute if compute > memory else memory) + self.overhead_s

    def prefill_s(self, new_tokens: int, context_tokens: int = 0) -> float:
        """One sequence's prefill alone, in one step (for calibration and tests)."""
        units = new_tokens * context_tokens + new_tokens * (new_tokens + 1) / 2
        return self.step_s(new_tokens, units, context_tokens + new_tokens)

    def decode_s(self, num_seqs: int, mean_context: float) -> float:
        """One decode step of `num_seqs` sequences of `mean_context` tokens each."""
        units = num_seqs * (mean_context + 1)
        return self.step_s(num_seqs, units, int(num_seqs * (mean_context + 1)))
