"""The data plane: NIXL one-sided transfers, same-host shared memory, CUDA copies and the TCP path
to a node's segment.

Names are loaded on first use, so importing a light module of this package (memcopy, the TCP
path's tags) never loads NIXL's libraries.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpool.transfer.hostinfo import host_id
    from kvpool.transfer.plane import DataPlane
    from kvpool.transfer.segment import SegmentMemory

_EXPORTS = {
    "DataPlane": "kvpool.transfer.plane",
    "SegmentMemory": "kvpool.transfer.segment",
    "host_id": "kvpool.transfer.hostinfo",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpool.transfer' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
