"""What the pool holds, as the master publishes it: a snapshot on request, then batches of changes.

Rules:
- A key is held from the moment its object is readable (complete, or re-announced by its node to a
  restarted master) until the master forgets it (evicted with no disk copy, removed, its segment
  gone). An object moved from DRAM to a disk tier is still held: a lookup promotes it.
- `PoolEventBatch`es go out on the master's PUB socket (`PoolEventsOffer.address`), one per loop
  wake-up that changed something, numbered 1, 2, ... within one incarnation (`epoch`). A batch
  holds the net change per namespace: a key stored and removed within it appears once, as its end
  state. PUB/SUB drops messages a slow subscriber cannot take: a subscriber that sees a sequence
  gap, or another epoch, asks for a new snapshot.
- `PoolEventsQuery` answers the PUB address and a snapshot of the keys held (per namespace, or of
  one) as of batch `seq`: every change up to `seq` is in it, none after. A subscriber subscribes
  first, then asks, applies the batches after `seq` and skips the older ones.
- A master that publishes nothing (authentication is on: the stream would show every tenant's
  keys) answers `address=""` and no keys.
"""

from __future__ import annotations

from msgspec import Struct

POOL_EVENTS_TOPIC = b"pool"  # the first frame of every published batch


class PoolEventsQuery(Struct, tag="pool_events_query", frozen=True):
    """Where the master publishes pool events, and what the pool holds now."""

    tenant: str = ""  # one namespace; "": every namespace
    with_keys: bool = True  # False: the address and sequence only


class NamespaceKeys(Struct, frozen=True, array_like=True):
    tenant: str
    keys: list[str]


class PoolEventsOffer(Struct, tag="pool_events_offer", frozen=True):
    address: str  # the PUB socket's endpoint; "": this master publishes no pool events
    epoch: int  # the incarnation whose batches follow (as in the reply frame)
    seq: int  # the last batch published before the snapshot (0: none yet)
    held: list[NamespaceKeys] = []


class NamespaceChanges(Struct, frozen=True, array_like=True):
    tenant: str
    stored: list[str]
    removed: list[str]


class PoolEventBatch(Struct, frozen=True, array_like=True):
    """One published message's payload (frames: POOL_EVENTS_TOPIC, msgpack of this)."""

    epoch: int
    seq: int
    changes: list[NamespaceChanges]
