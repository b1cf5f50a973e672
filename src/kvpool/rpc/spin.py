"""When a call on a TCP socket spins for its reply and when it blocks at once (pure logic, no I/O).

Spinning (non-blocking receives, the CPU yielded between them) saves a blocked caller the
hypervisor's wake-up when the reply comes within the spin. When replies come later than that (a
master busy with other clients, more runnable processes than CPUs), every spin is lost: the caller
burns up to `spin_s` of a CPU the master and the nodes need, and the tail grows
(docs/design/data-plane.md). So the policy spins only while most recent replies came within the
spin:

- every call's wait for its reply (from the end of the send to the first bytes back, spinning or
  blocked) is a sample: 1 if it was within `spin_s`, else 0;
- `rate` is the samples' exponentially weighted mean (weight 1/8 for the newest: one late reply
  among quick ones changes nothing, a run of late ones stops the spin within a few calls);
- a call spins while `rate` >= 1/2. A blocked call's wait includes its wake-up, so while not
  spinning the rate is, if anything, low: it comes back once blocked replies come within the spin.

Used by the TCP channel to the master (tcp_channel.py) and the data plane's TCP path.
"""

from __future__ import annotations

_WEIGHT = 0.125  # of the newest sample in `rate`
_SPIN_FROM_RATE = 0.5


class SpinPolicy:
    """Whether the next call spins (`spins`), from the waits `record`ed so far."""

    __slots__ = ("spin_s", "rate")

    def __init__(self, spin_s: float) -> None:
        self.spin_s = max(0.0, float(spin_s))
        self.rate = 1.0  # a new channel spins from its first call

    @property
    def spins(self) -> bool:
        return self.spin_s > 0 and self.rate >= _SPIN_FROM_RATE

    def record(self, wait_s: float) -> None:
        """One call's wait for its reply (seconds)."""
        self.rate += ((1.0 if wait_s <= self.spin_s else 0.0) - self.rate) * _WEIGHT
