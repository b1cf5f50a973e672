"""The master's session-aware eviction order (master/session_order.py SessionAwareOrder), exact order on
tiny pools, against LRU on the same puts; and the eviction study's policies on a small log."""

from __future__ import annotations

from kvpool.core import protocol as p
from kvpool.master import MasterConfig, MasterCore
from kvpool.sim.eviction_study import LOOKUP, WRITE, Access, replay

SLOT = 64


def make_core(session_aware: bool, slots: int = 20) -> MasterCore:
    order = "session" if session_aware else "lru"
    core = MasterCore(MasterConfig(alignment_bytes=SLOT, node_ttl_s=1e9, high_watermark=0.9, low_watermark=0.5,
                                   eviction_order=order))
    core.handle(p.MountSegment("n1", "host", slots * SLOT, 0, "agent", b""), 0.0)
    return core


def put(core, keys, now_s, parent=None, session=""):
    parents = [parent] + keys[:-1]
    reply = core.handle(p.PutStart("t", keys, [SLOT] * len(keys), parents, 1, False, session), now_s)
    assert reply.statuses == [p.PUT_ALLOCATED] * len(keys)
    core.handle(p.PutEnd("t", keys, reply.tokens, [0] * len(keys)), now_s)


def event(core, session, kind, now_s, request="r"):
    reply = core.handle(p.SessionEvents("t", [p.SessionEvent(session, f"{session}-{request}", kind)]), now_s)
    assert isinstance(reply, p.OkReply), reply


def turn(core, session, keys, parent, arrive_s, write_s):
    """One turn as the connector reports it: arrival (before its lookup), its put, its end."""
    event(core, session, p.TURN_ARRIVED, arrive_s, request=str(arrive_s))
    put(core, keys, write_s, parent, session)
    event(core, session, p.TURN_DONE, write_s, request=str(arrive_s))


def present(core, keys):
    return [k for k, e in zip(keys, core.handle(p.Exists("t", keys), 0.0).exists) if e]


def eviction_order(core, now_s, keys):
    order = []
    for _ in keys:
        before = set(present(core, keys))
        core.pressure.evict(now_s, SLOT)
        gone = before - set(present(core, keys))
        assert len(gone) <= 1
        if gone:
            order.append(gone.pop())
    return order


def two_sessions(core):
    """A thinks ~100 s between turns, B ~59 s (the master measures it: arrival - last turn's end).
    B's last write (t=61) is older than A's (t=102)."""
    turn(core, "A", ["a1", "a2"], None, 0.0, 1.0)
    turn(core, "B", ["b1", "b2"], None, 0.0, 1.0)
    turn(core, "B", ["b3"], "b2", 60.0, 61.0)
    turn(core, "A", ["a3"], "a2", 101.0, 102.0)


KEYS = ["a1", "a2", "a3", "b1", "b2", "b3"]


def test_lru_evicts_the_session_used_longest_ago_tail_first():
    core = make_core(session_aware=False)
    two_sessions(core)
    assert eviction_order(core, 103.0, KEYS) == ["b3", "b2", "b1", "a3", "a2", "a1"]


def test_session_aware_evicts_the_session_predicted_back_last_tail_first():
    core = make_core(session_aware=True)
    two_sessions(core)
    # think times seen: 59, 100 (the fleet's: neither session has 4 of its own). At 103:
    # A idle 1 s -> mean(59 - 1, 100 - 1) = 78.5 s more -> back at 181.5
    # B idle 42 s -> mean(59 - 42, 100 - 42) = 37.5 s more -> back at 140.5: A goes first
    assert eviction_order(core, 103.0, KEYS) == ["a3", "a2", "a1", "b3", "b2", "b1"]


def test_a_session_gone_longer_than_any_think_time_is_expected_away_as_long_again():
    core = make_core(session_aware=True)
    two_sessions(core)
    # at 170: A idle 68 s -> 100 - 68 = 32 s more -> 202; B idle 109 s, past every think time seen
    # -> 109 s more -> 279: B goes first now
    assert eviction_order(core, 170.0, KEYS) == ["b3", "b2", "b1", "a3", "a2", "a1"]


def test_a_session_that_ended_goes_first():
    core = make_core(session_aware=True)
    two_sessions(core)
    event(core, "A", p.SESSION_END, 102.5, request="101.0")
    # without the end A would stay (test above: B first at 170)
    assert eviction_order(core, 170.0, KEYS) == ["a3", "a2", "a1", "b3", "b2", "b1"]


def test_a_retried_lookup_of_one_turn_is_one_arrival():
    core = make_core(session_aware=True)
    two_sessions(core)
    order = core.hints.order
    thinks = list(order.thinks)
    for now in (150.0, 151.0, 152.0):  # vLLM asks again while the request waits: one request id
        event(core, "A", p.TURN_ARRIVED, now, request="150")
    assert len(order.thinks) == len(thinks) + 1


