"""Trace statistics: potential prefix-cache hit rate with an unbounded cache, and the trace's shape.

Rules:
- Pure: sessions in, a TraceStats value out. No I/O, no printing.
- A block's identity is (scope, the chain of ids up to it): `Session.block_scope` gives the scope,
  so a shared system prompt is shared, ids of one Claude Code file are shared by its subagents, and
  two sessions' private ids never meet even when the numbers are equal.
- A turn's hit is the longest prefix of its block chain already seen; the partial tail block never
  hits. Hit tokens = hit blocks x block size, over all prompt tokens (tails included).
- "global": one cache for the whole trace, turns taken in trace time (session offset + turn offset),
  ties by session then turn order. Totals do not depend on that order (a turn misses exactly the
  blocks nobody sent before), only the split between sessions does.
  "session": each session alone with its own cache (no cross-session sharing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from kvpool.workload.model import Session

_ChainKey = tuple[int, str, int]  # (parent node, scope, block id)


@dataclass(frozen=True)
class HitCounts:
    hit_blocks: int = 0
    total_blocks: int = 0
    hit_tokens: int = 0
    total_tokens: int = 0

    def __add__(self, other: HitCounts) -> HitCounts:
        return HitCounts(
            self.hit_blocks + other.hit_blocks,
            self.total_blocks + other.total_blocks,
            self.hit_tokens + other.hit_tokens,
            self.total_tokens + other.total_tokens,
        )

    @property
    def block_hit_rate(self) -> float | None:
        return self.hit_blocks / self.total_blocks if self.total_blocks else None

    @property
    def token_hit_rate(self) -> float | None:
        return self.hit_tokens / self.total_tokens if self.total_tokens else None


@dataclass(frozen=True)
class Percentiles:
    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    min: float
    max: float

    @staticmethod
    def of(values: Sequence[float]) -> Percentiles | None:
        if len(values) == 0:
            return None
        a = np.asarray(values, dtype=float)
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        return Percentiles(len(a), float(a.mean()), float(p50), float(p90), float(p99), float(a.min()), float(a.max()))


@dataclass(frozen=True)
class TurnRecord:
    session_index: int
    turn_index: int
    input_tokens: int
    output_tokens: int
    think_time_s: float
    global_hit_tokens: int
    session_hit_tokens: int


@dataclass(frozen=True)
class SessionStats:
    session_id: str
    parent_session_id: str | None
    num_turns: int
    input_tokens: int
    output_tokens: int
    global_hits: HitCounts
    session_hits: HitCounts


@dataclass(frozen=True)
class TraceStats:
    num_sessions: int
    num_subagent_sessions: int
    num_turns: int
    input_tokens: int
    output_tokens: int
    global_hits: HitCounts  # one unbounded cache for the whole trace
    session_hits: HitCounts  # each session with its own unbounded cache
    turns_per_session: Percentiles | None
    think_time_s: Percentiles | None  # before every turn but a session's first
    input_tokens_per_turn: Percentiles | None  # the context each call sends
    first_turn_input_tokens: Percentiles | None  # context growth: where sessions start ...
    last_turn_input_tokens: Percentiles | None  # ... and where they end
    new_tokens_per_turn: Percentiles | None  # prompt growth between consecutive turns
    global_session_hit_rate: Percentiles | None  # per-session token hit rate, global cache
    sessions: list[SessionStats]
    turns: list[TurnRecord]

    @property
    def input_output_ratio(self) -> float | None:
        return self.input_tokens / self.output_tokens if self.output_tokens else None


class PrefixCache:
    """An unbounded prefix cache over chained block ids; `add` returns how many leading blocks hit."""

    def __init__(self) -> None:
        self._nodes: dict[_ChainKey, int] = {}

    def __len__(self) -> int:
        return len(self._nodes)

    def add(self, session: Session, block_ids: Sequence[int], known: tuple[list[int], list[int]] | None = None) -> tuple[int, list[int]]:
        """Insert a prompt's chain; returns (hit blocks, node of every block). `known` is the same
        session's previous (block ids, nodes) in this cache, reused for the common prefix."""
        reused = 0
        nodes: list[int] = []
        if known is not None:
            reused = _common_prefix(known[0], block_ids)
            nodes = known[1][:reused]
        parent = nodes[-1] if nodes else 0
        hit = reused
        missed = False
        for position in range(reused, len(block_ids)):
            key = (parent, session.block_scope(position), block_ids[position])
            node = None if missed else self._nodes.get(key)
            if node is None:
                missed = True
                node = len(self._nodes) + 1
                self._nodes[key] = node
            else:
                hit += 1
            nodes.append(node)
            parent = node
        return hit, nodes


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix, by binary search over C-speed slice comparisons."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # invariant: a[:lo] == b[:lo], a[:hi+1] != b[:hi+1] somewhere below hi
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def analyze(sessions: Sequence[Session], on_turn: Callable[[], None] | None = None) -> TraceStats:
    """Compute TraceStats. `on_turn` is called once per turn processed in each pass (for progress)."""
    order = sorted(
        ((s.trace_offset_s + t.start_offset_s, si, ti) for si, s in enumerate(sessions) for ti, t in enumerate(s.turns))
    )
    global_cache = PrefixCache()
    global_hit_blocks: dict[tuple[int, int], int] = {}
    last: dict[int, tuple[list[int], list[int]]] = {}
    for _, si, ti in order:
        session = sessions[si]
        ids = session.turns[ti].block_ids
        hit, nodes = global_cache.add(session, ids, last.get(si))
        last[si] = (ids, nodes)
        global_hit_blocks[(si, ti)] = hit
        if on_turn is not None:
            on_turn()
    del last, global_cache

    turns: list[TurnRecord] = []
    session_stats: list[SessionStats] = []
    for si, session in enumerate(sessions):
        cache = PrefixCache()
        known = None
        g_counts, s_counts = HitCounts(), HitCounts()
        for ti, turn in enumerate(session.turns):
            hit, nodes = cache.add(session, turn.block_ids, known)
            known = (turn.block_ids, nodes)
            input_tokens = session.input_tokens(turn)
            g_hit = global_hit_blocks[(si, ti)]
            g_counts += HitCounts(g_hit, len(turn.block_ids), g_hit * session.block_size, input_tokens)
            s_counts += HitCounts(hit, len(turn.block_ids), hit * session.block_size, input_tokens)
            turns.append(
                TurnRecord(si, ti, input_tokens, turn.output_tokens, turn.think_time_s, g_hit * session.block_size, hit * session.block_size)
            )
            if on_turn is not None:
                on_turn()
        session_stats.append(
            SessionStats(
                session.session_id,
                session.parent_session_id,
                len(session.turns),
                session.total_input_tokens,
                session.total_output_tokens,
                g_counts,
                s_counts,
            )
        )
    return _summarize(sessions, session_stats, turns)


