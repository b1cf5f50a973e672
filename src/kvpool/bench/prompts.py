"""Turn a session of block ids into the token-id prompts an agent would send. Pure: no I/O.

Rules:
- Every block id maps to a deterministic block of tokens in [first_token, vocab_size): equal ids
  in the same scope give equal tokens, so the engine sees the prefix structure the trace recorded.
  The scope is the session model's `Session.block_scope(position)`: the whole trace inside the
  shared prefix (a system prompt), else the session's `id_scope` or its own id.
- A turn whose block ids extend the previous turn's is sent as the previous prompt + the output the
  server actually returned + new tokens, as an agent does. A turn that shares only part of the
  previous turn's blocks (context compaction, an edit) keeps that part of the previous prompt; a
  turn that shares nothing starts over. The prompt length follows the trace where it can; a turn
  always adds at least one new token.
- `PrefixLedger` counts what an unbounded, shared cache could have served (the potential hit rate
  of the prompts actually sent), in the engine's block size.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from kvpool.workload.model import Session, Turn

_BLOCK_STREAM = 0
_TAIL_STREAM = 1


@dataclass(frozen=True)
class TokenSpace:
    vocab_size: int
    seed: int = 0
    first_token: int = 3  # below: pad/bos/eos of the tiny model

    def __post_init__(self) -> None:
        if self.first_token < 0 or self.vocab_size <= self.first_token + 1:
            raise ValueError(f"vocab_size ({self.vocab_size}) must exceed first_token ({self.first_token}) + 1")
        if self.seed < 0:
            raise ValueError("seed must be >= 0")

    def block(self, scope: str | None, block_id: int, num_tokens: int) -> list[int]:
        return list(_tokens(self.vocab_size, self.first_token, self.seed, _scope_key(scope), _BLOCK_STREAM,
                            block_id & 0xFFFF_FFFF_FFFF_FFFF, num_tokens))  # fmt: skip

    def tail(self, scope: str, turn_index: int, num_tokens: int) -> list[int]:
        return list(_tokens(self.vocab_size, self.first_token, self.seed, _scope_key(scope), _TAIL_STREAM,
                            turn_index, num_tokens))  # fmt: skip


@lru_cache(maxsize=65536)
def _tokens(vocab: int, first: int, seed: int, scope_key: int, stream: int, ident: int, n: int) -> tuple[int, ...]:
    rng = np.random.default_rng([seed, scope_key, stream, ident])
    return tuple(rng.integers(first, vocab, size=n).tolist())


def _scope_key(scope: str | None) -> int:
    if not scope:  # None or "": the whole trace
        return 0
    return 1 + int.from_bytes(hashlib.blake2b(scope.encode(), digest_size=8).digest(), "little")


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class SessionPrompts:
    """Builds one session's prompts turn by turn; feed back each turn's returned output tokens."""

    session: Session
    space: TokenSpace
    min_new_tokens: int = 1
    _prev_turn: Turn | None = field(default=None, init=False)
    _prev_prompt: list[int] = field(default_factory=list, init=False)

    def block_tokens(self, position: int, block_id: int) -> list[int]:
        return self.space.block(self.session.block_scope(position), block_id, self.session.block_size)

    def _stream(self, turn_index: int, turn: Turn, first_position: int, num_tokens: int) -> list[int]:
        """`num_tokens` tokens from the turn's blocks starting at `first_position`, then its tail."""
        out: list[int] = []
        for pos in range(first_position, len(turn.block_ids)):
            if len(out) >= num_tokens:
                break
            out += self.block_tokens(pos, turn.block_ids[pos])
        if len(out) < num_tokens:
            out += self.space.tail(self.session.session_id, turn_index, num_tokens - len(out))
        return out[:num_tokens]

    def next_prompt(self, turn_index: int, prev_output: list[int] | None) -> list[int]:
        turn = self.session.turns[turn_index]
        target = self.session.input_tokens(turn)
        prev = self._prev_turn
        if prev is None:
            base, first_new = [], 0
        else:
            shared = common_prefix_len(prev.block_ids, turn.block_ids)
            if shared == len(prev.block_ids) and shared > 0:
                base, first_new = self._prev_prompt + list(prev_output or []), shared
            else:
                base, first_new = self._prev_prompt[: shared * self.session.block_size], shared
        num_new = max(target - len(base), self.min_new_tokens)
        prompt = base + self._stream(turn_index, turn, first_new, num_new)
        self._prev_turn, self._prev_prompt = turn, prompt
        return prompt


class PrefixLedger:
    """Potential hits of an unbounded cache shared by every server, in `block_size`-token blocks.

    A block is cached once a request that contains it was computed: its prompt on admission, its
    prompt + output (all but the last output token, whose KV is never computed) on completion.
    Like vLLM, a request never gets its last prompt token from the cache.
    """

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be > 0")
        self.block_size = block_size
        self._seen: set[bytes] = set()

    def _chain(self, tokens: list[int]) -> list[bytes]:
        hashes, parent = [], b""
        arr = np.asarray(tokens, dtype=np.int64)
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            parent = hashlib.blake2b(parent + arr[start : start + self.block_size].tobytes(), digest_size=16).digest()
            hashes.append(parent)
        return hashes

    def hit_tokens(self, prompt: list[int]) -> int:
        hits = 0
        for h in self._chain(prompt):
            if h not in self._seen:
                break
            hits += 1
        max_blocks = (len(prompt) - 1) // self.block_size if prompt else 0
        return min(hits, max_blocks) * self.block_size

    def add(self, tokens: list[int]) -> None:
        self._seen.update(self._chain(tokens))
