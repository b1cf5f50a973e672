"""The `kvpool` command. Parses arguments and hands them to a component's own `cli` module.

Each subcommand lives in `kvpool.<component>.cli` (or another module named below) exposing
`add_arguments(parser)` and `run(args) -> int`. Modules are imported lazily so `kvpool master`
never pays for importing vLLM or NIXL.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "master": ("kvpool.master.cli", "run the metadata master (allocation, eviction, leases, health)"),
    "node": ("kvpool.node.cli", "run a storage node contributing DRAM to the pool"),
    "auth": ("kvpool.master.auth_cli", "make the master's CURVE keys and the identities it trusts (nodes, tenants, admin)"),
    "status": ("kvpool.client.status_cli", "show the pool: nodes, capacity, objects, hit rate, evictions"),
    "trace": ("kvpool.workload.cli", "read, synthesize and analyze agentic traces"),
    "bench": ("kvpool.bench.cli", "benchmarks: replay traces against endpoints, store benchmarks"),
    "demo": ("kvpool.bench.demo_cli", "the end-to-end demo: two vLLM servers, with and without the pool"),
    "router": ("kvpool.router.cli", "an OpenAI-compatible router in front of several vLLM servers"),
    "connector-config": ("kvpool.core.transfer_config_cli",
                         "print the --kv-transfer-config JSON for a vLLM server using the pool (aggregated or P/D)"),
    "sim": ("kvpool.sim.cli", "simulate a serving fleet on a trace: with/without the pool, routing policies"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpool",
        description="kvpool: a shared, distributed KV-cache pool for LLM serving fleets.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=help_text, add_help=False)
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
            p.set_defaults(_unavailable=f"`kvpool {name}` is not built yet")
            continue
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(only=command if command in SUBCOMMANDS else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "_unavailable", None):
        print(args._unavailable, file=sys.stderr)
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
