"""`kvpool master`: parse options, build MasterConfig, serve until SIGTERM / Ctrl-C."""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import sys
import tomllib
from pathlib import Path

from kvpool.core.protocol import MAX_MESSAGE_BYTES
from kvpool.core.sizes import parse_size
from kvpool.master.config import MasterConfig
from kvpool.master.quotas import QuotaTable, parse_quota, quota_table_from_toml

_D = MasterConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.description = (
        "Run the kvpool metadata master: it tracks mounted segments and objects, allocates space for "
        "puts, answers prefix lookups with read leases, evicts LRU chain tails above the high "
        "watermark and unmounts nodes that stop heartbeating. It holds metadata only; bytes move "
        "directly between clients and nodes. Restarting it keeps the cache: nodes announce what they hold to "
        "the new incarnation. With --ha, masters elect a leader through etcd (standbys hold nothing); without it, "
        "a standby is another master started with the same options (never two at once): "
        "nodes and clients given both addresses (comma-separated) move to it when the first stops answering."
    )
    parser.add_argument("--host", default=_D.host, help="interface to bind the ZMQ control socket and metrics endpoint to")
    parser.add_argument("--port", type=int, default=_D.port, help="ZMQ control port; 0 lets the OS choose")
    parser.add_argument(
        "--metrics-port", type=int, default=None,
        help="serve Prometheus metrics on this port (0: the OS chooses, reported in the ready file); omit for none",
    )
    parser.add_argument("--high-watermark", type=float, default=_D.high_watermark,
                        help="fraction of capacity in use above which eviction starts (the put that crosses it "
                             "evicts back under it; default %(default)s)")
    parser.add_argument("--low-watermark", type=float, default=_D.low_watermark,
                        help="eviction then frees space down to this fraction of capacity, in 1 MiB slices while "
                             "the master has no request waiting (default %(default)s)")
    parser.add_argument("--eviction-order", choices=("lru", "session"), default=_D.eviction_order,
                        help="which eviction candidates go first: lru (chain tails used longest ago) or session "
                             "(tails of the agent session predicted to come back last, from the session hints "
                             "the connector sends; blocks of no session stay LRU). Default %(default)s")
    parser.add_argument("--max-retained-fraction", type=float, default=_D.max_retained_fraction,
                        help="TTL hints (a request's cache TTL) keep objects from eviction up to this share of the "
                             "pool's DRAM per tenant; a tenant with a quota keeps up to its quota (default "
                             "%(default)s; 0: ignore TTLs)")
    parser.add_argument("--lease-ttl-s", type=float, default=_D.lease_ttl_s,
                        help="seconds a read lease from a lookup lasts; a read finishing later is discarded by the client")
    parser.add_argument("--max-lease-hold-s", type=float, default=_D.max_lease_hold_s,
                        help="an object leased without a break for this long takes no new lease once eviction "
                        "wants its space, so lookups can never keep it from eviction for ever")
    parser.add_argument("--node-ttl-s", type=float, default=_D.node_ttl_s,
                        help="a segment whose node has not heartbeated for this long is unmounted and its objects dropped")
    parser.add_argument("--heartbeat-interval-s", type=float, default=_D.heartbeat_interval_s,
                        help="how often nodes are told to heartbeat (must be below --node-ttl-s)")
    parser.add_argument("--put-timeout-s", type=float, default=_D.put_timeout_s,
                        help="a put started but never ended within this is reclaimed (its writer died)")
    parser.add_argument("--ahead-timeout-s", type=float, default=_D.ahead_timeout_s,
                        help="an allocation a client holds for its next plain put and does not use within this "
                        "(or --put-timeout-s, if shorter) is reclaimed")
    parser.add_argument("--quarantine-max-s", type=float, default=_D.quarantine_max_s,
                        help="space of a write that timed out and may still land is held until its writer says it "
                        "ended, or this long at most")
    parser.add_argument("--recovery-timeout-s", type=float, default=_D.recovery_timeout_s,
                        help="a remounted node's segment takes new objects after this long even if its announcement "
                        "of what it holds did not finish")
    parser.add_argument("--confirm-timeout-s", type=float, default=_D.confirm_timeout_s,
                        help="a put is answered once its objects are in their nodes' directories (so a master crash "
                        "right after loses none); a node slower than this gets the answer sent anyway. 0: answer at "
                        "once (the last commits may then be lost to a crash)")
    parser.add_argument("--max-promotions-per-lookup", type=int, default=_D.max_promotions_per_lookup,
                        help="a lookup that reaches objects held only on a node's disk tier starts copying up to this "
                        "many of them back to DRAM (the reader looks up again a moment later and hits them)")
    parser.add_argument("--rate-limit-keys-per-s", type=float, default=_D.rate_limit_keys_per_s,
                        help="per identity: keys its lookups, puts, existence checks and removals may name per second; "
                        "above it calls are refused (rate_limited) until its budget refills, so one flooding client "
                        "cannot crowd out the others")
    parser.add_argument("--rate-limit-burst-keys", type=float, default=_D.rate_limit_burst_keys,
                        help="keys an identity may name at once after a quiet spell (also the largest single call)")
    parser.add_argument("--alignment-bytes", type=int, default=_D.alignment_bytes,
                        help="object offsets inside segments are multiples of this (a power of two)")
    parser.add_argument("--max-message-bytes", type=int, default=MAX_MESSAGE_BYTES,
                        help="control messages larger than this are answered with a protocol error")
    parser.add_argument("--inline-capacity", type=parse_size, default=_D.inline_capacity_bytes, metavar="SIZE",
                        help="memory the master keeps for small plain values (`client.put` of a value without a "
                        "parent, up to --max-inline): each is stored and read in one round trip instead of going "
                        "through a node; least recently used ones are evicted, a restart loses them; 0 turns it off "
                        "(default %(default)s bytes)")
    parser.add_argument("--max-inline", type=parse_size, default=_D.max_inline_bytes, metavar="SIZE",
                        help="the largest plain value kept in the master (larger ones go to a node) "
                        "(default %(default)s bytes)")
    secure = parser.add_mutually_exclusive_group()
    secure.add_argument("--auth", type=Path, default=None, metavar="DIR",
                        help="CURVE authentication with the keys and identities in DIR (`kvpool auth init DIR`). "
                        "Without --auth or --insecure the master uses $KVPOOL_AUTH_DIR or ~/.config/kvpool/auth, "
                        "creating it with admin.cred, node.cred and tenant-default.cred on first start")
    secure.add_argument("--insecure", action="store_true",
                        help="no authentication: any client may read and write every tenant's objects "
                        "(a single-user machine or a test)")
    parser.add_argument("--quota", action="append", default=[], metavar="TENANT=BYTES[:OBJECTS]",
                        help="a tenant's quota of pool DRAM (object bytes x replicas) and objects, e.g. alice=64MiB:10000 "
                        "(BYTES or OBJECTS 'none': no limit; TENANT '*': every tenant not listed). A tenant at its "
                        "quota evicts its own least recently used objects, never another tenant's; when they do "
                        "not make room its put fails with a CapacityError naming the quota. Repeatable; overrides "
                        "--quota-file")
    parser.add_argument("--quota-file", type=Path, default=None, metavar="PATH",
                        help="quotas as TOML: [default] and [tenants.NAME] tables with max_bytes (a size such as "
                        '"64MiB", or bytes) and/or max_objects, and dedicated = true (as --dedicated-tenant); '
                        "tenants in neither have no quota")
    parser.add_argument("--dedicated-tenant", action="append", default=[], metavar="NAME",
                        help="NAME's objects go only to segments of nodes started with --tenant NAME, from this "
                        "master's start on (without it, from when the first such node mounts: puts before that, "
                        "e.g. right after a restart, would land on shared segments). Repeatable")
    ha = parser.add_argument_group("high availability (masters elect a leader through etcd)")
    ha.add_argument("--ha", default=None, metavar="etcd://HOST:PORT[,HOST:PORT...]",
                    help="campaign for leadership on these etcd endpoints: the leader serves, the others stand by "
                    "holding nothing and take over when its lease lapses (then nodes announce the cache to the new "
                    "leader). Nodes, clients and routers then name the pool as etcd://HOST:PORT[,...]/NAME")
    ha.add_argument("--ha-name", default="kvpool", metavar="NAME",
                    help="the pool's name in etcd: masters of one pool share it")
    ha.add_argument("--ha-ttl-s", type=int, default=5, metavar="SECONDS",
                    help="the leader's etcd lease: a dead or cut-off leader is replaced within about this plus 2 s, "
                    "and stops answering before it can have lapsed")
    ha.add_argument("--advertise-host", default=None, metavar="HOST",
                    help="the host others reach this master at, written to etcd when it leads (default: --host, "
                    "or this machine's name when --host is 0.0.0.0)")
    parser.add_argument("--ready-file", type=Path, default=None,
                        help='once serving, write {"address", "metrics_port", "pid"} as JSON to this file (with --ha: '
                        '{"state": "standby", "pid"} while standing by)')
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="logging verbosity")


