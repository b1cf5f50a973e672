"""The control channel to the master: one request, one reply, with a deadline.

Rules:
- A DEALER socket with an 8-byte request id per call: a reply that arrives after its caller gave
  up is recognised by id and dropped, so a late reply can never answer the next call.
- Every reply names the master's incarnation (its epoch frame). When it changes, the channel calls
  its epoch listeners BEFORE the reply is handed to the caller, so whoever cached ids of the old
  incarnation (segment descriptions, routes, leases) drops them before using anything of the new
  one. Listeners run under the channel's lock: they must not call the channel.
- Several master addresses (a list, or one string with commas) name one master and its standbys,
  started with the same config and never two at a time: a call that gets no reply moves the next
  call to the next address. A standby is a new incarnation, so the rule above applies.
- An etcd address (`etcd://HOST:PORT[,...]/NAME`, leader.py) names whichever master leads: the
  channel reads the leader from etcd at each (re)connect, reconnects after a call that got no
  reply, and never takes a reply from a leader older than one it saw (epochs ordered by election).
- Thread-safe by a lock: calls are short; batching, not concurrency, is how callers go fast.
- A call that gets no reply within `timeout_s` raises UnavailableError and never hangs; an
  ErrorReply is raised as the matching KVPoolError class.
- `fallback_role` (node, tenant:default, admin): a channel with no credential, to a master on this
  host, whose handshake the master refuses for want of CURVE takes that role's credential from the
  default auth directory (credentials.local_default_credential) and makes the call again, once.
- With a credential (credentials.py) the socket is a CURVE client: the control plane is encrypted
  and the master knows who calls. A refused handshake (unknown key; or the master needs CURVE and
  none was given) shows on the socket's monitor: the call raises AuthError saying so, instead of
  waiting out its timeout as if the master were down.
- `send` is fire-and-forget (a request whose answer nobody needs, e.g. ReleaseLeases): its reply
  arrives later and the next `call` drops it like any stale reply.
- `begin` sends a call and returns without its reply, which `finish` takes later (or `abandon`
  drops): a reply to a begun call that another call reads first is kept for its finish. A socket
  closed in between (a fail-over, a refused handshake) fails the finish at once.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq
import zmq.utils.monitor

from kvpool.core import protocol
from kvpool.core.errors import AuthError, ProtocolError, UnavailableError, error_from_reply
from kvpool.rpc.credentials import Credential, local_default_credential
from kvpool.rpc.leader import epoch_order, find_leader, is_etcd_address, parse_etcd_address

log = logging.getLogger(__name__)

EpochListener = Callable[[int | None, int], None]  # (old epoch or None, new epoch)

_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
_POLL_SLICE_MS = 100  # a refused handshake is noticed within this, not at the call's timeout


@dataclass(frozen=True)
class BegunCall:
    """A call a channel's `begin` sent (MasterChannel's, LaneChannel's); its reply is that
    channel's `finish`."""

    request: protocol.Request
    request_id: int
    deadline_s: float  # monotonic
    generation: int  # the socket (ZMQ) or lane connection it went on


def host_of(address: str) -> str:
    """'tcp://HOST:PORT' -> HOST (brackets of an IPv6 address removed); an etcd address: its first
    endpoint's host."""
    if is_etcd_address(address):
        return parse_etcd_address(address).endpoints[0][0]
    host = address.split("://", 1)[1].rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") else host


def parse_addresses(address: str | list[str] | tuple[str, ...]) -> list[str]:
    """'tcp://a:1,tcp://b:2' or a list of addresses -> the list; ValueError when empty or malformed.
    An etcd address stands alone: [it]."""
    if is_etcd_address(address):
        parse_etcd_address(address)  # ValueError when malformed
        return [address.strip()]
    items = address.split(",") if isinstance(address, str) else list(address)
    addresses = [a.strip() for a in items if a and a.strip()]
    if not addresses:
        raise ValueError("no master address given")
    for a in addresses:
        if not a.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"master address must be a ZMQ endpoint like tcp://HOST:PORT, got {a!r}")
    return addresses