def test_a_turn_in_flight_returns_after_its_service_and_a_think_time():
    def setup():
        core = make_core(session_aware=True)
        turn(core, "A", ["a1"], None, 0.0, 1.0)
        turn(core, "B", ["b1"], None, 0.0, 2.5)
        event(core, "A", p.TURN_ARRIVED, 3.0, request="3")  # A's next turn in flight: 3 + 1 (service) + 2 (think) = 6
        return core
    # at 3.5, B idle 1 s -> 2 - 1 = 1 s more -> 4.5: A (6) goes first
    assert eviction_order(setup(), 3.5, ["a1", "b1"]) == ["a1", "b1"]
    # at 5.5, B idle 3 s, past every think time seen -> 3 s more -> 8.5: B goes first
    assert eviction_order(setup(), 5.5, ["a1", "b1"]) == ["b1", "a1"]


def test_shared_prefix_is_never_evicted_before_the_chains_on_it():
    core = make_core(session_aware=True)
    put(core, ["sys"], 0.0, session="A")
    for s in ("A", "B"):
        event(core, s, p.TURN_ARRIVED, 1.0)
        put(core, [f"{s}1"], 2.0, parent="sys", session=s)
        event(core, s, p.TURN_DONE, 2.0)
    assert eviction_order(core, 3.0, ["sys", "A1", "B1"])[-1] == "sys"


def test_one_tenants_session_names_do_not_rank_another_tenants_blocks():
    core = make_core(session_aware=True)
    two_sessions(core)  # tenant "t"
    order = core.hints.order
    core.handle(p.SessionEvents("u", [p.SessionEvent("A", "x", p.SESSION_END)]), 103.0)
    assert not order.sessions[order.owner_key("t", "A")].ended
    assert eviction_order(core, 103.0, KEYS) == ["a3", "a2", "a1", "b3", "b2", "b1"]


def _cyclic_log(num_sessions: int, turns: int, blocks_per_turn: int) -> list[Access]:
    """Sessions served one at a time in a fixed cycle: each turn extends the session's chain."""
    log = []
    t = 0.0
    chains = {s: [] for s in range(num_sessions)}
    next_key = 1
    for _ in range(turns):
        for s in range(num_sessions):
            keys = chains[s]
            think_s = num_sessions - 0.5 if keys else 0.0  # from its last write to this lookup
            log.append(Access(t, LOOKUP, s, tuple(keys), None, prompt_tokens=max(1, len(keys)) * 16, think_s=think_s))
            new = list(range(next_key, next_key + blocks_per_turn))
            next_key += blocks_per_turn
            log.append(Access(t + 0.5, WRITE, s, tuple(keys + new), None))  # the whole prompt, as the sim writes
            chains[s] = keys + new
            t += 1.0
    return log


def test_cyclic_sessions_thrash_lru_but_not_session_aware_nor_belady():
    log = _cyclic_log(num_sessions=6, turns=10, blocks_per_turn=2)
    capacity = 30  # the sessions end at 6 x 20 = 120 blocks
    lru = replay("lru", capacity, log, 16)
    tail_lru = replay("tail-lru", capacity, log, 16)
    session = replay("session", capacity, log, 16)
    belady = replay("belady", capacity, log, 16)
    assert lru < 0.1 and tail_lru < 0.1  # each session is evicted just before it comes back
    assert session > 5 * lru and session > 0.25  # a stable subset of sessions stays whole, as with the optimum
    assert belady >= session
    assert replay("lru", 10**6, log, 16) == replay("session", 10**6, log, 16) == replay("belady", 10**6, log, 16)


def test_a_pool_the_master_cannot_mount_is_refused_not_simulated_empty():
    import pytest

    from kvpool.sim.config import PoolConfig
    from kvpool.sim.pool import PoolModel

    with pytest.raises(ValueError, match="cannot be mounted"):
        PoolModel(PoolConfig(capacity_bytes=float(1 << 63), num_nodes=2), 4096)
    unbounded = PoolModel(PoolConfig(capacity_bytes=float("inf"), num_nodes=60), 4096)
    assert len(unbounded.core.segments.by_id) == 60


def test_sessions_that_say_they_ended_leave_room_for_the_others():
    """Half the sessions stop after 3 turns; told so, the session order drops them at once."""
    log = []
    t, next_key = 0.0, 1
    chains: dict[int, list[int]] = {s: [] for s in range(6)}
    for turn in range(8):
        for s in range(6):
            if s < 3 and turn >= 3:
                continue
            keys = chains[s]
            log.append(Access(t, LOOKUP, s, tuple(keys), None, prompt_tokens=max(1, len(keys)) * 16))
            new = [next_key, next_key + 1]
            next_key += 2
            last = turn == (2 if s < 3 else 7)
            log.append(Access(t + 0.5, WRITE, s, tuple(keys + new), None, session_end=last))
            chains[s] = keys + new
            t += 1.0
    capacity = 30  # the three that stay need 3 x 16 blocks by their end
    assert replay("session-end", capacity, log, 16) > replay("session", capacity, log, 16) + 0.1
    assert replay("belady", capacity, log, 16) >= replay("session-end", capacity, log, 16)
