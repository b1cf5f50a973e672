"""Trace readers: Claude Code JSON and Mooncake FAST'25 JSONL into the session model; format detection.

Rules:
- Parsers (`parse_*`) are pure: they take decoded JSON and return sessions. Only `load_trace` and
  `detect_format` read files.
- Block ids are copied unchanged; which ids share a namespace is said by `Session.id_scope`, so
  the unbounded-cache math stays right: a Claude Code file's parent and subagents share one scope
  (their ids are local to the file: two Explore subagents re-use the same tool-prompt ids), and
  every request of a Mooncake trace shares one scope (its ids are global).
- A prompt is full blocks plus a tail (`0 <= tail < block_size`). Claude Code already lists one id per
  full 64-token block. Mooncake lists ceil(input/512) ids, the last for a partial block; that id is
  dropped and its tokens become the tail, because a partial block is never a cacheable unit.
- Mooncake has no session ids. Each request becomes a one-turn session starting at its timestamp,
  rather than grouping requests into guessed conversations: grouping by shared prefix would invent
  think times and client boundaries the trace does not record, while the one-turn form loses nothing
  (cross-request reuse is still counted through the shared scope).
- Bad input raises TraceFormatError naming the file, the record and what is wrong.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import msgspec

from kvpool.workload.errors import TraceFormatError
from kvpool.workload.model import Session, Turn, read_sessions

FORMATS = ("claude-code", "mooncake", "vllm-multiturn", "kvpool")
MOONCAKE_BLOCK_SIZE = 512


def _int_field(record: dict, key: str, where: str, minimum: int = 0) -> int:
    value = record.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise TraceFormatError(f"{where}: `{key}` must be an integer >= {minimum}, got {value!r}")
    return value


def _float_field(record: dict, key: str, where: str, default: float = 0.0) -> float:
    value = record.get(key, default)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
        raise TraceFormatError(f"{where}: `{key}` must be a number >= 0, got {value!r}")
    return float(value)


def _id_list(record: dict, key: str, where: str) -> list[int]:
    ids = record.get(key)
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise TraceFormatError(f"{where}: `{key}` must be a list of integers")
    return ids


# ---------------------------------------------------------------- Claude Code (kv-cache-tester)


def _claude_turn(request: dict, block_size: int, where: str) -> Turn:
    input_tokens = _int_field(request, "in", where)
    block_ids = _id_list(request, "hash_ids", where)
    tail_tokens = input_tokens - len(block_ids) * block_size
    if not 0 <= tail_tokens < block_size:
        raise TraceFormatError(
            f"{where}: in={input_tokens} tokens does not fit {len(block_ids)} hash_ids of "
            f"{block_size}-token blocks (expected len(hash_ids) == in // {block_size})"
        )
    return Turn(
        block_ids=block_ids,
        tail_tokens=tail_tokens,
        output_tokens=_int_field(request, "out", where),
        start_offset_s=_float_field(request, "t", where),
        think_time_s=_float_field(request, "think_time", where),
    )


def parse_claude_code(doc: object, name: str, label: str | None = None) -> list[Session]:
    """One Claude Code trace (a decoded JSON object) -> the parent session, then one per subagent.
    `name` names the sessions when the trace has no id; `label` (default: name) starts error messages."""
    label = label or name
    if not isinstance(doc, dict) or not isinstance(doc.get("requests"), list):
        raise TraceFormatError(f"{label}: a Claude Code trace is an object with a `requests` list")
    block_size = _int_field(doc, "block_size", label, minimum=1)
    trace_id = str(doc.get("id") or name)
    scope = f"claude-code:{trace_id}"
    sessions: list[Session] = []

    def walk(requests: list, session_id: str, parent: str | None, offset_s: float) -> None:
        turns: list[Turn] = []
        children: list[tuple[str, list, float]] = []
        for index, request in enumerate(requests):
            where = f"{label}: {session_id} request {index}"
            if not isinstance(request, dict):
                raise TraceFormatError(f"{where}: must be an object")
            if isinstance(request.get("requests"), list):  # a subagent with its own conversation
                agent = str(request.get("agent_id") or f"subagent-{len(children) + 1}")
                start_s = offset_s + _float_field(request, "t", where)
                children.append((f"{session_id}/{agent}", request["requests"], start_s))
            else:
                turns.append(_claude_turn(request, block_size, where))
        if turns:
            sessions.append(
                Session(
                    session_id=session_id,
                    block_size=block_size,
                    turns=turns,
                    source="claude-code",
                    parent_session_id=parent,
                    id_scope=scope,
                    trace_offset_s=offset_s,
                )
            )
        for child_id, child_requests, start_s in children:
            walk(child_requests, child_id, session_id, start_s)

    walk(doc["requests"], trace_id, None, 0.0)
    return sessions


# ---------------------------------------------------------------- Mooncake FAST'25


def parse_mooncake(records: Iterable[object], name: str, label: str | None = None) -> list[Session]:
    """Mooncake request records (decoded JSON lines) -> one one-turn session per request."""
    label = label or name
    sessions: list[Session] = []
    scope = f"mooncake:{name}"
    for index, record in enumerate(records):
        where = f"{label}: request {index}"
        if not isinstance(record, dict):
            raise TraceFormatError(f"{where}: must be an object")
        input_tokens = _int_field(record, "input_length", where)
        ids = _id_list(record, "hash_ids", where)
        expected = -(-input_tokens // MOONCAKE_BLOCK_SIZE)
        if len(ids) != expected:
            raise TraceFormatError(
                f"{where}: input_length={input_tokens} needs ceil(input/{MOONCAKE_BLOCK_SIZE})="
                f"{expected} hash_ids, got {len(ids)}"
            )
        num_full = input_tokens // MOONCAKE_BLOCK_SIZE
        turn = Turn(
            block_ids=ids[:num_full],
            tail_tokens=input_tokens - num_full * MOONCAKE_BLOCK_SIZE,
            output_tokens=_int_field(record, "output_length", where),
        )
        sessions.append(
            Session(
                session_id=f"{name}/{index:06d}",
                block_size=MOONCAKE_BLOCK_SIZE,
                turns=[turn],
                source="mooncake",
                id_scope=scope,
                trace_offset_s=_float_field(record, "timestamp", where) / 1000.0,
            )
        )
    return sessions


# ---------------------------------------------------------------- detection and loading


def _first_line(path: Path) -> bytes:
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                return line.strip()
    raise TraceFormatError(f"{path}: the file is empty")


def detect_format(path: Path | str) -> str:
    """Guess a file's format from its first record (see FORMATS)."""
    path = Path(path)
    line = _first_line(path)
    if line.startswith(b"["):
        return "vllm-multiturn"
    try:
        first = msgspec.json.decode(line)
    except msgspec.DecodeError:
        first = msgspec.json.decode(path.read_bytes()) if line == b"{" else None
    if isinstance(first, dict):
        if "requests" in first and "block_size" in first:
            return "claude-code"
        if "hash_ids" in first and "input_length" in first:
            return "mooncake"
        if "session_id" in first and "turns" in first:
            return "kvpool"
        if "filetype" in first:
            raise TraceFormatError(
                f"{path}: a vLLM multi-turn generator config, not conversations; "
                "use `kvpool trace synth` or run vLLM's generator and convert its output"
            )
    raise TraceFormatError(
        f"{path}: cannot tell the format; pass --format ({', '.join(FORMATS)})"
    )


