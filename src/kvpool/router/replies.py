"""What the router says itself, and how it reads a backend's silence: OpenAI-style error bodies
and stream error events, the headers never forwarded, the errors and statuses that mean "try
another backend".

Rules:
- Every error the router answers is `{"error": {"message", "type", "code"}}`, as OpenAI clients
  parse it; the message names the backend and what to check.
- A send error (refused, reset, timeout) or 502/503/504 before any byte reached the client is the
  backend's failure, not the request's: the caller may try again elsewhere.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade"}
RETRY_STATUSES = {502, 503, 504}
SEND_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


def error_response(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


async def write_stream_error(response: web.StreamResponse, backend: str, e: BaseException) -> None:
    """End a cut SSE stream the way OpenAI clients understand: an error event, then [DONE]."""
    event = {"error": {"message": f"backend {backend} failed mid-stream: {type(e).__name__}: {e}",
                       "type": "backend_error", "code": 502}}  # fmt: skip
    try:
        await response.write(b"\n\ndata: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n")  # ends a cut event first
        await response.write_eof()
    except (ConnectionResetError, aiohttp.ClientConnectionResetError, RuntimeError):
        pass  # the client is gone too