def _auth_dir(explicit: Path | None) -> str:
    """The auth directory to serve with: --auth DIR (must be initialised), else the default one,
    created with a first set of credentials if it does not exist yet."""
    from kvpool.rpc.credentials import ROLE_ADMIN, ROLE_NODE, AuthDir, default_auth_dir

    if explicit is not None:
        AuthDir(explicit).master_keys()  # ValueError naming what is missing
        return str(explicit)
    auth = AuthDir(default_auth_dir())
    for path in auth.init((ROLE_ADMIN, ROLE_NODE, "tenant:default")):
        print(f"kvpool master: wrote {path}", file=sys.stderr)
    print(f"kvpool master: CURVE authentication with {auth.path}; nodes: --credential {auth.path}/node.cred, "
          f"clients: KVPOOL_CREDENTIAL={auth.path}/tenant-default.cred, status: --credential {auth.path}/admin.cred "
          "(or start with --insecure)", file=sys.stderr)
    return str(auth.path)


def quota_table(quota_file: Path | None, quotas: list[str], dedicated: list[str] = ()) -> QuotaTable:
    """The quotas of --quota-file (TOML, read here at the edge) with the --quota and
    --dedicated-tenant flags over them."""
    table = QuotaTable()
    if quota_file is not None:
        try:
            data = tomllib.loads(quota_file.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ValueError(f"--quota-file {quota_file}: {e}") from None
        try:
            table = quota_table_from_toml(data)
        except ValueError as e:
            raise ValueError(f"--quota-file {quota_file}: {e}") from None
    return table.updated([parse_quota(text) for text in quotas], dedicated)


_M_TRIM_THRESHOLD = -1  # glibc mallopt parameter


def keep_freed_memory(size_bytes: int) -> None:
    """Let glibc keep up to `size_bytes` of freed heap instead of handing it back to the kernel:
    small values the master keeps inline come and go, and memory given back has to be faulted in
    again page by page on the next put (64 KiB puts, one host: 165 -> 107 us; the first pass, on
    fresh memory, stays at ~155). No-op off glibc."""
    try:
        ctypes.CDLL(None).mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(min(size_bytes, 2**31 - 1)))
    except (AttributeError, OSError):
        pass


