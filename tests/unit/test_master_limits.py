"""Per-identity token buckets (master/limits.py) on a clock passed in: exact refills, refusals that
name the wait, identities that do not share a bucket, and calls larger than any burst."""

from kvpool.core import protocol as p
from kvpool.master.limits import RateLimiter, cost_of


def lookup(n: int) -> p.LookupPrefix:
    return p.LookupPrefix("t", [f"k{i}" for i in range(n)])


def test_cost_is_the_number_of_keys_named_or_one():
    assert cost_of(lookup(300)) == 300 and cost_of(lookup(0)) == 1
    assert cost_of(p.PutStart("t", ["a", "b"], [1, 1], [None, None])) == 2
    assert cost_of(p.Stats()) == 1 and cost_of(p.Heartbeat("n", [1, 2, 3])) == 1


def test_a_bucket_refills_at_its_rate_up_to_its_burst():
    limiter = RateLimiter(keys_per_s=100.0, burst_keys=200.0)
    assert limiter.admit("a", 200, 0.0) == 0.0
    assert limiter.admit("a", 50, 0.0) == 0.5  # 50 tokens missing at 100/s
    assert limiter.admit("a", 50, 0.5) == 0.0
    assert limiter.admit("a", 1, 0.5) > 0
    assert limiter.admit("a", 200, 100.0) == 0.0  # refilled to the burst, not beyond
    assert limiter.admit("a", 1, 100.0) == 0.01
    assert limiter.refused == 3


def test_identities_do_not_share_a_bucket_and_idle_ones_are_forgotten():
    limiter = RateLimiter(keys_per_s=10.0, burst_keys=10.0)
    assert limiter.refusal(b"flooder", lookup(10), 0.0) is None
    assert "rate limited" in limiter.refusal(b"flooder", lookup(10), 0.0)
    assert limiter.refusal(b"polite", lookup(10), 0.0) is None
    limiter.prune(30.0, idle_s=60.0)
    assert len(limiter) == 2
    limiter.prune(61.0, idle_s=60.0)
    assert len(limiter) == 0


def test_a_call_larger_than_the_burst_is_told_to_split():
    limiter = RateLimiter(keys_per_s=1000.0, burst_keys=100.0)
    assert "split it" in limiter.refusal("a", lookup(101), 0.0)


def test_an_empty_bucket_is_exhausted_until_one_token_refills():
    limiter = RateLimiter(keys_per_s=100.0, burst_keys=100.0)
    assert not limiter.exhausted("a", 0.0)  # never seen: a full bucket
    assert limiter.admit("a", 100, 0.0) == 0.0
    assert limiter.exhausted("a", 0.005)  # half a token back
    assert not limiter.exhausted("a", 0.01)  # one token back
    assert limiter.refused == 1
