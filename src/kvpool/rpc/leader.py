"""Finding the leading master through etcd: addresses of the form `etcd://HOST:PORT[,HOST:PORT...]/NAME`.

Rules:
- Masters started with `--ha` campaign for the key LEADER_KEY.format(name) (master/leadership.py);
  its value (LeaderRecord) names the leader's control address and epoch, and it lives on the
  leader's etcd lease: it is gone once the leader stops keeping the lease alive.
- A client, node or tool given an etcd address reads that key whenever it (re)connects (the first
  endpoint that answers, in order); no key means no leader right now (an election is under way,
  or etcd is down): UnavailableError, retried like a master that does not answer.
- Leaders' epochs grow: an HA epoch's high 31 bits are the etcd revision at which its leader won
  (`ha_epoch`), so a channel that saw one leader never takes a reply from an older one
  (zmq_channel.MasterChannel).
- Talks to etcd's v3 JSON gateway through etcd3gw (plain HTTP, no gRPC build); one short timeout
  per endpoint, so a dead endpoint costs the caller at most that.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import msgspec

from kvpool.core.errors import UnavailableError

SCHEME = "etcd://"
LEADER_KEY = "/kvpool/{}/leader"
DEFAULT_NAME = "kvpool"
ETCD_TIMEOUT_S = 1.0  # one request to one etcd endpoint


class LeaderRecord(msgspec.Struct, frozen=True):
    address: str  # the leader's ZMQ control endpoint, tcp://HOST:PORT
    metrics: str = ""  # http://HOST:PORT of its Prometheus endpoint, if any


@dataclass(frozen=True)
class EtcdAddress:
    endpoints: tuple[tuple[str, int], ...]
    name: str

    @property
    def key(self) -> str:
        return LEADER_KEY.format(self.name)

    def __str__(self) -> str:
        return SCHEME + ",".join(f"{h}:{p}" for h, p in self.endpoints) + "/" + self.name


def is_etcd_address(address: object) -> bool:
    return isinstance(address, str) and address.strip().startswith(SCHEME)


def parse_etcd_address(address: str, default_name: str = DEFAULT_NAME) -> EtcdAddress:
    """`etcd://h1:2379,h2:2379/NAME` (NAME optional: `default_name`); ValueError when malformed."""
    rest = address.strip()
    if not rest.startswith(SCHEME):
        raise ValueError(f"an etcd address starts with {SCHEME}, got {address!r}")
    rest = rest[len(SCHEME):]
    hosts, _, name = rest.partition("/")
    name = name.strip("/") or default_name
    if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise ValueError(f"the pool name in {address!r} must be letters, digits, '-', '_' or '.', got {name!r}")
    endpoints = []
    for item in hosts.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep:
            host, port = item.strip(), "2379"
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"etcd endpoints must be HOST:PORT, got {item!r} in {address!r}")
        endpoints.append((host, int(port)))
    return EtcdAddress(tuple(endpoints), name)


def ha_epoch(revision: int) -> int:
    """The epoch of a leader that won at etcd `revision`: ordered by revision, unique by its low bits."""
    if not 0 < revision < (1 << 31):
        raise ValueError(f"etcd revision {revision} does not fit an epoch's 31 high bits")
    return (revision << 32) | secrets.randbits(32)


def epoch_order(epoch: int) -> int:
    """What orders HA epochs: the revision at which their leader won."""
    return epoch >> 32


class Etcd:
    """etcd3gw clients for each endpoint; `call(fn)` runs fn(client) on the first that answers."""

    def __init__(self, address: EtcdAddress, timeout_s: float = ETCD_TIMEOUT_S) -> None:
        import etcd3gw  # lazy: only HA pools need it

        self.address = address
        self._clients = [etcd3gw.client(host=h, port=p, timeout=timeout_s, api_path="/v3/") for h, p in address.endpoints]
        self._first = 0

    def call(self, fn):
        from etcd3gw.exceptions import Etcd3Exception

        errors = []
        n = len(self._clients)
        for i in range(n):
            index = (self._first + i) % n
            try:
                result = fn(self._clients[index])
            except (Etcd3Exception, OSError, ValueError, KeyError) as e:
                errors.append(f"{self.address.endpoints[index][0]}:{self.address.endpoints[index][1]}: {e}")
                continue
            self._first = index
            return result
        raise UnavailableError(f"no etcd endpoint of {self.address} answered ({'; '.join(errors)})")

    def close(self) -> None:
        for client in self._clients:
            client.session.close()


def read_leader(etcd: Etcd) -> LeaderRecord | None:
    """The leader's record, or None when there is none (UnavailableError: etcd did not answer)."""
    values = etcd.call(lambda c: c.get(etcd.address.key))
    if not values:
        return None
    try:
        return msgspec.json.decode(values[0], type=LeaderRecord)
    except msgspec.DecodeError:
        return None


def find_leader(address: str) -> LeaderRecord:
    """The leader of the pool at an etcd address, or UnavailableError."""
    etcd = Etcd(parse_etcd_address(address))
    try:
        record = read_leader(etcd)
    finally:
        etcd.close()
    if record is None:
        raise UnavailableError(f"no master leads {address} now (an election is under way, or none is running)")
    return record