def _summarize(sessions: Sequence[Session], stats: list[SessionStats], turns: list[TurnRecord]) -> TraceStats:
    global_hits = sum((s.global_hits for s in stats), HitCounts())
    session_hits = sum((s.session_hits for s in stats), HitCounts())
    by_session: dict[int, list[TurnRecord]] = {}
    for record in turns:
        by_session.setdefault(record.session_index, []).append(record)
    growth = [b.input_tokens - a.input_tokens for rs in by_session.values() for a, b in zip(rs, rs[1:])]
    rates = [s.global_hits.token_hit_rate for s in stats if s.global_hits.token_hit_rate is not None]
    return TraceStats(
        num_sessions=len(sessions),
        num_subagent_sessions=sum(1 for s in sessions if s.parent_session_id is not None),
        num_turns=len(turns),
        input_tokens=sum(s.input_tokens for s in stats),
        output_tokens=sum(s.output_tokens for s in stats),
        global_hits=global_hits,
        session_hits=session_hits,
        turns_per_session=Percentiles.of([s.num_turns for s in stats]),
        think_time_s=Percentiles.of([r.think_time_s for r in turns if r.turn_index > 0]),
        input_tokens_per_turn=Percentiles.of([r.input_tokens for r in turns]),
        first_turn_input_tokens=Percentiles.of([rs[0].input_tokens for rs in by_session.values()]),
        last_turn_input_tokens=Percentiles.of([rs[-1].input_tokens for rs in by_session.values()]),
        new_tokens_per_turn=Percentiles.of(growth),
        global_session_hit_rate=Percentiles.of(rates),
        sessions=stats,
        turns=turns,
    )
