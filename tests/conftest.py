"""Shared fixtures: a real pool (a `kvpool master` and storage nodes as separate processes on
127.0.0.1, ports chosen by the OS) that is always torn down, and a runner for client processes."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvpool.bench import procs

WORKER = Path(__file__).parent / "integration" / "pool_worker.py"


@dataclass
class Pool:
    workdir: Path
    master: procs.ManagedProcess
    nodes: list[procs.ManagedProcess] = field(default_factory=list)

    @property
    def address(self) -> str:
        return self.master.info["address"]

    def add_node(self, memory: str = "64MiB", *extra: str) -> procs.ManagedProcess:
        node = procs.start_node(self.workdir, self.address, memory, *extra, name=f"node{len(self.nodes)}")
        self.nodes.append(node)
        return node

    def run_worker(self, *args: str, timeout_s: float = 120.0) -> dict:
        """Run tests/integration/pool_worker.py against this pool in its own process; its JSON."""
        argv = [sys.executable, str(WORKER), *args, "--master", self.address]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise AssertionError(f"worker {args} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    def stop(self) -> None:
        for proc in [*self.nodes, self.master]:
            proc.stop(grace_s=5.0)


@pytest.fixture
def make_pool(tmp_path):
    """`make_pool(num_nodes=2, node_memory="64MiB", master_args=())` -> a running Pool."""
    pools: list[Pool] = []

    def make(num_nodes: int = 2, node_memory: str = "64MiB", master_args: tuple[str, ...] = ()) -> Pool:
        workdir = tmp_path / f"pool{len(pools)}"
        master = procs.start_master(workdir, *master_args)
        pool = Pool(workdir, master)
        pools.append(pool)
        for _ in range(num_nodes):
            pool.add_node(node_memory)
        return pool

    yield make
    for pool in pools:
        pool.stop()


@pytest.fixture
def pool(make_pool) -> Pool:
    """A master and two 64 MiB nodes."""
    return make_pool()


# The vLLM tests run in two groups, each on one test worker (make test runs two with
# --dist loadgroup): the tests that start OpenAI servers, and those that run engines through
# tests/e2e/connector_run.py, so two vLLM tests at a time keep the two cores busy; each worker
# takes the other tests when its group is done. The groups are kept by the scheduler below
# (pytest-xdist's own xdist_group marks do not reach its scheduler under pytest 9). The longest
# tests start first, so that the groups finish together.
_VLLM_GROUPS = {
    **dict.fromkeys(("tests/e2e/test_demo.py", "tests/e2e/test_pd.py", "tests/e2e/test_connector_servers.py",
                     "tests/e2e/test_router_vllm.py", "tests/e2e/test_replay.py"), "vllm-servers"),
    **dict.fromkeys(("tests/e2e/test_connector.py", "tests/e2e/test_connector_hybrid.py",
                     "tests/e2e/test_connector_tp.py", "tests/e2e/test_connector_load.py",
                     "tests/e2e/test_connector_master_restart.py"), "vllm-runs"),
}  # fmt: skip
_LONGEST_FIRST = ("tests/e2e/test_connector_hybrid.py", "tests/e2e/test_demo.py", "tests/e2e/test_pd.py",
                  "tests/e2e/test_connector_tp.py")


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        path = item.nodeid.split("::")[0]
        return _LONGEST_FIRST.index(path) if path in _LONGEST_FIRST else len(_LONGEST_FIRST)

    items.sort(key=rank)  # stable: every other test keeps its place
    unknown = {i.nodeid.split("::")[0] for i in items if i.get_closest_marker("vllm")} - set(_VLLM_GROUPS)
    if unknown:
        raise pytest.UsageError(f"vLLM tests outside tests/conftest.py's groups: {sorted(unknown)}")


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class VllmGroups(LoadScopeScheduling):
        """Each test its own unit of work, except the vLLM tests: one unit per group."""

        def _split_scope(self, nodeid: str) -> str:
            return _VLLM_GROUPS.get(nodeid.split("::")[0], nodeid)

    return VllmGroups(config, log)
