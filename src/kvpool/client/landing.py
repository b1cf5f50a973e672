"""A put's PutEnd sent while its bytes are written: the end's round trip hides behind the write.

Why: without it a put is its write, then a PutEnd round trip to a master that slept through the
write (measurements: docs/design/client.md). With `landing` the PutEnd goes out just before the
write; the master checks it (tokens, keys that exist, the allocation asked ahead) while the bytes
travel and its reply is waiting when the write ends. Then one PutLanded, sent one way before the
put returns, makes the objects readable.

Rules:
- Only over the lane (LaneChannel.lands_puts: without it the usual PutEnd follows the write; nor with
  `Client(landing=False)`), with a master whose PutStartReply said `lands`, when the
  checksums are known before the write (not for the large batches checksummed beside their
  write: their end is no longer the cost), and when a write crosses to another host. A same-host
  write is the client's own copy: no wait to hide the round trip behind, and one more message
  per put for the master, which cost same-host writers throughput.
- A put is reported stored when its bytes are written and the master accepted its end. PutLanded
  follows on the same ordered connection, so this client's next request finds the object, and the
  master handles the one-way frames of a wake-up before its calls (master/service.py), so a
  reader whose lookup came in with it finds it too. A PutLanded lost on the way (the lane breaks
  right then, the master restarts) leaves the object pending until the master reclaims it, as
  if its writer had died: a miss later, never wrong bytes. One that cannot be sent at all makes
  the batch PUT_FAILED (metric `kvpool_client_landings_unsent`).
- A plain put (plain_values.py) that lands sends its PutEnd without the value's checksum and
  hashes the value once the write's bytes are on their way (the data plane's `sent`), while the
  node takes them in; the checksum goes with PutLanded, so it is recorded before anyone can read
  the object, and the hash is off the put's critical path.
- A write that fails, or ends past its deadline, is revoked, under both names where the end
  renamed it (a revoke names tokens: it can only free this writer's allocation), and never
  landed. An end whose reply cannot be had (the lane broke: the master restarted, or did not
  answer in time) is revoked quietly and its objects reported as refused: PUT_FAILED for
  put_from, and a plain put is made again the usual way (over ZMQ, which fails over).
- `Landings` is given the master link, the transfers (which replicas are same-host copies) and
  the Ahead part (a plain put's end asks for the next allocation).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from kvpool.core import protocol
from kvpool.core.errors import KVPoolError, ProtocolError, UnavailableError
from kvpool.core.protocol import Replica

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ending:
    """A PutEnd sent with `landing` before its write; its reply is taken after the write."""

    call: object  # rpc.zmq_channel.BegunCall
    num_keys: int
    grant: Callable[[protocol.PutEndReply], None] | None  # keeps the allocation asked ahead, if one was


class Landings:
    def __init__(self, link, transfers, ahead, metrics, enabled: bool) -> None:
        self._link = link  # master_link.MasterLink
        self._transfers = transfers  # rounds.Transfers
        self._ahead = ahead  # ahead.Ahead
        self._metrics = metrics
        self._enabled = enabled  # Client(landing=...)

    def begin(self, end: protocol.PutEnd, lands: bool, choices: list[tuple[int, Replica]],
              ahead_size: int | None = None) -> Ending | None:
        """Send `end` with `landing` now, before the write to the replicas `choices` (asking for an
        allocation of `ahead_size` for the next plain put, if given); None: not done here (no lane,
        a master that does not take it, only same-host copies), nothing sent: end after the write."""
        return self.send(end, ahead_size) if self.may_land(lands, choices) else None

    def send(self, end: protocol.PutEnd, ahead_size: int | None = None) -> Ending | None:
        """`begin` once `may_land` said yes: None if there was no lane to send it on."""
        grant = None
        if ahead_size:
            end, grant = self._ahead.asking(end, ahead_size)
        call = self._link.channel.begin(msgspec.structs.replace(end, landing=True))
        return None if call is None else Ending(call, len(end.keys), grant)

    def may_land(self, lands: bool, choices: list[tuple[int, Replica]]) -> bool:
        """Whether a put to these replicas ends with `landing` (the rules above); `begin` may
        still find no lane at that moment and send nothing."""
        return (lands and self._enabled and getattr(self._link.channel, "lands_puts", False)
                and not self._transfers.copies_locally(choices))

    def finish(self, ending: Ending, keys: list[str], tokens: list[int]) -> protocol.PutEndReply:
        """The reply to a begun end. If it cannot be had, the allocations (`keys` with their
        `tokens`: every name they may be pending under) are revoked quietly; an unavailable
        master's reply is then one that refused every end, any other error is raised."""
        try:
            reply = self._link.channel.finish(ending.call)
            if not isinstance(reply, protocol.PutEndReply):
                raise ProtocolError(f"master answered PutEnd with {type(reply).__name__}")
        except UnavailableError as e:
            self._link.revoke_quietly(keys, tokens)
            log.info("kvpool: no answer to a put's end (%s): its %d objects are not stored", e, ending.num_keys)
            return protocol.PutEndReply(ended=0, refused=list(range(ending.num_keys)))
        except BaseException:
            self._link.revoke_quietly(keys, tokens)
            raise
        if ending.grant is not None:
            ending.grant(reply)
        self._metrics.put_ends_landing.inc()
        return reply

    def abandon(self, ending: Ending, keys: list[str], tokens: list[int]) -> None:
        """The write raised: its end's reply is not wanted, its allocations are revoked quietly."""
        self._link.channel.abandon(ending.call)
        self._link.revoke_quietly(keys, tokens)

    def land(self, keys: list[str], tokens: list[int], checksums: list[int] | None = None) -> bool:
        """Tell the master these written objects' bytes are in (one way, sent now), with their
        checksums if their end went without; False if it could not be sent (then they are never
        readable: the master reclaims them)."""
        if not keys:
            return True
        try:
            self._link.channel.send(protocol.PutLanded(self._link.tenant, keys, tokens, checksums or []))
            return True
        except KVPoolError as e:
            self._metrics.landings_unsent.inc()
            log.warning("kvpool: %d written objects could not be made readable (PutLanded not sent: %s); "
                        "reported as failed puts", len(keys), e)
            return False
