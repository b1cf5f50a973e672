"""Messages between the connector's two halves, as vLLM carries them.

Scheduler -> worker: `KVPoolMetadata` rides on every SchedulerOutput (pickled to worker processes).
Worker -> scheduler: `KVPoolWorkerMetadata` rides on the model runner output; vLLM aggregates one
per worker (TP ranks) with `aggregate`, so completions are counted, and a save job's blocks are
released once every worker has reported it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvpool.connector.plan import LoadSpec, SaveSpec


@dataclass
class KVPoolMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class KVPoolWorkerMetadata(KVConnectorWorkerMetadata):
    completed_save_jobs: dict[int, int] = field(default_factory=dict)  # job id -> workers done
    failed_loads: set[str] = field(default_factory=set)  # requests whose load came back short

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVPoolWorkerMetadata):
            raise TypeError(f"cannot aggregate KVPoolWorkerMetadata with {type(other).__name__}")
        merged = dict(self.completed_save_jobs)
        for job_id, count in other.completed_save_jobs.items():
            merged[job_id] = merged.get(job_id, 0) + count
        return KVPoolWorkerMetadata(merged, self.failed_loads | other.failed_loads)
