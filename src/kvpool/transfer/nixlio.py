"""The NIXL agent behind a DataPlane or a SegmentMemory; the only module that imports nixl.

Rules:
- One agent per owner, UCX backend, reader-writer thread sync: transfers from several threads run
  concurrently, metadata changes (register, add/remove peer) take the writer side inside NIXL.
- Every NIXL failure leaves this module as TransferError; nothing here blocks without a deadline.
  A dead peer shows up as an error on post or poll (measured < 1 ms after SIGKILL, the kernel
  closes its sockets), a hung one as a deadline miss.
- A request that missed its deadline is NOT released: releasing is no cancel (measured: after
  `release_xfer_handle` on a request to a SIGSTOPped peer the bytes still land on SIGCONT, READ
  into our memory and WRITE into the segment, and `remove_remote_agent` does not stop them
  either). It goes to the reaper, a thread that polls it until it ends (done, or an error such as
  the peer's death), releases it then, and finishes its StuckTransfer (fence.py); the caller gets
  a TransferError carrying that StuckTransfer as `in_flight`. A peer with requests at the reaper
  is removed only after they end (removing it would take away their only completion signal).
- One owner per handle: the caller's thread polls it until the deadline, the reaper after.
- Descriptor lists are Nx3 int64 arrays (addr, len, dev 0). `initialize_xfer` per request was
  measured at 0.05-0.25 ms for 128-4096 descriptors against 20-80 ms of copying, so requests are
  not prepped: a prepped list needs fixed blocks, and the pool's regions are arbitrary.
"""

from __future__ import annotations

import glob
import importlib
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np

from kvpool.core.errors import TransferError
from kvpool.transfer.config import DEFAULT_PROGRESS_DELAY_US
from kvpool.transfer.fence import StuckTransfer

_BUILDS = ("nixl_cu13", "nixl_cu12")  # the meta package's own order on a machine without CUDA

# UCX's AWS EFA submodule (libuct_ib_efa) links libefa.so.1, which the wheels do not bundle. Where
# the distribution's rdma-core providers are installed (Debian's ibverbs-providers, e.g. pulled in
# by fio or librdmacm1) it loads the system libefa, and with it a second libibverbs and libnl next
# to the wheel's own copies; at process exit the two libnl-route copies' destructors then crash
# (SIGSEGV in rtnl_tc_unregister: every NIXL process exits 139, also after a clean SIGTERM).
# Skipping that one submodule keeps every other UCX transport (tcp, shm, cma, ib/mlx5 verbs):
# EFA fabrics are NIXL's LIBFABRIC backend's job. Set before NIXL (and so UCX) loads; an explicit
# UCX_MODULES from the user wins.
os.environ.setdefault("UCX_MODULES", "^efa")


def _nixl_api_module():
    """NIXL's `_api` for this machine. With CUDA (a driver present, or torch already loaded), the
    `nixl` meta package picks nixl_cu12 or nixl_cu13 by the CUDA version. Without CUDA it takes
    the first build installed, but finding that out imports torch when torch is a CPU build
    (measured: 3.4 s and 250 MB RSS against 0.4 s and 47 MB), so there we pick it the same way."""
    if "torch" in sys.modules or glob.glob("/dev/nvidia[0-9]*") or glob.glob("/proc/driver/nvidia/version"):
        import nixl._api

        return nixl._api
    for name in _BUILDS:
        try:
            return importlib.import_module(f"{name}._api")
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
    import nixl._api  # not one of ours: let the meta package say what is missing

    return nixl._api


_nixl_api = _nixl_api_module()
_nixl_bindings = _nixl_api.nixlBind
nixl_agent, nixl_agent_config, nixl_thread_sync_t = (
    _nixl_api.nixl_agent, _nixl_api.nixl_agent_config, _nixl_api.nixl_thread_sync_t
)

# nixl logs every agent creation at INFO to stdout; our CLIs print their own output there.
logging.getLogger("nixl").setLevel(logging.WARNING)

_NIXL_ERRORS: tuple[type[BaseException], ...] = tuple(
    cls
    for name, cls in vars(_nixl_bindings).items()
    if name.startswith("nixl") and name.endswith("Error") and isinstance(cls, type)
) + (RuntimeError,)

_SPIN_S = 0.0002  # busy-poll this long before sleeping between polls
_AGENT_LOCK = threading.Lock()
_MAX_SLEEP_S = 0.001
_REAP_INTERVAL_S = 0.005  # how often the reaper polls requests past their deadline
_REAP_WARN_EVERY_S = 30.0  # a request at the reaper for this long is logged (again)

log = logging.getLogger(__name__)


def nixl_backend() -> str:
    """Which NIXL build `import nixl` chose: nixl_cu12, nixl_cu13 (or nixl_rocm)."""
    return _nixl_api.__name__.split(".")[0]


