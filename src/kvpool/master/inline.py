"""Small plain values held by the master itself: one round trip for a `put` or a `get` (issue 14).

Why: a value on a node costs a reader two round trips (the leased lookup, then the node) and a
writer three (PutStart, the write, PutEnd). For a few KiB the round trips are the whole cost, so
a plain 4-64 KiB value was 2-4x slower than Redis, which answers in one. Values up to
`max_value_bytes` put without a parent (not part of a KV chain) are kept here instead, in the
master's memory, and travel inside the request and the reply.

Rules:
- Pure: no I/O, no clock. The core (core.py) calls it; the tests drive it directly.
- One namespace with the index: a key is either here or in the index, never both. The core checks
  the index before storing a value here, and the index's puts check here (`contains`), so a key
  answers PUT_EXISTS whichever way it was stored. `exists`, `remove` and prefix lookups see both
  (core.py): a counting lookup walks on through index and inline keys alike; a leased one (a read)
  returns its node hits, then the values of the inline keys right after them, and ends there.
- Bounded: at most `capacity_bytes` of values (0 turns inline values off). A put that does not fit
  evicts the least recently used unpinned values (a get is a use); if pinned ones fill it, the put
  is PUT_NO_SPACE. A tenant with a byte quota holds at most that many bytes here (evicting its own
  values first, never another tenant's to make room for its quota): its node quota is separate.
- Gone on a master restart: a restarted master holds no inline values, so a reader misses (and
  recomputes) rather than reading anything else. Nothing is written to nodes.
"""

from __future__ import annotations

from collections import OrderedDict

from kvpool.core.protocol import PUT_ALLOCATED, PUT_EXISTS, PUT_NO_SPACE
from kvpool.core.sizes import format_size
from kvpool.master.access import namespace_owner


class _Value:
    __slots__ = ("data", "pinned")

    def __init__(self, data: bytes, pinned: bool) -> None:
        self.data = data
        self.pinned = pinned


class InlineValues:
    def __init__(self, capacity_bytes: int, max_value_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.max_value_bytes = max_value_bytes if capacity_bytes else 0
        # (namespace, key) -> value, least recently used first
        self._values: OrderedDict[tuple[str, str], _Value] = OrderedDict()
        self._owner_bytes: dict[str, int] = {}  # quota owner -> bytes it holds here
        self._namespaces: dict[str, int] = {}  # namespace -> values it holds (a cheap "any here?")
        self.used_bytes = 0
        self.evictions = 0
        self.evicted_bytes = 0

    def __len__(self) -> int:
        return len(self._values)

    def accepts(self, size: int) -> bool:
        return 0 < size <= self.max_value_bytes

    def holds_any(self, namespace: str) -> bool:
        return namespace in self._namespaces

    def contains(self, namespace: str, key: str) -> bool:
        return namespace in self._namespaces and (namespace, key) in self._values

    def put(self, namespace: str, owner: str, key: str, data: bytes, pinned: bool,
            quota_bytes: int | None) -> tuple[int, str]:
        """(PUT_ALLOCATED, "") when stored; PUT_EXISTS when the key is here; PUT_NO_SPACE and why.
        The caller has checked the size (`accepts`) and that the index does not hold the key."""
        entry_key = (namespace, key)
        if entry_key in self._values:
            return PUT_EXISTS, ""
        size = len(data)
        if quota_bytes is not None and not self._make_room(size, quota_bytes, owner):
            return PUT_NO_SPACE, (f"tenant {owner!r} holds {format_size(self._owner_bytes.get(owner, 0))} of inline "
                                  f"values (pinned ones stay) and a quota of {format_size(quota_bytes)}: "
                                  f"{format_size(size)} more do not fit")
        if not self._make_room(size, self.capacity_bytes, None):
            return PUT_NO_SPACE, (f"the master's {format_size(self.capacity_bytes)} for inline values are held "
                                  "by pinned values")
        self._values[entry_key] = _Value(data, pinned)
        self.used_bytes += size
        self._owner_bytes[owner] = self._owner_bytes.get(owner, 0) + size
        self._namespaces[namespace] = self._namespaces.get(namespace, 0) + 1
        return PUT_ALLOCATED, ""

    def get(self, namespace: str, key: str) -> bytes | None:
        """The value, or None; a hit becomes the most recently used."""
        if namespace not in self._namespaces:
            return None
        entry_key = (namespace, key)
        value = self._values.get(entry_key)
        if value is None:
            return None
        self._values.move_to_end(entry_key)
        return value.data

    def run(self, namespace: str, keys: list[str], start: int, read: bool) -> list[bytes]:
        """The values of the keys held here from keys[start] on, up to the first one that is not.
        `read`: they are being read (each becomes the most recently used); else only counted."""
        if namespace not in self._namespaces:
            return []
        values, get = [], self._values.get
        for n in range(start, len(keys)):
            entry_key = (namespace, keys[n])
            value = get(entry_key)
            if value is None:
                break
            if read:
                self._values.move_to_end(entry_key)
            values.append(value.data)
        return values

    def remove(self, namespace: str, keys: list[str]) -> int:
        if namespace not in self._namespaces:
            return 0
        removed = 0
        for key in keys:
            value = self._values.pop((namespace, key), None)
            if value is not None:
                self._forget(namespace, value)
                removed += 1
        return removed

    def _make_room(self, size: int, limit: int, owner: str | None) -> bool:
        """Evict least recently used unpinned values (only `owner`'s, unless None) until `size` more
        bytes fit under `limit`; False (nothing evicted) when they cannot."""
        used = self.used_bytes if owner is None else self._owner_bytes.get(owner, 0)
        if used + size <= limit:
            return True
        victims, freed = [], 0
        for entry_key, value in self._values.items():  # oldest first
            if value.pinned or (owner is not None and namespace_owner(entry_key[0]) != owner):
                continue
            victims.append(entry_key)
            freed += len(value.data)
            if used - freed + size <= limit:
                break
        else:
            return False
        for entry_key in victims:
            value = self._values.pop(entry_key)
            self._forget(entry_key[0], value)
            self.evictions += 1
            self.evicted_bytes += len(value.data)
        return True

    def _forget(self, namespace: str, value: _Value) -> None:
        size = len(value.data)
        self.used_bytes -= size
        owner = namespace_owner(namespace)
        left = self._owner_bytes[owner] - size
        if left:
            self._owner_bytes[owner] = left
        else:
            del self._owner_bytes[owner]
        count = self._namespaces[namespace] - 1
        if count:
            self._namespaces[namespace] = count
        else:
            del self._namespaces[namespace]
