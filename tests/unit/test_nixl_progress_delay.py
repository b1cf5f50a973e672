"""The NIXL progress thread's fallback poll period, from the environment (transfer/config.py)."""

import pytest

from kvpool.transfer import nixlio
from kvpool.transfer.config import PROGRESS_DELAY_ENV, NixlConfig


def test_default_and_override(monkeypatch):
    monkeypatch.delenv(PROGRESS_DELAY_ENV, raising=False)
    assert NixlConfig.from_env().progress_delay_us == 100_000
    monkeypatch.setenv(PROGRESS_DELAY_ENV, "5000")
    assert NixlConfig.from_env().progress_delay_us == 5000


@pytest.mark.parametrize("bad", ["", "fast", "0", "999", "20000000"])
def test_bad_values_are_refused_with_the_variable_named(monkeypatch, bad):
    monkeypatch.setenv(PROGRESS_DELAY_ENV, bad)
    with pytest.raises(ValueError, match=PROGRESS_DELAY_ENV):
        NixlConfig.from_env()


def test_an_endpoint_with_its_progress_thread_starts_under_an_override():
    endpoint = nixlio.NixlEndpoint("progress-delay-test", progress_thread=True, progress_delay_us=2000)
    try:
        assert endpoint.metadata()  # a working agent (its thread polls every 2 ms when idle)
    finally:
        endpoint.close()
