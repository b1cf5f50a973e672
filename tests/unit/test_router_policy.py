"""Routing policies on plain data: exact choices, unhealthy backends skipped, deterministic ties,
and how few sessions move on the hash ring when a backend joins or leaves."""

import pytest

from kvpool.router.policy import (
    BackendView,
    CacheAwarePolicy,
    CostModel,
    Decision,
    LeastLoadedPolicy,
    NoHealthyBackend,
    RoundRobinPolicy,
    RouteRequest,
    SessionPolicy,
    estimate_ttft,
    make_policy,
)

COSTS = CostModel(prefill_s_per_token=1e-3, pool_load_s_per_token=1e-4, decode_s_per_token=1e-5)


def views(*names, **fields):
    return [BackendView(n, **{k: v[i] for k, v in fields.items()}) for i, n in enumerate(names)]


def req(prompt=1000, pool=0, session="s"):
    return RouteRequest(session_id=session, prompt_tokens=prompt, pool_prefix_tokens=pool)


def test_round_robin_cycles_and_skips_unhealthy():
    policy = RoundRobinPolicy()
    abc = views("a", "b", "c")
    assert [policy.choose(req(), abc).index for _ in range(4)] == [0, 1, 2, 0]
    b_down = views("a", "b", "c", healthy=[True, False, True])
    assert policy.choose(req(), b_down) == Decision(2, "next_healthy")  # would be b
    assert policy.choose(req(), b_down) == Decision(0, "next")
    assert policy.choose(req(), abc) == Decision(1, "next")  # b is back in rotation


def test_no_healthy_backend_raises():
    down = views("a", "b", healthy=[False, False])
    for name in ("round_robin", "least_loaded", "session", "cache_aware"):
        with pytest.raises(NoHealthyBackend):
            make_policy(name, ["a", "b"], COSTS).choose(req(), down)


def test_least_loaded_counts_prompt_and_decode_tokens():
    policy = LeastLoadedPolicy()
    backends = views("a", "b", "c", inflight_prompt_tokens=[100, 0, 50], inflight_decode_tokens=[0, 120, 60])
    assert policy.choose(req(), backends) == Decision(0, "least_loaded")  # 100 < 110 < 120
    tied = views("a", "b", "c", inflight_prompt_tokens=[5, 3, 3])
    assert policy.choose(req(), tied).index == 1  # tie goes to the earlier one
    b_down = views("a", "b", "c", inflight_prompt_tokens=[5, 3, 4], healthy=[True, False, True])
    assert policy.choose(req(), b_down).index == 2


def test_session_sticks_to_its_home_and_skips_an_unhealthy_one():
    names = ["a", "b", "c"]
    policy = SessionPolicy(names)
    home = policy.ring_order("user-7")
    assert sorted(home) == names
    backends = views(*names)
    first = policy.choose(req(session="user-7"), backends)
    assert first == Decision(names.index(home[0]), "home")
    assert all(policy.choose(req(session="user-7"), backends) == first for _ in range(5))
    down = views(*names, healthy=[n != home[0] for n in names])
    assert policy.choose(req(session="user-7"), down) == Decision(names.index(home[1]), "home")


def test_session_spills_from_a_hot_backend_to_the_next_on_the_ring():
    names = ["a", "b", "c"]
    policy = SessionPolicy(names, load_factor=1.5)
    home, second, third = policy.ring_order("hot")

    def choose(prompt, **load):
        backends = [BackendView(n, inflight_prompt_tokens=load.get(n, 0)) for n in names]
        return policy.choose(req(prompt, session="hot"), backends)

    # bound = 1.5 x (in flight + this request) / 3
    assert choose(1000, **{home: 9000}) == Decision(names.index(second), "spill")  # 9000 > 5000
    assert choose(1000, **{home: 9000, second: 6000}) == Decision(names.index(second), "spill")  # 9000 > 8000 >= 6000
    assert choose(1000, **{home: 2500, second: 2500}) == Decision(names.index(home), "home")  # 2500 <= 3000
    assert choose(1000, **{home: 1000, second: 1000, third: 1000}) == Decision(names.index(home), "home")
    # a prompt larger than all that is in flight still goes home (the home holds its KV)
    assert choose(8000, **{home: 500, second: 100}) == Decision(names.index(home), "home")


