"""`kvpool status`: one Stats round trip to the master, shown as a rich table or JSON.

Talks to the master only (no data plane, no NIXL), so it is quick to start and safe to run anywhere.
"""

from __future__ import annotations

import argparse
import json
import sys

import msgspec
import zmq

from kvpool.core import protocol
from kvpool.core.errors import KVPoolError
from kvpool.rpc.zmq_channel import MasterChannel
from kvpool.rpc.credentials import resolve_credential


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Ask a kvpool master for its statistics and print them: the pool (capacity, used bytes, "
        "objects, hit rate, evictions, leases, fragmentation) and one row per storage node "
        "(state, capacity, used, objects, heartbeat age). Exits 1 when the master does not answer."
    )
    parser.add_argument(
        "--master",
        required=True,
        metavar="ADDR",
        help="the master's ZMQ endpoint, e.g. tcp://127.0.0.1:5555 (the 'address' in its ready file)",
    )
    parser.add_argument("--credential", default=None, metavar="FILE",
                        help="an admin credential (Stats covers every tenant); default: $KVPOOL_CREDENTIAL, else none "
                        "(enough for an --insecure master)")
    parser.add_argument("--json", action="store_true", help="print the raw stats as one JSON object instead of tables")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=3.0,
        metavar="S",
        help="give up when the master has not answered within S seconds (default: 3)",
    )


def _human_bytes(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.1f} TiB"


def _percent(part: float, whole: float) -> str:
    return "-" if whole <= 0 else f"{100 * part / whole:.1f} %"


def render(stats: protocol.StatsReply, master: str):
    """The tables as rich renderables (a function of the stats only, so it is testable)."""
    from rich.console import Group
    from rich.table import Table

    pool = Table(title=f"kvpool at {master}", show_header=False, title_justify="left")
    pool.add_column("what", style="bold")
    pool.add_column("value", justify="right")
    lookups = stats.hit_keys + stats.miss_keys
    rows = [
        ("nodes", f"{sum(n.state == 'alive' for n in stats.nodes)} alive / {len(stats.nodes)}"),
        ("capacity", _human_bytes(stats.capacity_bytes)),
        ("used", f"{_human_bytes(stats.used_bytes)} ({_percent(stats.used_bytes, stats.capacity_bytes)})"),
        ("objects", f"{stats.num_objects} ({stats.num_pending} pending)"),
        ("small values in the master", f"{stats.inline_values} ({_human_bytes(stats.inline_bytes)} of "
                                       f"{_human_bytes(stats.inline_capacity_bytes)}, "
                                       f"{stats.inline_evictions} evicted)"),
        ("puts", str(stats.puts)),
        ("gets (leased lookups)", str(stats.gets)),
        ("lookups", str(stats.lookups)),
        ("hit rate (keys)", f"{_percent(stats.hit_keys, lookups)} of {lookups}"),
        ("evictions", f"{stats.evictions} ({_human_bytes(stats.evicted_bytes)})"),
        ("leases granted / expired", f"{stats.lease_grants} / {stats.lease_expiries}"),
        ("fragmentation", f"{100 * stats.fragmentation:.1f} %"),
        ("refused: forbidden / rate limited / handshakes",
         f"{stats.forbidden} / {stats.rate_limited} / {stats.refused_handshakes}"),
    ]
    h = stats.hints
    if h is not None:
        rows += [
            ("eviction order", h.eviction_order),
            ("retained by TTL hints", f"{_human_bytes(h.retained_bytes)} in {h.retained_objects} objects "
                                      f"({h.retention_refused} refused past a tenant's share)"),
            ("hits kept by a TTL / by the order", f"{h.ttl_hits} / {max(0, stats.hit_keys - h.ttl_hits)}"),
            ("session turns arrived / done / ended", f"{h.turns_arrived} / {h.turns_done} / {h.sessions_ended}"),
        ]
    for what, value in rows:
        pool.add_row(what, value)

    nodes = Table(title="nodes", title_justify="left")
    for column, justify in (
        ("node", "left"),
        ("segment", "right"),
        ("host", "left"),
        ("state", "left"),
        ("capacity", "right"),
        ("used", "right"),
        ("objects", "right"),
        ("heartbeat age", "right"),
    ):
        nodes.add_column(column, justify=justify)
    for n in sorted(stats.nodes, key=lambda n: n.node_id):
        style = "green" if n.state == "alive" else "red"
        nodes.add_row(
            n.node_id,
            str(n.segment_id),
            n.host_id,
            f"[{style}]{n.state}[/{style}]",
            _human_bytes(n.capacity_bytes),
            f"{_human_bytes(n.used_bytes)} ({_percent(n.used_bytes, n.capacity_bytes)})",
            str(n.num_objects),
            f"{n.last_heartbeat_age_s:.1f} s",
        )
    parts = [pool, nodes]
    if stats.tenants:
        parts.append(_tenants_table(stats.tenants))
    if any(t.key_groups for t in stats.tenants):
        parts.append(_key_groups_table(stats.tenants))
    return Group(*parts)


