"""Parsing settings out of an environment mapping: the helpers every `from_env()` uses.

Rules:
- Pure: each helper takes the mapping (os.environ at the edge, a dict in tests) and returns a
  value or raises ValueError naming the variable and what it takes. Unset (or blank) is the
  default; nothing is read from the process here.
"""

from __future__ import annotations

from collections.abc import Mapping


def env_bytes(env: Mapping[str, str], name: str, default: int) -> int:
    """$name as a whole number of bytes (unset: `default`)."""
    text = env.get(name, "")
    if not text.strip():
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"${name} must be a number of bytes, got {text!r}") from None
    if value < 0:
        raise ValueError(f"${name} must be >= 0 bytes, got {value}")
    return value


def env_microseconds(env: Mapping[str, str], name: str, default_us: float) -> float:
    """$name in microseconds, as seconds (unset: `default_us`; negative counts as 0)."""
    text = env.get(name, "")
    try:
        us = float(text) if text.strip() else default_us
    except ValueError:
        raise ValueError(f"${name} must be a number of microseconds, got {text!r}") from None
    return max(0.0, us) * 1e-6


def env_int_in(env: Mapping[str, str], name: str, default: int, low: int, high: int, unit: str) -> int:
    """$name as a whole number from `low` to `high` (unset: `default`)."""
    text = env.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise ValueError(f"${name}={text!r}: give {unit} from {low} to {high}")
    return value


def env_switch(env: Mapping[str, str], name: str, default: bool) -> bool:
    """$name as on/off: "0" is off, anything else set is on (unset: `default`)."""
    text = env.get(name)
    if text is None:
        return default
    return text != "0"


def env_path(env: Mapping[str, str], name: str) -> str | None:
    """$name as a path, None when unset or empty."""
    return env.get(name) or None
