"""KVPoolConnector: vLLM's KV connector interface (v1) on top of the kvpool client.

Load it with
  --kv-transfer-config '{"kv_connector": "KVPoolConnector", "kv_connector_module_path":
    "kvpool.connector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {"master_address": "tcp://HOST:PORT", ...}}'
(extra config keys: kvpool.connector.config). vLLM builds one instance per role: SCHEDULER in the
engine-core process, WORKER in each worker process; this class only routes each call to the half
that serves it (scheduler.py, worker.py) and derives the pool namespace both halves agree on.
It is a `SupportsHMA` connector: vLLM keeps its hybrid KV cache manager on, and a model with
several KV-cache groups (sliding window, Mamba beside attention) is stored one object per (group,
block), its hits decided by vLLM's own coordinator (groups.py, hit_rule.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvpool.connector.config import ConnectorConfig
from kvpool.connector.health import PoolHealth
from kvpool.connector.keys import derive_namespace, readable_model_name, unshareable_hash_reason
from kvpool.connector.plan import Geometry
from kvpool.connector.scheduler import SchedulerSide
from kvpool.connector.stats import KVPoolConnectorStats, KVPoolPromMetrics
from kvpool.connector.worker import WorkerSide

log = logging.getLogger(__name__)

NAMESPACE_FORMAT = 1  # bump when the object byte layout changes


def pool_namespace(
    vllm_config, kv_cache_config, cfg: ConnectorConfig, geom: Geometry, tp_rank: int, pp_rank: int
) -> str:
    """Everything that changes the bytes stored for a token prefix (see keys.py)."""
    import json

    from vllm.platforms import current_platform

    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    groups = kv_cache_config.kv_cache_groups
    attention = getattr(vllm_config, "attention_config", None)
    identity = {
        "format": NAMESPACE_FORMAT,
        "model": model.model,  # the path or hub id: serve the same model under the same name everywhere
        "revision": model.revision,
        "quantization": model.quantization,
        "hf_config": json.dumps(model.hf_config.to_dict(), sort_keys=True, default=str),
        "model_dtype": str(model.dtype),
        "cache_dtype": str(cache.cache_dtype),
        # a hybrid model's groups each name their spec and layers (an object is one group's block)
        "kv_spec": repr(groups[0].kv_cache_spec) if len(groups) == 1 else [repr(g.kv_cache_spec) for g in groups],
        "layers": list(groups[0].layer_names) if len(groups) == 1 else [list(g.layer_names) for g in groups],
        "kv_cache_layout": kv_cache_config.kv_cache_layout,
        "device": current_platform.device_type,
        "attention_backend": str(getattr(attention, "backend", None)),
        "hash_algo": cache.prefix_caching_hash_algo,
        "block_size": geom.block_size,
        "blocks_per_object": geom.blocks_per_object,
        "tp": [tp_rank, parallel.tensor_parallel_size],
        "pp": [pp_rank, parallel.pipeline_parallel_size],
        "tenant": cfg.tenant,
        "cache_salt": cfg.cache_salt,
    }
    return derive_namespace(readable_model_name(model.model), identity)


class KVPoolConnector(KVConnectorBase_V1, SupportsHMA):
    # The pool is DRAM (local or one network hop away): vLLM's per-tier hit metrics call it host.
    _cache_hit_source = CacheHitSource.HOST

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = ConnectorConfig.from_extra_config(dict(self._kv_transfer_config.kv_connector_extra_config or {}))
        groups = kv_cache_config.kv_cache_groups
        hash_block_size = kv_cache_config.hash_block_size or vllm_config.cache_config.block_size
        self._group_rules = None  # models beyond one full-attention group: groups.py
        if len(groups) > 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
            from kvpool.connector.hit_rule import kv_group_rules

            self._group_rules = kv_group_rules(kv_cache_config, hash_block_size)
            if cfg.tokens_per_object not in (None, hash_block_size):
                raise ValueError(
                    f"KVPoolConnector: a hybrid model's pool objects are single blocks; remove tokens_per_object "
                    f"({cfg.tokens_per_object}) or set it to the block size ({hash_block_size})"
                )
            if cfg.load_async is False:
                log.warning("kvpool: load_async is false, but vLLM reports failed loads of hybrid models only "
                            "for asynchronous loads: loading asynchronously")
            cfg = dataclasses.replace(cfg, load_async=True)
        block_size = groups[0].kv_cache_spec.block_size
        if hash_block_size != block_size:
            raise ValueError(
                f"KVPoolConnector needs vLLM's hash block size ({hash_block_size}) == block size ({block_size})"
            )
        # the edge where the connector may read the environment (config.py): vLLM's seed lives there
        unshareable = unshareable_hash_reason(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"),
                                              os.environ.get("PYTHONHASHSEED"))
        if unshareable is not None:
            raise ValueError(f"KVPoolConnector: {unshareable}")
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning(
                "kvpool: kv_load_failure_policy is %r: a failed pool load then fails the request. "
                "Set \"kv_load_failure_policy\": \"recompute\" so vLLM recomputes it instead.",
                self._kv_transfer_config.kv_load_failure_policy,
            )
        from vllm.platforms import current_platform

        if cfg.load_async is None:
            cfg = dataclasses.replace(cfg, load_async=current_platform.device_type != "cpu")
        self.config = cfg
        self.geom = Geometry(block_size, cfg.blocks_per_object(block_size))
        self._vllm_config = vllm_config
        self._num_blocks = kv_cache_config.num_blocks
        self._node = None
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            if cfg.switch_interval_s:
                log.info("kvpool: GIL switch interval %.6f s (was %.6f s) so lookup replies are not kept waiting",
                         cfg.switch_interval_s, sys.getswitchinterval())
                sys.setswitchinterval(cfg.switch_interval_s)
            # TP/PP ranks store under their own namespaces; a lookup counts what all of them have
            parallel = vllm_config.parallel_config
            self.rank_namespaces = [
                pool_namespace(vllm_config, kv_cache_config, cfg, self.geom, tp, pp)
                for pp in range(parallel.pipeline_parallel_size) for tp in range(parallel.tensor_parallel_size)
            ]
            self.namespace = self.rank_namespaces[0]
            self._scheduler = SchedulerSide(
                self.geom, make_client=lambda: self._make_client(cfg.lookup_timeout_s),
                num_workers=vllm_config.parallel_config.world_size,
                health=PoolHealth("pool master", cfg.retry_initial_s, cfg.retry_max_s),
                save_decode=cfg.save_decode, load_async=cfg.load_async,
                lookup_cache_ttl_s=cfg.lookup_cache_ttl_s, lookup_answer_wait_s=cfg.lookup_wait_ms / 1000,
                lookup_give_up_s=cfg.lookup_timeout_s, max_pinned_fraction=cfg.max_pinned_fraction,
                rank_namespaces=self.rank_namespaces, lookup_on_arrival=cfg.lookup_on_arrival,
                touch_waiting_s=cfg.touch_waiting_s, group_rules=self._group_rules,
                hit_rule=self._make_hit_rule(vllm_config, kv_cache_config, hash_block_size),
            )
        else:
            self.namespace = None  # known once the worker's ranks are (register_kv_caches)
            self._kv_cache_config = kv_cache_config
            self._worker = WorkerSide(
                self.geom, health=PoolHealth("pool", cfg.retry_initial_s, cfg.retry_max_s),
                load_async=cfg.load_async, load_wait_s=cfg.load_wait_ms / 1000,
                sync_lookup_timeout_s=cfg.lookup_timeout_s,
            )

    def _make_hit_rule(self, vllm_config, kv_cache_config, hash_block_size: int):
        if self._group_rules is None:
            return None
        from kvpool.connector.hit_rule import HitRule

        return HitRule(vllm_config, kv_cache_config, hash_block_size)

    def _make_client(self, timeout_s: float):
        from kvpool.client import Client

        return Client(self.config.master_address, self.namespace, timeout_s=timeout_s,
                      path=self.config.transfer_path, num_replicas=self.config.num_replicas,
                      checksums=self.config.checksums, credential=self.config.credential)

    # ---- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        tp_rank, pp_rank = get_tensor_model_parallel_rank(), get_pp_group().rank_in_group
        self.namespace = pool_namespace(
            self._vllm_config, self._kv_cache_config, self.config, self.geom, tp_rank, pp_rank
        )
        groups = self._kv_cache_config.kv_cache_groups
        group_layers = [list(g.layer_names) for g in groups] if self._group_rules else None
        group_kinds = [self._group_rules[g].kind for g in range(len(groups))] if self._group_rules else None
        self._worker.attach(self._make_client(self.config.timeout_s), kv_caches, self._num_blocks,
                            group_layers, group_kinds)
        if self.config.pool_memory_bytes is not None:
            from kvpool.connector.embedded import EmbeddedNode

            node_id = self.config.node_id or f"vllm-{socket.gethostname()}-{os.getpid()}-r{tp_rank}p{pp_rank}"
            self._node = EmbeddedNode(
                self.config.master_address, self.config.pool_memory_bytes, node_id, timeout_s=self.config.timeout_s,
                retry_initial_s=self.config.retry_initial_s, retry_max_s=self.config.retry_max_s,
                credential=self.config.node_credential,
            ).start()
        log.info("kvpool: connector worker uses namespace %s at %s", self.namespace, self.config.master_address)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        if self.has_connector_metadata():
            self._worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads fill whole blocks before vLLM schedules the request (async) or the forward (sync)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # saves read whole blocks after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save(self._connector_metadata)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return KVConnectorTransferResults(finished_recving=self._worker.take_finished_loads(),
                                          failed_recving=self._worker.take_failed_recving())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    def build_connector_worker_meta(self):
        return self._worker.take_worker_meta()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()
        if self._node is not None:
            self._node.stop()
            self._node = None

    # ---- scheduler side ------------------------------------------------------------------------

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        if self._scheduler is not None:
            self._scheduler.bind_block_pool(gpu_block_pool)

    def on_new_request(self, request) -> None:
        if self._scheduler is not None:
            self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid KV cache manager stays on with this connector (SupportsHMA)."""
        return self._scheduler.request_finished(request, block_ids if self._group_rules else block_ids[0])

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_saves()

    # ---- metrics -------------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVPoolConnectorStats | None:
        side = self._scheduler or self._worker
        return side.stats.take() if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVPoolConnectorStats:
        return KVPoolConnectorStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> KVPoolPromMetrics:
        return KVPoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