def run(args: argparse.Namespace) -> int:
    from kvpool.master.service import MasterService  # zmq only when actually serving

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        auth_dir = None if args.insecure else _auth_dir(args.auth)
        config = MasterConfig(
            auth_dir=auth_dir,
            host=args.host,
            port=args.port,
            metrics_port=args.metrics_port,
            high_watermark=args.high_watermark,
            low_watermark=args.low_watermark,
            eviction_order=args.eviction_order,
            max_retained_fraction=args.max_retained_fraction,
            lease_ttl_s=args.lease_ttl_s,
            max_lease_hold_s=args.max_lease_hold_s,
            node_ttl_s=args.node_ttl_s,
            heartbeat_interval_s=args.heartbeat_interval_s,
            put_timeout_s=args.put_timeout_s,
            ahead_timeout_s=args.ahead_timeout_s,
            quarantine_max_s=args.quarantine_max_s,
            recovery_timeout_s=args.recovery_timeout_s,
            confirm_timeout_s=args.confirm_timeout_s,
            alignment_bytes=args.alignment_bytes,
            max_promotions_per_lookup=args.max_promotions_per_lookup,
            max_message_bytes=args.max_message_bytes,
            rate_limit_keys_per_s=args.rate_limit_keys_per_s,
            rate_limit_burst_keys=args.rate_limit_burst_keys,
            inline_capacity_bytes=args.inline_capacity,
            max_inline_bytes=args.max_inline,
            quotas=quota_table(args.quota_file, args.quota, args.dedicated_tenant),
        )
    except ValueError as e:
        print(f"kvpool master: {e}")
        return 2
    if config.inline_capacity_bytes:
        keep_freed_memory(max(config.inline_capacity_bytes, 128 << 10))
    if args.insecure:
        print("kvpool master: --insecure: no authentication, every client may read and write every tenant",
              file=sys.stderr)
    leadership = None
    epoch = None
    if args.ha:
        try:
            leadership, config = _campaign(args, config)
        except ValueError as e:
            print(f"kvpool master: {e}")
            return 2
        if leadership is None:
            return 0  # stopped while standing by
        epoch = leadership.epoch
    service = MasterService(config, epoch=epoch, fence=leadership)
    address = service.bind()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: service.request_stop())
    if leadership is not None:
        leadership.keep(on_lost=service.request_stop)
    logging.getLogger("kvpool.master").info("serving on %s, metrics port %s", address, service.metrics_port)
    _write_ready(args.ready_file, {"state": "leader" if leadership else "serving", "address": address,
                                   "metrics_port": service.metrics_port, "pid": os.getpid(),
                                   "auth_dir": config.auth_dir, "epoch": service.core.epoch})
    service.serve_forever(owns_process=True)
    if leadership is not None:
        if service.fenced or leadership.lost.is_set():
            logging.getLogger("kvpool.master").error("stopped: no longer the leader (exit %d: start again to stand by)",
                                                     EXIT_LOST_LEADERSHIP)
            return EXIT_LOST_LEADERSHIP
        leadership.resign()
    logging.getLogger("kvpool.master").info("stopped")
    return 0


