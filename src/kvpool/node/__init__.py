"""Storage nodes: DRAM segments contributed to the pool, mounted on the master."""

from kvpool.node.config import NodeConfig, parse_size
from kvpool.node.service import StorageNode

__all__ = ["NodeConfig", "StorageNode", "parse_size"]
