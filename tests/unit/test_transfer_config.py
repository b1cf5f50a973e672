"""The --kv-transfer-config JSON for aggregated and P/D servers (kvpool.core.transfer_config), and
the `kvpool connector-config` command that prints it."""

import json

import pytest

from kvpool.cli import main
from kvpool.core.transfer_config import pd_transfer_config, pool_transfer_config


def test_aggregated_config_is_the_pool_connector_recomputing_failed_loads():
    config = pool_transfer_config({"master_address": "tcp://10.0.0.5:7400", "num_replicas": 2})
    assert config["kv_connector"] == "KVPoolConnector" and config["kv_connector_module_path"] == "kvpool.connector"
    assert config["kv_load_failure_policy"] == "recompute"
    assert config["kv_connector_extra_config"] == {"master_address": "tcp://10.0.0.5:7400", "num_replicas": 2}
    with pytest.raises(ValueError, match="master_address"):
        pool_transfer_config({})


def test_pd_config_puts_nixl_first_so_decode_loads_from_the_prefill_instance():
    config = pd_transfer_config({"master_address": "tcp://m:1"})
    assert config["kv_connector"] == "MultiConnector" and config["kv_load_failure_policy"] == "recompute"
    nixl, pool = config["kv_connector_extra_config"]["connectors"]
    assert nixl["kv_connector"] == "NixlConnector" and nixl["kv_buffer_device"] == "cpu"
    assert pool == pool_transfer_config({"master_address": "tcp://m:1"})
    assert all(c["kv_load_failure_policy"] == "recompute" for c in (nixl, pool))
    alone = pd_transfer_config(None, nixl_buffer_device=None)
    assert alone["kv_connector"] == "NixlConnector" and "kv_buffer_device" not in alone


def test_connector_config_command_prints_json_and_rejects_bad_input(capsys):
    assert main(["connector-config", "--pd", "--master", "tcp://m:1", "--set", "num_replicas=2", "--set", "tenant=a"]) == 0
    config = json.loads(capsys.readouterr().out)
    assert config["kv_connector_extra_config"]["connectors"][1]["kv_connector_extra_config"] == {
        "master_address": "tcp://m:1", "num_replicas": 2, "tenant": "a"}
    assert main(["connector-config"]) == 2
    assert "master_address" in capsys.readouterr().err
    assert main(["connector-config", "--no-pool", "--master", "tcp://m:1"]) == 2
    assert main(["connector-config", "--master", "tcp://m:1", "--set", "oops"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err
