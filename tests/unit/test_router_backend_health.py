"""The router's health table for one backend (router/backends.py): what takes it out of rotation."""

from kvpool.router.backends import Backend


def test_one_timed_out_check_is_a_busy_server_not_a_dead_one():
    b = Backend("http://a", "a", fail_threshold=2)
    assert not b.check_timed_out("/health: no answer in 2 s") and b.healthy
    assert b.check_passed() is False and b.consecutive_failures == 0  # answered: the count starts again
    assert not b.check_timed_out("/health: no answer in 2 s") and b.healthy
    assert b.check_timed_out("/health: no answer in 2 s") and not b.healthy  # twice in a row: out
    assert b.check_passed() is True and b.healthy


def test_a_refused_check_takes_the_backend_out_at_once():
    b = Backend("http://a", "a", fail_threshold=2)
    assert b.check_failed("/health: ClientConnectorError") and not b.healthy
    assert not b.check_timed_out("/health: no answer in 2 s")  # already out: not taken out twice


def test_timeouts_and_failed_requests_add_up():
    b = Backend("http://a", "a", fail_threshold=3)
    b.request_failed("connect: refused")
    b.check_timed_out("/health: no answer in 2 s")
    assert b.healthy
    assert b.request_failed("read: reset") and not b.healthy
