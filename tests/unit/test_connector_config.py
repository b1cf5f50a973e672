"""The connector's extra_config: defaults, sizes, and clear errors for bad values."""

import pytest

from kvpool.connector.config import ConnectorConfig


def test_defaults_and_sizes():
    cfg = ConnectorConfig.from_extra_config({"master_address": "tcp://127.0.0.1:5555", "pool_memory_bytes": "64MiB"})
    assert cfg.pool_memory_bytes == 64 << 20 and cfg.load_async is None and cfg.save_decode
    assert (cfg.checksums, cfg.lookup_wait_ms, cfg.lookup_timeout_s, cfg.max_pinned_fraction) == (True, 2.0, 0.5, 0.25)
    assert cfg.touch_waiting_s == 0.0 and cfg.switch_interval_s == 0.0002
    assert ConnectorConfig.from_extra_config({"master_address": "tcp://h:1", "switch_interval_s": 0}).switch_interval_s == 0.0
    assert cfg.blocks_per_object(32) == 1
    assert ConnectorConfig.from_extra_config({"master_address": "tcp://h:1", "touch_waiting_s": 3}).touch_waiting_s == 3.0
    assert ConnectorConfig("tcp://h:1", tokens_per_object=128).blocks_per_object(32) == 4


@pytest.mark.parametrize(
    "extra, message",
    [
        ({}, "needs master_address"),
        ({"master_address": "localhost:5555"}, "ZMQ endpoint"),
        ({"master_address": "tcp://h:1", "bogus": 1}, "unknown kv_connector_extra_config keys"),
        ({"master_address": "tcp://h:1", "pool_memory_bytes": "lots"}, "cannot read"),
        ({"master_address": "tcp://h:1", "tenant": "a b"}, "tenant must be"),
        ({"master_address": "tcp://h:1", "timeout_s": 0}, "timeouts must be > 0"),
        ({"master_address": "tcp://h:1", "lookup_wait_ms": 500}, "delays the engine step"),
        ({"master_address": "tcp://h:1", "max_pinned_fraction": 0}, "max_pinned_fraction"),
        ({"master_address": "tcp://h:1", "checksums": "yes"}, "checksums must be true or false"),
        ({"master_address": "tcp://h:1", "touch_waiting_s": -1}, "touch_waiting_s must be within"),
        ({"master_address": "tcp://h:1", "switch_interval_s": 1}, "switch_interval_s must be 0"),
        ({"master_address": "tcp://h:1", "switch_interval_s": 1e-9}, "switch_interval_s must be 0"),
    ],
)
def test_bad_values_are_rejected_with_a_clear_error(extra, message):
    with pytest.raises(ValueError, match=message):
        ConnectorConfig.from_extra_config(extra)


def test_tokens_per_object_must_be_whole_blocks():
    with pytest.raises(ValueError, match="multiple of vLLM's block size"):
        ConnectorConfig("tcp://h:1", tokens_per_object=48).blocks_per_object(32)
