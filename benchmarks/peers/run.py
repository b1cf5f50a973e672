"""kvpool side by side with Mooncake Store and Redis, across hosts as well as on one.

    benchmarks/run.py peers [--quick] [--rounds N] [--peers kvpool-same,kvpool-nixl,mooncake-tcp,redis]
        [--variant NAME] [--out PREFIX]

Writes benchmarks/results/peers/DATE-MACHINE[-VARIANT].{json,md,png} and LATEST.md. Run it alone on
the machine: other work on the same cores moves the absolute figures (the ratios less).

Method (benchmarks/method.md; the peers' long form in benchmarks/results/peers/):
- Hosts are the multi-host harness's (kvpool.bench.hosts): network + PID + mount namespaces on a
  bridge. Cross-host peers keep their metadata server, storage process and client on three
  different hosts; `kvpool-same` has all three on one host (its shared-memory path).
- Each peer gets one storage process with the same memory. The benchmark starts every server
  itself and stops them at the end (also on Ctrl-C); a peer that cannot start or install is
  reported with the reason and skipped.
- Every case runs in a fresh client process on the client host (never in a storage process),
  so no case inherits the allocator state an earlier one left (a client process whose glibc had
  raised its trim threshold after freeing large values took no page faults on 64 KiB results:
  docs/performance/index.md, Method); every byte read is compared with what was written.
- Round 0 writes each store's memory once (Mooncake and Redis do not pre-fault) and is excluded.
  Then `--rounds` rounds, each running every peer once in a rotated order, so a peer's figures
  and its ratio to another come from the same minutes of a shared machine. Reported: the median
  over rounds and, for the goals, the median (and range) of per-round ratios.
- Peers' packages: Mooncake (`mooncake-transfer-engine-non-cuda`, plus Debian's libibverbs1
  librdmacm1 libnuma1) and Redis (Debian's redis-server, PyPI's redis + hiredis) are installed
  when missing: into this venv if pip's dry run downgrades nothing, else into a venv of their own
  under the work dir (`--no-install` reports them missing instead).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from servers import PEERS, PeerUnavailable, run_client  # noqa: E402

from kvpool.bench import hosts, procs  # noqa: E402

MiB = 1024 * 1024
CASES = ["get_1m", "bw_16m", "sg", "lookup", "plain_64k", "agent"]
EXTRA_CASES = ["plain_sweep"]  # not run by default: plain get/put at 4 KiB .. 4 MiB
AGENT_CLIENTS = 4  # the agent-like loop: this many client processes at once
PIP_PACKAGES = {"mooncake": ["mooncake-transfer-engine-non-cuda==0.3.13.post1"], "redis": ["redis", "hiredis"]}
IMPORTS = {"mooncake": "mooncake.store", "redis": "redis"}
DEBIAN = {"mooncake": ["libibverbs1", "librdmacm1", "libnuma1"], "redis": ["redis-server"]}


# ---- installing peers ---------------------------------------------------------------------------


def _importable(python: str, module: str) -> bool:
    return subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0


def _debian_missing(packages: list[str]) -> list[str]:
    missing = []
    for pkg in packages:
        done = subprocess.run(["dpkg-query", "-W", "-f=${Status}", pkg], capture_output=True, text=True)
        if "install ok installed" not in done.stdout:
            missing.append(pkg)
    return missing


def _pip_downgrades(python: str, packages: list[str]) -> list[str]:
    """What `pip install packages` would change to a lower version in `python`'s environment."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    done = subprocess.run([python, "-m", "pip", "install", "--dry-run", "--quiet", "--report", "-", *packages],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        raise PeerUnavailable(f"pip cannot resolve {packages}: {done.stderr.strip()[-500:]}")
    lower = []
    for item in json.loads(done.stdout).get("install", []):
        name, new = item["metadata"]["name"], item["metadata"]["version"]
        try:
            if Version(new) < Version(version(name)):
                lower.append(f"{name} {version(name)} -> {new}")
        except PackageNotFoundError:
            pass
    return lower


