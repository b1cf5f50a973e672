"""Sizes as people write them ("64MiB", "4GiB") and back: one parser for every CLI and config file."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """'4GiB' -> 4294967296. Binary units (KiB, MiB, GiB, TiB; K/M/G/T mean the same), decimal
    units (KB, MB, GB, TB), or a plain number of bytes."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size: use e.g. 64MiB, 4GiB, 512M or a number of bytes")
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(size_bytes: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size_bytes >= scale:
            return f"{size_bytes / scale:.4g} {unit}"
    return f"{size_bytes} B"
