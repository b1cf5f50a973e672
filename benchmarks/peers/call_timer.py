"""Timers the phase scripts wrap around methods inside client and master processes (plain_phases.py,
agent_phases.py): each call's seconds, kept per label, for percentiles after the run."""

from __future__ import annotations

import time


def timed(owner, name: str, label, into: dict[str, list[float]]) -> None:
    """Replace `owner.name` (a class's method or a module's function) with a wrapper that appends
    each call's seconds to `into[label(args)]` (`args`: the call's positional arguments, `self`
    first for a method), or to `into[label]` when `label` is a string; exceptions pass through."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            into.setdefault(label(args) if callable(label) else label, []).append(time.perf_counter() - started)

    setattr(owner, name, wrapper)
