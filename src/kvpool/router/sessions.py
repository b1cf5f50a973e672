"""Who a request belongs to, and what it asks for, from its headers and JSON body. Pure: no I/O.

Rules:
- Session identity, first that applies: an explicit session header (`x-session-id`, or one of the
  headers coding agents send), the body's `user` (or `metadata.user_id`), else a hash of the first
  prompt block, so the turns of one conversation (which all start with the same system prompt and
  first message) agree without any cooperation from the client.
- Prompt size: token-id prompts are counted exactly, and so are text and chat prompts when the
  router tokenizes them (`--tokenizer`, prompt_tokens.py; app.py puts their ids in RequestInfo);
  without a tokenizer text is estimated at 4 characters a token, chat messages by their text.
- A body that is not JSON, or not an object, is routed as an anonymous request of 0 tokens and
  forwarded unchanged: the backend gives the client its own error.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

SESSION_HEADERS = ("x-session-id", "x-claude-code-session-id", "session_id", "session-id", "x-conversation-id",
                   "conversation_id")  # fmt: skip
FIRST_BLOCK_CHARS = 1024  # of the first prompt's text when no id is given
FIRST_BLOCK_TOKENS = 256
CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class RequestInfo:
    session_id: str
    session_source: str  # header | user | prefix | none
    prompt_token_ids: list[int] | None  # None: the prompt is text
    prompt_tokens: int  # exact for token ids, estimated for text
    max_tokens: int
    stream: bool


def parse_body(body: bytes) -> dict | None:
    try:
        parsed = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        return None
    return parsed if isinstance(parsed, dict) else None


def _prompt_ids(prompt: object) -> list[int] | None:
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        return _prompt_ids(prompt[0])
    return None


def _messages_text(messages: object) -> str:
    if not isinstance(messages, list):
        return ""
    parts = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):  # content parts: [{"type": "text", "text": ...}]
            parts += [p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return "\n".join(parts)


def request_info(headers: Mapping[str, str], body: dict | None) -> RequestInfo:
    lowered = {k.lower(): v for k, v in headers.items()}
    body = body or {}
    prompt = body.get("prompt")
    ids = _prompt_ids(prompt)
    if ids is not None:
        text = ""
        num_tokens = len(ids)
    else:
        text = prompt if isinstance(prompt, str) else _messages_text(body.get("messages"))
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            text = "\n".join(prompt)
        num_tokens = (len(text) + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else 16
    stream = body.get("stream") is True

    session, source = None, "none"
    for name in SESSION_HEADERS:
        if lowered.get(name):
            session, source = lowered[name], "header"
            break
    if session is None:
        user = body.get("user")
        metadata = body.get("metadata")
        if not isinstance(user, str) and isinstance(metadata, dict):
            user = metadata.get("user_id")
        if isinstance(user, str) and user:
            session, source = user, "user"
    if session is None and (ids or text):
        head = (json.dumps(ids[:FIRST_BLOCK_TOKENS]) if ids is not None else text[:FIRST_BLOCK_CHARS]).encode()
        session, source = "prefix-" + hashlib.blake2b(head, digest_size=8).hexdigest(), "prefix"
    return RequestInfo(session or "anonymous", source, ids, num_tokens, max_tokens, stream)
