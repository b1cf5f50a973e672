"""kvpool: a distributed KV-cache pool for LLM serving fleets."""

from kvpool.core.errors import (
    CapacityError,
    KVPoolError,
    LeaseExpiredError,
    ProtocolError,
    TransferError,
    UnavailableError,
    UsageError,
)

__all__ = [
    "CapacityError",
    "Client",
    "KVPoolError",
    "LeaseExpiredError",
    "ProtocolError",
    "TransferError",
    "UnavailableError",
    "UsageError",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: `import kvpool` must stay cheap (the master and CLI never need the data plane).
    if name == "Client":
        from kvpool.client import Client

        return Client
    raise AttributeError(name)