def test_adding_a_backend_moves_only_the_sessions_it_takes_over():
    sessions = [f"session-{i}" for i in range(2000)]
    ring = SessionPolicy(["a", "b", "c", "d"])
    before = {s: ring.ring_order(s)[0] for s in sessions}
    ring.add_backend("e")
    after = {s: ring.ring_order(s)[0] for s in sessions}
    moved = [s for s in sessions if before[s] != after[s]]
    assert all(after[s] == "e" for s in moved)  # nobody moves between the old backends
    assert 0.10 * len(sessions) < len(moved) < 0.30 * len(sessions)  # ~1/5 of them, not ~4/5
    ring.remove_backend("e")
    assert {s: ring.ring_order(s)[0] for s in sessions} == before  # removal undoes it exactly
    # the same sessions with modulo hashing would move ~4/5: the ring's point
    modulo_moved = sum(1 for s in sessions if hash_mod(s, 4) != hash_mod(s, 5))
    assert modulo_moved > 2 * len(moved)


def hash_mod(session, n):
    import hashlib

    return int.from_bytes(hashlib.blake2b(session.encode(), digest_size=8).digest(), "big") % n


def test_ring_membership_errors_are_clear():
    ring = SessionPolicy(["a"])
    with pytest.raises(ValueError, match="already on the ring"):
        ring.add_backend("a")
    with pytest.raises(ValueError, match="not on the ring"):
        ring.remove_backend("z")
    with pytest.raises(ValueError, match="load_factor"):
        SessionPolicy(["a"], load_factor=0.9)


def test_estimate_splits_prompt_into_local_pool_and_recompute():
    backend = BackendView("a", inflight_prompt_tokens=200, inflight_decode_tokens=1000, local_prefix_tokens=300)
    e = estimate_ttft(req(prompt=1000, pool=800), backend, COSTS)
    assert (e.local_tokens, e.pool_tokens, e.recompute_tokens) == (300, 500, 200)
    assert e.queue_s == pytest.approx(200 * 1e-3 + 1000 * 1e-5)
    assert e.ttft_s == pytest.approx(e.queue_s + 500 * 1e-4 + 200 * 1e-3)
    shorter_pool = estimate_ttft(req(prompt=1000, pool=100), backend, COSTS)  # local covers the pool
    assert (shorter_pool.local_tokens, shorter_pool.pool_tokens, shorter_pool.recompute_tokens) == (300, 0, 700)
    over = estimate_ttft(req(prompt=100), BackendView("a", local_prefix_tokens=500), COSTS)
    assert (over.local_tokens, over.recompute_tokens, over.ttft_s) == (100, 0, 0.0)


def test_cache_aware_goes_where_the_prefix_is_local():
    policy = CacheAwarePolicy(COSTS)
    backends = views("a", "b", "c", local_prefix_tokens=[0, 900, 0])
    assert policy.choose(req(1000, pool=900), backends) == Decision(1, "local")
    assert policy.choose(req(1000, pool=0), backends) == Decision(1, "local")


def test_cache_aware_leaves_a_local_prefix_behind_a_long_queue_for_the_pool():
    policy = CacheAwarePolicy(COSTS)
    # b holds 900 local tokens but has 2000 prompt tokens queued (2 s); a loads 900 from the pool
    # (0.09 s) and recomputes 100 (0.1 s)
    backends = views("a", "b", local_prefix_tokens=[0, 900], inflight_prompt_tokens=[0, 2000])
    assert policy.choose(req(1000, pool=900), backends) == Decision(0, "pool")
    # without the pool, a would recompute 1000 tokens (1 s) against b's 2 s + 0.1 s: still a
    assert policy.choose(req(1000, pool=0), backends) == Decision(0, "cold")
    # a short queue on b: b's local prefix wins
    backends = views("a", "b", local_prefix_tokens=[0, 900], inflight_prompt_tokens=[0, 50])
    assert policy.choose(req(1000, pool=900), backends) == Decision(1, "local")


