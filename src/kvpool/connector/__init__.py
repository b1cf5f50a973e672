"""The vLLM KV connector (the only kvpool package that imports vllm).

`kv_connector_module_path: "kvpool.connector"` finds `KVPoolConnector` here (loaded on first
access). Importing the package also registers the name with vLLM's connector factory, so vLLM can
rebuild our stats by name in processes that only see the name (MultiConnector's stats, the metrics
logger). Where vLLM is not installed (a GPU check driving `connector.device` alone), the package
still imports: only `KVPoolConnector` needs vLLM.
"""

import importlib.util


def __getattr__(name: str):
    if name == "KVPoolConnector":
        from kvpool.connector.connector import KVPoolConnector

        return KVPoolConnector
    raise AttributeError(f"module 'kvpool.connector' has no attribute {name!r}")


def _register_with_vllm() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if "KVPoolConnector" not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector("KVPoolConnector", "kvpool.connector", "KVPoolConnector")


if importlib.util.find_spec("vllm") is not None:
    _register_with_vllm()

__all__ = ["KVPoolConnector"]
