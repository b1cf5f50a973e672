"""The vLLM KV connector (the only kvpool package that imports vllm).

`kv_connector_module_path: "kvpool.connector"` finds `KVPoolConnector` here. Importing the package
also registers the name with vLLM's connector factory, so vLLM can rebuild our stats by name in
processes that only see the name (MultiConnector's stats, the metrics logger).
"""

from kvpool.connector.connector import KVPoolConnector


def _register_with_vllm() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if "KVPoolConnector" not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector("KVPoolConnector", "kvpool.connector", "KVPoolConnector")


_register_with_vllm()

__all__ = ["KVPoolConnector"]
