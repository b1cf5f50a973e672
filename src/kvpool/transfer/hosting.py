"""Serve one SegmentMemory from a process of its own, without a master: for tests and benchmarks
of the data plane across processes.

`serve_segment` writes the segment's SegmentInfo (msgpack) to a file once the memory is ready,
then holds the segment until SIGTERM/SIGINT (or until the parent dies). Launch it with
`python -c "from kvpool.transfer.hosting import serve_segment; serve_segment(...)"` and read the
file with `read_segment_info`.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import msgspec
import numpy as np

from kvpool.core.protocol import SegmentInfo
from kvpool.transfer.segment import SegmentMemory


def pattern(seed: int, size_bytes: int) -> np.ndarray:
    """The bytes a served segment starts with when filled: tests verify reads against it."""
    return np.random.default_rng(seed).integers(0, 256, size_bytes, dtype=np.uint8)


def serve_segment(info_path: str, size_bytes: int, fill_seed: int | None = None, segment_id: int = 1) -> None:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    parent = os.getppid()
    with SegmentMemory(size_bytes, name="served") as segment:
        if fill_seed is not None:
            view = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * size_bytes).from_address(segment.base_addr))
            view[:] = pattern(fill_seed, size_bytes)
            del view
        info = segment.segment_info(segment_id, node_id=f"served-{os.getpid()}")
        tmp = Path(f"{info_path}.tmp")
        tmp.write_bytes(msgspec.msgpack.encode(info))
        tmp.rename(info_path)
        while not stop.wait(0.2):
            if os.getppid() != parent:
                break  # the test or benchmark that started us is gone


def read_segment_info(info_path: str | Path, timeout_s: float = 30.0) -> SegmentInfo:
    deadline = time.monotonic() + timeout_s
    path = Path(info_path)
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no segment info at {path} after {timeout_s} s")
        time.sleep(0.02)
    return msgspec.msgpack.decode(path.read_bytes(), type=SegmentInfo)
