"""`kvpool connector-config`: print the `--kv-transfer-config` JSON that makes a vLLM server use the pool."""

from __future__ import annotations

import argparse
import json

from kvpool.core.transfer_config import pool_transfer_config, pd_transfer_config

EPILOG = """examples:
  vllm serve MODEL --kv-transfer-config "$(kvpool connector-config --master tcp://10.0.0.5:7400)"
  # prefill/decode disaggregation: the same config on prefill and decode instances, each with its
  # own VLLM_NIXL_SIDE_CHANNEL_PORT; put `kvpool router --prefill URL --decode URL` in front
  vllm serve MODEL --kv-transfer-config "$(kvpool connector-config --pd --master tcp://10.0.0.5:7400)"
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("--master", default=None, metavar="tcp://HOST:PORT",
                        help="the pool master's address (required unless --pd --no-pool)")
    parser.add_argument("--pd", action="store_true",
                        help="prefill/decode disaggregation: MultiConnector(NixlConnector, KVPoolConnector)")
    parser.add_argument("--no-pool", action="store_true", help="with --pd: NixlConnector alone (P/D without the pool)")
    parser.add_argument("--nixl-buffer-device", default="cpu",
                        help="NixlConnector's kv_buffer_device (default cpu, what the CPU build needs; "
                             "'' leaves vLLM's default)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                        help="another key of the pool connector's extra config, e.g. --set num_replicas=2 "
                             "(see docs/connector.md); the value is JSON, or a plain string")


def _extra(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--set wants KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def run(args: argparse.Namespace) -> int:
    import sys

    try:
        if args.no_pool and not args.pd:
            raise ValueError("--no-pool only makes sense with --pd")
        pool = None if args.no_pool else {"master_address": args.master, **_extra(args.set)}
        if args.pd:
            config = pd_transfer_config(pool, nixl_buffer_device=args.nixl_buffer_device or None)
        else:
            config = pool_transfer_config(pool)
    except ValueError as e:
        print(f"kvpool connector-config: {e}", file=sys.stderr)
        return 2
    print(json.dumps(config))
    return 0
