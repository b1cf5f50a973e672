"""Argument checks shared by the client's calls: each raises a UsageError that says what to change."""

from __future__ import annotations

from kvpool.client import plan
from kvpool.core.errors import UsageError
from kvpool.core.types import MAX_KEY_LENGTH


def check_keys(keys, *, unique: bool) -> None:
    if isinstance(keys, (str, bytes)) or not isinstance(keys, (list, tuple)):
        raise UsageError(f"keys must be a list of strings, got {type(keys).__name__}")
    for key in keys:
        if not isinstance(key, str) or not key or len(key) > MAX_KEY_LENGTH:
            raise UsageError(f"each key must be a string of 1..{MAX_KEY_LENGTH} characters, got {key!r:.80}")
    if unique and len(set(keys)) != len(keys):
        raise UsageError("a put batch names the same key twice")


def regions(num_keys: int, addrs, sizes) -> tuple[list[list[int]], list[list[int]]]:
    """Per object, its regions' addresses and sizes (plan.normalize_regions)."""
    try:
        return plan.normalize_regions(num_keys, addrs, sizes)
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from None
