"""vLLM's multi-turn benchmark conversations -> sessions, with an approximate tokenisation.

Input (benchmarks/multi_turn in the vLLM repo): `[{"id": ..., "messages": [{"role", "content"}, ...]}]`.
Each user message is one turn; its prompt is every earlier message plus itself, as the benchmark
re-sends the whole history; its output is the next assistant message (when there is one).

Rules:
- No tokenizer is loaded (a model's tokenizer is not a trace's property, and may not be on disk):
  a token is `chars_per_token` characters of the conversation text, each message prefixed by a
  role marker. Counts are approximate; prefix structure is exact.
- Block ids are content hashes chained through the previous block (blake2b, 63 bits), so equal
  text at the start of two conversations (a shared system prompt) gives equal ids. The whole file is
  one id scope.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from kvpool.workload.errors import TraceFormatError
from kvpool.workload.model import Session, Turn


@dataclass(frozen=True)
class MultiturnConfig:
    block_size: int = 64  # tokens per block
    chars_per_token: float = 4.0  # approximate tokenisation: this many characters make one token
    missing_output_tokens: int = 128  # output length for a final user message with no answer

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not self.chars_per_token > 0:
            raise ValueError(f"chars_per_token must be > 0, got {self.chars_per_token}")
        if self.missing_output_tokens < 1:
            raise ValueError(f"missing_output_tokens must be >= 1, got {self.missing_output_tokens}")


def _chain_id(parent: int, text: str) -> int:
    digest = hashlib.blake2b(parent.to_bytes(8, "little") + text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _messages(conversation: object, where: str) -> list[tuple[str, str]]:
    if not isinstance(conversation, dict) or not isinstance(conversation.get("messages"), list):
        raise TraceFormatError(f"{where}: a conversation is an object with a `messages` list")
    messages = []
    for index, message in enumerate(conversation["messages"]):
        if not isinstance(message, dict):
            raise TraceFormatError(f"{where} message {index}: must be an object")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise TraceFormatError(f"{where} message {index}: `role` and `content` must be strings")
        messages.append((role, content))
    return messages


class _TokenStream:
    """The conversation's text, growing by whole messages; block ids assigned as blocks fill."""

    def __init__(self, config: MultiturnConfig) -> None:
        self.text = ""
        self.block_ids: list[int] = []
        self._chars_per_block = config.block_size * config.chars_per_token
        self._config = config

    def append(self, role: str, content: str) -> None:
        self.text += f"<|{role}|>\n{content}\n"

    def num_tokens(self) -> int:
        return math.ceil(len(self.text) / self._config.chars_per_token)

    def prompt(self) -> tuple[list[int], int]:
        num_tokens = self.num_tokens()
        num_full = num_tokens // self._config.block_size
        while len(self.block_ids) < num_full:
            j = len(self.block_ids)
            start, end = round(j * self._chars_per_block), round((j + 1) * self._chars_per_block)
            parent = self.block_ids[-1] if self.block_ids else 0
            self.block_ids.append(_chain_id(parent, self.text[start:end]))
        return list(self.block_ids[:num_full]), num_tokens - num_full * self._config.block_size


def parse_vllm_multiturn(doc: object, name: str, config: MultiturnConfig, label: str | None = None) -> list[Session]:
    """`name` names the sessions and the id scope; `label` (default: name) starts error messages."""
    label = label or name
    if isinstance(doc, dict) and "filetype" in doc:
        raise TraceFormatError(
            f"{label}: a vLLM generator config, not conversations; use `kvpool trace synth`"
        )
    if not isinstance(doc, list):
        raise TraceFormatError(f"{label}: vLLM multi-turn conversations are a JSON list")
    sessions: list[Session] = []
    for index, conversation in enumerate(doc):
        where = f"{label}: conversation {index}"
        messages = _messages(conversation, where)
        stream = _TokenStream(config)
        turns: list[Turn] = []
        for position, (role, content) in enumerate(messages):
            stream.append(role, content)
            if role != "user":
                continue
            block_ids, tail_tokens = stream.prompt()
            following = messages[position + 1] if position + 1 < len(messages) else None
            if following is not None and following[0] == "assistant":
                output_tokens = max(1, math.ceil(len(following[1]) / config.chars_per_token))
            else:
                output_tokens = config.missing_output_tokens
            turns.append(Turn(block_ids=block_ids, tail_tokens=tail_tokens, output_tokens=output_tokens))
        if not turns:
            continue
        conv_id = conversation.get("id") if isinstance(conversation, dict) else None
        sessions.append(
            Session(
                session_id=f"{name}/{conv_id if conv_id is not None else index}",
                block_size=config.block_size,
                turns=turns,
                source="vllm-multiturn",
                id_scope=f"vllm-multiturn:{name}",
            )
        )
    return sessions
