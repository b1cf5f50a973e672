"""transfer/nixlio.py: the NIXL progress thread's fallback poll period, from the environment."""

import pytest

from kvpool.core.errors import TransferError
from kvpool.transfer import nixlio


def test_default_and_override(monkeypatch):
    monkeypatch.delenv(nixlio.PROGRESS_DELAY_ENV, raising=False)
    assert nixlio.progress_delay_us() == 100_000
    monkeypatch.setenv(nixlio.PROGRESS_DELAY_ENV, "5000")
    assert nixlio.progress_delay_us() == 5000


@pytest.mark.parametrize("bad", ["", "fast", "0", "999", "20000000"])
def test_bad_values_are_refused_with_the_variable_named(monkeypatch, bad):
    monkeypatch.setenv(nixlio.PROGRESS_DELAY_ENV, bad)
    with pytest.raises(TransferError, match=nixlio.PROGRESS_DELAY_ENV):
        nixlio.progress_delay_us()


def test_an_endpoint_with_its_progress_thread_starts_under_an_override(monkeypatch):
    monkeypatch.setenv(nixlio.PROGRESS_DELAY_ENV, "2000")
    endpoint = nixlio.NixlEndpoint("progress-delay-test", progress_thread=True)
    try:
        assert endpoint.metadata()  # a working agent (its thread polls every 2 ms when idle)
    finally:
        endpoint.close()
