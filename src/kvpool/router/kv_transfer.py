"""The request bodies of a prefill/decode handoff, as vLLM's KV connectors (NixlConnector and the
like) expect them through `kv_transfer_params`. Pure: no I/O.

Rules:
- The prefill request is the client's body asking for remote decode: `kv_transfer_params` with
  `do_remote_decode` true and the remote fields null, one output token (`max_tokens`, and
  `max_completion_tokens` where the client used that key), no stream, no `stream_options`, no
  `min_tokens` (a minimum above one would be refused next to a maximum of one).
- Its response's top-level `kv_transfer_params` (an object: the prefill engine's id, block ids,
  host and port) is all the decode needs; it is passed on unchanged, never read.
- The decode request is the client's body as sent (its stream, its max_tokens) plus those params.
- The client's body is never changed in place.
"""

from __future__ import annotations

from kvpool.router.hints import keep_hint

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")

REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip


class NoTransferParams(ValueError):
    """A prefill instance answered without `kv_transfer_params`: it is not set up for P/D."""


def prefill_body(body: dict) -> dict:
    prefill = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    prefill["kv_transfer_params"] = keep_hint(body, dict(REMOTE_DECODE))
    prefill["max_tokens"] = 1
    if "max_completion_tokens" in body:
        prefill["max_completion_tokens"] = 1
    prefill["stream"] = False
    return prefill


def transfer_params(response: object) -> dict:
    """The `kv_transfer_params` of a prefill's JSON response; NoTransferParams when there are none."""
    params = response.get("kv_transfer_params") if isinstance(response, dict) else None
    if not isinstance(params, dict):
        got = "not a JSON object" if not isinstance(response, dict) else \
            f"kv_transfer_params {params!r}" if "kv_transfer_params" in response else "no kv_transfer_params"  # fmt: skip
        raise NoTransferParams(got)
    return params


def decode_body(body: dict, params: dict) -> dict:
    return {**body, "kv_transfer_params": keep_hint(body, params)}
