"""Separate "hosts" on one machine, for tests and benchmarks of the path a cluster uses.

Each host is a network namespace with one veth link to a bridge that lives in a namespace of its
own (the switch), with a PID, mount, UTS and IPC namespace held by the host's init process (its
PID 1), a hostname and a private /dev/shm; every process started in a host joins all of them, so
processes of one host are one machine to each other and another machine to every other host:

    switch netns: br0 -- h0 ... hN          host netns i: eth0 = 10.77.0.(10+i)/24, lo

Rules:
- Nothing in the machine's own network namespace is touched: no interface, route or address is
  added there, so two runs never clash on addresses (each has its own switch) and a leftover can
  only be namespaces. Names carry the creator's pid and a random part (`kvh<pid>x<hex>-<host>`);
  `sweep_stale()` removes those whose creator is gone (a run killed with SIGKILL).
- `HostNetwork` removes everything it made on exit, on an exception and on SIGINT/SIGTERM (the
  handlers it installs restore the previous ones). Deleting the switch namespace deletes every
  veth pair (a pair goes with either end), then the host namespaces go.
- Where namespaces cannot be made (not root, no `ip`/`unshare`, a container without CAP_SYS_ADMIN)
  `HostsUnavailable` says why; tests skip on it.

Why these namespaces: kvpool takes its same-host shortcut (mapping the node's memfd through
/proc/PID/fd) only when `transfer.hostinfo.host_id()` matches, i.e. same boot id AND same PID
namespace. A PID namespace per host makes that id differ and makes another host's /proc/PID
invisible, so the shortcut cannot be taken even by mistake.

What UCX does between these hosts (measured with UCX_LOG_LEVEL=info; UCX 1.23 inside nixl 1.5.1):
the kernel is shared, but UCX tells peers apart by host name and namespaces. Between two hosts
here it logs `inter-node cfg#1 rma_am(tcp/eth0) amo_am(tcp/eth0) am(tcp/eth0)`: TCP over the veth
pair is the only lane; `cma` (process_vm_readv, which cannot name a process of another PID
namespace) and posix/sysv shared memory (private /dev/shm and IPC namespace) appear only in its
`self` configuration. So no UCX_TLS restriction is needed, and none is set: a restriction would
also hide a regression that made UCX pick a same-kernel transport. `UCX_LINES_RE` lets a test
check the lanes from a process's log instead (tests/integration/test_multihost.py does). Two
processes in ONE host here get `intra-node` and would use cma/shm like any same-host pair.
The veth link is a kernel copy without a wire limit: figures measured across these hosts are
what the TCP stack and the software above it cost, not what a 25-100 Gb/s NIC would allow.
MTU 9000 (datacenter jumbo frames) by default; 1500 and 65535 measured the same here (+-20 %).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.77.0"
_PREFIX = "kvh"
_NAME_RE = re.compile(rf"^{_PREFIX}(\d+)x[0-9a-f]+-")
_HOST_NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,15}$")

# Transports that move bytes only within one kernel: never a path between two real machines.
SAME_KERNEL_TRANSPORTS = ("cma", "knem", "xpmem", "sysv", "posix", "shm")
# UCX's log line (UCX_LOG_LEVEL=info) naming a worker configuration's lanes, e.g.
# "... kvpool-client-4-1640be45 inter-node cfg#1 rma_am(tcp/eth0)  am(tcp/eth0)  ka(tcp/eth0)"
UCX_LINES_RE = re.compile(r"\b(self|intra-node|inter-node) cfg#\d+ (.*)$", re.MULTILINE)


def ucx_lanes(log_text: str) -> list[tuple[str, set[str]]]:
    """(scope, transports) of every UCX worker configuration logged in `log_text`."""
    return [(scope, set(re.findall(r"\b([a-z_]+)/", lanes))) for scope, lanes in UCX_LINES_RE.findall(log_text)]


class HostsUnavailable(RuntimeError):
    """Network namespaces cannot be made here; the message says why."""


@dataclass(frozen=True)
class Host:
    name: str  # short name: "a", "node1"
    netns: str  # the network namespace
    address: str  # its IPv4 address on the switch
    init_pid: int  # the host's PID 1, as this machine's PID namespace sees it

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host: its network namespace and the PID, mount (private /proc
        and /dev/shm), UTS (hostname = the host's name) and IPC namespaces that its init holds,
        shared by every process of the host as on a real machine. nsenter forks the program as
        its child in the same process group, so a group signal (ManagedProcess.stop/kill) reaches
        it, and nsenter exits with its status."""
        return ["nsenter", "-t", str(self.init_pid), "--net", "--pid", "--mount", "--uts", "--ipc", "--", *argv]


# A host's PID 1: a shell that names the host, mounts a private /dev/shm and then waits forever
# (a shell as PID 1 reaps orphans). Killing it (SIGKILL from outside) ends every process of the host.
_INIT_SCRIPT = 'hostname "$0" && mount -t tmpfs -o mode=1777 tmpfs /dev/shm && echo ready && exec sleep infinity'


