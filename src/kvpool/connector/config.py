"""The connector's configuration, read from vLLM's `kv_connector_extra_config` (the only edge where
the connector reads settings; nothing here looks at the environment).

Keys (all optional except `master_address`):
  master_address       ZMQ endpoint of `kvpool master`, e.g. "tcp://127.0.0.1:5555", or an HA pool's
                       "etcd://HOST:PORT[,...]/NAME" (the leader, found through etcd)
  tenant               extra namespace component: deployments with different tenants never share
  cache_salt           same effect as tenant, for operators who salt caches per security domain
  tokens_per_object    tokens per pool object, a multiple of vLLM's block size (default: one block)
  pool_memory_bytes    run an embedded storage node contributing this much memory ("4GiB" or int)
  node_id              name of the embedded node (default: vllm-<host>-<pid>-r<rank>)
  timeout_s            one master round trip / transfer round on the worker (default 2.0)
  lookup_timeout_s     a lookup unanswered this long is a miss: the request is computed without the pool
                       (default 0.5). Lookups run off the engine step (connector/lookups.py)
  lookup_wait_ms       how long one engine step may wait for a lookup in flight before vLLM is told to
                       ask again next step (default 2)
  switch_interval_s    the engine process's GIL switch interval (sys.setswitchinterval), so the lookup
                       thread's reply is not kept waiting up to 5 ms behind the scheduler's Python
                       (default 0.0002; 0 leaves the interpreter's own). Against Python's 5 ms it
                       deferred fewer lookups to a later step and lowered P99 TTFT
                       (docs/design/client.md)
  lookup_on_arrival    start a request's lookup when vLLM adds it, before its first step asks (default
                       False): it gained little on the demo trace, and it also looks up (and so
                       keeps fresh in the master's LRU) prefixes vLLM then finds locally
  touch_waiting_s      a request waiting in vLLM's queue this long has its prefix looked up again (and
                       so kept fresh in the pool's LRU) every this many seconds until admitted (default
                       0: off; on a trace where most sessions wait it lost hits and P50 TTFT,
                       docs/design/client.md). See connector/waiting.py
  lookup_cache_ttl_s   reuse a request's lookup answer while it waits for admission, at most this
                       long (default 1.0; 0 asks the master every scheduler step)
  load_async           report pool hits to vLLM as asynchronous loads (True) or load them in the
                       step, before the forward (False). Default: async except on the CPU build,
                       where the "transfer" is a memcpy on the CPUs that compute, so async only adds
                       engine steps (25-40x slower TTFT there: docs/design/client.md)
  load_wait_ms         with async loads, how long one engine step may wait for a load in flight
                       (default 5; see worker.take_finished_loads)
  save_decode          also save KV produced during decode (default True)
  max_pinned_fraction  at most this fraction of vLLM's KV blocks may be held for saves in flight; past
                       it saves wait or are dropped rather than starve admission (default 0.25)
  num_replicas         replicas per saved object (default 1)
  transfer_path        auto | nixl | shm (default auto: shared memory on the same host, else NIXL)
  checksums            checksum every saved object and verify every load (default True; a mismatch is
                       a failed load, recomputed)
  retry_initial_s      first back-off after the pool became unreachable (default 1.0)
  retry_max_s          longest back-off (default 30.0)
  credential           CURVE credential file of a tenant identity, for a master started with --auth
                       (`kvpool auth add DIR tenant:NAME`); default: $KVPOOL_CREDENTIAL, else none
  node_credential      the embedded node's credential (a node identity); default: $KVPOOL_NODE_CREDENTIAL
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

_TENANT_PART = re.compile(r"^[A-Za-z0-9._:@/-]{1,200}$")
_PATHS = ("auto", "nixl", "shm")


def _parse_size(value: object) -> int:
    from kvpool.node import parse_size  # the same parser as `kvpool node --memory`

    if isinstance(value, bool):
        raise ValueError(f"pool_memory_bytes must be a size, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        return parse_size(value)
    raise ValueError(f"pool_memory_bytes must be an int or a size string like '4GiB', got {value!r}")


@dataclass(frozen=True)
class ConnectorConfig:
    master_address: str
    tenant: str | None = None
    cache_salt: str | None = None
    tokens_per_object: int | None = None  # None: one vLLM block
    pool_memory_bytes: int | None = None  # None: no embedded node
    node_id: str | None = None
    timeout_s: float = 2.0
    lookup_timeout_s: float = 0.5
    lookup_wait_ms: float = 2.0
    lookup_cache_ttl_s: float = 1.0
    lookup_on_arrival: bool = False
    switch_interval_s: float = 0.0002  # 0: leave the interpreter's
    touch_waiting_s: float = 0.0
    load_async: bool | None = None  # None: by device (see above)
    load_wait_ms: float = 5.0
    save_decode: bool = True
    max_pinned_fraction: float = 0.25
    num_replicas: int = 1
    transfer_path: str = "auto"
    checksums: bool = True
    retry_initial_s: float = 1.0
    retry_max_s: float = 30.0
    credential: str | None = None
    node_credential: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.master_address, str) or not re.match(r"^(tcp|ipc|etcd)://.+", self.master_address):
            raise ValueError(
                "kv_connector_extra_config.master_address must be the ZMQ endpoint of `kvpool master`, "
                f"like tcp://127.0.0.1:5555, or an HA pool's etcd://HOST:PORT[,...]/NAME; got {self.master_address!r}"
            )
        for name in ("tenant", "cache_salt"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not _TENANT_PART.match(value)):
                raise ValueError(f"{name} must be 1-200 characters of letters, digits or ._:@/-, got {value!r}")
        if self.tokens_per_object is not None and (
            not isinstance(self.tokens_per_object, int) or self.tokens_per_object <= 0
        ):
            raise ValueError(f"tokens_per_object must be a positive int, got {self.tokens_per_object!r}")
        if self.pool_memory_bytes is not None and self.pool_memory_bytes < (1 << 20):
            raise ValueError(f"pool_memory_bytes must be at least 1 MiB, got {self.pool_memory_bytes}")
        if self.load_async not in (None, True, False):
            raise ValueError(f"load_async must be true, false or absent, got {self.load_async!r}")
        if not 0 <= self.lookup_wait_ms <= 100:
            raise ValueError(f"lookup_wait_ms must be within 0..100 (it delays the engine step), got {self.lookup_wait_ms!r}")
        if not (self.switch_interval_s == 0 or 1e-5 <= self.switch_interval_s <= 0.1):
            raise ValueError(f"switch_interval_s must be 0 (unchanged) or within 1e-5..0.1 s, got {self.switch_interval_s!r}")
        if not 0 <= self.load_wait_ms <= 1000:
            raise ValueError(f"load_wait_ms must be within 0..1000, got {self.load_wait_ms!r}")
        if not self.timeout_s > 0 or not self.lookup_timeout_s > 0:
            raise ValueError(f"timeouts must be > 0, got {self.timeout_s!r}, {self.lookup_timeout_s!r}")
        if not 0 <= self.lookup_cache_ttl_s <= 3600:
            raise ValueError(f"lookup_cache_ttl_s must be within 0..3600, got {self.lookup_cache_ttl_s!r}")
        if not isinstance(self.num_replicas, int) or self.num_replicas < 1:
            raise ValueError(f"num_replicas must be an int >= 1, got {self.num_replicas!r}")
        if not 0 < self.max_pinned_fraction <= 1:
            raise ValueError(f"max_pinned_fraction must be in (0, 1], got {self.max_pinned_fraction!r}")
        if self.lookup_on_arrival not in (True, False):
            raise ValueError(f"lookup_on_arrival must be true or false, got {self.lookup_on_arrival!r}")
        if not 0 <= self.touch_waiting_s <= 3600:
            raise ValueError(f"touch_waiting_s must be within 0..3600 (0: off), got {self.touch_waiting_s!r}")
        if self.checksums not in (True, False):
            raise ValueError(f"checksums must be true or false, got {self.checksums!r}")
        if self.transfer_path not in _PATHS:
            raise ValueError(f"transfer_path must be one of {_PATHS}, got {self.transfer_path!r}")
        for name in ("credential", "node_credential"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be the path of a credential file, got {getattr(self, name)!r}")
        if not 0 < self.retry_initial_s <= self.retry_max_s:
            raise ValueError(
                f"need 0 < retry_initial_s <= retry_max_s, got {self.retry_initial_s!r}, {self.retry_max_s!r}"
            )

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> "ConnectorConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"unknown kv_connector_extra_config keys for KVPoolConnector: {unknown}; known: {sorted(known)}"
            )
        values = dict(extra)
        if values.get("pool_memory_bytes") is not None:
            values["pool_memory_bytes"] = _parse_size(values["pool_memory_bytes"])
        for name in ("timeout_s", "lookup_timeout_s", "retry_initial_s", "retry_max_s", "load_wait_ms", "lookup_wait_ms",
                     "lookup_cache_ttl_s", "touch_waiting_s", "switch_interval_s"):
            if isinstance(values.get(name), int) and not isinstance(values.get(name), bool):
                values[name] = float(values[name])
        if "master_address" not in values:
            raise ValueError("kv_connector_extra_config needs master_address (the `kvpool master` endpoint)")
        return cls(**values)

    def blocks_per_object(self, block_size: int) -> int:
        """Objects are whole vLLM blocks, so an object's key is one of vLLM's block hashes."""
        tokens = self.tokens_per_object or block_size
        if tokens % block_size:
            raise ValueError(f"tokens_per_object ({tokens}) must be a multiple of vLLM's block size ({block_size})")
        return tokens // block_size
