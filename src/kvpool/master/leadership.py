"""Leading a pool of masters through etcd (`kvpool master --ha etcd://HOST:PORT[,...] --ha-name NAME`).

Rules:
- Every master of a pool campaigns for one key (rpc/leader.py: LEADER_KEY) on its own etcd lease
  of `ttl_s`: the one whose transaction creates the key leads, and writes its control address
  there; the others (standbys) hold nothing and serve nothing, and try again whenever the key is
  gone (they look every ttl/4). A new leader starts empty and rebuilds the cache from the nodes'
  announcements, as after a restart.
- The leader's epoch comes from the etcd revision of its win (leader.ha_epoch): every leader's is
  newer than every earlier one's, and clients refuse replies from an older one.
- Fencing by lease: the leader keeps its lease alive every ttl/3. A keepalive sent at monotonic
  time t and answered proves the lease lives at least until t + TTL (etcd counts from when it got
  it, after t). The leader serves only before `serving_until_s`, that bound less `margin_s`: cut
  off from etcd, or stopped (SIGSTOP) and continued, it stops answering before its lease can have
  expired, so before any standby can have won. A keepalive answered "no such lease" ends its
  leadership at once. A leader that stopped serving never serves again (the process ends; its
  supervisor starts it again as a standby).
- Resigning (SIGTERM) revokes the lease: a standby takes over without waiting out the TTL.
- I/O: HTTP to etcd, in the caller's thread (the campaign) and in one keepalive thread.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections.abc import Callable

import msgspec

from kvpool.core.errors import UnavailableError
from kvpool.rpc.leader import Etcd, EtcdAddress, LeaderRecord, ha_epoch

log = logging.getLogger("kvpool.master")

MIN_TTL_S = 2  # etcd refuses leases much shorter than its election timeout


def _b64(text: str) -> str:
    """Keys and values travel base64-encoded through etcd's JSON gateway."""
    return base64.b64encode(text.encode()).decode()


class Leadership:
    def __init__(self, address: EtcdAddress, ttl_s: int = 5, clock: Callable[[], float] = time.monotonic) -> None:
        if not MIN_TTL_S <= ttl_s <= 3600:
            raise ValueError(f"the leader lease TTL must be {MIN_TTL_S}..3600 s, got {ttl_s}")
        self.address = address
        self.ttl_s = int(ttl_s)
        self.margin_s = max(0.25, 0.15 * ttl_s)
        self.clock = clock
        self.etcd = Etcd(address)
        self.serving_until_s = 0.0  # monotonic; 0: not leading
        self.epoch = 0
        self.lost = threading.Event()
        self._lease_id = 0
        self._thread: threading.Thread | None = None

    def campaign(self, record: LeaderRecord, stop: threading.Event) -> bool:
        """Wait until this master leads (True) or `stop` is set (False). etcd being down is waited out."""
        key = self.address.key
        value = msgspec.json.encode(record).decode()
        announced = False
        while not stop.is_set():
            try:
                holder = self.etcd.call(lambda c: c.get(key))
                if not holder:
                    if self._try_lead(key, value):
                        return True
                elif not announced:
                    log.info("standing by: %s leads %s", holder[0].decode(errors="replace"), self.address)
                    announced = True
            except UnavailableError as e:
                log.warning("campaign: %s", e)
            stop.wait(max(0.1, self.ttl_s / 4))
        return False

    def _try_lead(self, key: str, value: str) -> bool:
        started = self.clock()
        lease_id = int(self.etcd.call(lambda c: c.post(c.get_url("/lease/grant"), json={"TTL": self.ttl_s, "ID": 0}))["ID"])
        txn = {"compare": [{"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}],
               "success": [{"request_put": {"key": _b64(key), "value": _b64(value), "lease": lease_id}}],
               "failure": []}
        result = self.etcd.call(lambda c: c.transaction(txn))
        if not result.get("succeeded"):
            self._revoke(lease_id)
            return False
        try:
            self.epoch = ha_epoch(int(result["header"]["revision"]))
        except (KeyError, TypeError, ValueError) as e:  # the key must not outlive this attempt
            self._revoke(lease_id)
            raise UnavailableError(f"etcd's answer to the election gave no usable revision ({e})") from None
        self._lease_id = lease_id
        self.serving_until_s = started + self.ttl_s - self.margin_s
        log.info("leading %s (epoch %016x, lease TTL %d s)", self.address, self.epoch, self.ttl_s)
        return True

    def keep(self, on_lost: Callable[[], None]) -> None:
        """Keep the lease alive in a thread until it is lost or resigned; `on_lost()` when lost."""
        self._thread = threading.Thread(target=self._keep, args=(on_lost,), name="kvpool-leadership", daemon=True)
        self._thread.start()

    def _keep(self, on_lost: Callable[[], None]) -> None:
        period_s = self.ttl_s / 3
        while not self.lost.wait(period_s):
            sent = self.clock()
            try:
                ttl = self.etcd.call(lambda c: int(c.post(c.get_url("/lease/keepalive"), json={"ID": self._lease_id})
                                                   ["result"].get("TTL", -1)))
            except UnavailableError as e:
                log.warning("leader lease keepalive failed: %s (serving for %.1f s more at most)", e,
                            max(0.0, self.serving_until_s - self.clock()))
                ttl = None
            if ttl is not None and ttl <= 0:
                log.error("the leader lease expired: this master stops serving now")
                self.serving_until_s = 0.0
            elif ttl is not None:
                self.serving_until_s = max(self.serving_until_s, sent + ttl - self.margin_s)
            if self.clock() >= self.serving_until_s:
                self.lost.set()
                on_lost()
                return

    def serving(self, now_s: float) -> bool:
        return now_s < self.serving_until_s

    def resign(self) -> None:
        """Give the lease back (the key goes with it); nothing more is served."""
        self.serving_until_s = 0.0
        self.lost.set()
        if self._lease_id:
            try:
                self._revoke(self._lease_id)
            except UnavailableError as e:
                log.warning("could not revoke the leader lease (a standby waits out its TTL): %s", e)
        self.etcd.close()

    def _revoke(self, lease_id: int) -> None:
        self.etcd.call(lambda c: c.post(c.get_url("/kv/lease/revoke"), json={"ID": lease_id}))
