"""Per-identity rate limits on the master's expensive calls: pure, clock passed in.

Rules:
- Each identity (its public key; without authentication, its connection) has a token bucket of
  keys: a lookup, put, existence check or removal costs one token per key it names, every other
  call one. A call that finds too few tokens is refused whole (`rate_limited`, nothing done), and
  the caller is told how long until its bucket holds enough again.
- A caller whose bucket is empty is refused before its message is even decoded (`exhausted`):
  a flood of big requests then costs the loop a dictionary lookup each, not a decode.
- One message's size is bounded elsewhere (max_message_bytes, checked before decoding); a bucket
  bounds what an identity asks per second, so a flood from one client costs the others at most
  its fair share of the loop (ZeroMQ already takes messages from connections in turn).
- Buckets of identities silent for a while are dropped (`prune`), so a client that reconnects
  over and over does not grow the table without bound.
"""

from __future__ import annotations

from kvpool.core import protocol as p

_KEYED = (p.LookupPrefix, p.PutStart, p.Exists, p.Remove, p.PutEnd, p.PutRevoke, p.PutLanded)


def cost_of(request: p.Request) -> int:
    """Tokens a request takes: its number of keys for the calls that name keys, else 1."""
    if isinstance(request, _KEYED):
        return max(1, len(request.keys) + len(request.ahead) if type(request) is p.PutEnd else len(request.keys))
    return 1


class _Bucket:
    __slots__ = ("tokens", "updated_s")

    def __init__(self, tokens: float, now_s: float) -> None:
        self.tokens = tokens
        self.updated_s = now_s


class RateLimiter:
    def __init__(self, keys_per_s: float, burst_keys: float) -> None:
        if keys_per_s <= 0 or burst_keys < 1:
            raise ValueError(f"rate limits must be > 0 keys/s with a burst >= 1, got {keys_per_s}, {burst_keys}")
        self.keys_per_s = keys_per_s
        self.burst_keys = burst_keys
        self._buckets: dict[bytes | str, _Bucket] = {}
        self.refused = 0

    def admit(self, identity: bytes | str, cost: int, now_s: float) -> float:
        """0.0 if admitted (tokens taken), else the seconds until `cost` tokens will be there. A
        cost above the burst can never be admitted: the caller must split it (also reported)."""
        bucket = self._buckets.get(identity)
        if bucket is None:
            bucket = self._buckets[identity] = _Bucket(self.burst_keys, now_s)
        else:
            bucket.tokens = min(self.burst_keys, bucket.tokens + (now_s - bucket.updated_s) * self.keys_per_s)
            bucket.updated_s = now_s
        if cost <= bucket.tokens:
            bucket.tokens -= cost
            return 0.0
        self.refused += 1
        return (cost - bucket.tokens) / self.keys_per_s

    def exhausted(self, identity: bytes | str, now_s: float) -> bool:
        """True when the identity's bucket holds less than one token: its next call is refused
        whatever it asks, so the service need not even decode it."""
        bucket = self._buckets.get(identity)
        if bucket is None:
            return False
        if bucket.tokens + (now_s - bucket.updated_s) * self.keys_per_s >= 1:
            return False
        self.refused += 1
        return True

    @property
    def exhausted_message(self) -> str:
        return f"rate limited: this identity asks for more than {self.keys_per_s:g} keys/s; retry in a moment"

    def refusal(self, identity: bytes | str, request: p.Request, now_s: float) -> str | None:
        """None if admitted, else the message for the refused caller."""
        cost = cost_of(request)
        wait_s = self.admit(identity, cost, now_s)
        if wait_s == 0.0:
            return None
        if cost > self.burst_keys:
            return (f"{type(request).__name__} names {cost} keys, more than the {self.burst_keys:g} one identity may "
                    "ask at once: split it")
        return (f"rate limited: this identity asks for more than {self.keys_per_s:g} keys/s; "
                f"retry in {wait_s * 1000:.0f} ms")

    def prune(self, now_s: float, idle_s: float = 60.0) -> None:
        """Forget identities silent for `idle_s` (their bucket is full again by then anyway)."""
        stale = [k for k, b in self._buckets.items() if now_s - b.updated_s > idle_s]
        for identity in stale:
            del self._buckets[identity]

    def __len__(self) -> int:
        return len(self._buckets)
