"""Quotas and tenant-dedicated segments with real processes: a `kvpool master --auth DIR --quota ...`,
storage nodes (one of them `--tenant alice`), and tenants' clients with their own credentials.
A tenant at its quota evicts only its own objects, then gets a CapacityError naming its quota,
while the other tenant's objects stay put and read back byte for byte."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpool.bench import procs
from kvpool.client import Client
from kvpool.core.errors import CapacityError
from kvpool.rpc.credentials import AuthDir
from pool_worker import pattern, wait_until

KiB = 1024
SIZE = 256 * KiB


@pytest.fixture
def auth(tmp_path) -> AuthDir:
    auth = AuthDir(tmp_path / "auth")
    auth.init(("admin", "node"))
    for tenant in ("alice", "bob"):
        auth.add(f"tenant:{tenant}")
    return auth


@pytest.fixture
def started():
    running: list[procs.ManagedProcess] = []
    yield running
    for proc in reversed(running):
        proc.stop(grace_s=5.0)


def client(master, auth, role) -> Client:
    return Client(master.info["address"], credential=str(auth.path / f"{role.replace(':', '-')}.cred"), timeout_s=10.0)


def tenant_stats(master, auth) -> dict:
    with client(master, auth, "admin") as admin:
        return {t.tenant: t for t in admin.stats().tenants}


def tenant_metrics(master) -> dict[tuple[str, str], float]:
    """(sample name, tenant) -> value of the master's per-tenant Prometheus samples."""
    with urllib.request.urlopen(f"http://127.0.0.1:{master.info['metrics_port']}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {(s.name, s.labels["tenant"]): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if "tenant" in s.labels}


def test_tenant_at_its_quota_evicts_its_own_then_gets_capacity_error_and_others_are_untouched(tmp_path, auth, started):
    master = procs.start_master(tmp_path, "--auth", str(auth.path), "--quota", f"bob={4 * SIZE}")
    started.append(master)
    started.append(procs.start_node(tmp_path, master.info["address"], "16MiB", "--credential",
                                    str(auth.path / "node.cred")))
    alice_keys = [f"a{i}" for i in range(8)]
    with client(master, auth, "tenant:alice") as alice, client(master, auth, "tenant:bob") as bob:
        for key in alice_keys:  # the oldest objects in the pool, and more than bob's quota
            assert alice.put(key, pattern(key, SIZE)) is True
        for i in range(4):
            assert bob.put(f"b{i}", pattern(f"b{i}", SIZE)) is True
        stats = tenant_stats(master, auth)
        assert (stats["bob"].used_bytes, stats["bob"].num_objects, stats["bob"].max_bytes) == (4 * SIZE, 4, 4 * SIZE)
        # at its quota: bob's fifth object takes the place of bob's least recently used one
        assert bob.put("b4", pattern("b4", SIZE)) is True
        assert bob.exists([f"b{i}" for i in range(5)]) == [False, True, True, True, True]
        # bob's objects pinned (never evicted): the quota is full for good and the put is refused
        assert bob.remove([f"b{i}" for i in range(1, 5)]) == 4
        for i in range(4):
            assert bob.put(f"p{i}", pattern(f"p{i}", SIZE), pinned=True) is True
        with pytest.raises(CapacityError) as refused:
            bob.put("p4", pattern("p4", SIZE))
        assert "tenant 'bob'" in str(refused.value) and f"{4 * SIZE} bytes" in str(refused.value)
        assert bob.get("p4") is None
        # alice's objects: all there, byte for byte; bob cannot see them
        assert alice.exists(alice_keys) == [True] * 8
        for key in alice_keys:
            assert alice.get(key) == pattern(key, SIZE).tobytes()
        assert bob.exists(alice_keys) == [False] * 8
        stats = tenant_stats(master, auth)
        # alice's 8 and the allocation her client holds for its next plain put (client/ahead.py)
        assert (stats["alice"].num_objects, stats["alice"].quota_evictions, stats["alice"].max_bytes) == (9, 0, 0)
        assert (stats["bob"].num_objects, stats["bob"].quota_evictions, stats["bob"].quota_refusals) == (4, 1, 1)
    def published():
        # her client's close gives its held allocation back in a message with no reply: the master
        # may take it in after the scrape, so wait for it as for the refusal
        metrics = tenant_metrics(master)
        refused = metrics.get(("kvpool_master_tenant_quota_refusals_total", "bob")) == 1
        given_back = metrics.get(("kvpool_master_tenant_used_bytes", "alice")) == 8 * SIZE
        return metrics if refused and given_back else None

    metrics = wait_until(published, 10.0, "bob's quota refusal and alice's given-back allocation in the metrics")
    assert metrics[("kvpool_master_tenant_quota_bytes", "bob")] == 4 * SIZE
    assert metrics[("kvpool_master_tenant_quota_evictions_total", "bob")] == 1


def test_dedicated_segment_holds_only_its_tenant_whose_objects_go_only_there(tmp_path, auth, started):
    master = procs.start_master(tmp_path, "--auth", str(auth.path))
    started.append(master)
    node_cred = ("--credential", str(auth.path / "node.cred"))
    address = master.info["address"]
    shared = procs.start_node(tmp_path, address, "8MiB", *node_cred, name="shared")
    started.append(shared)
    dedicated = procs.start_node(tmp_path, address, "8MiB", *node_cred, "--tenant", "alice", name="alice-only")
    started.append(dedicated)
    with client(master, auth, "tenant:alice") as alice, client(master, auth, "tenant:bob") as bob:
        for i in range(6):
            assert alice.put(f"a{i}", pattern(f"a{i}", SIZE)) is True
            assert bob.put(f"b{i}", pattern(f"b{i}", SIZE)) is True
        with client(master, auth, "admin") as admin:
            stats = admin.stats()
        by_node = {n.node_id: n for n in stats.nodes}
        # 6 objects each, and each writer's allocation held for its next plain put (client/ahead.py)
        assert (by_node["alice-only"].tenant, by_node["alice-only"].num_objects) == ("alice", 7)
        assert (by_node["shared"].tenant, by_node["shared"].num_objects) == ("", 7)
        for i in range(6):
            assert alice.get(f"a{i}") == pattern(f"a{i}", SIZE).tobytes()
            assert bob.get(f"b{i}") == pattern(f"b{i}", SIZE).tobytes()
        # alice's dedicated node stops: her puts are refused rather than spilled onto the shared node
        dedicated.stop(grace_s=5.0)
        wait_until(lambda: alice.exists(["a0"]) == [False], 15.0, "alice's objects gone with her node")
        with pytest.raises(CapacityError, match="places only on segments dedicated to it"):
            alice.put("late", pattern("late", SIZE))
        assert bob.put("b-late", pattern("b-late", SIZE)) is True
