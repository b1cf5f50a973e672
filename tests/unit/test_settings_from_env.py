"""Settings read once into frozen configs (core/settings.py, transfer/config.py, rpc/config.py)."""

import dataclasses
from pathlib import Path

import pytest

from kvpool.rpc.config import ENV_CREDENTIAL, ENV_NODE_CREDENTIAL, CredentialSettings, TcpChannelConfig
from kvpool.transfer.config import (
    RDMA_TCP_MAX_BYTES, TCP_MAX_BYTES, DataPlaneConfig, NixlConfig,
)


def test_the_data_plane_config_reads_each_variable_once_and_names_a_bad_one():
    env = {"UCX_TLS": "tcp", "KVPOOL_SEGMENT_LANE_MAX_BYTES": "65536", "KVPOOL_SEGMENT_LANE_SPLIT_BYTES": "0",
           "KVPOOL_SEGMENT_LANE_SPIN_US": "50", "KVPOOL_NIXL_PROGRESS_DELAY_US": "2000"}
    config = DataPlaneConfig.from_env(env)
    assert config.tcp_spin_s == pytest.approx(50e-6)
    assert config == DataPlaneConfig(rdma=False, tcp_max_bytes=65536, write_split_bytes=0, read_split_bytes=0,
                                     tcp_spin_s=config.tcp_spin_s, nixl=NixlConfig(2000))
    assert DataPlaneConfig.from_env({"UCX_TLS": "tcp"}).max_bytes == TCP_MAX_BYTES
    assert DataPlaneConfig(rdma=True).max_bytes == RDMA_TCP_MAX_BYTES
    with pytest.raises(ValueError, match="KVPOOL_SEGMENT_LANE_MAX_BYTES"):
        DataPlaneConfig.from_env({"KVPOOL_SEGMENT_LANE_MAX_BYTES": "4M"})
    with pytest.raises(ValueError, match="KVPOOL_SEGMENT_LANE_SPLIT_BYTES"):
        DataPlaneConfig.from_env({"KVPOOL_SEGMENT_LANE_SPLIT_BYTES": "-1"})
    with pytest.raises(ValueError, match="tcp_max_bytes"):
        DataPlaneConfig(tcp_max_bytes=-1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.tcp_spin_s = 0.0


def test_the_tcp_channel_config():
    assert TcpChannelConfig.from_env({}) == TcpChannelConfig()
    assert TcpChannelConfig.from_env({"KVPOOL_LANE_UNIX": "0", "KVPOOL_LANE_SPIN_US": "0"}) == \
        TcpChannelConfig(spin_s=0.0, unix_socket=False)
    with pytest.raises(ValueError, match="KVPOOL_LANE_SPIN_US"):
        TcpChannelConfig.from_env({"KVPOOL_LANE_SPIN_US": "fast"})


def test_credential_settings_name_a_credential_only_through_its_variable(tmp_path):
    settings = CredentialSettings.from_env({"KVPOOL_AUTH_DIR": str(tmp_path), ENV_CREDENTIAL: "/c.cred"})
    assert settings.auth_dir == Path(tmp_path)
    assert settings.credential_path(ENV_CREDENTIAL) == "/c.cred"
    assert settings.credential_path(ENV_NODE_CREDENTIAL) is None
    with pytest.raises(ValueError, match="not a credential variable"):
        settings.credential_path("HOME")
    assert CredentialSettings.from_env({}).auth_dir == Path.home() / ".config" / "kvpool" / "auth"