class MasterChannel:
    def __init__(
        self, address: str | list[str], timeout_s: float = 5.0, context: zmq.Context | None = None,
        credential: Credential | None = None, fallback_role: str | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.addresses = parse_addresses(address)
        self._etcd = self.addresses[0] if is_etcd_address(self.addresses[0]) else None  # then: the leader's
        self.timeout_s = timeout_s
        self.epoch: int | None = None  # the incarnation that answered last
        self._current = 0  # index into addresses
        self._context = context or zmq.Context.instance()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._socket: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._listeners: list[EpochListener] = []
        self.credential = credential
        self._fallback = (local_default_credential(host_of(self.addresses[0]), fallback_role)
                          if credential is None and fallback_role and self._etcd is None else None)
        self._generation = 0  # counts sockets made: a begun call's reply comes on its own socket only
        self._awaited: set[bytes] = set()  # ids of begun calls not finished yet
        self._parked: dict[bytes, list[bytes]] = {}  # their replies, read by another call

    @property
    def address(self) -> str:
        return self.addresses[self._current]

    def add_epoch_listener(self, listener: EpochListener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def _connect(self) -> zmq.Socket:
        if self._socket is None:
            if self._etcd is not None:
                self.addresses = [find_leader(self._etcd).address]  # UnavailableError: no leader now
            sock = self._context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 1000)
            if self.credential is not None:
                self.credential.apply_client(sock)
            self._monitor = sock.get_monitor_socket(_HANDSHAKE_FAILED)
            sock.connect(self.address)
            self._socket = sock
        return self._socket

    def _close_socket(self) -> None:
        self._generation += 1
        self._awaited.clear()
        self._parked.clear()
        if self._socket is not None:
            self._socket.disable_monitor()
            self._socket.close(linger=0)
            self._socket = None
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None

    def _handshake_refusal(self) -> AuthError | None:
        """AuthError if the monitor saw the master refuse our handshake (the socket is then reset)."""
        if self._monitor is None or not self._monitor.poll(0, zmq.POLLIN):
            return None
        event = zmq.utils.monitor.recv_monitor_message(self._monitor)
        address = self.address
        self._close_socket()
        if self.credential is None:
            return AuthError(f"master {address} requires CURVE authentication and this client has no credential: "
                             "pass one (--credential FILE, credential=..., or $KVPOOL_CREDENTIAL; "
                             "`kvpool auth add DIR tenant:NAME` makes one)")
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return AuthError(f"master {address} refused this client's key (role {self.credential.role}, public key "
                             f"{self.credential.public_key}): it is not in the master's identities.json, or was revoked")
        return AuthError(f"CURVE handshake with master {address} failed (event {event['event']:#x}): is the "
                         "credential's master_public_key this master's, and does the master use CURVE?")

    def _fail_over(self) -> None:
        """No reply: the next call goes to the next address (with one address: a fresh socket; with
        etcd: to whichever master leads then)."""
        if self._etcd is not None:
            self._close_socket()
        elif len(self.addresses) > 1:
            self._close_socket()
            self._current = (self._current + 1) % len(self.addresses)
            log.warning("master did not answer; trying %s next", self.address)

    def _see_epoch(self, frame: bytes) -> None:
        epoch = int.from_bytes(frame, "little")
        if epoch == self.epoch:
            return
        if self._etcd is not None and self.epoch is not None and epoch_order(epoch) < epoch_order(self.epoch):
            address = self.address
            self._close_socket()
            raise UnavailableError(f"master {address} answered as a leader older than one already seen: "
                                   "it is not leading any more")
        old, self.epoch = self.epoch, epoch
        if old is not None:
            log.warning("master %s is a new incarnation (epoch %016x, was %016x): dropping what was cached",
                        self.address, epoch, old)
        for listener in self._listeners:
            listener(old, epoch)

    # ---- for a channel that carries requests another way (transfer/tcp_channel.py) ----------------------

    def next_request_id(self) -> int:
        """A fresh id from this channel's sequence: shared with the lane, so ids never repeat."""
        return next(self._ids)

    def see_epoch(self, epoch: int) -> None:
        """The epoch rule above for a reply that came another way (listeners run under the lock); the
        same epoch as last time, the usual case, takes no lock."""
        if epoch != self.epoch:
            with self._lock:
                self._see_epoch(epoch.to_bytes(8, "little"))

    def call(self, request: protocol.Request, timeout_s: float | None = None, meanwhile=None) -> protocol.Reply:
        """The master's reply, or UnavailableError / the error it answered. `meanwhile()`: run
        once the request is sent, before the reply is awaited (it must not raise)."""
        try:
            return self._call(request, timeout_s, meanwhile)
        except AuthError:
            if self._fallback is None or self.credential is not None:
                raise
            with self._lock:
                self.credential, self._fallback = self._fallback, None
            log.info("master %s asks for CURVE: using the default %s credential its host holds", self.address,
                     self.credential.role)
            return self._call(request, timeout_s, None)  # `meanwhile` ran with the first try

    def _call(self, request: protocol.Request, timeout_s: float | None, meanwhile) -> protocol.Reply:
        timeout_ms = int(1000 * (self.timeout_s if timeout_s is None else timeout_s))
        payload = protocol.request_encoder.encode(request)
        with self._lock:
            sock = self._connect()
            request_id = self._post(sock, payload)
            if request_id is None:
                self._fail_over()
                raise UnavailableError(f"master {self.address} is not accepting requests")
            deadline = time.monotonic() + timeout_ms / 1000
            if meanwhile is not None:
                meanwhile()
            frames = self._await_reply(sock, request_id, deadline, request, timeout_ms / 1000)
            self._see_epoch(frames[1])
        return self._decoded(frames[2])

    def _decoded(self, body: bytes) -> protocol.Reply:
        try:
            reply = protocol.reply_decoder.decode(body)
        except msgspec.DecodeError as e:
            raise ProtocolError(f"undecodable reply from master {self.address}: {e}") from None
        if isinstance(reply, protocol.ErrorReply):
            raise error_from_reply(reply.kind, reply.message)
        return reply

    def _post(self, sock: zmq.Socket, payload: bytes) -> bytes | None:
        """Send one request frame under a fresh id (the caller holds the lock): its id, or None when
        the socket's send queue is full and nothing was sent."""
        request_id = next(self._ids).to_bytes(8, "little")
        try:
            sock.send_multipart([request_id, payload], flags=zmq.NOBLOCK)
        except zmq.Again:
            return None
        return request_id

    def _await_reply(self, sock: zmq.Socket, request_id: bytes, deadline: float, request,
                     timeout_s: float) -> list[bytes]:
        """The reply frames to `request_id` (parked by another call, or received now; a begun call's
        reply met on the way is parked, any other dropped: a stale reply to a call that gave up), or
        AuthError / UnavailableError at `deadline`. The caller holds the lock."""
        frames = self._parked.pop(request_id, None)
        while frames is None:
            remaining_ms = max(0, int(1000 * (deadline - time.monotonic())))
            if not sock.poll(min(remaining_ms, _POLL_SLICE_MS), zmq.POLLIN):
                refused = self._handshake_refusal()
                if refused is not None:
                    raise refused
                if remaining_ms > _POLL_SLICE_MS:
                    continue
                address = self.address
                self._fail_over()
                raise UnavailableError(f"master {address} did not answer {type(request).__name__} within "
                                       f"{timeout_s:.1f} s (is `kvpool master` running there?)")
            got = sock.recv_multipart()
            if len(got) == 3 and got[0] == request_id:
                frames = got
            else:
                self._park(got)
        return frames

    def _park(self, frames: list[bytes]) -> None:
        """Keep a reply to a begun call for its finish (the caller holds the lock)."""
        if len(frames) == 3 and frames[0] in self._awaited:
            self._parked[frames[0]] = frames

    def begin(self, request: protocol.Request, timeout_s: float | None = None) -> BegunCall | None:
        """Send a call and return without its reply (take it with `finish`, or `abandon` it); None,
        having sent nothing, when the socket takes no more requests."""
        payload = protocol.request_encoder.encode(request)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            try:
                request_id = self._post(self._connect(), payload)
            except UnavailableError:  # no leader to send it to (etcd)
                return None
            if request_id is None:
                return None
            self._awaited.add(request_id)
            return BegunCall(request, int.from_bytes(request_id, "little"), time.monotonic() + timeout,
                             self._generation)

    def finish(self, call: BegunCall) -> protocol.Reply:
        """The reply to a call `begin` sent, or UnavailableError (its socket was closed meanwhile, or
        the master did not answer in time) / the error it answered."""
        with self._lock:
            try:
                if call.generation != self._generation or self._socket is None:
                    raise UnavailableError(f"the connection to master {self.address} was reset before it answered "
                                           f"{type(call.request).__name__}")
                timeout_s = max(0.0, call.deadline_s - time.monotonic())
                frames = self._await_reply(self._socket, _frame_id(call), call.deadline_s, call.request, timeout_s)
            finally:
                self._awaited.discard(_frame_id(call))
            self._see_epoch(frames[1])
        return self._decoded(frames[2])

    def abandon(self, call: BegunCall) -> None:
        """Give up on a begun call's reply (dropped whenever it comes)."""
        with self._lock:
            self._awaited.discard(_frame_id(call))
            self._parked.pop(_frame_id(call), None)

    def send(self, request: protocol.Request, *, lazy: bool = False) -> None:
        """Send without waiting for the reply; raises UnavailableError if the send queue is full.
        `lazy` (the lane's: the frame may wait for the next one) changes nothing here."""
        payload = protocol.request_encoder.encode(request)
        with self._lock:
            if self._post(self._connect(), payload) is None:
                raise UnavailableError(f"master {self.address} is not accepting requests")

    def close(self) -> None:
        with self._lock:
            self._close_socket()


def _frame_id(call: BegunCall) -> bytes:
    """A begun call's id as its request frame carries it."""
    return call.request_id.to_bytes(8, "little")
