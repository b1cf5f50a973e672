"""vLLM's `--kv-transfer-config` for a server that uses the pool (pure: builds dicts, imports no vLLM).

Rules:
- Aggregated serving: `KVPoolConnector` alone.
- Prefill/decode disaggregation: vLLM's `MultiConnector` with `NixlConnector` first and
  `KVPoolConnector` second, the same on prefill and decode instances (the router's
  `kv_transfer_params` tell each what it is). MultiConnector loads from the first member that
  reports a hit, so a decode request takes its prompt from the prefill instance over NIXL, and a
  prefill request, which NIXL has nothing for, from the pool; every member saves, so the prefill
  instance writes the prompt and the decode instance the output to the pool.
- `kv_load_failure_policy` is "recompute" everywhere: a failed load (a dead prefill instance, a
  dead pool node) is computed again, never served wrong.
- NIXL moves host memory on the CPU build (`kv_buffer_device: "cpu"`); on a GPU build vLLM's
  default (the KV cache's own device) is used unless `nixl_buffer_device` says otherwise.
"""

from __future__ import annotations

from typing import Any

POOL_CONNECTOR = {"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool.connector",
                  "kv_role": "kv_both"}  # fmt: skip
RECOMPUTE = {"kv_load_failure_policy": "recompute"}


def pool_transfer_config(pool: dict[str, Any]) -> dict[str, Any]:
    """KVPoolConnector alone; `pool` is its extra config (`master_address`, ...: kvpool.connector.config)."""
    if not pool.get("master_address"):
        raise ValueError("the pool connector needs master_address (the master's tcp://HOST:PORT)")
    return {**POOL_CONNECTOR, **RECOMPUTE, "kv_connector_extra_config": dict(pool)}


def pd_transfer_config(pool: dict[str, Any] | None, *, nixl_buffer_device: str | None = "cpu",
                       nixl: dict[str, Any] | None = None) -> dict[str, Any]:
    """MultiConnector(NixlConnector, KVPoolConnector) for a P/D instance (prefill or decode);
    `pool=None` gives NixlConnector alone (P/D without the pool, for comparison)."""
    nixl_member = {"kv_connector": "NixlConnector", "kv_role": "kv_both", **RECOMPUTE,
                   **({"kv_buffer_device": nixl_buffer_device} if nixl_buffer_device else {}),
                   **({"kv_connector_extra_config": dict(nixl)} if nixl else {})}  # fmt: skip
    if pool is None:
        return nixl_member
    pool_member = pool_transfer_config(pool)
    return {"kv_connector": "MultiConnector", "kv_role": "kv_both", **RECOMPUTE,
            "kv_connector_extra_config": {"connectors": [nixl_member, pool_member]}}  # fmt: skip
