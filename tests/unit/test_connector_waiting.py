"""Which waiting requests get their prefix touched, and when (connector/waiting.py). Time is passed in."""

import pytest

from kvpool.connector.waiting import WaitingRequests


def test_only_requests_waiting_past_the_interval_are_due_and_each_once_per_interval():
    w = WaitingRequests(interval_s=2.0)
    w.arrived("a", "req-a", 0.0)
    w.arrived("b", "req-b", 1.0)
    assert w.due(1.9) == []  # nobody has waited 2 s
    assert w.due(2.0) == ["req-a"]
    assert w.due(2.6) == []  # a was just touched, b has waited 1.6 s
    assert w.due(3.1) == ["req-b"]
    assert w.due(4.0) == ["req-a"]  # again, every interval while it waits
    w.arrived("a", "req-a-again", 4.0)  # vLLM re-adding the same id does not restart its clock
    assert w.due(5.2) == ["req-b"]


def test_admitted_or_finished_requests_are_never_touched():
    w = WaitingRequests(interval_s=1.0)
    for rid in "abc":
        w.arrived(rid, rid, 0.0)
    w.admitted("a")  # blocks allocated within the interval: its own lookup was the only one
    w.finished("b")  # aborted while waiting
    w.finished("zzz")  # unknown ids are ignored
    assert w.due(1.0) == ["c"] and len(w) == 1


def test_a_request_the_connector_never_hears_of_again_is_dropped_after_max_age():
    w = WaitingRequests(interval_s=1.0, max_age_s=10.0)
    w.arrived("lost", "lost", 0.0)
    assert w.due(5.0) == ["lost"]
    assert w.due(10.5) == [] and len(w) == 0


def test_the_interval_must_be_positive():
    with pytest.raises(ValueError):
        WaitingRequests(0.0)
