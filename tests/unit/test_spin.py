"""The lane's spin policy (kvpool.rpc.spin): pure logic."""

from hypothesis import given
from hypothesis import strategies as st

from kvpool.rpc.spin import SpinPolicy


def test_a_new_policy_spins_and_one_late_reply_among_quick_ones_changes_nothing():
    policy = SpinPolicy(100e-6)
    assert policy.spins
    for _ in range(20):
        policy.record(30e-6)
    policy.record(5e-3)
    assert policy.spins


def test_a_run_of_late_replies_stops_the_spin_within_a_few_calls_and_quick_ones_bring_it_back():
    policy = SpinPolicy(100e-6)
    late = 0
    while policy.spins:
        policy.record(400e-6)
        late += 1
    assert late <= 6
    quick = 0
    while not policy.spins:
        policy.record(50e-6)
        quick += 1
    assert quick <= 6


def test_a_zero_spin_never_spins():
    policy = SpinPolicy(0.0)
    policy.record(0.0)
    assert not policy.spins


@given(st.lists(st.floats(min_value=0.0, max_value=1.0), max_size=200))
def test_the_rate_stays_a_fraction_and_all_quick_waits_keep_spinning(waits):
    policy = SpinPolicy(100e-6)
    for wait in waits:
        policy.record(wait)
        assert 0.0 <= policy.rate <= 1.0
    for _ in range(40):
        policy.record(0.0)
    assert policy.spins
