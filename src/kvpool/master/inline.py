"""Small plain values held by the master itself: one round trip for a `put` or a `get`.

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
- Bounded: at most `capacity_bytes` (0 turns inline values off), each value charged its bytes plus
  its key's and namespace's length plus ENTRY_OVERHEAD_BYTES (the master's own memory per entry:
  1-byte values under long keys must not hold GiBs). A put that does not fit evicts the least
  recently used unpinned values (a get is a use); if pinned ones fill it, the put is PUT_NO_SPACE.
  A tenant with a byte quota holds at most that much here (evicting its own values, never another
  tenant's, to make room under its quota): its node quota is separate. Victims are chosen for both
  limits before any is evicted, so a refused put evicts nothing. Pinned values are kept out of the
  LRU orders, so eviction never walks past them.
- A read's reply carries at most `max_reply_bytes` of values (a lookup naming one key a million
  times must not make the master build a 64 GiB reply): the run of inline hits ends there.
- Kept across a master restart by copies on nodes (inline_copies.py): with `changes` on (a list),
  every value stored is appended as (key, value) and every value dropped as (key, None), for the
  core to send on; a new master takes the nodes' copies back through `put`.
"""

from __future__ import annotations

from collections import OrderedDict

from kvpool.core.protocol import PUT_ALLOCATED, PUT_EXISTS, PUT_NO_SPACE
from kvpool.core.sizes import format_size

ENTRY_OVERHEAD_BYTES = 200  # the master's memory per entry beyond its bytes and names (measured ~180-420)

_Key = tuple[str, str]  # (namespace, key)


class _Value:
    __slots__ = ("data", "pinned", "owner", "cost")

    def __init__(self, data: bytes, pinned: bool, owner: str, cost: int) -> None:
        self.data = data
        self.pinned = pinned
        self.owner = owner
        self.cost = cost


def entry_cost(namespace: str, key: str, size: int) -> int:
    """What one value is charged against the capacity and quotas."""
    return size + len(key) + len(namespace) + ENTRY_OVERHEAD_BYTES


