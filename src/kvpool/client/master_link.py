"""The client's side of the master's control channel, as every part of the client uses it.

Rules:
- Every request goes through `call`, which refuses once the client is closed and checks the
  reply's type (a ProtocolError names the request and what came back).
- One-way messages that clean up (a lease's release, a quarantine's end) never raise: a lost one
  costs only the wait until the master's own timer ends what it would have ended.
- A revoke after a failed write is quiet too: the error that caused it is the one worth raising.
"""

from __future__ import annotations

from kvpool.core import protocol
from kvpool.core.errors import KVPoolError, ProtocolError, UsageError


class MasterLink:
    def __init__(self, channel, tenant: str) -> None:
        self.channel = channel  # rpc.zmq_channel.MasterChannel or rpc.tcp_channel.LaneChannel
        self.tenant = tenant
        self.closed = False

    @property
    def epoch(self) -> int | None:
        """The master incarnation that answered last (None before the first answer)."""
        return self.channel.epoch

    def call(self, request, reply_type, timeout_s: float | None = None, meanwhile=None):
        if self.closed:
            raise UsageError("the client is closed")
        reply = self.channel.call(request, timeout_s, meanwhile) if meanwhile is not None else \
            self.channel.call(request, timeout_s)
        if not isinstance(reply, reply_type):
            raise ProtocolError(f"master answered {type(request).__name__} with {type(reply).__name__}")
        return reply

    def send_quietly(self, request) -> None:
        try:
            self.channel.send(request)
        except KVPoolError:
            pass  # the master's quarantine limit ends it instead

    def release(self, lease_id: int) -> None:
        """Hand a leased lookup back (fire-and-forget; the lease TTL covers a lost message)."""
        if lease_id and not self.closed:
            try:
                self.channel.send(protocol.ReleaseLeases(self.tenant, [lease_id]), lazy=True)
            except KVPoolError:
                pass

    def revoke_quietly(self, keys: list[str], tokens: list[int]) -> None:
        """Free allocations whose write never happened; if the master is unreachable too, its put
        timeout reclaims them."""
        if keys:
            try:
                self.call(protocol.PutRevoke(self.tenant, keys, tokens), protocol.OkReply)
            except KVPoolError:
                pass

    def close(self) -> None:
        self.closed = True
        self.channel.close()
