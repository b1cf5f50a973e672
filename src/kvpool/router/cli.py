"""`kvpool router`: serve the router until SIGTERM / Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path

from aiohttp import web

from kvpool.router.app import Router
from kvpool.router.config import RouterConfig
from kvpool.router.policy import POLICY_NAMES, CostModel

POLICY_HELP = {
    "round_robin": "each request to the next healthy backend (the reference baseline)",
    "least_loaded": "fewest in-flight prompt + decode tokens",
    "session": "consistent hashing of the session id with bounded load: a session stays on one backend "
               "(its KV cache) unless that one carries 1.5x the mean load; adding a backend moves ~1/n sessions",
    "cache_aware": "lowest estimated time to first token: queue + pool tokens x load cost + the rest x prefill "
                   "cost (tokens in the backend's own cache are free); needs --kv-events, rates are measured",
}  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "An OpenAI-compatible router in front of vLLM servers: proxies /v1/completions, /v1/chat/completions "
        "(streams passed through), /v1/models; /health and /metrics are its own. Backends are health-checked "
        "(GET /health); a dead one leaves the rotation and returns when it answers again. A request that "
        "failed before any byte reached the client is retried on another backend; a stream cut later ends "
        "with an OpenAI error event. Sessions are identified by the x-session-id header (or the headers "
        "coding agents send), the `user` field, or a hash of the first prompt block. Policies: "
        + "; ".join(f"{k}: {v}" for k, v in POLICY_HELP.items())
        + ". P/D mode (--prefill URL ... --decode URL ..., instead of --backend): each completion is "
        "prefilled on a prefill instance chosen by --policy (max_tokens 1, kv_transfer_params asking for "
        "remote decode), then decoded on a decode instance (the session's own while healthy, else the "
        "least loaded) with the prefill's kv_transfer_params, and streamed back from there; the vLLM servers "
        "need a --kv-transfer-config whose connector hands KV over (e.g. NixlConnector). A failed prefill is "
        "retried on another prefill instance, a decode that fails before the first byte redoes the request. "
        "--kv-events then name the prefill instances' endpoints; every other path goes to a decode instance."
    )
    parser.set_defaults(_usage_error=parser.error)
    parser.add_argument("--backend", action="append", default=[], metavar="URL",
                        help="base URL of a vLLM OpenAI server (repeat for each); aggregated mode")  # fmt: skip
    parser.add_argument("--prefill", action="append", default=[], metavar="URL",
                        help="P/D mode: base URL of a vLLM server that prefills (repeat for each; needs --decode)")
    parser.add_argument("--decode", action="append", default=[], metavar="URL",
                        help="P/D mode: base URL of a vLLM server that decodes from the prefill's KV "
                             "(repeat for each; needs --prefill)")  # fmt: skip
    parser.add_argument("--policy", choices=POLICY_NAMES, default="round_robin", help="routing policy (default round_robin)")
    parser.add_argument("--kv-events", action="append", default=[], metavar="ZMQ_ENDPOINT",
                        help="where backend i publishes its KV events (vLLM --kv-events-config with "
                             '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:PORT"}); '
                             "repeat once per --backend (P/D mode: per --prefill), same order, "
                             "e.g. tcp://127.0.0.1:PORT")  # fmt: skip
    parser.add_argument("--no-session-hints", action="store_true",
                        help="with --pooled the router tells the pool, in each request's kv_transfer_params, the "
                             "request's session, its cache TTL (x-kvpool-ttl header or cache_control) and whether "
                             "its session ends (x-session-end header), for the pool's eviction; this turns that off")
    parser.add_argument("--session-ttl-s", type=float, default=0.0, metavar="S",
                        help="with session hints: the cache TTL of requests that name none (default 0: none); "
                             "the pool keeps what a TTL covers within each tenant's share")
    parser.add_argument("--pooled", action="store_true",
                        help="the backends share a kvpool pool (KVPoolConnector): a prefix one computed, any can load. "
                             "Without --master the router estimates what the pool holds from what the backends "
                             "stored (it cannot see the pool's evictions)")
    parser.add_argument("--master", default="", metavar="tcp://HOST:PORT",
                        help="with --pooled: the pool's master; the router follows its stored/removed events and "
                             "knows exactly which prompt prefixes the pool holds (needs --kv-events)")
    parser.add_argument("--pool-object-blocks", type=int, default=1, metavar="N",
                        help="vLLM blocks per pool object, as the connector stores them (default 1)")
    parser.add_argument("--pool-namespace", default="", metavar="NAMESPACE",
                        help="follow only this pool namespace (the connector's; default: every namespace)")
    parser.add_argument("--tokenizer", default="", metavar="MODEL",
                        help="the served model's tokenizer (a local directory or a cached hub id): text and chat "
                             "prompts are tokenized as vLLM does (chat template included), so they are sized exactly "
                             "and matched against the caches; without it they are sized at 4 characters a token "
                             "and routed with no prefix match")
    parser.add_argument("--prefill-s-per-token", type=float, default=None,
                        help="prior for the recompute cost until measured (default 1e-3)")
    parser.add_argument("--pool-load-s-per-token", type=float, default=None,
                        help="prior for the pool load cost until measured (default 1e-4)")
    parser.add_argument("--no-observed-wait", action="store_true",
                        help="cache_aware: estimate a backend's queue from the tokens in flight only, not also from "
                             "how long its oldest request has waited for a first token")
    parser.add_argument("--max-waiting", type=int, default=0, metavar="N",
                        help="late binding: hold a streamed completion at the router while every backend has N requests "
                             "still without a first token, and route it when one has room (default 0: off)")
    parser.add_argument("--max-attempts", type=int, default=3,
                        help="tries per request, on different backends (P/D mode: prefills sent) (default 3)")
    parser.add_argument("--health-interval-s", type=float, default=1.0, help="seconds between health checks (default 1)")
    parser.add_argument("--health-timeout-s", type=float, default=2.0,
                        help="a health check unanswered this long counts as failed; two in a row take a backend out "
                             "(default 2; raise it on machines where busy servers answer slowly)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on; 0 = any free port (default 8000)")
    parser.add_argument("--request-timeout-s", type=float, default=3600.0, help="give up on a backend after this")
    parser.add_argument("--access-log", type=Path, default=None,
                        help="append one line per request here (default: standard error)")
    parser.add_argument("--quiet", action="store_true", help="no access log")
    parser.add_argument("--ready-file", type=Path, default=None,
                        help='write {"url", "port", "pid"} as JSON here once serving')  # fmt: skip


async def _serve(router: Router, host: str, port: int, ready_file: Path | None) -> None:
    runner = web.AppRunner(router.app(), access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # the OS-chosen port when port == 0
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    config = router.config
    to = (f"prefill {', '.join(config.prefill)}; decode {', '.join(config.decode)}" if config.disaggregated
          else ", ".join(config.backends))  # fmt: skip
    print(f"kvpool router ({config.policy}) on http://{host}:{bound} -> {to}", flush=True)
    if ready_file is not None:
        tmp = ready_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"url": f"http://{host}:{bound}", "port": bound, "pid": os.getpid()}))
        tmp.replace(ready_file)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def _setup_logging(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    access = logging.getLogger("kvpool.router.access")
    access.propagate = False
    if args.quiet:
        access.disabled = True
        return
    handler = logging.FileHandler(args.access_log) if args.access_log else logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    access.addHandler(handler)
    access.setLevel(logging.INFO)


def mode_error(backend: list[str], prefill: list[str], decode: list[str]) -> str | None:
    """Why the URLs given name no mode (aggregated: --backend; P/D: --prefill and --decode), or None."""
    if backend and (prefill or decode):
        return "give either --backend URLs (aggregated) or --prefill and --decode URLs (P/D mode), not both"
    if prefill and not decode:
        return "--prefill needs at least one --decode URL (P/D mode: the prefill's KV is decoded there)"
    if decode and not prefill:
        return "--decode needs at least one --prefill URL (P/D mode: the decode continues a prefill)"
    if not backend and not prefill:
        return "give at least one --backend URL, or --prefill and --decode URLs (P/D mode)"
    return None


def run(args: argparse.Namespace) -> int:
    error = mode_error(args.backend, args.prefill, args.decode)
    if error is not None:
        usage_error = getattr(args, "_usage_error", None)
        if usage_error is not None:
            usage_error(error)  # argparse's usage and message; exits 2
        print(f"kvpool router: {error}", file=sys.stderr)
        return 2
    try:
        prior = CostModel(
            prefill_s_per_token=args.prefill_s_per_token if args.prefill_s_per_token is not None else 1e-3,
            pool_load_s_per_token=args.pool_load_s_per_token if args.pool_load_s_per_token is not None else 1e-4,
            decode_s_per_token=1e-4,
        )
        config = RouterConfig(backends=tuple(args.backend), prefill=tuple(args.prefill), decode=tuple(args.decode),
                              policy=args.policy, kv_events=tuple(args.kv_events),
                              pooled=args.pooled, master=args.master, pool_object_blocks=args.pool_object_blocks,
                              pool_namespace=args.pool_namespace, tokenizer=args.tokenizer,
                              request_timeout_s=args.request_timeout_s,
                              health_interval_s=args.health_interval_s, health_timeout_s=args.health_timeout_s, max_attempts=args.max_attempts,
                              prior_costs=prior, observed_wait=not args.no_observed_wait,
                              max_waiting=args.max_waiting, session_hints=args.pooled and not args.no_session_hints,
                              session_ttl_s=args.session_ttl_s)  # fmt: skip
    except ValueError as e:
        print(f"kvpool router: {e}", file=sys.stderr)
        return 2
    _setup_logging(args)
    try:
        router = Router(config)
    except ValueError as e:  # a tokenizer that does not load
        print(f"kvpool router: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(router, args.host, args.port, args.ready_file))
    except OSError as e:
        print(f"kvpool router: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    return 0
