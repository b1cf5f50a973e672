"""The metadata master: pure logic in layers (docs/design/master.md) and its ZMQ shell (service)."""

from kvpool.master.config import MasterConfig
from kvpool.master.core import MasterCore

__all__ = ["MasterConfig", "MasterCore", "MasterService"]


def __getattr__(name: str):
    if name == "MasterService":  # imports zmq and prometheus_client: only when asked for
        from kvpool.master.service import MasterService

        return MasterService
    raise AttributeError(name)