def _start_init(netns: str, name: str) -> tuple[subprocess.Popen, int]:
    popen = subprocess.Popen(
        ["ip", "netns", "exec", netns, "unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--uts",
         "--ipc", "--mount", "sh", "-c", _INIT_SCRIPT, name],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    line = popen.stdout.readline()
    if line.strip() != "ready":
        popen.kill()
        raise HostsUnavailable(f"host {name}: its init did not start: {popen.stderr.read().strip()[-500:]}")
    try:  # unshare --fork has exactly one child: the host's PID 1
        children = Path(f"/proc/{popen.pid}/task/{popen.pid}/children").read_text().split()
    except OSError as e:
        popen.kill()
        raise HostsUnavailable(f"host {name}: cannot find its init process: {e}") from e
    if len(children) != 1:
        popen.kill()
        raise HostsUnavailable(f"host {name}: unshare has children {children}, expected one")
    return popen, int(children[0])


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise HostsUnavailable(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")


def existing_netns() -> list[str]:
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def why_unavailable() -> str | None:
    """None when this process can make hosts, else the reason (for a skip message)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    for tool in ("ip", "unshare", "nsenter", "sh", "hostname", "mount", "sleep"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    return None


def sweep_stale() -> list[str]:
    """Remove namespaces left by runs whose process is gone; returns their names."""
    removed = []
    for name in existing_netns():
        match = _NAME_RE.match(name)
        if match and not _pid_alive(int(match.group(1))):
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
            for pid in pids:  # the dead run's host inits and whatever still runs in its hosts
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            removed.append(name)
    return removed


class HostNetwork:
    """`with HostNetwork(["master", "node0", ...]) as net: net["node0"].wrap(argv)`."""

    def __init__(self, names: Sequence[str], mtu: int = 9000) -> None:
        names = list(names)
        if not names or len(set(names)) != len(names):
            raise ValueError(f"host names must be distinct and at least one, got {names}")
        if len(names) > 200:
            raise ValueError(f"at most 200 hosts on one switch, got {len(names)}")
        for name in names:
            if not _HOST_NAME_RE.match(name):
                raise ValueError(f"host name {name!r}: lower-case letters and digits, starting with a letter, <= 16")
        if not 1280 <= mtu <= 65535:
            raise ValueError(f"mtu must be 1280..65535, got {mtu}")
        self._names = names
        self.mtu = mtu
        self._tag = f"{_PREFIX}{os.getpid()}x{secrets.token_hex(3)}"
        self.switch = f"{self._tag}-switch"
        self.hosts: dict[str, Host] = {}
        self._made: list[str] = []  # namespaces created, in order
        self._inits: list[subprocess.Popen] = []  # each host's `unshare` (parent of its PID 1)
        self._old_handlers: dict[int, object] = {}

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def create(self) -> "HostNetwork":
        reason = why_unavailable()
        if reason is not None:
            raise HostsUnavailable(reason)
        sweep_stale()
        self._install_handlers()
        try:
            self._netns_add(self.switch)
            _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.switch, "link", "set", "br0", "mtu", str(self.mtu), "up")
            for i, name in enumerate(self._names):
                netns, address = f"{self._tag}-{name}", f"{SUBNET}.{10 + i}"
                self._netns_add(netns)
                port = f"h{i}"
                # both ends are created inside their namespaces: nothing appears in ours
                _run("ip", "link", "add", "eth0", "netns", netns, "type", "veth", "peer", "name", port,
                     "netns", self.switch)  # fmt: skip
                _run("ip", "-n", self.switch, "link", "set", port, "master", "br0")
                _run("ip", "-n", self.switch, "link", "set", port, "mtu", str(self.mtu), "up")
                _run("ip", "-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
                _run("ip", "-n", netns, "link", "set", "eth0", "mtu", str(self.mtu), "up")
                _run("ip", "-n", netns, "link", "set", "lo", "up")
                popen, init_pid = _start_init(netns, name)
                self._inits.append(popen)
                self.hosts[name] = Host(name, netns, address, init_pid)
        except BaseException:
            self.remove()
            raise
        return self

    def _netns_add(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._made.append(name)

    def remove(self) -> None:
        """Delete everything made (idempotent): each host's init (and with it every process left
        in the host), then the namespaces; the switch goes last, deleting the veths with it."""
        for popen in self._inits:
            try:
                os.killpg(popen.pid, signal.SIGKILL)  # unshare and, by --kill-child, the host's PID 1
            except (ProcessLookupError, PermissionError):
                pass
            popen.wait()
        self._inits.clear()
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._made.clear()
        self.hosts.clear()
        self._restore_handlers()

    # SIGINT/SIGTERM: remove the namespaces, then behave as the previous handler would
    def _install_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers; the context manager still cleans up
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    def _on_signal(self, signum: int, frame) -> None:
        previous = self._old_handlers.get(signum)
        self.remove()
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_IGN:
            return
        else:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def __enter__(self) -> "HostNetwork":
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.remove()
