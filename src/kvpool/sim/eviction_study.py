"""Pool hit rate against capacity for eviction policies, replayed on one access log.

Rules:
- The access log comes from a simulated run (its request records give when each turn arrived, got
  its first token and finished): at arrival a turn looks up its prompt's block chain (prefix
  semantics: the leading blocks present hit); at its first token its prompt blocks are written,
  at its finish its output blocks (named by the next turn's ids). The same log for every policy
  and capacity, so only the policy differs. The pool is the only cache here (no local caches).
- All blocks have one size, so capacity is in blocks.
- Policies:
  lru          plain LRU over blocks (a lookup touches the blocks it hit; a write touches all).
  tail-lru     the master's own code (MasterCore via sim.pool.PoolModel, watermarks at 1.0/0.999
               so it evicts on demand like the others, or as given): LRU among chain tails only.
  session      the master's session-aware option (master/session_order.py, `SessionAwareOrder`).
  session-end  the same, told when each session's last turn is done (an agent's end-of-session hint).
  belady       the offline optimum for equal sizes: evict the block whose next use is farthest
               (never used again first). Uses the future; an upper bound, not a policy.
- Pure: sessions and records in, hit counts out.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

from kvpool.master.config import MasterConfig
from kvpool.core import protocol as p
from kvpool.sim.config import PoolConfig
from kvpool.sim.fleet import RequestRecord
from kvpool.sim.pool import PoolModel
from kvpool.workload.analysis import PrefixCache
from kvpool.workload.model import Session

LOOKUP, WRITE = 1, 0  # at equal times a write lands before a lookup
ON_DEMAND = (1.0, 0.999)  # master watermarks: evict only when full


@dataclass(frozen=True)
class Access:
    at_s: float
    kind: int
    session: int
    keys: tuple[int, ...]
    parent: int | None  # key before keys[0] (writes)
    prompt_tokens: int = 0
    think_s: float = 0.0  # lookups: the think time that preceded this turn (the master measures its own)
    turn_done: bool = True  # writes: the turn's last write (its output)
    session_end: bool = False  # writes: the session's last turn is done (an agent that says so)


def access_log(sessions: Sequence[Session], records: Sequence[RequestRecord], block_tokens: int) -> list[Access]:
    chains = PrefixCache()
    by_turn = {(r.session_index, r.turn_index): r for r in records}
    log: list[Access] = []
    for si, s in enumerate(sessions):
        group = block_tokens // s.block_size
        known = None
        keys_by_turn = []
        for turn in s.turns:
            _, nodes = chains.add(s, turn.block_ids, known)
            known = (turn.block_ids, nodes)
            keys_by_turn.append(nodes[group - 1 :: group])
        for ti, turn in enumerate(s.turns):
            rec = by_turn.get((si, ti))
            if rec is None:
                continue
            keys = keys_by_turn[ti]
            log.append(Access(rec.arrival_s, LOOKUP, si, tuple(keys), None, rec.prompt_tokens, turn.think_time_s))
            log.append(Access(rec.first_token_s, WRITE, si, tuple(keys), None, turn_done=False))
            output: tuple[int, ...] = ()
            if ti + 1 < len(s.turns):
                nxt = keys_by_turn[ti + 1]
                upto = min(len(nxt), (rec.prompt_tokens + rec.output_tokens) // block_tokens)
                output = tuple(nxt[len(keys):upto])
            log.append(Access(rec.finish_s, WRITE, si, output, keys[-1] if keys else None,
                              session_end=ti + 1 == len(s.turns)))
    log.sort(key=lambda a: (a.at_s, a.kind, a.session))
    return log


def unique_blocks(log: Sequence[Access]) -> int:
    return len({k for a in log for k in a.keys})


class LRUCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def lookup(self, a: Access) -> int:
        n = 0
        blocks = self.blocks
        for k in a.keys:
            if k not in blocks:
                break
            blocks.move_to_end(k)
            n += 1
        return n

    def write(self, a: Access) -> None:
        blocks = self.blocks
        if not a.keys:
            return
        for k in a.keys:
            if k in blocks:
                blocks.move_to_end(k)
            else:
                blocks[k] = None
                if len(blocks) > self.capacity:
                    blocks.popitem(last=False)


class BeladyCache:
    """Farthest next use first; needs the whole log (next uses are lookups that name the block)."""

    def __init__(self, capacity: int, log: Sequence[Access]) -> None:
        self.capacity = capacity
        self.uses: dict[int, list[int]] = {}
        for i, a in enumerate(log):
            if a.kind == LOOKUP:
                for k in a.keys:
                    self.uses.setdefault(k, []).append(i)
        self.pos: dict[int, int] = {}  # key -> index into its uses of the next use
        self.present: dict[int, int] = {}  # key -> next use (log index) as pushed
        self.heap: list[tuple[int, int]] = []  # (-next use, key)
        self.i = 0
        self.never = len(log) + 1

    def _next_use(self, k: int) -> int:
        uses = self.uses.get(k)
        if not uses:
            return self.never
        p = self.pos.get(k, 0)
        while p < len(uses) and uses[p] <= self.i:
            p += 1
        self.pos[k] = p
        return uses[p] if p < len(uses) else self.never

    def _touch(self, k: int) -> None:
        nu = self._next_use(k)
        self.present[k] = nu
        heapq.heappush(self.heap, (-nu, -k))  # ties: the later block (tail) first

    def lookup(self, a: Access) -> int:
        n = 0
        for k in a.keys:
            if k not in self.present:
                break
            n += 1
        for k in a.keys[:n]:
            self._touch(k)
        return n

    def write(self, a: Access) -> None:
        for k in a.keys:
            self._touch(k)
            while len(self.present) > self.capacity:
                nu, neg = heapq.heappop(self.heap)
                victim = -neg
                if self.present.get(victim) == -nu:
                    del self.present[victim]


class MasterCache:
    """The master's own index and eviction (tail-LRU, or its session-aware option), fed the same
    messages a connector sends: a turn's arrival before its lookup, its session on its puts, its
    end after its output's write."""

    def __init__(self, capacity: int, order: str, watermarks: tuple[float, float] = ON_DEMAND) -> None:
        master = MasterConfig(node_ttl_s=1e12, heartbeat_interval_s=1e11, put_timeout_s=1e12,
                              high_watermark=watermarks[0], low_watermark=watermarks[1], alignment_bytes=64,
                              eviction_order="lru" if order == "tail-lru" else "session")
        self.pool = PoolModel(PoolConfig(capacity_bytes=capacity * 64, num_nodes=1), 64, master)
        self.hinted = order in ("session", "session-end")
        self.ends = order == "session-end"  # the agents also say when a session ends
        self._turn: dict[int, str] = {}  # session -> id of its turn in flight

    def _event(self, a: Access, kind: int) -> None:
        self.pool.session_event(str(a.session), self._turn.get(a.session, ""), kind, a.at_s)

    def lookup(self, a: Access) -> int:
        if self.hinted:
            self._turn[a.session] = f"{a.session}@{a.at_s}"
            self._event(a, p.TURN_ARRIVED)
        return self.pool.lookup(a.keys, a.at_s, lease=False)[0]

    def write(self, a: Access) -> None:
        self.pool.put(a.keys, a.parent, a.at_s, session=str(a.session) if self.hinted else "")
        if self.hinted and a.turn_done:
            self._event(a, p.TURN_DONE)
            if self.ends and a.session_end:
                self._event(a, p.SESSION_END)


def make_cache(policy: str, capacity: int, log: Sequence[Access], watermarks: tuple[float, float] = ON_DEMAND):
    if policy == "lru":
        return LRUCache(capacity)
    if policy == "belady":
        return BeladyCache(capacity, log)
    if policy in ("tail-lru", "session", "session-end"):
        return MasterCache(capacity, policy, watermarks)
    raise ValueError(f"unknown policy {policy!r}: lru, tail-lru, session, session-end, belady")


def replay(policy: str, capacity: int, log: Sequence[Access], block_tokens: int,
           on_access: Callable[[], None] | None = None, watermarks: tuple[float, float] = ON_DEMAND) -> float:
    """Pool hit rate (hit tokens / prompt tokens) of `policy` with `capacity` blocks (`watermarks`:
    the master's high / low, for tail-lru and session)."""
    cache = make_cache(policy, capacity, log, watermarks)
    hit = total = 0
    belady = isinstance(cache, BeladyCache)
    for i, a in enumerate(log):
        if belady:
            cache.i = i
        if a.kind == LOOKUP:
            hit += cache.lookup(a) * block_tokens
            total += a.prompt_tokens
        else:
            cache.write(a)
        if on_access is not None:
            on_access()
    return hit / total if total else 0.0