class InlineValues:
    def __init__(self, capacity_bytes: int, max_value_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.max_value_bytes = max_value_bytes if capacity_bytes else 0
        self._values: dict[_Key, _Value] = {}
        self._lru: OrderedDict[_Key, _Value] = OrderedDict()  # unpinned ones, least recently used first
        self._owner_lru: dict[str, OrderedDict[_Key, _Value]] = {}  # the same, per quota owner
        self._owner_bytes: dict[str, int] = {}  # quota owner -> bytes charged to it (pinned too)
        self._namespaces: dict[str, int] = {}  # namespace -> values it holds (a cheap "any here?")
        self.used_bytes = 0  # charged (entry_cost), pinned included
        self.evictions = 0
        self.evicted_bytes = 0
        self.changes: list[tuple[_Key, _Value | None]] | None = None  # None: not recorded

    def take_changes(self) -> list[tuple[_Key, _Value | None]]:
        changes = self.changes
        if changes:
            self.changes = []
        return changes or []

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
        """(PUT_ALLOCATED, "") when stored; PUT_EXISTS when the key is here; PUT_NO_SPACE and why
        (nothing evicted then). The caller has checked the size (`accepts`) and that the index does
        not hold the key."""
        entry_key = (namespace, key)
        if entry_key in self._values:
            return PUT_EXISTS, ""
        cost = entry_cost(namespace, key, len(data))
        victims: list[_Key] = []
        freed = 0
        if quota_bytes is not None:
            held = self._owner_bytes.get(owner, 0)
            planned = self._victims(self._owner_lru.get(owner), held + cost - quota_bytes, ())
            if planned is None:
                return PUT_NO_SPACE, (f"tenant {owner!r} holds {format_size(held)} of inline values (pinned ones "
                                      f"stay) under a quota of {format_size(quota_bytes)}: "
                                      f"{format_size(cost)} more do not fit")
            victims, freed = planned
        planned = self._victims(self._lru, self.used_bytes - freed + cost - self.capacity_bytes, set(victims))
        if planned is None:
            return PUT_NO_SPACE, (f"the master's {format_size(self.capacity_bytes)} for inline values are held "
                                  "by pinned values")
        for entry_key_ in victims + planned[0]:
            self._evict(entry_key_)
        value = _Value(data, pinned, owner, cost)
        self._values[entry_key] = value
        if not pinned:
            self._lru[entry_key] = value
            owner_lru = self._owner_lru.get(owner)
            if owner_lru is None:
                owner_lru = self._owner_lru[owner] = OrderedDict()
            owner_lru[entry_key] = value
        self.used_bytes += cost
        self._owner_bytes[owner] = self._owner_bytes.get(owner, 0) + cost
        self._namespaces[namespace] = self._namespaces.get(namespace, 0) + 1
        if self.changes is not None:
            self.changes.append((entry_key, value))
        return PUT_ALLOCATED, ""

    def get(self, namespace: str, key: str) -> bytes | None:
        """The value, or None; a hit becomes the most recently used."""
        if namespace not in self._namespaces:
            return None
        entry_key = (namespace, key)
        value = self._values.get(entry_key)
        if value is None:
            return None
        self._touch(entry_key, value)
        return value.data

    def run(self, namespace: str, keys: list[str], start: int, read: bool, max_bytes: int) -> list[bytes]:
        """The values of the keys held here from keys[start] on, up to the first one that is not, or
        until they would pass `max_bytes` together. `read`: they are being read (each becomes the most
        recently used); else only counted."""
        if namespace not in self._namespaces:
            return []
        values, get, total = [], self._values.get, 0
        for n in range(start, len(keys)):
            entry_key = (namespace, keys[n])
            value = get(entry_key)
            if value is None:
                break
            total += len(value.data)
            if total > max_bytes:
                break
            if read:
                self._touch(entry_key, value)
            values.append(value.data)
        return values

    def remove(self, namespace: str, keys: list[str]) -> int:
        if namespace not in self._namespaces:
            return 0
        removed = 0
        for key in keys:
            if (namespace, key) in self._values:
                self._drop((namespace, key))
                removed += 1
        return removed

    def _touch(self, entry_key: _Key, value: _Value) -> None:
        if not value.pinned:
            self._lru.move_to_end(entry_key)
            self._owner_lru[value.owner].move_to_end(entry_key)

    @staticmethod
    def _victims(order: OrderedDict | None, need: int, skip) -> tuple[list[_Key], int] | None:
        """The least recently used entries of `order` (not in `skip`) freeing >= `need` bytes, and
        what they free; None when all of them would not."""
        if need <= 0:
            return [], 0
        victims, freed = [], 0
        for entry_key, value in (order or {}).items():  # oldest first
            if entry_key in skip:
                continue
            victims.append(entry_key)
            freed += value.cost
            if freed >= need:
                return victims, freed
        return None

    def _evict(self, entry_key: _Key) -> None:
        cost = self._drop(entry_key)
        self.evictions += 1
        self.evicted_bytes += cost

    def _drop(self, entry_key: _Key) -> int:
        value = self._values.pop(entry_key)
        if self.changes is not None:
            self.changes.append((entry_key, None))
        if not value.pinned:
            del self._lru[entry_key]
            owner_lru = self._owner_lru[value.owner]
            del owner_lru[entry_key]
            if not owner_lru:
                del self._owner_lru[value.owner]
        self.used_bytes -= value.cost
        left = self._owner_bytes[value.owner] - value.cost
        if left:
            self._owner_bytes[value.owner] = left
        else:
            del self._owner_bytes[value.owner]
        namespace = entry_key[0]
        count = self._namespaces[namespace] - 1
        if count:
            self._namespaces[namespace] = count
        else:
            del self._namespaces[namespace]
        return value.cost
