"""The P/D decode choice: a session keeps its decode instance while it is eligible, moves to the
least loaded one when not, new sessions spread round-robin over equally loaded instances, requests
without a session are never pinned, and the session map stays bounded."""

import pytest

from kvpool.router.decode_policy import DecodePolicy
from kvpool.router.policy import BackendView, NoHealthyBackend


def views(*loads: int, down: tuple[int, ...] = ()) -> list[BackendView]:
    return [BackendView(f"d{i}", healthy=i not in down, inflight_decode_tokens=load) for i, load in enumerate(loads)]


def test_new_sessions_go_round_robin_over_idle_instances_and_then_stick():
    policy = DecodePolicy()
    first = [policy.choose(f"s{k}", views(0, 0, 0)) for k in range(6)]
    assert [(d.index, d.reason) for d in first] == [(0, "new"), (1, "new"), (2, "new"), (0, "new"), (1, "new"), (2, "new")]
    again = [policy.choose(f"s{k}", views(0, 0, 0)) for k in range(6)]
    assert [(d.index, d.reason) for d in again] == [(0, "sticky"), (1, "sticky"), (2, "sticky")] * 2
    assert policy.home("s4") == "d1"


def test_the_least_loaded_instance_takes_a_new_session():
    policy = DecodePolicy()
    assert policy.choose("s", views(50, 10, 30)).index == 1
    # sticky even when its instance is now the busiest: the load only places new sessions
    assert policy.choose("s", views(0, 90, 0)).reason == "sticky"


def test_a_session_moves_when_its_instance_is_not_eligible_and_stays_moved():
    policy = DecodePolicy()
    assert policy.choose("s", views(0, 0)).index == 0
    moved = policy.choose("s", views(0, 0, down=(0,)))
    assert (moved.index, moved.reason) == (1, "moved") and policy.home("s") == "d1"
    assert (policy.choose("s", views(0, 0)).index, policy.choose("s", views(0, 0)).reason) == (1, "sticky")


def test_requests_without_a_session_are_not_pinned():
    policy = DecodePolicy()
    picks = [policy.choose(None, views(0, 0)) for _ in range(4)]
    assert [(d.index, d.reason) for d in picks] == [(0, "unpinned"), (1, "unpinned")] * 2
    assert policy.home("anonymous") is None


def test_no_eligible_instance_raises():
    with pytest.raises(NoHealthyBackend, match="none of the 2 decode instances"):
        DecodePolicy().choose("s", views(0, 0, down=(0, 1)))


def test_the_session_map_drops_the_least_recently_used():
    policy = DecodePolicy(max_sessions=2)
    policy.choose("a", views(0, 0))
    policy.choose("b", views(0, 0))
    policy.choose("a", views(0, 0))  # a is used again: b is the oldest
    policy.choose("c", views(0, 0))
    assert policy.home("b") is None and policy.home("a") == "d0" and policy.home("c") is not None
    with pytest.raises(ValueError, match="max_sessions"):
        DecodePolicy(max_sessions=0)
