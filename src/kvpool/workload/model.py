"""The session model every trace format is read into, and written out as JSONL (one session a line).

A session is one agent conversation: turns in order. A turn's prompt is a chain of block ids
(equal id at equal position = equal prefix up to there, as in the Claude Code and Mooncake traces)
plus `tail_tokens` tokens after the last full block. Block ids are scoped to one session unless
`shared_prefix_blocks` says how many leading ids are shared across sessions (a system prompt).
Subagents are sessions of their own with `parent_session_id` set.

Added fields (defaults keep older files readable):
- `id_scope`: sessions with the same non-None `id_scope` share one block-id namespace (a Claude Code
  file's parent and subagents; every request of a Mooncake trace, whose ids are global). None means
  the ids past `shared_prefix_blocks` are private to the session. A block's identity is therefore
  (scope, the chain of ids up to and including it), scope being the trace for the first
  `shared_prefix_blocks` positions and `id_scope or session_id` after.
- `trace_offset_s`: when the session starts, seconds after the trace's start (a subagent: when its
  parent spawned it; a Mooncake request: its timestamp). Turn offsets stay relative to the session.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

import msgspec
from msgspec import Struct


class Turn(Struct, frozen=True):
    block_ids: list[int]  # chained prompt blocks, each `Session.block_size` tokens
    tail_tokens: int  # prompt tokens after the last full block (0 <= tail < block_size)
    output_tokens: int
    start_offset_s: float = 0.0  # when the trace sent it, seconds after the session's first turn
    think_time_s: float = 0.0  # the agent's tool/think time between the previous answer and this turn


class Session(Struct, frozen=True):
    session_id: str
    block_size: int
    turns: list[Turn]
    source: str = ""  # the trace format it came from: claude-code, mooncake, vllm-multiturn, synth
    parent_session_id: str | None = None  # set for a subagent's session
    shared_prefix_blocks: int = 0  # leading block ids shared by every session of the trace (system prompt)
    id_scope: str | None = None  # sessions with equal id_scope share block ids; None: private past the shared prefix
    trace_offset_s: float = 0.0  # when the session starts, seconds after the trace's start

    def block_scope(self, position: int) -> str:
        """The namespace of the block id at `position`: "" (the whole trace) inside the shared prefix,
        else `id_scope`, else the session id. Map ids to tokens keyed by (scope, id), never id alone."""
        if position < self.shared_prefix_blocks:
            return ""
        return self.id_scope if self.id_scope is not None else self.session_id

    def input_tokens(self, turn: Turn) -> int:
        return len(turn.block_ids) * self.block_size + turn.tail_tokens

    @property
    def total_input_tokens(self) -> int:
        return sum(self.input_tokens(t) for t in self.turns)

    @property
    def total_output_tokens(self) -> int:
        return sum(t.output_tokens for t in self.turns)


def scale_session(session: Session, scale: float) -> Session:
    """The same session with token counts times `scale` (0 < scale <= 1), its sharing intact: the
    block ids stay, each block holds round(block_size * scale) tokens (at least 1), tails and outputs
    shrink alike. For replaying traces with 100K+ contexts on a model with a short context."""
    if not 0 < scale <= 1:
        raise ValueError(f"scale must be in (0, 1], got {scale}")
    block_size = max(1, round(session.block_size * scale))
    turns = [
        msgspec.structs.replace(
            t, tail_tokens=min(block_size - 1, round(t.tail_tokens * scale)),
            output_tokens=max(1, round(t.output_tokens * scale)),
        )
        for t in session.turns
    ]
    return msgspec.structs.replace(session, block_size=block_size, turns=turns)


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Session)


def write_sessions(path: Path | str, sessions: Iterable[Session]) -> int:
    count = 0
    with open(path, "wb") as f:
        for session in sessions:
            f.write(_encoder.encode(session))
            f.write(b"\n")
            count += 1
    return count


def iter_sessions(path: Path | str) -> Iterator[Session]:
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield _decoder.decode(line)
            except msgspec.DecodeError as e:
                raise ValueError(f"{path}:{line_no}: not a kvpool session: {e}") from None


def read_sessions(path: Path | str) -> list[Session]:
    return list(iter_sessions(path))