def ensure_peer(need: str, workdir: Path, install: bool) -> str:
    """The python that has `need`'s client (installing it if allowed), or PeerUnavailable."""
    missing_deb = _debian_missing(DEBIAN[need])
    if missing_deb:
        if not install:
            raise PeerUnavailable(f"Debian packages missing: {' '.join(missing_deb)}")
        if os.geteuid() != 0:
            raise PeerUnavailable(f"Debian packages missing and not root: {' '.join(missing_deb)}")
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True)
        done = subprocess.run(["apt-get", "install", "-y", "-qq", *missing_deb], capture_output=True, text=True,
                              env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})  # fmt: skip
        if done.returncode != 0:
            raise PeerUnavailable(f"apt-get install {' '.join(missing_deb)} failed: {done.stderr.strip()[-500:]}")
    python = sys.executable
    if _importable(python, IMPORTS[need]):
        return python
    own = workdir / f"venv-{need}" / "bin" / "python"
    if own.exists() and _importable(str(own), IMPORTS[need]):
        return str(own)
    if not install:
        raise PeerUnavailable(f"python package missing: {' '.join(PIP_PACKAGES[need])}")
    packages = PIP_PACKAGES[need]
    if not _pip_downgrades(python, packages):
        target = python
    else:  # a venv of its own: the project's stays as it is
        subprocess.run([sys.executable, "-m", "venv", str(own.parent.parent)], check=True)
        target = str(own)
        packages = [*packages, "numpy"]
    done = subprocess.run([target, "-m", "pip", "install", "--quiet", *packages], capture_output=True, text=True)
    if done.returncode != 0 or not _importable(target, IMPORTS[need]):
        raise PeerUnavailable(f"pip install {' '.join(packages)} failed: {done.stderr.strip()[-500:]}")
    return target


# ---- running --------------------------------------------------------------------------------------


def machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    mem_kib = next(int(ln.split()[1]) for ln in open("/proc/meminfo") if ln.startswith("MemTotal"))
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem_kib / MiB, 1),
            "kernel": platform.release(), "python": platform.python_version()}  # fmt: skip


