"""Measured rates: the fit recovers the rates that generated the observations, the prior holds
where the traffic shows nothing, and old observations fade."""

import pytest

from kvpool.router.policy import BackendView, CostModel, RouteRequest, estimate_ttft
from kvpool.router.rates import RateConfig, RateEstimator

PRIOR = CostModel(prefill_s_per_token=1e-3, pool_load_s_per_token=1e-4, decode_s_per_token=1e-2)


def test_no_observations_gives_the_prior():
    costs = RateEstimator(RateConfig(PRIOR)).costs()
    assert costs.prefill_s_per_token == pytest.approx(1e-3)
    assert costs.pool_load_s_per_token == pytest.approx(1e-4)
    assert costs.decode_s_per_token == pytest.approx(1e-3)  # a decoded token costs what a prefilled one does


def test_fit_recovers_prefill_pool_and_overhead():
    est = RateEstimator(RateConfig(PRIOR, prior_weight=0.01))
    true_prefill, true_pool, overhead = 4e-3, 3e-4, 0.05
    for k in range(200):
        compute, pool = 100 + 37 * (k % 11), 64 * (k % 7)
        est.observe_ttft(compute, pool, overhead + true_prefill * compute + true_pool * pool)
    costs = est.costs()
    assert costs.prefill_s_per_token == pytest.approx(true_prefill, rel=0.02)
    assert costs.pool_load_s_per_token == pytest.approx(true_pool, rel=0.05)


def test_pool_rate_stays_at_the_prior_when_no_request_loaded_from_the_pool():
    est = RateEstimator(RateConfig(PRIOR))
    for k in range(100):
        compute = 100 + 250 * (k % 9)
        est.observe_ttft(compute, 0, 0.02 + 5e-3 * compute)
    costs = est.costs()
    assert costs.prefill_s_per_token == pytest.approx(5e-3, rel=0.05)
    assert costs.pool_load_s_per_token == pytest.approx(1e-4, rel=0.2)


def test_old_observations_fade():
    est = RateEstimator(RateConfig(PRIOR, half_life=8.0, prior_weight=0.01))
    for k in range(100):
        c = 100 + 200 * (k % 5)
        est.observe_ttft(c, 0, 1e-3 * c)
    for k in range(100):  # the machine got 3x slower
        c = 100 + 200 * (k % 5)
        est.observe_ttft(c, 0, 3e-3 * c)
    assert est.costs().prefill_s_per_token == pytest.approx(3e-3, rel=0.02)


def test_decode_latency_is_an_ewma_reported_apart_and_ignores_empty_decodes():
    est = RateEstimator(RateConfig(PRIOR, half_life=1e9))
    assert est.decode_latency_s_per_token is None
    est.observe_decode(10, 0.2)
    est.observe_decode(10, 0.4)
    est.observe_decode(0, 5.0)
    assert est.decode_latency_s_per_token == pytest.approx(0.03)
    assert est.num_decode_observations == 2
    assert est.costs().decode_s_per_token == pytest.approx(est.costs().prefill_s_per_token)


def test_a_server_decoding_a_few_answers_does_not_look_busy():
    # on the Claude Code replay a server decoding two answers (100 tokens left)
    # at 0.2 s between tokens looked 20 s busy, and warm requests went behind a cold 14K prefill
    est = RateEstimator(RateConfig(PRIOR))
    for k in range(50):
        est.observe_ttft(200 + 50 * k, 0, 2e-3 * (200 + 50 * k))
        est.observe_decode(20, 4.0)
    costs = est.costs()
    decoding = BackendView("b", inflight_decode_tokens=100)
    prefilling = BackendView("a", inflight_prompt_tokens=13_640)
    assert estimate_ttft(RouteRequest("s", 3000, 2900), decoding, costs).queue_s < 0.5
    assert estimate_ttft(RouteRequest("s", 3000, 2900), prefilling, costs).queue_s > 20.0


def test_rates_never_go_negative_and_bad_input_is_refused():
    est = RateEstimator(RateConfig(PRIOR, prior_weight=0.01))
    for k in range(50):
        est.observe_ttft(100 + k, 500, 1.0 - 1e-3 * k)  # noisy data suggesting a negative slope
    assert est.costs().prefill_s_per_token >= 0.0
    with pytest.raises(ValueError, match="bad observation"):
        est.observe_ttft(-1, 0, 0.1)
    with pytest.raises(ValueError, match="half_life"):
        RateConfig(PRIOR, half_life=0)
