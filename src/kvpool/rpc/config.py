"""The control plane's settings: frozen configs, read from the environment only by `from_env()`.

Rules:
- Nothing else in kvpool.rpc reads the environment: LaneChannel takes a TcpChannelConfig and the
  credential helpers a CredentialSettings (each made with `from_env()` when the caller passes
  none), so a bad value is a ValueError naming its variable when the component is made.
- A credential is used when named (an argument, or the one variable for that role); the auth
  directory's files are picked up only as the fallback for a master on the same host that asks
  for CURVE (credentials.local_default_credential).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvpool.core.settings import env_microseconds, env_path, env_switch

TCP_SPIN_ENV = "KVPOOL_LANE_SPIN_US"
TCP_UNIX_ENV = "KVPOOL_LANE_UNIX"  # 0: the TCP channel over TCP even on the master's host (A/Bs)
ENV_AUTH_DIR = "KVPOOL_AUTH_DIR"
ENV_CREDENTIAL = "KVPOOL_CREDENTIAL"  # clients (the connector, the router, bench tools)
ENV_NODE_CREDENTIAL = "KVPOOL_NODE_CREDENTIAL"  # storage nodes

DEFAULT_TCP_SPIN_US = 100.0  # how long a call on the TCP channel spins for its reply (spin.py)


@dataclass(frozen=True)
class TcpChannelConfig:
    """The TCP channel to the master (tcp_channel.py)."""

    spin_s: float = DEFAULT_TCP_SPIN_US * 1e-6  # $KVPOOL_LANE_SPIN_US; 0: never spin
    unix_socket: bool = True  # $KVPOOL_LANE_UNIX=0: TCP even where the master's Unix socket is reachable

    def __post_init__(self) -> None:
        if not self.spin_s >= 0:
            raise ValueError(f"spin_s must be >= 0 seconds, got {self.spin_s!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TcpChannelConfig:
        env = os.environ if env is None else env
        return cls(spin_s=env_microseconds(env, TCP_SPIN_ENV, DEFAULT_TCP_SPIN_US),
                   unix_socket=env_switch(env, TCP_UNIX_ENV, True))


@dataclass(frozen=True)
class CredentialSettings:
    """Where credentials come from when no argument names one (credentials.py)."""

    auth_dir: Path  # $KVPOOL_AUTH_DIR, else ~/.config/kvpool/auth
    client_credential: str | None = None  # $KVPOOL_CREDENTIAL
    node_credential: str | None = None  # $KVPOOL_NODE_CREDENTIAL

    def credential_path(self, variable: str) -> str | None:
        """The path the credential variable `variable` named (None: unset)."""
        if variable == ENV_CREDENTIAL:
            return self.client_credential
        if variable == ENV_NODE_CREDENTIAL:
            return self.node_credential
        raise ValueError(f"{variable} is not a credential variable: use {ENV_CREDENTIAL} or {ENV_NODE_CREDENTIAL}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> CredentialSettings:
        env = os.environ if env is None else env
        auth_dir = env_path(env, ENV_AUTH_DIR)
        return cls(
            auth_dir=Path(auth_dir) if auth_dir else Path.home() / ".config" / "kvpool" / "auth",
            client_credential=env_path(env, ENV_CREDENTIAL),
            node_credential=env_path(env, ENV_NODE_CREDENTIAL),
        )