def run_benchmark(args: argparse.Namespace) -> dict:
    from rich.progress import Progress

    workdir = procs.scratch_dir("kvpool-peers-")
    names = [n.strip() for n in args.peers.split(",") if n.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise SystemExit(f"unknown peers {unknown}; known: {', '.join(PEERS)}")
    cases = [c.strip() for c in args.cases.split(",")]
    results: dict = {"machine": machine(), "load_avg_start": os.getloadavg(), "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()} | {"cases": cases},
                     "skipped": {}, "rounds": {n: [] for n in names}, "failed": {}}  # fmt: skip
    pythons = {}
    for name in names:
        try:
            python = sys.executable
            for need in PEERS[name].needs:
                python = ensure_peer(need, workdir, not args.no_install)
            pythons[name] = python
        except PeerUnavailable as e:
            results["skipped"][name] = f"not installed: {e}"
    why = hosts.why_unavailable()
    if why is not None:
        raise SystemExit(f"the multi-host harness cannot run here: {why}")
    running = {}
    with hosts.HostNetwork(servers_hosts()) as net:
        try:
            for name in [n for n in names if n in pythons]:
                try:
                    running[name] = PEERS[name].start(net, workdir, args.storage_mib * MiB, pythons[name])
                except PeerUnavailable as e:
                    results["skipped"][name] = f"cannot start: {e}"
            live = [n for n in names if n in running]
            with Progress() as progress:
                task = progress.add_task("peers benchmark", total=len(live) * (args.rounds + 1))
                for name in live:  # round 0: write each store's memory once (excluded)
                    fill = {**running[name].spec, "tag": "r0", "cases": ["fill"], "quick": args.quick,
                            "fill_bytes": int(args.storage_mib * MiB * 0.6)}  # fmt: skip
                    try:
                        run_client(running[name], fill)
                    except RuntimeError as e:
                        results["failed"].setdefault(name, []).append(f"round 0: {e}")
                    progress.advance(task)
                for r in range(1, args.rounds + 1):
                    order = live[r % len(live):] + live[: r % len(live)]  # rotated: nobody always goes first
                    for name in order:
                        spec = {**running[name].spec, "tag": f"r{r}", "cases": [c for c in cases if c != "agent"],
                                "quick": args.quick}  # fmt: skip
                        t = time.monotonic()
                        try:
                            out, routes = {}, set()
                            for case in spec["cases"]:  # each case in a fresh process: none inherits another's
                                result = run_client(running[name], {**spec, "cases": [case]})
                                routes |= set(result.pop("route", None) or ())
                                out.update(result)
                            if routes:
                                out["route"] = sorted(routes)
                            if "agent" in cases:
                                out["agent"] = run_agents(running[name], {**spec, "tag": f"r{r}"})
                            out["round"], out["elapsed_s"], out["load_avg"] = r, time.monotonic() - t, os.getloadavg()
                            results["rounds"][name].append(out)
                        except (RuntimeError, subprocess.TimeoutExpired) as e:
                            results["failed"].setdefault(name, []).append(f"round {r}: {e}")
                        progress.advance(task)
        finally:
            for proc in running.values():
                proc.stop()
    results["load_avg_end"] = os.getloadavg()
    shutil.rmtree(workdir, ignore_errors=True)
    return results


def run_agents(running, spec: dict) -> dict:
    """AGENT_CLIENTS client processes running the agent-like loop at once (clients.case_agent):
    loops per second over all of them and the per-loop latency percentiles."""
    import numpy as np
    from concurrent.futures import ThreadPoolExecutor

    start_at = time.time() + 8.0  # every process imports its client and writes its prefixes first
    specs = [{**spec, "cases": ["agent_worker"], "worker": w, "start_at": start_at} for w in range(AGENT_CLIENTS)]
    with ThreadPoolExecutor(AGENT_CLIENTS) as pool:
        outs = list(pool.map(lambda s: run_client(running, s), specs))
    if time.time() < start_at:
        raise RuntimeError("agent loop: a client finished before the common start")
    lat = np.concatenate([o["agent_worker"]["latencies_s"] for o in outs]) * 1e3
    loops = sum(o["agent_worker"]["loops"] for o in outs)
    out = {"loops_per_s": loops / max(o["agent_worker"]["elapsed_s"] for o in outs), "p50_ms": float(np.percentile(lat, 50)),
           "p99_ms": float(np.percentile(lat, 99)), "clients": AGENT_CLIENTS, "loops": loops}  # fmt: skip
    phases = np.concatenate([o["agent_worker"]["phases_s"] for o in outs]) * 1e3
    for j, phase in enumerate(("lookup", "get", "put")):  # where a slow loop spent its time
        out[f"{phase}_p50_ms"], out[f"{phase}_p99_ms"] = (float(np.percentile(phases[:, j], q)) for q in (50, 99))
    return out


def servers_hosts() -> list[str]:
    from servers import HOSTS

    return HOSTS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, from: {', '.join(PEERS)}")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from: {', '.join(CASES + EXTRA_CASES)} (default: all but {', '.join(EXTRA_CASES)})")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds after the warm-up round (default 3)")
    parser.add_argument("--quick", action="store_true", help="smaller transfers and fewer samples (a smoke run)")
    parser.add_argument("--storage-mib", type=int, default=1024, help="each peer's storage memory (default 1024)")
    parser.add_argument("--no-install", action="store_true", help="report missing peers instead of installing them")
    parser.add_argument("--variant", default=None, help="names this configuration in the file name (e.g. same-host)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output path without extension (default: benchmarks/results/peers/DATE-MACHINE[-VARIANT])")
    parser.add_argument("--note", default="", help="a line written into the report (what else ran, which build)")
    parser.add_argument("--pin", default=None, metavar="SERVERS:CLIENT",
                        help="pin every peer's servers and every client to these CPU lists (taskset), e.g. 0:1; "
                             "default: the kernel places them (see echo_placement.py)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if args.pin is not None:
        servers_cpus, _, client_cpus = args.pin.partition(":")
        if not servers_cpus or not client_cpus or shutil.which("taskset") is None:
            parser.error("--pin needs SERVERS:CLIENT CPU lists (like 0:1) and taskset")
        import servers

        servers.PIN.update(servers=servers_cpus, client=client_cpus)
        args.note = (args.note + "; " if args.note else "") + (
            f"every peer's servers pinned to CPU {servers_cpus}, every client process to CPU {client_cpus}")
    try:
        results = run_benchmark(args)
    except KeyboardInterrupt:
        print("interrupted: servers stopped, namespaces removed, nothing written", file=sys.stderr)
        raise SystemExit(130)
    from report import write_report

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import results_io

    out = args.out or results_io.result_files("peers", args.variant).prefix
    write_report(results, out.parent, out.name)
    if args.out is None:
        results_io.refresh_latest("peers")
    print(f"wrote {out}.md, .json, .png")


if __name__ == "__main__":
    main()