def descriptors(addrs: list[int] | np.ndarray, sizes: list[int] | np.ndarray, device: int = 0) -> np.ndarray:
    """NIXL's Nx3 (addr, len, device id) list; the id is the CUDA device for VRAM, 0 for DRAM."""
    out = np.zeros((len(sizes), 3), dtype=np.int64)
    out[:, 0] = addrs
    out[:, 1] = sizes
    out[:, 2] = device
    return out


@dataclass
class Pending:
    """A posted request; `peer` names the remote agent for error messages."""

    handle: object
    peer: str
    done: bool = False


def _agent_with_progress_delay(name: str, config, delay_us: int):
    """nixl_agent(name, config) with the progress thread's poll timeout set to `delay_us`
    (nixl_agent_config does not expose it; the wrapper reads nixlBind.nixlAgent at call time)."""
    api = _nixl_api
    real = api.nixlBind.nixlAgent

    def make(agent_name, agent_config):
        agent_config.pthrDelay = delay_us
        return real(agent_name, agent_config)

    with _AGENT_LOCK:
        api.nixlBind.nixlAgent = make
        try:
            return nixl_agent(name, config)
        finally:
            api.nixlBind.nixlAgent = real


class NixlEndpoint:
    def __init__(self, name: str, progress_thread: bool = True,
                 progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US) -> None:
        """`progress_thread`: NIXL's UCX progress thread. A passive side (a node's segment) needs
        it: nobody else would answer remote reads and writes. An initiator that waits for its own
        requests (DataPlane) does not: `wait` progresses the worker on every poll, and a second
        thread progressing the same worker only contends with it (profiled: 22 % of a cross-host
        reader's CPU in pthread_spin_lock under check_xfer_state). `progress_delay_us`: that
        thread's fallback poll period (NixlConfig: the thread is woken by events at once, the
        period bounds only its idle polling; NIXL's Python wrapper would spin a core with 0)."""
        self.name = name
        delay_us = progress_delay_us
        try:
            config = nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"],
                                       sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)  # fmt: skip
            self._agent = _agent_with_progress_delay(name, config, delay_us)
        except _NIXL_ERRORS as e:
            raise TransferError(f"cannot start NIXL agent {name!r} with the UCX backend: {e}") from e
        if "UCX" not in self._agent.backends:
            raise TransferError(f"NIXL ({nixl_backend()}) has no UCX plugin here (is the nixl package installed completely?)")
        self._reap_lock = threading.Lock()
        self._reaping: list[tuple[Pending, StuckTransfer, float]] = []  # (request, fence, since)
        self._remove_when_idle: set[str] = set()  # peers to remove once their reaped requests end
        self._reaper: threading.Thread | None = None
        self._closing = threading.Event()

    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    def register(self, addr: int, size_bytes: int, device: int | None = None) -> object:
        """Host memory (DRAM), or CUDA device `device`'s memory (VRAM)."""
        mem_type = "DRAM" if device is None else "VRAM"
        try:
            return self._agent.register_memory([(addr, size_bytes, device or 0, "")], mem_type=mem_type)
        except _NIXL_ERRORS as e:
            raise TransferError(f"NIXL could not register {size_bytes} bytes of {mem_type} at {addr:#x}: {e}") from e

    def deregister(self, registration: object) -> None:
        try:
            self._agent.deregister_memory(registration)
        except _NIXL_ERRORS as e:
            raise TransferError(f"NIXL could not deregister memory: {e}") from e

    def add_peer(self, metadata: bytes) -> str:
        try:
            name = self._agent.add_remote_agent(metadata)
        except _NIXL_ERRORS as e:
            raise TransferError(f"NIXL rejected a peer's agent metadata: {e}") from e
        name = name.decode() if isinstance(name, bytes) else str(name)
        with self._reap_lock:
            self._remove_when_idle.discard(name)  # wanted again: a deferred removal must not tear it out
        return name

    def remove_peer(self, name: str) -> None:
        with self._reap_lock:
            if any(pending.peer == name for pending, _, _ in self._reaping):
                self._remove_when_idle.add(name)  # after its stuck requests end (module rules)
                return
        self._remove_peer_now(name)

    def _remove_peer_now(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except _NIXL_ERRORS:
            pass  # already gone: forgetting twice is fine

    def post(self, op: str, local: np.ndarray, remote: np.ndarray, peer: str, local_vram: bool = False) -> Pending:
        """Remote regions are a pool segment (DRAM); local ones DRAM, or VRAM with `local_vram`."""
        try:
            handle = self._agent.initialize_xfer(
                op, self._agent.get_xfer_descs(local, "VRAM" if local_vram else "DRAM"),
                self._agent.get_xfer_descs(remote, "DRAM"), peer,
            )
        except _NIXL_ERRORS as e:
            raise TransferError(f"NIXL {op} to {peer}: cannot create the request: {e}") from e
        pending = Pending(handle, peer)
        try:
            state = self._agent.transfer(handle)
        except _NIXL_ERRORS as e:
            self.release(pending)
            raise TransferError(f"NIXL {op} to {peer} failed to start: {e}") from e
        if state == "ERR":
            self.release(pending)
            raise TransferError(f"NIXL {op} to {peer} failed to start")
        pending.done = state == "DONE"
        return pending

    def poll(self, pending: Pending) -> bool:
        """True when done; raises TransferError on failure (the request is then released)."""
        if pending.done:
            return True
        try:
            state = self._agent.check_xfer_state(pending.handle)
        except _NIXL_ERRORS as e:
            self.release(pending)
            raise TransferError(f"NIXL transfer with {pending.peer} failed: {e}") from e
        if state == "ERR":
            self.release(pending)
            raise TransferError(f"NIXL transfer with {pending.peer} failed")
        pending.done = state == "DONE"
        return pending.done

    def wait(self, pending: list[Pending], deadline: float) -> list[TransferError | None]:
        """Poll every request until done, failed or past `deadline` (time.monotonic)."""
        errors: list[TransferError | None] = [None] * len(pending)
        open_ = set(range(len(pending)))
        started = time.monotonic()
        sleep_s = 0.00002
        while open_:
            for i in list(open_):
                try:
                    if self.poll(pending[i]):
                        open_.discard(i)
                        self.release(pending[i])
                except TransferError as e:
                    errors[i] = e
                    open_.discard(i)
            if not open_:
                break
            now = time.monotonic()
            if now >= deadline:
                for i in open_:
                    what = f"NIXL transfer with {pending[i].peer}"
                    errors[i] = TransferError(
                        f"{what} did not finish within {deadline - started:.2f} s (peer hung or overloaded); "
                        "it may still move bytes until it ends, so its memory is fenced",
                        in_flight=self._reap(pending[i], what),
                    )
                break
            if now - started > _SPIN_S:
                time.sleep(sleep_s)
                sleep_s = min(2 * sleep_s, _MAX_SLEEP_S)
        return errors

    def release(self, pending: Pending) -> None:
        try:
            self._agent.release_xfer_handle(pending.handle)
        except _NIXL_ERRORS:
            pass  # nixl keeps it on its leak list and frees it with the agent

    # ---- requests past their deadline (module rules) --------------------------------------------

    def _reap(self, pending: Pending, what: str) -> StuckTransfer:
        fence = StuckTransfer(what)
        with self._reap_lock:
            self._reaping.append((pending, fence, time.monotonic()))
            if self._reaper is None:
                self._reaper = threading.Thread(target=self._reap_loop, name=f"kvpool-reaper-{self.name}", daemon=True)
                self._reaper.start()
        return fence

    def _reap_loop(self) -> None:
        warned: dict[int, float] = {}
        while not self._closing.wait(_REAP_INTERVAL_S):
            with self._reap_lock:
                items = list(self._reaping)
            for item in items:
                pending, fence, since = item
                try:
                    state = self._agent.check_xfer_state(pending.handle)
                    outcome = "done" if state == "DONE" else ("failed" if state == "ERR" else None)
                except _NIXL_ERRORS as e:
                    outcome = f"failed: {e}"
                if outcome is None:
                    age_s = time.monotonic() - since
                    if age_s - warned.get(id(pending), 0.0) >= _REAP_WARN_EVERY_S:
                        warned[id(pending)] = age_s
                        log.warning("%s still in flight after %.0f s; its memory stays fenced", fence.description, age_s)
                    continue
                self.release(pending)
                warned.pop(id(pending), None)
                with self._reap_lock:
                    self._reaping.remove(item)
                    idle = pending.peer in self._remove_when_idle and not any(
                        p.peer == pending.peer for p, _, _ in self._reaping
                    )
                    if idle:
                        self._remove_when_idle.discard(pending.peer)
                if idle:
                    self._remove_peer_now(pending.peer)
                fence.finish(outcome)

    def close(self) -> None:
        """Tear the agent down. Requests still at the reaper stay unreleased (NIXL frees them with
        the agent). Their fences finish as "agent closed": with our agent gone nothing can write
        into this process's memory any more, and the owner of a quarantined remote range is
        closing too (its quarantine ends by the master's time limit)."""
        self._closing.set()
        if self._reaper is not None:
            self._reaper.join(5.0)  # it polls without blocking: it sees _closing within one interval
            self._reaper = None
        self._agent = None  # the agent is torn down by its destructor
        with self._reap_lock:
            left, self._reaping = self._reaping, []
        for _, fence, _ in left:
            fence.finish("agent closed")
