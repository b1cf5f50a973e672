"""Authentication and authorization with real processes: a `kvpool master --auth DIR`, a node with
its own credential, tenants' clients. Wrong, missing and revoked keys are refused with AuthError
(quickly, not at a timeout); a tenant cannot reach another's objects through any call; a client
cannot unmount a node's segment; the default start creates its keys where the README says."""

from __future__ import annotations

import os
import time

import pytest

from kvpool.bench import procs
from kvpool.client import Client
from kvpool.core import protocol as p
from kvpool.core.errors import AuthError, ForbiddenError, UsageError
from kvpool.rpc.zmq_channel import MasterChannel
from kvpool.rpc.credentials import AuthDir, Credential


@pytest.fixture
def secure_pool(tmp_path):
    """(master, node, auth dir) with tenants alice and bob."""
    auth = AuthDir(tmp_path / "auth")
    auth.init(("admin", "node"))
    for tenant in ("alice", "bob"):
        auth.add(f"tenant:{tenant}")
    master = procs.start_master(tmp_path, "--auth", str(auth.path))
    node = procs.start_node(tmp_path, master.info["address"], "16MiB", "--credential", str(auth.path / "node.cred"))
    yield master, node, auth
    node.stop(grace_s=5.0)
    master.stop(grace_s=5.0)


def client(master, auth, role, **kw) -> Client:
    return Client(master.info["address"], credential=str(auth.path / f"{role.replace(':', '-')}.cred"), **kw)


def refused_quickly(make_call) -> AuthError:
    started = time.monotonic()
    with pytest.raises(AuthError) as refused:
        make_call()
    assert time.monotonic() - started < 2.0  # the call's timeout is 5 s: the refusal was seen, not waited out
    return refused.value


def test_missing_unknown_and_revoked_keys_are_refused(secure_pool, tmp_path):
    master, _, auth = secure_pool
    address = master.info["address"]
    with Client(address, timeout_s=5.0) as anonymous:
        assert "requires CURVE authentication" in str(refused_quickly(lambda: anonymous.exists(["k"])))
    stranger = AuthDir(tmp_path / "other")  # a key pair this master never trusted, for its real public key
    stranger.init()
    cred = Credential.load(stranger.add("tenant:alice"))
    forged = Credential(cred.role, cred.public_key, cred.secret_key, auth.master_keys()[0])
    forged.save(tmp_path / "forged.cred")
    with Client(address, credential=str(tmp_path / "forged.cred"), timeout_s=5.0) as impostor:
        assert "refused this client's key" in str(refused_quickly(lambda: impostor.exists(["k"])))
    with client(master, auth, "tenant:bob") as bob:
        assert bob.put("k", b"bob's bytes")
        assert auth.revoke("tenant:bob") == 1
        deadline = time.monotonic() + 5.0
        while True:  # the master re-reads identities.json within about a second
            try:
                bob.exists(["k"])
            except AuthError as e:
                assert "no longer trusted" in str(e)
                break
            assert time.monotonic() < deadline, "a revoked key was still served after 5 s"
            time.sleep(0.2)
    assert "refused" in master.tail_log(200)
    with client(master, auth, "admin") as admin:
        assert admin.stats().refused_handshakes >= 1  # the impostor (the keyless client fails before ZAP)


def test_a_tenant_reaches_only_its_own_objects(secure_pool):
    master, _, auth = secure_pool
    value = os.urandom(100_000)
    with client(master, auth, "tenant:alice") as alice, client(master, auth, "tenant:bob") as bob:
        bob.ping()  # any trusted identity may reach the master (the connector connects at start)
        assert alice.put("secret", value) and alice.put("secret2", value, parent="secret")
        # bob names the same keys in the same namespace string, and in alice's stored one
        for spy in (bob, client(master, auth, "tenant:bob", tenant="alice/default")):
            assert spy.get("secret") is None
            assert spy.lookup_prefix(["secret", "secret2"]) == 0
            assert spy.exists(["secret", "secret2"]) == [False, False]
            assert spy.remove(["secret", "secret2"]) == 0
            with pytest.raises(ForbiddenError):
                spy.stats()  # sizes and counts of every tenant: admin only
        assert alice.get("secret") == value and alice.get("secret2") == value
        with client(master, auth, "admin", tenant="alice/default") as admin:
            stats = admin.stats()
            assert stats.num_objects == 2
            assert stats.forbidden == 2  # the two spies' Stats calls
            assert admin.get("secret") == value  # admin reaches any namespace


