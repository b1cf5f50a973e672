"""The reference table of one simulated run: throughput, TTFT and end-to-end percentiles, hit rate.

Pure: a SimResult in, a Summary out. Throughput is input + output tokens over the makespan
(first arrival to last finish), also per device, as the reference reports it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from kvpool.sim.fleet import SimResult


@dataclass(frozen=True)
class Summary:
    name: str
    num_devices: int
    requests: int
    unfinished: int
    makespan_s: float
    input_tokens: int
    output_tokens: int
    throughput_tok_s: float
    throughput_tok_s_per_device: float
    output_tok_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    hit_rate: float  # (local + pool hit tokens) / prompt tokens
    local_hit_rate: float
    pool_hit_rate: float
    preemptions: int
    pool_evictions: int
    local_evictions: int
    mean_utilisation: float  # busy time / makespan, over instances
    events: int

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(result: SimResult, name: str | None = None) -> Summary:
    recs = result.records
    ttft = np.array([r.ttft_s for r in recs]) if recs else np.zeros(1)
    e2e = np.array([r.e2e_s for r in recs]) if recs else np.zeros(1)
    inp = sum(r.prompt_tokens for r in recs)
    out = sum(r.output_tokens for r in recs)
    local = sum(r.local_hit_tokens for r in recs)
    pool = sum(r.pool_hit_tokens for r in recs)
    start = min((r.arrival_s for r in recs), default=0.0)
    span = max(result.makespan_s - start, 1e-9)
    busy = result.busy_s
    return Summary(
        name=name or result.config.name,
        num_devices=result.num_devices,
        requests=len(recs),
        unfinished=result.unfinished,
        makespan_s=span,
        input_tokens=inp,
        output_tokens=out,
        throughput_tok_s=(inp + out) / span,
        throughput_tok_s_per_device=(inp + out) / span / max(1, result.num_devices),
        output_tok_s=out / span,
        ttft_p50_s=float(np.percentile(ttft, 50)),
        ttft_p90_s=float(np.percentile(ttft, 90)),
        ttft_p99_s=float(np.percentile(ttft, 99)),
        e2e_p50_s=float(np.percentile(e2e, 50)),
        e2e_p99_s=float(np.percentile(e2e, 99)),
        hit_rate=(local + pool) / inp if inp else 0.0,
        local_hit_rate=local / inp if inp else 0.0,
        pool_hit_rate=pool / inp if inp else 0.0,
        preemptions=result.preemptions,
        pool_evictions=result.pool_evictions,
        local_evictions=result.local_evictions,
        mean_utilisation=sum(busy.values()) / len(busy) / span if busy else 0.0,
        events=result.events,
    )
