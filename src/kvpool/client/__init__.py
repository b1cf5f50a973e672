"""The kvpool client: `Client(master_address, tenant)` with batch put_from/get_into and put/get.

Imported lazily (PEP 562) so `kvpool status`, which only talks to the master, never loads NIXL.
"""

from kvpool.core.protocol import PUT_ALLOCATED, PUT_EXISTS, PUT_NO_SPACE

__all__ = ["Client", "ClientConfig", "PUT_ALLOCATED", "PUT_EXISTS", "PUT_FAILED", "PUT_NO_SPACE"]


def __getattr__(name: str):
    if name in ("Client", "ClientConfig", "PUT_FAILED"):
        from kvpool.client import client

        return getattr(client, name)
    raise AttributeError(name)
