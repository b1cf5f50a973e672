"""The simulator's configuration: one frozen dataclass per part, validated at construction.

A fleet is either `num_instances` identical aggregated instances (prefill and decode on each) or,
with `disaggregated`, `num_prefill_instances` + `num_decode_instances` (the reference's 1P + 1D),
each of `devices_per_instance` accelerators. KV capacity per instance defaults to what the devices
hold after the weights (`kv_memory_fraction` of device memory minus the weights); `kv_capacity_tokens`
overrides it (the demo sets vLLM's --kv-cache-memory-bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.sim.hardware import Accelerator, ModelSpec, accelerator_preset, model_preset


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 8192  # token budget per engine step (vLLM's chunked prefill budget)
    max_num_seqs: int = 256
    block_tokens: int = 256  # KV block (the local cache's and the pool's unit); a multiple of the trace's
    recompute_last_token: bool = True  # vLLM: a full hit still computes the last token (hit <= prompt - 1)
    cache_decode_kv: bool = True  # output tokens' KV is reusable by the next turn (vLLM caches full blocks)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.block_tokens < 1:
            raise ValueError("max_num_batched_tokens, max_num_seqs and block_tokens must be >= 1")


@dataclass(frozen=True)
class PoolConfig:
    capacity_bytes: float = 0.0  # 0: no pool; float("inf"): unbounded
    num_nodes: int = 1  # the capacity is split into one segment per node
    node_bandwidth_bytes_s: float = 25e9  # what one pool node serves; loads get min(this x nodes, the instance's NIC)
    lookup_latency_s: float = 0.001  # one master round trip before a load
    load_overhead_s: float = 0.0  # fixed cost of one request's pool load (connector work besides the bytes)
    save_prefill: bool = True  # prefill writes the prompt's KV
    save_decode: bool = True  # decode writes prompt + output KV (the reference's decode instance does)
    eviction: str = "tail-lru"  # the master's policy (master/eviction.py)

    def __post_init__(self) -> None:
        if (self.capacity_bytes < 0 or self.num_nodes < 1 or self.node_bandwidth_bytes_s <= 0 or self.lookup_latency_s < 0
                or self.load_overhead_s < 0):
            raise ValueError("pool: capacity_bytes >= 0, num_nodes >= 1, node_bandwidth_bytes_s > 0, lookup_latency_s >= 0, "
                             "load_overhead_s >= 0")

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0


@dataclass(frozen=True)
class FleetConfig:
    name: str = "fleet"
    model: str | ModelSpec = "llama-8b"
    accelerator: str | Accelerator = "h100"
    devices_per_instance: int = 1
    num_instances: int = 1
    disaggregated: bool = False
    num_prefill_instances: int = 1
    num_decode_instances: int = 1
    decode_devices_per_instance: int | None = None  # disaggregated: the decode instance's size (default: same)
    kv_capacity_tokens: int | None = None  # per instance; None: from device memory
    router: str = "round_robin"
    # cache_aware: a backend's queue is also how long its oldest request has waited for a first
    # token, as `kvpool router` does by default (--no-observed-wait there, False here)
    observed_wait: bool = True
    # late binding, as `kvpool router --max-waiting N`: a request waits at the router while every
    # instance has N routed requests without a first token (0: off). First tokens found at the end
    # of a multi-step decode segment free room only then (the simulator's steps are coarser there).
    max_waiting: int = 0
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)
    time_scale: float = 1.0  # think times and session start offsets are multiplied by this
    max_sim_time_s: float = float("inf")

    def __post_init__(self) -> None:
        if self.devices_per_instance < 1 or self.num_instances < 1:
            raise ValueError("devices_per_instance and num_instances must be >= 1")
        if self.disaggregated and (self.num_prefill_instances < 1 or self.num_decode_instances < 1):
            raise ValueError("a disaggregated fleet needs >= 1 prefill and >= 1 decode instance")
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < self.scheduler.block_tokens:
            raise ValueError(f"kv_capacity_tokens must hold at least one block ({self.scheduler.block_tokens} tokens)")
        if self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0 (0: off)")
        if self.time_scale < 0:
            raise ValueError("time_scale must be >= 0")
        spec = self.model_spec
        free = self.accelerator_spec.memory_bytes * self.accelerator_spec.kv_memory_fraction * self.devices_per_instance
        if self.kv_capacity_tokens is None and free <= spec.weight_bytes:
            raise ValueError(
                f"{spec.name} weights ({spec.weight_bytes / 1e9:.0f} GB) do not fit in {self.devices_per_instance} x "
                f"{self.accelerator_spec.name}: use more devices_per_instance"
            )

    @property
    def model_spec(self) -> ModelSpec:
        return self.model if isinstance(self.model, ModelSpec) else model_preset(self.model)

    @property
    def accelerator_spec(self) -> Accelerator:
        return self.accelerator if isinstance(self.accelerator, Accelerator) else accelerator_preset(self.accelerator)

    def instance_devices(self, role: str) -> int:
        if role == "decode" and self.decode_devices_per_instance is not None:
            return self.decode_devices_per_instance
        return self.devices_per_instance

    def kv_tokens(self, role: str) -> int:
        if self.kv_capacity_tokens is not None:
            return self.kv_capacity_tokens
        acc, spec = self.accelerator_spec, self.model_spec
        free = acc.memory_bytes * acc.kv_memory_fraction * self.instance_devices(role) - spec.weight_bytes
        return max(self.scheduler.block_tokens, int(free / spec.kv_bytes_per_token))

    @property
    def num_devices(self) -> int:
        if self.disaggregated:
            return (self.num_prefill_instances * self.devices_per_instance
                    + self.num_decode_instances * self.instance_devices("decode"))
        return self.num_instances * self.devices_per_instance
