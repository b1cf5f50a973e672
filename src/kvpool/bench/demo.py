"""The end-to-end demo: the same agent trace replayed through two vLLM servers, run by run.

Each run starts its own processes and stops them before the next, so the runs share nothing but
the trace and the compiled-graph caches. The runs (`RUN_SPECS`), on the same total memory:
1. baseline: two vLLM-CPU OpenAI servers (local prefix cache on, KV memory too small to hold every
   session) behind `kvpool router --policy round_robin`;
2. more_kv: the same, each server's KV memory grown by what it would give the pool (is sharing
   better than just more local memory?);
3. pool: baseline plus `kvpool master`, each server loading `KVPoolConnector` with an embedded
   pool segment, so any server can load any prefix the other computed;
4. session: the pool run with `--policy session` (consistent hashing of the session id);
5. cache_aware: the pool run with `--policy cache_aware` (lowest estimated TTFT from the servers'
   KV events and the pool);
6. pd: prefill/decode disaggregation, server 0 prefills and server 1 decodes, vLLM's NixlConnector
   hands the KV over (`kvpool router --prefill ... --decode ...`), no pool;
7. pd_more_kv: the same, each server's KV memory grown by what it would give the pool;
8. pd_pool: P/D with the pool: both servers run MultiConnector(NixlConnector, KVPoolConnector), so
   the prefill loads what the pool holds and the decode saves the agent's output for the next turn.
`--pd` runs 6, 7, 8 and 5 (aggregated, with the pool) on the same trace and memory. In P/D runs the
hit rates are the prefill instance's: the decode instance's "external" hits are NIXL's hand-offs.
Every server publishes its KV events in every run (like for like). Server i's worker threads are
pinned to core i in every run.
A run that cannot start (no connector yet, a server that dies) is reported with its reason and
no numbers; nothing is made up.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import msgspec

from kvpool.bench import procs
from kvpool.bench.replay import ReplayConfig, ReplayResult
from kvpool.bench.reports import summarize
from kvpool.bench.tiny_model import TinyLlamaConfig, write_tiny_llama
from kvpool.bench.tiny_tokenizer import write_tiny_tokenizer
from kvpool.core.transfer_config import pd_transfer_config, pool_transfer_config
from kvpool.workload.formats import expand_inputs, load_trace
from kvpool.workload.model import Session, scale_session
from kvpool.workload.synth import SynthConfig, synth_sessions



@dataclass(frozen=True)
class RunSpec:
    name: str
    label: str
    policy: str
    pooled: bool
    more_kv: bool = False  # each server's KV memory + its pool share
    pd: bool = False  # server 0 prefills, server 1 decodes (needs num_servers == 2)


RUN_SPECS = {s.name: s for s in (
    RunSpec("baseline", "1. round-robin, no pool", "round_robin", pooled=False),
    RunSpec("more_kv", "2. round-robin, no pool, pool memory as local KV", "round_robin", pooled=False, more_kv=True),
    RunSpec("pool", "3. round-robin + pool", "round_robin", pooled=True),
    RunSpec("session", "4. session + pool", "session", pooled=True),
    RunSpec("cache_aware", "5. cache_aware + pool", "cache_aware", pooled=True),
    RunSpec("pd", "6. P/D, no pool", "round_robin", pooled=False, pd=True),
    RunSpec("pd_more_kv", "7. P/D, no pool, pool memory as local KV", "round_robin", pooled=False, more_kv=True, pd=True),
    RunSpec("pd_pool", "8. P/D + pool", "round_robin", pooled=True, pd=True),
)}  # fmt: skip
RUNS = tuple(RUN_SPECS)
DEFAULT_RUNS = ("baseline", "cache_aware")
COMPARE_RUNS = ("baseline", "more_kv", "pool", "session", "cache_aware")  # `--compare`
PD_RUNS = ("pd", "pd_more_kv", "pd_pool", "cache_aware")  # `--pd`
LABELS = {name: spec.label for name, spec in RUN_SPECS.items()}


# the tiny models the demo serves: a full-attention Llama, and a sliding-window hybrid (vLLM's
# hybrid KV cache manager on). Their vocabularies match the tiny tokenizer's.
DEMO_MODELS = ("llama", "gemma3")


@dataclass(frozen=True)
class DemoConfig:
    num_sessions: int = 12
    scale: float = 0.25  # of the Codex profile's token counts
    max_turns: int = 12
    time_scale: float = 0.05  # of the trace's tool/think times
    seed: int = 0
    sessions_file: Path | None = None  # replay this instead of synthesizing
    sessions_scale: float = 1.0  # token counts of the sessions file times this (workload.model.scale_session)
    num_servers: int = 2
    kv_cache_bytes: int = 48 * 2**20  # per server: smaller than the sessions' contexts together
    pool_bytes_per_server: int = 256 * 2**20  # embedded pool segment of each server
    max_model_len: int = 16384
    runs: tuple[str, ...] = DEFAULT_RUNS
    workdir: Path | None = None  # None: a fresh temporary directory
    start_timeout_s: float = 420.0
    request_timeout_s: float = 600.0
    model: str = "llama"  # or a hybrid model of kvpool.bench.tiny_hybrid: "gemma3" (sliding window)

    def __post_init__(self) -> None:
        if self.model not in DEMO_MODELS:
            raise ValueError(f"model must be one of {', '.join(DEMO_MODELS)}; got {self.model!r}")
        if self.num_sessions < 1 or self.max_turns < 1 or self.num_servers < 1:
            raise ValueError("num_sessions, max_turns and num_servers must be >= 1")
        if not 0 < self.scale <= 1:
            raise ValueError(f"scale must be in (0, 1], got {self.scale}")
        if self.time_scale < 0:
            raise ValueError("time_scale must be >= 0")
        if self.kv_cache_bytes < 2**20 or self.pool_bytes_per_server < 2**20:
            raise ValueError("kv_cache_bytes and pool_bytes_per_server must be at least 1 MiB")
        if not self.runs or any(r not in RUNS for r in self.runs):
            raise ValueError(f"runs must be a non-empty subset of {', '.join(RUNS)}; got {', '.join(self.runs)}")
        if self.num_servers != 2 and any(RUN_SPECS[r].pd for r in self.runs):
            raise ValueError("the P/D runs use two servers: one prefill and one decode instance")


@dataclass
class RunOutcome:
    name: str  # baseline | pool
    result: ReplayResult | None = None
    summary: dict | None = None
    error: str | None = None  # why there are no numbers
    warnings: list[str] = field(default_factory=list)
    startup_s: float = 0.0
    router_metrics: str | None = None  # the router's /metrics text at the end of the replay

    @property
    def label(self) -> str:
        return LABELS[self.name]


class ConnectorProbe:
    """Whether the pool run can work (master and connector importable), checked in a child process
    started at once (importing the connector imports vLLM: seconds), answered when needed."""

    def __init__(self) -> None:
        self._missing = next((m for m in ("kvpool.master.cli", "kvpool.connector")
                              if importlib.util.find_spec(m) is None), None)  # fmt: skip
        self._proc = None
        if self._missing is None:
            self._proc = subprocess.Popen([sys.executable, "-c", "from kvpool.connector import KVPoolConnector"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip

    def problem(self, timeout_s: float = 300.0) -> str | None:
        """Why the pool run cannot work, else None."""
        if self._missing is not None:
            return f"{self._missing} is not built yet"
        try:
            _, err = self._proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            return f"importing kvpool.connector took more than {timeout_s:.0f} s"
        if self._proc.returncode != 0:
            last = (err.strip().splitlines() or ["(no output)"])[-1]
            return f"`from kvpool.connector import KVPoolConnector` fails: {last}"
        return None

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


def read_trace(path: Path) -> list[Session]:
    """Sessions from a kvpool sessions JSONL or any trace `kvpool trace convert` reads (a file, or a
    directory of them: Claude Code, Mooncake, vLLM multi-turn), in file order."""
    return [s for f in expand_inputs([path]) for s in load_trace(f)]


class Demo:
    def __init__(self, config: DemoConfig, status: Callable[[str], None] = print) -> None:
        self.config = config
        self.status = status
        self.workdir = Path(config.workdir) if config.workdir else procs.scratch_dir("kvpool-demo-")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.model_dir: Path | None = None
        self.tokenizer_dir: Path | None = None  # None: token-id prompts only (--skip-tokenizer-init)

    def sessions(self) -> list[Session]:
        c = self.config
        if c.sessions_file is not None:
            return [scale_session(msgspec.structs.replace(s, turns=s.turns[: c.max_turns]), c.sessions_scale)
                    if c.sessions_scale != 1.0 else msgspec.structs.replace(s, turns=s.turns[: c.max_turns])
                    for s in read_trace(c.sessions_file)[: c.num_sessions]]  # fmt: skip
        return synth_sessions(SynthConfig(profile="codex", num_sessions=c.num_sessions, scale=c.scale,
                                          seed=c.seed, max_turns=c.max_turns))  # fmt: skip

    def prepare(self, with_tokenizer: bool = False) -> None:
        """Write the tiny model; with a tokenizer and chat template for text / chat requests (--serve).
        The replay runs send token ids and keep --skip-tokenizer-init (no detokenizing cost)."""
        if self.config.model == "llama":
            model = TinyLlamaConfig(max_position_embeddings=self.config.max_model_len)
            self.model_dir = write_tiny_llama(self.workdir / "model", model)
        else:
            from kvpool.bench.tiny_hybrid import TinyHybridConfig, write_tiny_gemma3

            model = TinyHybridConfig(max_position_embeddings=self.config.max_model_len, dtype="bfloat16")
            self.model_dir = write_tiny_gemma3(self.workdir / f"model-{self.config.model}", model)
        if with_tokenizer:
            self.tokenizer_dir = write_tiny_tokenizer(self.model_dir, model.vocab_size, self.config.max_model_len)

    def start_stack(self, name: str) -> tuple[list[procs.ManagedProcess], str, list[str]]:
        """Start (master,) servers and the router of one run; return them, the router URL, the server URLs."""
        c, spec = self.config, RUN_SPECS[name]
        started: list[procs.ManagedProcess] = []
        pool = None
        follow: list[str] = []  # the router follows the pool's master: it knows what the pool holds
        if spec.pooled:
            master = procs.start_master(self.workdir / name, name="master")
            started.append(master)
            pool = {"master_address": master.info["address"], "pool_memory_bytes": c.pool_bytes_per_server}
            follow = ["--master", master.info["address"]]
        if spec.pd:
            transfer = pd_transfer_config(pool)
        else:
            transfer = pool_transfer_config(pool) if pool else None
        kv_bytes = c.kv_cache_bytes + (c.pool_bytes_per_server if spec.more_kv else 0)
        servers = []
        for i in range(c.num_servers):
            server = procs.start_vllm_server(
                self.workdir / name, self.model_dir, name=f"vllm{i}", kv_cache_memory_bytes=kv_bytes,
                max_model_len=c.max_model_len, kv_transfer_config=transfer, cpu_bind=_cpu_for(i),
                cache_root=self.workdir / f"vllm-cache-{i}", kv_events=True, tokenizer=self.tokenizer_dir,
                wait=False, extra_env=procs.nixl_env() if spec.pd else None,
            )  # fmt: skip
            servers.append(server)
            started.append(server)
        for server in servers:
            procs.wait_http_ok(server, server.info["url"] + "/health", c.start_timeout_s)
        urls = [s.info["url"] for s in servers]
        if spec.pd:  # the router's view of the prefill side: its KV events
            router_args = ["--prefill", urls[0], "--decode", urls[1], "--policy", spec.policy,
                           *(["--pooled", *follow] if spec.pooled else []),
                           "--kv-events", servers[0].info["kv_events"]]  # fmt: skip
            router = procs.start_router(self.workdir / name, [], *router_args, name="router")
        else:
            router_args = ["--policy", spec.policy, *(["--pooled", *follow] if spec.pooled else []),
                           *[a for s in servers for a in ("--kv-events", s.info["kv_events"])]]  # fmt: skip
            router = procs.start_router(self.workdir / name, urls, *router_args, name="router")
        started.append(router)
        return started, router.info["url"], urls

    def run_one(self, name: str, sessions: list[Session], replay_fn: Callable[[list[Session], ReplayConfig, str], ReplayResult]) -> RunOutcome:
        outcome = RunOutcome(name)
        started: list[procs.ManagedProcess] = []
        t0 = time.monotonic()
        try:
            self.status(f"{LABELS[name]}: starting {'master, ' if RUN_SPECS[name].pooled else ''}"
                        f"{self.config.num_servers} vLLM servers and the router")  # fmt: skip
            try:
                started, router_url, server_urls = self.start_stack(name)
            except (RuntimeError, TimeoutError) as e:
                outcome.error = f"could not start the {LABELS[name]} stack: {e}"
                return outcome
            outcome.startup_s = time.monotonic() - t0
            # P/D: the prefill instance's counters are the hit rates (the decode's are NIXL's hand-offs)
            metrics_urls = tuple(server_urls[:1] if RUN_SPECS[name].pd else server_urls)
            config = ReplayConfig(endpoints=(router_url,), metrics_urls=metrics_urls, time_scale=self.config.time_scale,
                                  seed=self.config.seed, request_timeout_s=self.config.request_timeout_s)  # fmt: skip
            try:
                outcome.result = replay_fn(sessions, config, f"replay {LABELS[name]}")
            except (RuntimeError, OSError) as e:
                outcome.error = f"replay failed: {e}"
                return outcome
            outcome.router_metrics = _read_metrics(router_url)
            outcome.summary = summarize(outcome.result)
            outcome.summary["router"] = router_counters(outcome.router_metrics)
            outcome.warnings += self._check(name, outcome.summary, started)
            return outcome
        finally:
            for proc in reversed(started):
                proc.stop(grace_s=10.0)

    def _check(self, name: str, summary: dict, started: list[procs.ManagedProcess]) -> list[str]:
        warnings = []
        req = summary["requests"]
        if req["error"] or req["skipped"]:
            warnings.append(f"{req['error']} requests failed and {req['skipped']} were skipped")
        counters = summary["server_counters"]
        if counters is None:
            warnings.append("vLLM's /metrics could not be read: hit rates unknown")
        elif RUN_SPECS[name].pooled and counters["external_queries"] == 0:
            warnings.append("the servers never asked the pool (vllm:external_prefix_cache_queries stayed 0)")
        elif RUN_SPECS[name].pooled and counters["pool_load_failed_blocks"] > 0:
            warnings.append(f"{counters['pool_load_failed_blocks']:.0f} of "
                            f"{counters['pool_load_failed_blocks'] + counters['pool_loaded_blocks']:.0f} pool blocks "
                            "failed to load and were recomputed (see 'less failed pool loads')")  # fmt: skip
        if name == "pool" and counters is not None and counters["external_queries"] > 0 and counters["external_hits"] == 0:
            # round-robin moves every turn to the other server: only here must the pool hit
            logs = "; ".join(p.tail_log(3).replace("\n", " | ")[-300:] for p in started if p.name.startswith("vllm"))
            warnings.append(f"the pool never hit; server logs end: {logs}")
        return warnings


def _cpu_for(index: int) -> str:
    """The core that server `index` is pinned to: the usable cores in turn."""
    import os

    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return str(cpus[index % len(cpus)])


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _read_metrics(url: str) -> str | None:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            return r.read().decode()
    except (urllib.error.URLError, OSError):
        return None


def router_counters(text: str | None) -> dict | None:
    """Retries, failures, stream cuts, decisions by reason and the pool keys it placed in its chains
    (following the master) from the router's /metrics."""
    if text is None:
        return None
    out: dict = {"retries": 0.0, "backend_failures": 0.0, "stream_errors": 0.0, "no_backend": 0.0, "decisions": {},
                 "pool_keys_placed": 0.0}
    names = {"kvpool_router_retries_total": "retries", "kvpool_router_backend_failures_total": "backend_failures",
             "kvpool_router_stream_errors_total": "stream_errors", "kvpool_router_no_backend_total": "no_backend"}  # fmt: skip
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        key, value = line.rsplit(" ", 1)
        metric = key.split("{", 1)[0]
        if metric in names:
            out[names[metric]] += float(value)
        elif metric == "kvpool_router_pool_index_keys" and 'state="placed"' in key:
            out["pool_keys_placed"] = float(value)
        elif metric == "kvpool_router_decisions_total" and 'reason="' in key:
            reason = key.split('reason="', 1)[1].split('"', 1)[0]
            out["decisions"][reason] = out["decisions"].get(reason, 0.0) + float(value)
    return out