def _decode_file(path: Path) -> object:
    try:
        return msgspec.json.decode(path.read_bytes())
    except msgspec.DecodeError as e:
        raise TraceFormatError(f"{path}: not valid JSON: {e}") from None


def _decode_lines(path: Path) -> list[object]:
    records = []
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(msgspec.json.decode(line))
            except msgspec.DecodeError as e:
                raise TraceFormatError(f"{path}:{line_no}: not valid JSON: {e}") from None
    return records


def load_trace(
    path: Path | str,
    fmt: str = "auto",
    *,
    block_size: int = 64,
    chars_per_token: float = 4.0,
) -> list[Session]:
    """Read one trace file into sessions. `block_size` and `chars_per_token` apply to
    vllm-multiturn only (the other formats carry their block size)."""
    path = Path(path)
    if fmt == "auto":
        fmt = detect_format(path)
    if fmt not in FORMATS:
        raise TraceFormatError(f"unknown trace format {fmt!r}; choose one of {', '.join(FORMATS)}")
    name = path.stem
    if fmt == "claude-code":
        return parse_claude_code(_decode_file(path), name, str(path))
    if fmt == "mooncake":
        return parse_mooncake(_decode_lines(path), name, str(path))
    if fmt == "vllm-multiturn":
        from kvpool.workload.multiturn import MultiturnConfig, parse_vllm_multiturn

        config = MultiturnConfig(block_size=block_size, chars_per_token=chars_per_token)
        return parse_vllm_multiturn(_decode_file(path), name, config, str(path))
    try:
        return read_sessions(path)
    except ValueError as e:
        raise TraceFormatError(str(e)) from None


def expand_inputs(paths: Iterable[Path | str]) -> list[Path]:
    """Files as given; a directory stands for its *.json and *.jsonl files, sorted."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(q for q in p.iterdir() if q.suffix in (".json", ".jsonl") and q.is_file())
            if not found:
                raise TraceFormatError(f"{p}: no .json or .jsonl files in this directory")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise TraceFormatError(f"{p}: no such file or directory")
    return files
