"""`kvpool node`: run a storage node until SIGTERM or Ctrl-C, then unmount and exit 0."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from kvpool.core.errors import KVPoolError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run a storage node: allocate a DRAM segment in shared memory, register it with NIXL, mount "
        "it on the master and heartbeat until SIGTERM or Ctrl-C, which unmount it. Clients on this "
        "host map the segment directly; clients elsewhere reach it with NIXL one-sided transfers."
    )
    parser.add_argument("--master", required=True, metavar="ADDR",
                        help="the master's ZMQ address, as written in its ready file (tcp://HOST:PORT), or an HA pool's etcd://HOST:PORT[,...]/NAME; "
                             "standbys may follow, comma-separated: tried in turn when one does not answer, and "
                             "after a restart or take-over the node announces what it holds so the cache survives")
    parser.add_argument("--memory", default="1GiB", metavar="SIZE",
                        help="segment size contributed to the pool: 64MiB, 4GiB, 512M, 10GB or bytes; "
                             "allocated and pre-faulted at start (default: %(default)s)")
    parser.add_argument("--disk", default=None, metavar="DIR",
                        help="give the node a disk tier in this directory (an NVMe SSD's file system): objects "
                             "evicted from DRAM stay on disk and are copied back when read; it survives a node "
                             "restart (the node announces what it holds). Off when not given")
    parser.add_argument("--disk-size", default=None, metavar="SIZE",
                        help="bound on the disk tier's files, e.g. 100GiB (default: 90%% of the file system's free "
                             "space at start)")
    parser.add_argument("--writeback-queue", type=int, default=4096, metavar="N",
                        help="objects waiting to be written to disk, at most; past it new ones are not cached on "
                             "disk (default: %(default)s)")
    parser.add_argument("--tenant", default="", metavar="NAME",
                        help="dedicate this node's segment to one tenant: it holds only that tenant's objects, and once "
                        "a tenant has a dedicated segment its objects go only to its dedicated segments (hard isolation "
                        "on the data plane: other tenants never need this segment's metadata); omit for a shared segment")
    parser.add_argument("--credential", default=None, metavar="FILE",
                        help="CURVE credential of a node identity (`kvpool auth add DIR node`); default: "
                        "$KVPOOL_NODE_CREDENTIAL, else none (only an --insecure master accepts that)")
    parser.add_argument("--no-segment-lane", dest="segment_lane", action="store_false",
                        help="do not serve small transfers over the plain TCP segment lane (served by default "
                        "without a credential: one round trip instead of UCX's emulated one-sided ops); "
                        "clients then use NIXL for every cross-host transfer")
    parser.add_argument("--node-id", default=None, metavar="NAME",
                        help="name shown in `kvpool status` and metrics (default: HOSTNAME-PID)")
    parser.add_argument("--timeout-s", type=float, default=5.0,
                        help="deadline in seconds for each call to the master: mount, heartbeat, unmount (default: %(default)s)")
    parser.add_argument("--mount-timeout-s", type=float, default=30.0,
                        help="seconds to keep retrying the first mount while the master is unreachable (default: %(default)s)")
    parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                        help="serve Prometheus metrics on this port (0: any free port, written to the "
                             "ready file); off when not given")
    parser.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                        help="address the metrics server listens on (default: %(default)s)")
    parser.add_argument("--ready-file", type=Path, default=None, metavar="PATH",
                        help="write {node_id, segment_id, pid, metrics_port} as JSON here once mounted "
                             "(rewritten after a remount)")
    parser.add_argument("--exit-with-parent", action="store_true",
                        help="unmount and exit when the process that started this one is gone (used by the vLLM "
                             "connector's embedded node, so a killed engine leaves no node behind)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="logging verbosity (default: %(default)s)")


def _write_ready(path: Path, info: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)


def run(args: argparse.Namespace) -> int:
    from kvpool.node.config import NodeConfig, format_size, parse_size
    from kvpool.node.service import StorageNode

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.disk_size is not None and args.disk is None:
            raise ValueError("--disk-size needs --disk DIR (where the disk tier lives)")
        disk_bytes = 0
        if args.disk is not None:
            if args.disk_size is not None:
                disk_bytes = parse_size(args.disk_size)
            else:
                import shutil

                Path(args.disk).mkdir(parents=True, exist_ok=True)
                disk_bytes = int(shutil.disk_usage(args.disk).free * 0.9)
        config = NodeConfig(
            master_address=args.master,
            memory_bytes=parse_size(args.memory),
            node_id=args.node_id,
            timeout_s=args.timeout_s,
            mount_timeout_s=args.mount_timeout_s,
            disk_path=args.disk,
            disk_bytes=disk_bytes,
            writeback_queue=args.writeback_queue,
            tenant=args.tenant,
            credential=args.credential,
            segment_lane=args.segment_lane,
        )
    except (ValueError, OSError) as e:
        print(f"kvpool node: {e}", file=sys.stderr)
        return 2

    stop = threading.Event()
    metrics_port: int | None = None

    def on_mount(segment_id: int) -> None:
        if args.ready_file is not None:
            _write_ready(args.ready_file, {"node_id": node.node_id, "segment_id": segment_id,
                                           "pid": os.getpid(), "metrics_port": metrics_port})

    node = StorageNode(config, on_mount=on_mount)
    if args.metrics_port is not None:
        from prometheus_client import start_http_server

        server, _ = start_http_server(args.metrics_port, addr=args.metrics_host, registry=node.registry)
        metrics_port = server.server_port
    def on_signal(*_: object) -> None:
        stop.set()
        node.request_stop()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    disk = f" + disk tier {format_size(config.disk_bytes)} in {config.disk_path}" if config.disk_path else ""
    dedicated = f" dedicated to tenant {config.tenant!r}" if config.tenant else ""
    print(f"kvpool node {node.node_id}: mounting {format_size(config.memory_bytes)}{disk}{dedicated} on "
          f"{config.master_address}",
          flush=True)
    if args.exit_with_parent:
        parent = os.getppid()

        def watch_parent() -> None:
            while not stop.wait(0.5):
                if os.getppid() != parent:
                    print(f"kvpool node {node.node_id}: parent {parent} is gone; stopping", flush=True)
                    on_signal()
                    return

        threading.Thread(target=watch_parent, name="kvpool-parent-watch", daemon=True).start()
    try:
        node.start()
        print(f"kvpool node {node.node_id}: segment {node.segment_id:x} ({format_size(config.memory_bytes)}) "
              f"mounted on {config.master_address}", flush=True)
        stop.wait()
    except KVPoolError as e:
        if stop.is_set():
            return 0  # told to stop while still trying to mount: nothing was mounted
        print(f"kvpool node: {e}", file=sys.stderr)
        return 1
    finally:
        node.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(f"kvpool node {node.node_id}: unmounted, bye", flush=True)
    return 0