EXIT_LOST_LEADERSHIP = 75  # EX_TEMPFAIL: a supervisor should start it again (it then stands by)


def _write_ready(path: Path | None, info: dict) -> None:
    if path is not None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(info))
        tmp.replace(path)


def _campaign(args: argparse.Namespace, config: MasterConfig):
    """Stand by until this master leads: (Leadership, config with its port fixed), or (None, config)
    when SIGTERM came first. ValueError for a malformed --ha."""
    import dataclasses
    import socket
    import threading

    from kvpool.master.leadership import Leadership
    from kvpool.rpc.leader import LeaderRecord, parse_etcd_address

    etcd = parse_etcd_address(args.ha.rstrip("/") + "/" + args.ha_name)
    port = config.port
    if port == 0:  # the address goes to etcd before the socket is bound: choose the port now
        with socket.socket() as probe:
            probe.bind((config.host if config.host not in ("*", "0.0.0.0") else "", 0))
            port = probe.getsockname()[1]
        config = dataclasses.replace(config, port=port)
    host = args.advertise_host or (socket.gethostname() if config.host in ("*", "0.0.0.0") else config.host)
    metrics = f"http://{host}:{config.metrics_port}" if config.metrics_port else ""
    leadership = Leadership(etcd, args.ha_ttl_s)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    _write_ready(args.ready_file, {"state": "standby", "pid": os.getpid()})
    logging.getLogger("kvpool.master").info("campaigning for %s as tcp://%s:%d", etcd, host, port)
    server = _standby_metrics(config)
    try:
        won = leadership.campaign(LeaderRecord(f"tcp://{host}:{port}", metrics), stop)
    finally:
        if server is not None:  # the leader's own endpoint takes the port
            server.shutdown()
            server.server_close()
    if won and stop.is_set():  # SIGTERM came while it won: hand the lease on at once
        leadership.resign()
        won = False
    return (leadership, config) if won else (None, config)


def _standby_metrics(config: MasterConfig):
    """A standby's /metrics (probes and dashboards see it alive): kvpool_master_leader 0."""
    if config.metrics_port is None:
        return None
    from prometheus_client.core import GaugeMetricFamily

    from kvpool.master.metrics import serve_metrics

    standing_by = lambda: [GaugeMetricFamily("kvpool_master_leader", "1 while this master leads its pool",  # noqa: E731
                                              value=0)]
    server, _ = serve_metrics(config.host, config.metrics_port, lambda: None, standing_by)
    return server