def test_cache_aware_never_chooses_an_unhealthy_backend_with_the_prefix():
    policy = CacheAwarePolicy(COSTS)
    backends = views("a", "b", local_prefix_tokens=[0, 1000], healthy=[True, False])
    assert policy.choose(req(1000, pool=1000), backends) == Decision(0, "pool")


def test_cache_aware_ties_are_deterministic_per_session_and_spread_sessions():
    policy = CacheAwarePolicy(COSTS)
    idle = views("a", "b", "c")
    picks = {s: policy.choose(req(session=s), idle).index for s in (f"s{i}" for i in range(60))}
    assert all(policy.choose(req(session=s), idle).index == i for s, i in picks.items())  # same again
    assert set(picks.values()) == {0, 1, 2}  # ties spread sessions, not all on the first backend
    assert {policy.choose(req(session=s), list(reversed(idle))).index for s in picks} == {0, 1, 2}
    reordered = list(reversed(idle))
    assert all(reordered[policy.choose(req(session=s), reordered).index].name == idle[i].name
               for s, i in picks.items())  # fmt: skip  # by name, not position


def test_cache_aware_uses_new_costs():
    policy = CacheAwarePolicy(COSTS)
    backends = views("a", "b", local_prefix_tokens=[0, 900], inflight_prompt_tokens=[0, 200])
    assert policy.choose(req(1000, pool=900), backends).index == 0  # pool 0.19 s < queue 0.2 s + 0.1 s
    policy.set_costs(CostModel(prefill_s_per_token=1e-3, pool_load_s_per_token=5e-4))
    assert policy.choose(req(1000, pool=900), backends).index == 1  # pool 0.55 s > 0.3 s


def test_make_policy_names():
    assert isinstance(make_policy("round_robin", ["a"]), RoundRobinPolicy)
    assert isinstance(make_policy("least_loaded", ["a"]), LeastLoadedPolicy)
    assert make_policy("session", ["a", "b"]).members == {"a", "b"}
    assert make_policy("cache_aware", ["a"], COSTS).costs == COSTS
    with pytest.raises(ValueError, match="round_robin, least_loaded, session, cache_aware"):
        make_policy("random", ["a"])
    with pytest.raises(ValueError, match="prefill_s_per_token"):
        CostModel(prefill_s_per_token=-1.0, pool_load_s_per_token=0.0)


def test_a_backend_whose_oldest_request_has_waited_long_is_left_for_the_pool_copy():
    policy = CacheAwarePolicy(COSTS)
    # a's tokens in flight look cheap (0.01 s), but its oldest request has waited 8 s for a first token
    backends = views("a", "b", local_prefix_tokens=[900, 0], inflight_prompt_tokens=[10, 0], oldest_wait_s=[8.0, 0.0])
    assert policy.choose(req(1000, pool=900), backends) == Decision(1, "pool")  # 0.19 s on b against 8.1 on a
    assert policy.choose(req(1000, pool=0), backends) == Decision(1, "cold")  # a full recompute (1 s) still wins
    short_wait = views("a", "b", local_prefix_tokens=[900, 0], oldest_wait_s=[0.05, 0.0])
    assert policy.choose(req(1000, pool=900), short_wait) == Decision(0, "local")  # a blip: the local copy wins
    e = estimate_ttft(req(1000), BackendView("a", inflight_prompt_tokens=5000, oldest_wait_s=1.0), COSTS)
    assert e.queue_s == pytest.approx(5.0)  # the larger of the two estimates
