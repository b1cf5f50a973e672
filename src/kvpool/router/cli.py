"""`kvpool router`: serve the round-robin proxy until SIGTERM / Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from pathlib import Path

from aiohttp import web

from kvpool.router.app import ProxyConfig, RoundRobinProxy


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", action="append", required=True, metavar="URL",
                        help="base URL of a vLLM OpenAI server (repeat; requests go round-robin)")  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on; 0 = any free port (default 8000)")
    parser.add_argument("--request-timeout-s", type=float, default=3600.0, help="give up on a backend after this")
    parser.add_argument("--ready-file", type=Path, default=None,
                        help='write {"url", "port", "pid"} as JSON here once serving')  # fmt: skip


async def _serve(config: ProxyConfig, host: str, port: int, ready_file: Path | None) -> None:
    runner = web.AppRunner(RoundRobinProxy(config).app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # the OS-chosen port when port == 0
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"kvpool router on http://{host}:{bound} -> {', '.join(config.backends)}", flush=True)
    if ready_file is not None:
        tmp = ready_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"url": f"http://{host}:{bound}", "port": bound, "pid": os.getpid()}))
        tmp.replace(ready_file)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def run(args: argparse.Namespace) -> int:
    try:
        config = ProxyConfig(backends=tuple(args.backend), request_timeout_s=args.request_timeout_s)
    except ValueError as e:
        print(f"kvpool router: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(config, args.host, args.port, args.ready_file))
    except OSError as e:
        print(f"kvpool router: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    return 0
