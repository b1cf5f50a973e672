"""vLLM's MooncakeStoreConnector, unchanged, on vLLM's CPU build: the one CUDA call it makes is shimmed.

The benchmark's vLLM servers load the connector from here (`kv_connector_module_path`), so this
module is the only difference from running it on a GPU:
- `wait_for_save` records a `torch.cuda.Event` after the forward pass and the sending thread
  waits on it before it reads the KV. On CPU the forward pass has finished when the method runs
  (no streams, no asynchronous kernels), so an event that is complete from the start is exact.
  The CPU build of torch has no CUDA runtime, and `torch.cuda.Event()` raises there.
- Nothing else is touched: the scheduler, the worker, the lookup server, the key layout and the
  Mooncake client are vLLM's and Mooncake's own.
"""

from __future__ import annotations

import torch


class CompletedEvent:
    """A `torch.cuda.Event` whose work is already done: CPU work is synchronous."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream=None) -> None:
        pass


if not torch.cuda.is_available():
    torch.cuda.Event = CompletedEvent  # type: ignore[misc,assignment]

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import (  # noqa: E402
    MooncakeStoreConnector,
)

__all__ = ["MooncakeStoreConnector", "CompletedEvent"]
