"""The master's ZMQ shell: a ROUTER socket in front of `MasterCore`, one thread, one loop.

Rules:
- Wire format: a DEALER sends [request_id (8 bytes), msgpack Request]; the ROUTER sees
  [identity, request_id, payload] and answers [identity, request_id, epoch (8 bytes, little
  endian), msgpack Reply]: every reply names this incarnation, so a peer sees a restart at once.
- Single-threaded: the loop polls the socket with a timeout that ends at the next tick (health
  checks, pending reclaim, eviction, metric snapshot), so no lock guards the index. While the core
  has idle work (eviction towards the low watermark, in slices), it polls without waiting and does
  one slice whenever no request came.
- Nothing a peer sends stops the loop: wrong frame counts, oversized frames, undecodable or unknown
  messages get ErrorReply(kind="protocol"); frames over twice the limit are dropped by ZMQ itself
  (MAXMSGSIZE, which closes that peer's connection) so a hostile peer cannot make us buffer them.
- Authentication (auth.py): with `auth_dir` the socket is a CURVE server and every message's
  User-Id (its proven public key) becomes a Principal that `MasterCore.handle` authorizes;
  without it the master serves anyone (`--insecure`) and says so at start.
- Rate limits (limits.py) per identity (its key; its connection when insecure), checked after
  decoding and before any work: a flooding client is refused `rate_limited`, the others served.
- Within one wake-up, lane frames sent one way (releases, revokes, PutLanded) are handled before
  the calls read with them: a writer sends PutLanded before its put returns, so a reader whose
  lookup was read in the same wake-up sees the object (only frames that name what an earlier
  reply gave their sender are sent one way, so none depends on a call read beside it).
- Pool events (protocol/events.py): an XPUB socket bound beside the ROUTER socket publishes the
  index's changes (pool_events.py), one batch after each wake-up that made any. The index records
  only from the first PoolEventsQuery until no subscription has been seen for a while (XPUB tells,
  read at each tick): a pool nobody follows does no work for it. A query cuts the pending batch
  before its snapshot. Not with authentication: the stream would show every tenant's keys.
- Durability (durability.py): a node's heartbeat with `wait_s` and nothing to deliver is parked
  until its segments have directory ops; a PutEnd or PutValue reply that committed objects is held
  until their nodes acknowledged the ops. Both are released after each wake-up, and the loop never
  waits past the nearest deadline of either.
- With a `fence` (leadership.py: an HA leader), a request that arrives at or past
  `fence.serving_until_s` is not answered, and the loop ends: past it the lease may have lapsed
  and another master lead. Nothing is sent after that, held replies included.
- `MasterService` runs in-process too: `start()` serves from a background thread, `stop()` ends it.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from kvpool.core import protocol as p
from kvpool.master.access import OPEN
from kvpool.master.config import MasterConfig
from kvpool.master.limits import RateLimiter
from kvpool.master.core import MasterCore
from kvpool.master.durability import Durability
from kvpool.master.gc_pauses import CollectorPauses
from kvpool.master.metrics import serve_metrics
from kvpool.rpc.frames import ONE_WAY_BYTES
from kvpool.rpc.tcp_server import REPLY_HEAD_BYTES, LaneServer

log = logging.getLogger("kvpool.master")

_BATCH = 256  # messages handled per poll wake-up before timed work gets a look
_POLLIN = int(zmq.POLLIN)  # plain ints: each test of a zmq.PollEvent flag runs Python (~1 us)
_LOGGED = (p.MountSegment, p.UnmountSegment, p.AnnounceObjects)
_EVENTS_GRACE_S = 10.0  # recording stays on this long after a query while no subscription is seen


def _log_event(request, reply) -> None:
    """Membership changes at INFO: an operator must see mounts, remounts and recoveries."""
    if isinstance(reply, p.ErrorReply):
        log.warning("%s refused: %s", type(request).__name__, reply.message)
    elif isinstance(request, p.MountSegment):
        log.info("node %s mounted segment %x (%d bytes%s)", request.node_id, reply.segment_id, request.size_bytes,
                 ", recovering its directory" if request.recovering else "")
    elif isinstance(request, p.UnmountSegment):
        log.info("segment %x unmounted by its node", request.segment_id)
    elif request.last or reply.rejected_offsets:
        log.info("segment %x announced %d objects (%d rejected)%s", request.segment_id, reply.accepted,
                 len(reply.rejected_offsets), "; recovery done" if request.last else "")


_ENCODE_ERRORS = (OverflowError, TypeError, ValueError, msgspec.EncodeError)


def _unencodable(reply: p.Reply) -> p.ErrorReply:
    """What the caller gets for a reply that cannot be encoded (a value out of the wire's range
    that validation missed): an internal error, logged, never the end of the loop."""
    log.exception("internal error: cannot encode a %s reply", type(reply).__name__)
    return p.ErrorReply(kind="internal", message=f"master could not encode its {type(reply).__name__}; see its log")


class MasterService:
    def __init__(self, config: MasterConfig, clock: Callable[[], float] = time.monotonic, epoch: int | None = None,
                 fence=None) -> None:
        self.config = config
        self.clock = clock
        self.core = MasterCore(config, epoch)
        self.fence = fence  # an object with serving_until_s (monotonic, as `clock`); None: always serving
        self.fenced = False
        self.address: str | None = None
        self.metrics_port: int | None = None
        self._context = zmq.Context()
        self._socket: zmq.Socket | None = None
        self._metrics_server = None
        self._gc_pauses: CollectorPauses | None = None  # with owns_process (serve_forever)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._snapshot: p.StatsReply | None = None
        self._encode = p.reply_encoder.encode
        self._encode_into = p.reply_encoder.encode_into
        self._decode = p.request_decoder.decode
        self._epoch_frame = self.core.epoch.to_bytes(8, "little")
        self._auth = None  # MasterAuth when config.auth_dir is set
        self._lane: LaneServer | None = None  # the plain TCP lane (rpc/tcp_server.py): only without auth
        self._poller: zmq.Poller | None = None  # with a lane: polls the ROUTER socket and the lane's fds
        self._events_socket: zmq.Socket | None = None  # XPUB: the pool events (not with authentication)
        self.events_address = ""
        self._events = self.core.index.events
        self._subscribed_topics: set[bytes] = set()
        self._last_events_query_s = 0.0
        self.limiter = RateLimiter(config.rate_limit_keys_per_s, config.rate_limit_burst_keys)
        self.durability = Durability(config.confirm_timeout_s, self.core.index.space, self.core.handle)

    def _secure(self, sock: zmq.Socket) -> None:
        if self.config.auth_dir is None:
            log.warning("serving WITHOUT authentication (insecure): any client can read and write every tenant")
            return
        from kvpool.master.auth import MasterAuth
        from kvpool.rpc.credentials import AuthDir

        self._auth = MasterAuth(AuthDir(self.config.auth_dir), self._context)
        self._auth.apply_server(sock)
        log.info("CURVE authentication on: master public key %s, identities in %s", self._auth.public_key,
                 self.config.auth_dir)

    def bind(self) -> str:
        sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.config.max_message_bytes)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        self._secure(sock)
        port = "*" if self.config.port == 0 else str(self.config.port)
        sock.bind(f"tcp://{self.config.host}:{port}")
        self._socket = sock
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info("master epoch %016x serving on %s", self.core.epoch, self.address)
        if self._auth is None:
            self._poller = zmq.Poller()
            self._poller.register(sock, zmq.POLLIN)
            host = "0.0.0.0" if self.config.host == "*" else self.config.host
            self._lane = LaneServer(host, self._poller, 2 * self.config.max_message_bytes)
            log.info("plain TCP lane (unauthenticated, like this master) on port %d", self._lane.port)
        if self._auth is None:
            self._bind_events()
        self._snapshot = self._stats(self.clock())
        if self.config.metrics_port is not None:
            self._metrics_server, self.metrics_port = serve_metrics(
                self.config.host, self.config.metrics_port, lambda: self._snapshot,
                lambda: pauses.families() if (pauses := self._gc_pauses) is not None else ()
            )
        return self.address

    def _bind_events(self) -> None:
        pub = self._context.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 10_000)  # batches; a subscriber further behind loses some and resyncs
        pub.bind(f"tcp://{self.config.host}:*")
        self._events_socket = pub
        self.events_address = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info("pool events published on %s", self.events_address)

    def _publish_events(self) -> None:
        batch = self._events.take(self.core.epoch)
        if batch is None or self._events_socket is None:
            return
        try:
            self._events_socket.send_multipart([p.POOL_EVENTS_TOPIC, self._encode(batch)], zmq.NOBLOCK)
        except zmq.Again:
            pass  # the subscribers' queues are full: they see the gap and resync

    def _events_query(self, request: p.PoolEventsQuery, now_s: float) -> p.PoolEventsOffer:
        if self._events_socket is None:
            return p.PoolEventsOffer("", self.core.epoch, 0)
        self._publish_events()
        self._events.start()
        self._last_events_query_s = now_s
        return self._events.snapshot(self.events_address, self.core.epoch, self.core.index.tenants, request.tenant,
                                     request.with_keys)  # fmt: skip

    def _read_subscriptions(self, now_s: float) -> None:
        """XPUB passes a topic's first subscription and its last unsubscription (a subscriber that
        disconnects unsubscribes): recording ends once nobody has subscribed for a grace period."""
        pub = self._events_socket
        while pub.getsockopt(zmq.EVENTS) & _POLLIN:
            message = pub.recv(zmq.NOBLOCK)
            if message[:1] == b"\x01":
                self._subscribed_topics.add(message[1:])
            elif message[:1] == b"\x00":
                self._subscribed_topics.discard(message[1:])
        if (self._events.recording and not self._subscribed_topics
                and now_s - self._last_events_query_s > _EVENTS_GRACE_S):  # fmt: skip
            self._events.stop()

    def _stats(self, now_s: float) -> p.StatsReply:
        return self._with_service_counts(self.core.stats(now_s))

    def _with_service_counts(self, stats: p.StatsReply) -> p.StatsReply:
        """The core's stats plus what only this shell sees (handshakes, rate limits)."""
        refused = self._auth.identities.refused_handshakes if self._auth is not None else 0
        durability = self.durability
        return msgspec.structs.replace(stats, rate_limited=self.limiter.refused, refused_handshakes=refused,
                                       commits_confirmed=durability.confirmed,
                                       commits_unconfirmed=durability.unconfirmed)

    def request_stop(self) -> None:
        self._stop.set()

    def serve_forever(self, owns_process: bool = False) -> None:
        """Serve until `request_stop`. `owns_process` (the `kvpool master` command): after each
        tick, every object alive is handed to the garbage collector's permanent generation
        (gc.freeze, O(1)), so its collections walk only what the last tick made: with 100 K
        objects a full collection otherwise held this thread 82-106 ms, and one of the middle
        generation 8-14 ms (benchmarks/results/master_tail/). Records die by reference count (they
        form no cycles), frozen or not. The collector's pauses become metrics (gc_pauses.py).
        Off in-process: the collector is the host process's."""
        if self._socket is None:
            self.bind()
        sock = self._socket
        core = self.core
        clock = self.clock
        tick_s = self.config.tick_interval_s
        next_tick_s = clock() + tick_s
        idle_from_s = 0.0  # idle work waits until then after it failed
        if owns_process:
            self._gc_pauses = CollectorPauses()
        events = self._events
        durability = self.durability
        try:
            while not self._stop.is_set():
                idle = core.has_idle_work and clock() >= idle_from_s  # then only look for requests, not wait
                wake_s = next_tick_s
                if durability.num_parked or durability.num_held:
                    wake_s = min(wake_s, durability.next_deadline_s())
                timeout_ms = 0 if idle else max(0, int(1000 * (wake_s - clock())) + 1)
                if self._lane is not None:
                    served = self._serve_with_lane(min(timeout_ms, 200))
                else:
                    served = self._receive(sock, min(timeout_ms, 200))
                    if served:
                        self._drain(sock)
                if self.fenced:
                    break
                if events.changes:  # what this wake-up changed, in one batch
                    self._publish_events()
                now_s = clock()
                if self.fence is not None and now_s >= self.fence.serving_until_s:
                    self._stop_fenced()
                    break
                try:
                    durability.release(now_s)
                except Exception:  # as for the timed work: never the end of the loop
                    log.exception("internal error releasing parked heartbeats and held replies")
                if idle and not served:
                    try:
                        core.idle_work(now_s)
                    except Exception:  # as for the timed work; retried at the next tick
                        log.exception("internal error in the master's idle work")
                        idle_from_s = next_tick_s
                if now_s >= next_tick_s:
                    try:
                        for event in core.tick(now_s):
                            log.warning("%s", event)
                    except Exception:  # a bug in timed work must not end the loop that serves everyone
                        log.exception("internal error in the master's timed work")
                    self._snapshot = self._stats(now_s)
                    if self._auth is not None:
                        self._auth.identities.maybe_reload()
                    self.limiter.prune(now_s)
                    if self._events_socket is not None:
                        self._publish_events()  # what the timed work changed
                        self._read_subscriptions(now_s)
                    if owns_process:
                        gc.freeze()
                    next_tick_s = now_s + tick_s
        finally:
            if not self._past_fence():
                try:
                    self.durability.flush(clock())
                except Exception:
                    log.exception("internal error answering parked heartbeats and held replies at stop")
            self._close()

    def _receive(self, sock: zmq.Socket, timeout_ms: int) -> bool:
        """Wait for one message and answer it. A blocking receive with a timeout waits inside libzmq:
        no Python poller per wake-up and no zmq.Again raised per batch (~25 % of a lookup here)."""
        sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        try:
            frames = sock.recv_multipart(copy=False)
        except zmq.Again:
            return False
        self._answer_frames(frames)
        return True

    def _drain(self, sock: zmq.Socket) -> None:
        for _ in range(_BATCH):
            if not sock.getsockopt(zmq.EVENTS) & _POLLIN:
                break
            self._answer_frames(sock.recv_multipart(zmq.NOBLOCK, copy=False))

    def _serve_with_lane(self, timeout_ms: int) -> bool:
        """One wake-up of the loop when the lane is served: ZMQ messages and lane frames alike.
        False: nothing came within `timeout_ms`."""
        lane, sock = self._lane, self._socket
        ready = self._poller.poll(timeout_ms)
        calls = []
        for what, events in ready:
            if what is sock:
                self._drain(sock)
            elif lane.owns(what):
                for frame in lane.handle(what, events):
                    if frame[1] == ONE_WAY_BYTES:
                        self._answer(*frame, self._lane_send)
                    else:
                        calls.append(frame)
        for key, request_id, payload in calls:
            self._answer(key, request_id, payload, self._lane_send)
        return bool(ready)

    def _lane_send(self, key: bytes, request_id: bytes, reply: p.Reply) -> None:
        if request_id == ONE_WAY_BYTES:
            return  # the peer asked for no reply: nothing to encode
        if self.fence is not None and self._past_fence():
            self._stop_fenced()
            return
        frame = bytearray(REPLY_HEAD_BYTES)  # the reply is encoded behind its head: no copy to join them
        try:
            self._encode_into(reply, frame, REPLY_HEAD_BYTES)
        except _ENCODE_ERRORS:
            del frame[REPLY_HEAD_BYTES:]
            self._encode_into(_unencodable(reply), frame, REPLY_HEAD_BYTES)
        self._lane.reply_frame(key, request_id, self.core.epoch, frame)

    def _encode_reply(self, reply: p.Reply) -> bytes:
        try:
            return self._encode(reply)
        except _ENCODE_ERRORS:
            return self._encode(_unencodable(reply))

    def _answer_frames(self, frames: list[zmq.Frame]) -> None:
        """A request from the ROUTER socket: [identity, request_id, payload] frames."""
        identity = frames[0].bytes
        if len(frames) != 3:
            request_id = frames[1].bytes[:8] if len(frames) > 1 else b""
            self._send(identity, request_id, p.ErrorReply(
                kind="protocol", message=f"expected 2 frames [request_id, payload], got {len(frames) - 1}"
            ))
            return
        payload = frames[2]
        user_id = payload.get("User-Id") if self._auth is not None else None
        self._answer(identity, frames[1].bytes, payload.buffer, self._send, user_id)

    def _answer(self, identity: bytes, request_id: bytes, payload, send: Callable, user_id: str | None = None) -> None:
        """Check, decode, handle and answer one request; `send(identity, request_id, reply)` answers
        (over the ROUTER socket or the lane). `user_id`: the ZMQ authenticator's (with auth)."""
        if len(request_id) != 8:
            send(identity, request_id[:8], p.ErrorReply(
                kind="protocol", message=f"request id must be 8 bytes, got {len(request_id)}"
            ))
            return
        if len(payload) > self.config.max_message_bytes:
            send(identity, request_id, p.ErrorReply(
                kind="protocol",
                message=f"message of {len(payload)} bytes exceeds the {self.config.max_message_bytes}-byte limit: "
                "split the batch",
            ))
            return
        principal = OPEN
        if self._auth is not None:
            principal = self._auth.identities.principal_of(user_id)
            if principal is None:
                send(identity, request_id, p.ErrorReply(kind="auth", message="this key is no longer trusted"))
                return
        now_s = self.clock()
        if self.fence is not None and now_s >= self.fence.serving_until_s:
            self._stop_fenced()
            return
        caller = principal.key or identity
        if self.limiter.exhausted(caller, now_s):  # refused before the decode: a flood costs little
            send(identity, request_id, p.ErrorReply(kind="rate_limited", message=self.limiter.exhausted_message))
            return
        try:
            request = self._decode(payload)
        except msgspec.DecodeError as e:
            send(identity, request_id, p.ErrorReply(kind="protocol", message=f"undecodable request: {e}"))
            return
        limited = self.limiter.refusal(caller, request, now_s)
        if limited is not None:
            send(identity, request_id, p.ErrorReply(kind="rate_limited", message=limited))
            return
        try:
            if type(request) is p.LaneQuery:  # the shell's own business: the core knows no sockets
                reply = p.LaneOffer(self._lane.port, self._lane.unix_name) if self._lane is not None else p.LaneOffer(0)
            elif type(request) is p.PoolEventsQuery:  # the shell's too: it owns the PUB socket
                reply = self._events_query(request, now_s)
            else:
                reply = self.core.handle(request, now_s, principal)
                if self.durability.wait(request, reply, principal, now_s, send, identity, request_id):
                    return
            if type(reply) is p.StatsReply:
                reply = self._with_service_counts(reply)
            if type(request) in _LOGGED:
                _log_event(request, reply)
                if isinstance(request, p.AnnounceObjects) and request.last and self._gc_pauses is not None:
                    # recovery just made up to millions of long-lived records: keep the collector from
                    # walking them again and again (a third of the announcement's cost otherwise);
                    # only where the service owns its process (_gc_pauses is set then)
                    gc.freeze()
        except Exception:  # a bug in the master must not take the pool down; it is logged in full
            log.exception("internal error handling %s", type(request).__name__)
            reply = p.ErrorReply(kind="internal", message=f"master failed on {type(request).__name__}; see its log")
        send(identity, request_id, reply)

    def _past_fence(self) -> bool:
        """Whether this leader's lease may have lapsed: then nothing more may be sent."""
        return self.fenced or (self.fence is not None and self.clock() >= self.fence.serving_until_s)

    def _stop_fenced(self) -> None:
        if not self.fenced:
            self.fenced = True
            log.error("no longer the leader (its lease may have lapsed): answering nothing more")
        self._stop.set()

    def _send(self, identity: bytes, request_id: bytes, reply: p.Reply) -> None:
        if self.fence is not None and self._past_fence():  # a reply made in time, sent too late
            self._stop_fenced()
            return
        try:
            self._socket.send_multipart([identity, request_id, self._epoch_frame, self._encode_reply(reply)],
                                        zmq.NOBLOCK)
        except zmq.Again:
            log.warning("reply to a slow peer dropped (send queue full)")

    def _close(self) -> None:
        if self._gc_pauses is not None:
            self._gc_pauses.close()
            self._gc_pauses = None
        if self._lane is not None:
            self._lane.close()
            self._lane = None
        if self._events_socket is not None:
            self._events_socket.close(linger=0)
            self._events_socket = None
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None
        self._context.term()

    # ---- in-process use ------------------------------------------------------------------------

    def start(self) -> "MasterService":
        """Bind and serve from a background thread; returns self (`.address` is set)."""
        self.bind()
        self._thread = threading.Thread(target=self.serve_forever, name="kvpool-master", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def __enter__(self) -> "MasterService":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