def _key_groups_table(tenants: list[protocol.TenantStats]):
    """A hybrid model's KV-cache groups: one object per block, so a group's bytes per object are its
    bytes per block, and its objects against the full-attention group's show what its rule keeps
    (a sliding window: the blocks a hit needs; a Mamba group: one state per boundary)."""
    from rich.table import Table

    table = Table(title="KV-cache groups of hybrid models (keys g<N>-...)", title_justify="left")
    for column in ("tenant", "group", "objects", "used", "bytes per object", "share of tenant"):
        table.add_column(column, justify="left" if column in ("tenant", "group") else "right")
    for t in sorted(tenants, key=lambda t: t.tenant):
        for g in t.key_groups:
            table.add_row(t.tenant, g.group, str(g.num_objects), _human_bytes(g.used_bytes),
                          _human_bytes(g.used_bytes // max(g.num_objects, 1)), _percent(g.used_bytes, t.used_bytes))
    return table


def _tenants_table(tenants: list[protocol.TenantStats]):
    from rich.table import Table

    table = Table(title="tenants", title_justify="left")
    for column in ("tenant", "used", "quota", "objects", "object quota", "segments", "refusals", "quota evictions"):
        table.add_column(column, justify="left" if column == "tenant" else "right")
    for t in sorted(tenants, key=lambda t: t.tenant):
        table.add_row(t.tenant, _human_bytes(t.used_bytes), _human_bytes(t.max_bytes) if t.max_bytes else "-",
                      str(t.num_objects), str(t.max_objects) if t.max_objects else "-", str(t.num_segments),
                      str(t.quota_refusals), str(t.quota_evictions))
    return table


def run(args: argparse.Namespace) -> int:
    if args.timeout_s <= 0:
        print(f"--timeout-s must be > 0, got {args.timeout_s}", file=sys.stderr)
        return 2
    try:
        channel = MasterChannel(args.master, timeout_s=args.timeout_s, credential=resolve_credential(args.credential),
                                fallback_role="admin")
    except ValueError as e:
        print(f"kvpool status: {e}", file=sys.stderr)
        return 2
    try:
        reply = channel.call(protocol.Stats())
    except KVPoolError as e:
        print(f"kvpool status: {e}", file=sys.stderr)
        return 1
    except zmq.ZMQError as e:
        print(f"kvpool status: cannot connect to {args.master!r} ({e}); expected tcp://HOST:PORT", file=sys.stderr)
        return 2
    finally:
        channel.close()
    if not isinstance(reply, protocol.StatsReply):
        print(f"kvpool status: master answered Stats with {type(reply).__name__}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(msgspec.to_builtins(reply), indent=2))
        return 0
    from rich.console import Console

    Console().print(render(reply, args.master))
    return 0
