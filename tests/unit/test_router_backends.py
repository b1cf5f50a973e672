"""The router's per-backend load: the oldest wait for a first byte, taken back exactly once."""

import pytest

from kvpool.router.backends import Backend, Load


def test_oldest_wait_is_the_oldest_request_still_without_a_first_byte():
    b = Backend("http://a", "a")
    assert b.oldest_wait_s(100.0) == 0.0
    first, second = Load(b, 100, 10, sent_s=10.0), Load(b, 100, 10, sent_s=12.0)
    assert b.view(now_s=15.0).oldest_wait_s == pytest.approx(5.0)
    assert b.view().oldest_wait_s == 0.0  # no clock given: the signal is off
    first.first_byte()
    assert b.oldest_wait_s(15.0) == pytest.approx(3.0)  # the next oldest
    first.end()
    second.end()  # ended without a first byte (failed): no longer waiting either
    second.end()
    assert b.oldest_wait_s(15.0) == 0.0
    assert (b.inflight_requests, b.inflight_prompt_tokens, b.inflight_decode_tokens) == (0, 0, 0)
