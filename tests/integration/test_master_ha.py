"""Masters elected through a real etcd (Debian's etcd-server): three `kvpool master --ha` processes, real
nodes and clients that find the leader through etcd. A killed leader is replaced within its lease
TTL + 2 s with every committed object served again and no wrong byte; a stopped leader stops
answering before its lease can lapse and never leads again; etcd itself going away stops the
leader at its lease's end, and the pool comes back with etcd."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from kvpool.bench import procs
from kvpool.client import Client
from kvpool.core import protocol as p
from kvpool.core.errors import KVPoolError, UnavailableError
from kvpool.master.cli import EXIT_LOST_LEADERSHIP
from kvpool.rpc.zmq_channel import MasterChannel
from pool_worker import pattern, wait_until

KiB = 1024
TTL_S = 2
FAST = ("--heartbeat-interval-s", "0.2", "--node-ttl-s", "3")
SIZE = 96 * KiB  # over the master's inline limit: these live on nodes

pytestmark = pytest.mark.skipif(not __import__("shutil").which("etcd"), reason="etcd is not installed "
                                "(`make install` installs Debian's etcd-server as root)")


class HAPool:
    def __init__(self, tmp_path, masters: int = 3) -> None:
        self.tmp = tmp_path
        self.etcd = procs.start_etcd(tmp_path)
        self.address = f"etcd://{self.etcd.info['endpoint']}/pool"
        self.masters = [self.start_master(f"m{i}") for i in range(masters)]
        self.nodes = []

    def start_master(self, name: str) -> procs.ManagedProcess:
        argv = procs.kvpool_argv("master", "--host", "127.0.0.1", "--port", "0", "--insecure", *FAST,
                                 "--ha", f"etcd://{self.etcd.info['endpoint']}", "--ha-name", "pool",
                                 "--ha-ttl-s", str(TTL_S))
        return procs.ManagedProcess(name, argv, self.tmp).start(30)

    def state(self, master: procs.ManagedProcess) -> dict:
        try:
            return json.loads(master.ready_file.read_text())
        except (OSError, ValueError):
            return {}

    def leaders(self) -> list[procs.ManagedProcess]:
        return [m for m in self.masters if m.popen.poll() is None and self.state(m).get("state") == "leader"]

    def leader(self, timeout_s: float = 15.0, besides: procs.ManagedProcess | None = None) -> procs.ManagedProcess:
        """The one leader (besides `besides`, which may still think it leads)."""
        others = lambda: [m for m in self.leaders() if m is not besides]  # noqa: E731
        wait_until(lambda: len(others()) == 1, timeout_s, "one leader")
        return others()[0]

    def add_nodes(self, n: int = 2) -> None:
        self.nodes += [procs.start_node(self.tmp, self.address, "32MiB", "--timeout-s", "0.5", name=f"n{i}")
                       for i in range(n)]

    def stop(self) -> None:
        for proc in [*self.nodes, *self.masters, self.etcd]:
            proc.stop(grace_s=5.0)


@pytest.fixture
def ha_pool(tmp_path):
    pool = HAPool(tmp_path)
    yield pool
    pool.stop()


class Writer(threading.Thread):
    """Puts objects without pause and reads some back; remembers what was answered stored."""

    def __init__(self, address: str) -> None:
        super().__init__(daemon=True)
        self.address = address
        self.stop = threading.Event()
        self.stored: list[tuple[str, float]] = []  # (key, when its put was answered)
        self.wrong = 0
        self.failures = 0

    def run(self) -> None:
        with Client(self.address, timeout_s=0.5) as client:
            i = 0
            while not self.stop.is_set():
                key = f"obj/{i}"
                i += 1
                try:
                    if client.put(key, pattern(key, SIZE).tobytes()) is True:
                        self.stored.append((key, time.monotonic()))
                    back = self.stored[len(self.stored) // 2][0] if self.stored else None
                    if back is not None:
                        value = client.get(back)
                        self.wrong += value is not None and value != pattern(back, SIZE).tobytes()
                except KVPoolError:
                    self.failures += 1
                    time.sleep(0.05)


def _read_back(address: str, keys: list[str]) -> tuple[int, int]:
    served = wrong = 0
    with Client(address, timeout_s=2.0) as fresh:
        for key in keys:
            value = fresh.get(key)
            served += value is not None
            wrong += value is not None and value != pattern(key, SIZE).tobytes()
    return served, wrong


def _answers(address: str) -> bool:
    channel = MasterChannel(address, timeout_s=0.5)
    try:
        channel.call(p.Stats())
        return True
    except KVPoolError:
        return False
    finally:
        channel.close()


def test_a_killed_leader_is_replaced_within_its_ttl_and_every_committed_object_is_served_again(ha_pool):
    first = ha_pool.leader()
    ha_pool.add_nodes()
    writer = Writer(ha_pool.address)
    writer.start()
    try:
        wait_until(lambda: len(writer.stored) >= 30, 30, "30 objects stored")
        first.kill()
        killed_s = time.monotonic()
        before = len(writer.stored)
        second = ha_pool.leader()
        assert second is not first
        wait_until(lambda: len(writer.stored) > before + 10, 30, "puts answered by the new leader")
        resumed_s = next(t for _, t in writer.stored[before:])
        assert resumed_s - killed_s <= TTL_S + 2 + 1.5, f"writes resumed {resumed_s - killed_s:.1f} s after the kill"
    finally:
        writer.stop.set()
        writer.join(10)
    assert writer.wrong == 0
    keys = [k for k, _ in writer.stored]
    served, wrong = _read_back(ha_pool.address, keys)
    assert wrong == 0
    assert served == len(keys), f"{served} of {len(keys)} committed objects served after the failover"


def test_a_stopped_leader_stops_answering_before_its_lease_lapses_and_never_leads_again(ha_pool):
    first = ha_pool.leader()
    own_address = ha_pool.state(first)["address"]
    ha_pool.add_nodes(1)
    with Client(ha_pool.address, timeout_s=1.0) as client:
        assert client.put("before", pattern("before", SIZE).tobytes()) is True
    os.kill(first.pid, signal.SIGSTOP)
    try:
        second = ha_pool.leader(timeout_s=TTL_S + 10, besides=first)
        time.sleep(max(0.0, 3 * TTL_S - (TTL_S + 1)))
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert not _answers(own_address)  # fenced: its lease lapsed while it was stopped
    first.popen.wait(timeout=10)
    assert first.popen.returncode == EXIT_LOST_LEADERSHIP
    assert ha_pool.leaders() == [second]
    with Client(ha_pool.address, timeout_s=1.0) as client:
        wait_until(lambda: client.put("after", pattern("after", SIZE).tobytes()) is True, 15, "a put on the new leader")
        wait_until(lambda: client.get("before") is not None, 15, "the node announced to the new leader")
        assert client.get("before") == pattern("before", SIZE).tobytes()


def test_without_etcd_the_leader_serves_until_its_lease_would_lapse_then_the_pool_comes_back_with_etcd(ha_pool):
    first = ha_pool.leader()
    ha_pool.add_nodes(1)
    address = ha_pool.state(first)["address"]
    with Client(ha_pool.address, timeout_s=1.0) as client:
        assert client.put("kept", pattern("kept", SIZE).tobytes()) is True
    endpoint = ha_pool.etcd.info["endpoint"]
    ha_pool.etcd.kill()
    gone_s = time.monotonic()
    assert _answers(address)  # the lease cannot have lapsed yet
    first.popen.wait(timeout=TTL_S + 5)  # then it stops, as its lease could have lapsed
    assert first.popen.returncode == EXIT_LOST_LEADERSHIP
    assert time.monotonic() - gone_s <= TTL_S + 1
    with Client(ha_pool.address, timeout_s=0.5) as client:  # no leader: a clean miss, not a hang
        with pytest.raises(UnavailableError):
            client.get("kept")
    ha_pool.etcd = procs.start_etcd(ha_pool.tmp, port=int(endpoint.rsplit(":", 1)[1]))
    second = ha_pool.leader(timeout_s=TTL_S + 20)
    assert second is not first
    with Client(ha_pool.address, timeout_s=1.0) as client:
        wait_until(lambda: client.get("kept") is not None, 20, "the node announced to the new leader")
        assert client.get("kept") == pattern("kept", SIZE).tobytes()