def test_no_client_can_unmount_or_impersonate_a_node(secure_pool):
    master, node, auth = secure_pool
    address = master.info["address"]
    segment_id = node.info["segment_id"]
    other_node = Credential.load(auth.add("node", auth.path / "node2.cred"))
    for cred in (Credential.load(auth.path / "tenant-alice.cred"), Credential.load(auth.path / "admin.cred"),
                 other_node):
        channel = MasterChannel(address, timeout_s=5.0, credential=cred)
        try:
            with pytest.raises(ForbiddenError):
                channel.call(p.UnmountSegment(segment_id))
            with pytest.raises(ForbiddenError):
                channel.call(p.Heartbeat(node.info["node_id"], [segment_id]))
        finally:
            channel.close()
    with client(master, auth, "admin") as admin:
        assert [n.segment_id for n in admin.stats().nodes] == [segment_id]
    with client(master, auth, "tenant:alice") as alice:
        assert alice.put("still", b"served")  # the node kept its segment throughout


def test_default_start_creates_keys_in_the_documented_place(tmp_path):
    auth_dir = tmp_path / "default-auth"
    master = procs.ManagedProcess(
        "master", procs.kvpool_argv("master", "--host", "127.0.0.1", "--port", "0"), tmp_path,
        env={"KVPOOL_AUTH_DIR": str(auth_dir)},
    ).start(30)
    try:
        assert sorted(f.name for f in auth_dir.glob("*.cred")) == ["admin.cred", "node.cred", "tenant-default.cred"]
        assert (auth_dir / "tenant-default.cred").stat().st_mode & 0o777 == 0o600
        assert master.info["auth_dir"] == str(auth_dir)
        with Client(master.info["address"], timeout_s=5.0) as anonymous:
            refused_quickly(lambda: anonymous.exists(["k"]))  # never silently open
        with Client(master.info["address"], credential=str(auth_dir / "tenant-default.cred")) as tenant:
            assert tenant.exists(["k"]) == [False]
    finally:
        master.stop(grace_s=5.0)


def test_a_local_start_is_two_commands_the_node_and_client_find_the_default_credentials(tmp_path, monkeypatch):
    """`kvpool master` then `kvpool node --master ADDR` on one host: no credential named anywhere."""
    env = {"KVPOOL_AUTH_DIR": str(tmp_path / "default-auth")}
    master = procs.ManagedProcess(
        "master", procs.kvpool_argv("master", "--host", "127.0.0.1", "--port", "0"), tmp_path, env=env).start(30)
    node = None
    try:
        node = procs.start_node(tmp_path, master.info["address"], "16MiB", env=env)
        monkeypatch.setenv("KVPOOL_AUTH_DIR", env["KVPOOL_AUTH_DIR"])
        with Client(master.info["address"], timeout_s=5.0) as local:
            assert local.put("k", b"v" * 100_000) is True  # on the node: over 64 KiB
            assert local.get("k") == b"v" * 100_000
            assert local._channel.channel.credential.role == "tenant:default"  # found, not named
    finally:
        for proc in [node, master]:
            if proc is not None:
                proc.stop(grace_s=5.0)


def test_a_read_only_client_maps_segments_read_only_and_cannot_put(secure_pool):
    master, _, auth = secure_pool
    doc = b"alice wrote this" * 8192  # 128 KiB: on a node (smaller values stay in the master)
    with client(master, auth, "tenant:alice") as alice:
        assert alice.put("doc", doc)
    with client(master, auth, "tenant:alice", read_only=True, path="shm") as reader:
        assert reader.get("doc") == doc
        mappings = [r.mapping for r in reader.plane._routes.values() if r.mapping is not None]
        assert mappings, "the same-host path was not used"
        with open("/proc/self/maps") as maps:  # the segment's mapping has no write permission
            modes = [line.split()[1] for line in maps if "memfd:" in line]
        assert modes and all(mode.startswith("r-") for mode in modes), modes
        with pytest.raises(UsageError):
            reader.put("doc2", b"x")


def test_an_authenticated_client_reads_its_plain_values_early_over_zmq(secure_pool):
    """No lane with CURVE: GetValue is begun on the ZMQ channel while the value is read where the
    client put it (client/known_places.py), and the bytes are still checked against the answer."""
    master, _, auth = secure_pool
    with client(master, auth, "tenant:alice") as alice, client(master, auth, "tenant:bob") as bob:
        value = os.urandom(200 << 10)  # over the inline limit: on the node
        for i in range(3):
            assert alice.put(f"v{i}", value)
        assert [alice.get(f"v{i}") for i in range(3)] == [value] * 3
        assert alice._metrics.early_reads["used"]._value.get() >= 2  # the puts after the first went ahead
        assert bob.get("v1") is None  # another tenant's key: a miss, never alice's bytes
        assert alice.remove(["v1"]) == 1 and alice.get("v1") is None
