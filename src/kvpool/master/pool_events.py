"""The master's record of what became held and what was forgotten, cut into numbered batches. Pure.

Rules:
- The index reports each key that becomes readable (`stored`) and each readable key it forgets
  (`removed`); only while `recording` (someone subscribed), so a pool nobody follows pays one test
  of a flag per object. Eviction to a disk tier is neither: the object stays held.
- Changes gather per namespace, last one wins (a key stored and removed before the batch is cut
  appears once, as its end state); `take` cuts them into the next `PoolEventBatch`, numbered from
  1 within the incarnation (the caller names its epoch), or None when nothing changed.
- `snapshot` answers as of the last batch cut: the caller takes the pending batch first, so a
  subscriber that applies the batches after the snapshot's `seq` misses nothing and sees nothing twice.
- No I/O: the service shell publishes what `take` returns.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvpool.core.protocol import NamespaceChanges, NamespaceKeys, PoolEventBatch, PoolEventsOffer
from kvpool.master.records import COMPLETE, ObjectRecord


class PoolEvents:
    def __init__(self) -> None:
        self.recording = False
        self.seq = 0  # the last batch cut
        self.changes: dict[str, dict[str, bool]] = {}  # namespace -> key -> held at the end of the batch

    def stored(self, tenant: str, key: str) -> None:
        changed = self.changes.get(tenant)
        if changed is None:
            changed = self.changes[tenant] = {}
        changed[key] = True

    def removed(self, tenant: str, key: str) -> None:
        changed = self.changes.get(tenant)
        if changed is None:
            changed = self.changes[tenant] = {}
        changed[key] = False

    def start(self) -> None:
        self.recording = True

    def stop(self) -> None:
        """Nobody follows any more: record nothing (a new subscriber starts from a snapshot)."""
        self.recording = False
        self.changes.clear()

    def take(self, epoch: int) -> PoolEventBatch | None:
        if not self.changes:
            return None
        self.seq += 1
        changes = [NamespaceChanges(tenant, [k for k, held in keys.items() if held],
                                    [k for k, held in keys.items() if not held])
                   for tenant, keys in self.changes.items()]  # fmt: skip
        self.changes = {}
        return PoolEventBatch(epoch, self.seq, changes)

    def snapshot(self, address: str, epoch: int, tenants: Mapping[str, Mapping[str, ObjectRecord]], tenant: str = "",
                 with_keys: bool = True) -> PoolEventsOffer:  # fmt: skip
        """The keys held as of batch `seq` (call after `take`), of every namespace or of `tenant`."""
        if self.changes:
            raise RuntimeError("snapshot with changes not yet cut into a batch: take() first")
        held = []
        if with_keys:
            names = [tenant] if tenant else list(tenants)
            for name in names:
                space = tenants.get(name)
                if space is not None:
                    held.append(NamespaceKeys(name, [k for k, rec in space.items() if rec.state == COMPLETE]))
        return PoolEventsOffer(address, epoch, self.seq, held)
