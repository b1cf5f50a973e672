"""Commits in their nodes' directories before the writer hears "stored": parked heartbeats and held replies.

Why: nodes keep the directory a new master rebuilds the cache from (node/directory.py). Fed by
heartbeat replies alone, the last second of commits was in no node's directory when a master died,
and a restart lost every object put in it (docs/design/integrity.md).

Rules:
- A node mounted on this master (MountReply.parks_heartbeats) sends each heartbeat with `wait_s`.
  When its segments have no directory op to deliver, the heartbeat is parked here, and answered as
  soon as one of them has one (a commit, a removal, a tier op) or once `wait_s` passed. The node
  applies the ops and acknowledges them in its next heartbeat, sent at once: a commit is in its
  node's directory one master-node round trip after it was made.
- A reply to a request that committed or removed objects (PutEnd, PutValue, Remove) is held until
  every segment it changed has acknowledged the ops, so a writer told "stored" has its objects in their nodes'
  directories, and a crash of the master right after loses none of them. It is sent at once when
  a segment's node does not park heartbeats (it would wait a heartbeat interval) or its log was
  reset, and after `confirm_timeout_s` in any case (a slow or dead node): counted `unconfirmed`.
- A reply held here is the same reply, sent later: the writer's request id matches it as ever.
  Requests from one writer are matched by id, not order, so holding one never blocks another.
- A service that stops answers parked heartbeats and confirmed replies, and "unavailable" for the
  replies still waiting (`flush`); a leader that lost its lease sends nothing at all.
- No sockets and no clock: `send` callables and times come in. The service offers every reply to
  `wait` (True: parked or held here), calls `release` after each wake-up and waits no longer than
  `next_deadline_s`. The segment space's `grown` and `commits` are taken here, and only here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvpool.core import protocol as p
from kvpool.master.segments import Segment
from kvpool.master.space import SegmentSpace

_HELD_REQUESTS = (p.PutEnd, p.PutValue, p.Remove)  # their replies may wait for their commits
_MAX_WAIT_S = 1.0  # a heartbeat is held at most this long, whatever its wait_s

Send = Callable[[bytes, bytes, p.Reply], None]  # (identity, request id, reply)
Handle = Callable[[p.Heartbeat, float, object], p.Reply]  # MasterCore.handle


@dataclass(slots=True)
class _Parked:
    request: p.Heartbeat
    principal: object
    deadline_s: float
    send: Send
    identity: bytes
    request_id: bytes


@dataclass(slots=True)
class _Held:
    waits: list[tuple[Segment, int]]
    deadline_s: float
    send: Send
    identity: bytes
    request_id: bytes
    reply: p.Reply


def _acknowledged(segment: Segment, seq: int, by_id: dict) -> bool:
    """The node applied op `seq` (or can never: its segment is gone, or its log was reset)."""
    log = segment.log
    return by_id.get(segment.segment_id) is not segment or log.reset or log.first_seq > seq


class Durability:
    def __init__(self, confirm_timeout_s: float, space: SegmentSpace, handle: Handle) -> None:
        self.confirm_timeout_s = confirm_timeout_s
        self._space = space
        self._by_id = space.segments.by_id  # segment_id -> Segment
        self._handle = handle  # MasterCore.handle: a parked heartbeat's reply is cut when it goes
        self._parked: dict[str, _Parked] = {}  # node id -> its parked heartbeat
        self._held: list[_Held] = []
        self.confirmed = 0  # replies held until their commits were acknowledged
        self.unconfirmed = 0  # replies sent at their deadline without
        self.unheld = 0  # replies that committed to a node that does not park heartbeats: sent at once

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def wait(self, request: p.Request, reply: p.Reply, principal: object, now_s: float, send: Send,
             identity: bytes, request_id: bytes) -> bool:
        """Whether `reply` waits here: a heartbeat with nothing to deliver is parked, a reply that
        changed directories is held for their acknowledgement. False: the caller sends it now."""
        if type(request) in _HELD_REQUESTS:
            commits = self._space.take_commits()
            return bool(commits) and type(reply) is not p.ErrorReply and self._hold(commits, reply, now_s, send,
                                                                                   identity, request_id)
        if (type(reply) is p.HeartbeatReply and request.wait_s > 0 and self.confirm_timeout_s > 0
                and request.segment_ids and not reply.deltas and not reply.unknown_segment_ids):
            self._park(request, principal, now_s, send, identity, request_id)
            return True
        return False

    def _park(self, request: p.Heartbeat, principal: object, now_s: float, send: Send, identity: bytes,
              request_id: bytes) -> None:
        """Hold a heartbeat whose reply had no ops. A node has one parked at most: an earlier one
        (its node gave up on it) is answered now."""
        earlier = self._parked.pop(request.node_id, None)
        if earlier is not None:
            self._answer(earlier, now_s)
        wait_s = min(request.wait_s, _MAX_WAIT_S)
        self._parked[request.node_id] = _Parked(request, principal, now_s + wait_s, send, identity, request_id)

    def _hold(self, commits: list[tuple[Segment, int]], reply: p.Reply, now_s: float, send: Send, identity: bytes,
              request_id: bytes) -> bool:
        """Hold `reply` until `commits` are acknowledged; False (the caller sends it now) when there
        is nothing to wait for."""
        if self.confirm_timeout_s <= 0:
            return False
        by_id = self._by_id
        waits = []
        for segment, seq in commits:
            if _acknowledged(segment, seq, by_id):
                continue
            if not segment.parks:
                self.unheld += 1
                return False
            waits.append((segment, seq))
        if not waits:
            return False
        self._held.append(_Held(waits, now_s + self.confirm_timeout_s, send, identity, request_id, reply))
        return True

    def release(self, now_s: float) -> None:
        """After a wake-up: answer parked heartbeats whose segments have ops now (or whose wait
        ended), then send the held replies whose commits were acknowledged (or whose wait ended)."""
        grown = self._space.take_grown()
        self._space.take_commits()  # what no held reply waits for (one-way ends, timed work)
        parked = self._parked
        if parked:
            for segment in grown:
                waiting = parked.get(segment.node_id)
                if waiting is not None and segment.segment_id in waiting.request.segment_ids:
                    del parked[segment.node_id]
                    self._answer(waiting, now_s)
            if parked:
                for node_id in [n for n, w in parked.items() if w.deadline_s <= now_s]:
                    self._answer(parked.pop(node_id), now_s)
        if self._held:
            by_id = self._by_id
            still = []
            for held in self._held:
                held.waits = [(s, q) for s, q in held.waits if not _acknowledged(s, q, by_id)]
                if not held.waits:
                    self.confirmed += 1
                elif held.deadline_s <= now_s:
                    self.unconfirmed += 1
                else:
                    still.append(held)
                    continue
                held.send(held.identity, held.request_id, held.reply)
            self._held = still

    def next_deadline_s(self) -> float | None:
        deadlines = [w.deadline_s for w in self._parked.values()] + [h.deadline_s for h in self._held]
        return min(deadlines) if deadlines else None

    def flush(self, now_s: float) -> None:
        """Answer everything now (the service is stopping): parked heartbeats as they stand; held
        replies whose commits were acknowledged as they are, the others "unavailable" (the writer
        must not hear "stored" for what no node confirmed)."""
        for waiting in self._parked.values():
            self._answer(waiting, now_s)
        self._parked.clear()
        by_id = self._by_id
        for held in self._held:
            if all(_acknowledged(s, q, by_id) for s, q in held.waits):
                held.send(held.identity, held.request_id, held.reply)
            else:
                self.unconfirmed += 1
                held.send(held.identity, held.request_id, p.ErrorReply(
                    kind="unavailable", message="the master stopped before the node confirmed this write: retry it"))
        self._held = []

    def _answer(self, waiting: _Parked, now_s: float) -> None:
        """The parked heartbeat's reply as of now: ops, or an unknown segment (acks repeat harmlessly)."""
        request = p.Heartbeat(waiting.request.node_id, waiting.request.segment_ids, waiting.request.directory_seqs,
                              [], waiting.request.wait_s)
        waiting.send(waiting.identity, waiting.request_id, self._handle(request, now_s, waiting.principal))
