"""The worker half: moves bytes between vLLM's KV blocks and the pool, off the critical path.

Facts this relies on (vLLM 0.32, v1/worker/kv_connector_model_runner_mixin.py):
- Each step: bind_connector_metadata -> start_load_kv (before the forward when the step has
  synchronous loads, after it otherwise) -> forward -> wait_for_save -> get_transfer_results ->
  get_block_ids_with_load_errors -> get_kv_connector_stats -> build_connector_worker_meta. Steps
  with nothing to compute still run this sequence (kv_connector_no_forward), so completions of
  background work are picked up while requests wait for their KV.
- An asynchronous load must appear in `finished_recving` exactly once, failed or not; its failed
  blocks must be reported by `get_block_ids_with_load_errors` no later than that same pass. vLLM
  then truncates the request's computed tokens at the first failed block and recomputes the rest
  (with kv_load_failure_policy="recompute"; the default "fail" fails the request instead).
- A synchronous load is never listed in `finished_recving`: its failed blocks are reported in
  the pass that ran it.

Rules: every pool call runs inside a boundary that turns failures into "recompute" / "not saved"
and metrics; no exception from the pool reaches vLLM. Reads land only in blocks the scheduler
allocated for the load (or in scratch), so a failed or late read never touches KV that is in use.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from kvpool.connector import device
from kvpool.connector.health import PoolHealth
from kvpool.connector.metadata import KVPoolMetadata, KVPoolWorkerMetadata
from kvpool.connector.plan import Geometry, LoadSpec, SaveSpec, failed_block_ids
from kvpool.connector.stats import StatsRecorder
from kvpool.core.errors import KVPoolError, UnavailableError
from kvpool.core.protocol import PUT_ALLOCATED, PUT_EXISTS

log = logging.getLogger(__name__)


class _NoPool(Exception):
    """No client yet, or the pool is degraded and its back-off has not ended."""


class WorkerSide:
    def __init__(
        self, geom: Geometry, *, health: PoolHealth, load_async: bool, load_wait_s: float = 0.005,
        shutdown_timeout_s: float = 10.0, sync_lookup_timeout_s: float = 0.5,
    ):
        # a synchronous load runs inside vLLM's step: its master round trip is bounded like the
        # scheduler's lookups (a slow master makes it a failed load, recomputed), its copy is not
        self._sync_lookup_timeout_s = sync_lookup_timeout_s
        self.geom = geom
        self.stats = StatsRecorder()
        self._health = health
        self._load_async = load_async
        self._shutdown_timeout_s = shutdown_timeout_s
        self._client = None
        self._layout: device.KVLayout | None = None
        self._group_layouts: list[device.KVLayout] = []  # hybrid models: one per KV-cache group
        self._group_kinds: list[str] = []
        self._scratch = None
        self._device = None  # torch.device of the KV cache, known at attach
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvpool-load")
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvpool-save")
        self._load_wait_s = load_wait_s
        self._lock = threading.Lock()
        self._loads_changed = threading.Condition(self._lock)
        self._loads_in_flight = 0
        self._done_loads: list[tuple[LoadSpec, int]] = []  # (spec, leading objects read)
        self._done_saves: dict[int, int] = {}
        self._failed_loads: set[str] = set()
        self._errors_to_report: set[int] = set()
        self._failed_recving: set[str] = set()
        self._inflight: set[Future] = set()

    # ---- set-up --------------------------------------------------------------------------------

    def attach(self, client, kv_caches: dict, num_blocks: int, group_layers: list[list[str]] | None = None,
               group_kinds: list[str] | None = None) -> None:
        """Register vLLM's KV memory with the data plane, once. `group_layers`: a hybrid model's
        layer names per KV-cache group (an object is then one block of one group's layers), and
        `group_kinds` what each group keeps (groups.GroupRule.kind), for metrics."""
        if group_layers is not None:
            self._group_kinds = list(group_kinds or ["full"] * len(group_layers))
            self._group_layouts = [
                device.describe_kv_caches({n: kv_caches[n] for n in names}, num_blocks) for names in group_layers
            ]
            self._layout = self._group_layouts[0]  # groups differ in bytes per block (Mamba pages, windows)
        else:
            self._layout = device.describe_kv_caches(kv_caches, num_blocks)
        self._device = device.kv_device(kv_caches)
        registered = device.register_kv_memory(client, kv_caches)
        if self.geom.blocks_per_object > 1:
            self._scratch = device.scratch_region(self._layout.region_bytes, self._device)
            client.register(self._scratch)
        self._client = client
        log.info(
            "kvpool: registered %d bytes of KV cache (%d layers, %d bytes per block, %d blocks per object)",
            registered, len(self._layout.layer_names), self._layout.block_bytes, self.geom.blocks_per_object,
        )

    def _regions(self, block_ids: list[list[int | None]], groups: list[int] | None = None
                 ) -> tuple[list[list[int]], list[list[int]]]:
        if groups is not None:  # hybrid: object i is block block_ids[i][0] of group groups[i]
            addrs, sizes = [], []
            for (block_id,), g in zip(block_ids, groups):
                layout = self._group_layouts[g]
                addrs.append(layout.block_addrs(block_id))
                sizes.append([layout.region_bytes] * layout.regions_per_block)
            return addrs, sizes
        layout = self._layout
        scratch_addrs = None
        addrs, sizes = [], []
        for blocks in block_ids:
            obj_addrs: list[int] = []
            for block_id in blocks:
                if block_id is None:
                    if scratch_addrs is None:
                        scratch_addrs = [self._scratch.data_ptr()] * layout.regions_per_block
                    obj_addrs.extend(scratch_addrs)
                else:
                    obj_addrs.extend(layout.block_addrs(block_id))
            addrs.append(obj_addrs)
            sizes.append([layout.region_bytes] * len(obj_addrs))
        return addrs, sizes

    # ---- loads ---------------------------------------------------------------------------------

    def start_load_kv(self, meta: KVPoolMetadata) -> None:
        for spec in meta.loads:
            if self._load_async:
                with self._lock:
                    self._loads_in_flight += 1
                self._track(self._loader.submit(self._load, spec))
            else:  # synchronous: this step's forward reads these blocks right after we return
                num_loaded = self._load(spec)
                with self._lock:
                    self._errors_to_report |= failed_block_ids(spec, num_loaded)
                    if num_loaded < len(spec.keys):
                        self._failed_loads.add(spec.req_id)

    def _load(self, spec: LoadSpec) -> int:
        started = time.perf_counter()
        num_loaded = 0
        try:
            if self._client is None or not self._health.should_try():
                raise _NoPool
            addrs, sizes = self._regions(spec.block_ids, spec.groups)
            num_loaded = self._client.get_into(
                spec.keys, addrs, sizes, lookup_timeout_s=None if self._load_async else self._sync_lookup_timeout_s
            )
            self._health.record_success()
        except _NoPool:
            pass  # degraded, waiting for the back-off to end: vLLM recomputes
        except UnavailableError as exc:
            self._health.record_unavailable(exc)
            self.stats.add(pool_unavailable=1)
        except KVPoolError as exc:
            log.warning("kvpool: load for %s failed (%s); vLLM recomputes it", spec.req_id, exc)
        except Exception:  # the engine must never crash on a pool fault
            log.exception("kvpool: unexpected error loading %s; vLLM recomputes it", spec.req_id)
        num_blocks_read = sum(1 for blocks in spec.block_ids[:num_loaded] for b in blocks if b is not None)
        failed = failed_block_ids(spec, num_loaded)
        if spec.groups is not None:
            loaded_bytes = sum(self._group_layouts[g].block_bytes for g in spec.groups[:num_loaded])
        else:
            loaded_bytes = num_blocks_read * (self._layout.block_bytes if self._layout else 0)
        self.stats.add(loads=1, loaded_blocks=num_blocks_read, load_failed_blocks=len(failed), loaded_bytes=loaded_bytes)
        self.stats.observe("load_latency_s", time.perf_counter() - started)
        if self._load_async:
            with self._lock:
                self._done_loads.append((spec, num_loaded))
                self._loads_in_flight -= 1
                self._loads_changed.notify_all()
        return num_loaded

    def take_finished_loads(self) -> set[str]:
        """Async loads done since the last call; their failed blocks are queued for this pass.

        While loads are in flight and none is done, wait up to `load_wait_s` first: vLLM calls
        this every step, and an engine that spins through empty steps holds the GIL, so the
        loader thread (one GIL hand-off per copied region) would crawl. The wait releases the GIL;
        it delays other requests' steps by at most load_wait_s, only while a load runs.
        """
        with self._lock:
            if self._loads_in_flight and not self._done_loads and self._load_wait_s > 0:
                self._loads_changed.wait(self._load_wait_s)
            done, self._done_loads = self._done_loads, []
            for spec, num_loaded in done:
                if num_loaded < len(spec.keys):
                    self._failed_loads.add(spec.req_id)
                    if spec.groups is not None:
                        # vLLM maps failed block ids to tokens for one group only: a hybrid model's
                        # failed load is the request's, and vLLM recomputes all of it
                        self._failed_recving.add(spec.req_id)
                        continue
                self._errors_to_report |= failed_block_ids(spec, num_loaded)
        return {spec.req_id for spec, _ in done}

    def take_failed_recving(self) -> set[str]:
        """Requests (hybrid models) whose load failed, for this pass's `failed_recving`."""
        with self._lock:
            failed, self._failed_recving = self._failed_recving, set()
        return failed

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._errors_to_report = self._errors_to_report, set()
        return errors

    # ---- saves ---------------------------------------------------------------------------------

    def wait_for_save(self, meta: KVPoolMetadata | None) -> None:
        if meta is None or not meta.saves:
            return
        fence = device.kv_writes_fence(self._device)
        for spec in meta.saves:
            self._track(self._saver.submit(self._save, spec, fence))

    def _save(self, spec: SaveSpec, fence) -> None:
        started = time.perf_counter()
        k = self.geom.blocks_per_object
        stored = existing = 0
        statuses: list = []
        released = False

        def release_blocks() -> None:  # the copy is done: vLLM may reuse the blocks before PutEnd
            nonlocal released
            if not released:
                released = True
                with self._lock:
                    self._done_saves[spec.job_id] = 1

        try:
            if self._client is None or not self._health.should_try():
                raise _NoPool
            addrs, sizes = self._regions(spec.block_ids, spec.groups)
            fence.wait()  # this step's KV writes are in memory (a CUDA event on GPUs)
            statuses = self._client.put_from(spec.keys, addrs, sizes, spec.parents, on_written=release_blocks,
                                             session=spec.session, ttl_s=spec.ttl_s)
            self._health.record_success()
            stored = sum(1 for s in statuses if s == PUT_ALLOCATED)
            existing = sum(1 for s in statuses if s == PUT_EXISTS)
        except _NoPool:
            pass  # degraded: not cached
        except UnavailableError as exc:
            self._health.record_unavailable(exc)
            self.stats.add(pool_unavailable=1)
        except KVPoolError as exc:
            log.warning("kvpool: save for %s failed (%s); not cached", spec.req_id, exc)
        except Exception:
            log.exception("kvpool: unexpected error saving %s; not cached", spec.req_id)
        finally:
            release_blocks()  # even on failure: the blocks must go back to vLLM
        num_objects = len(spec.keys)
        self.stats.add(
            saves=1, saved_blocks=stored * k, save_existing_blocks=existing * k,
            save_failed_blocks=(num_objects - stored - existing) * k,
        )
        if spec.groups is None:
            saved = stored * k * (self._layout.block_bytes if self._layout else 0)
            self.stats.add(saved_bytes=saved, saved_full_bytes=saved)  # one full-attention group
        else:  # per group kind: what a token costs the pool in each (pool bytes per token by group)
            by_kind: dict[str, int] = {}
            for g, status in zip(spec.groups, statuses):
                if status == PUT_ALLOCATED:
                    name = f"saved_{self._group_kinds[g]}_bytes"
                    by_kind[name] = by_kind.get(name, 0) + self._group_layouts[g].block_bytes
            self.stats.add(saved_bytes=sum(by_kind.values()), **by_kind)
        self.stats.observe("save_latency_s", time.perf_counter() - started)

    def take_worker_meta(self) -> KVPoolWorkerMetadata | None:
        with self._lock:
            if not self._done_saves and not self._failed_loads:
                return None
            done, self._done_saves = self._done_saves, {}
            failed, self._failed_loads = self._failed_loads, set()
        return KVPoolWorkerMetadata(done, failed)

    # ---- life cycle ----------------------------------------------------------------------------

    def _track(self, future: Future) -> None:
        with self._lock:
            self._inflight.add(future)
        future.add_done_callback(self._untrack)

    def _untrack(self, future: Future) -> None:
        with self._lock:
            self._inflight.discard(future)

    def drain(self, timeout_s: float) -> bool:
        """Wait for queued loads and saves; True when none is left."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._inflight:
                    return True
            time.sleep(0.005)
        return False

    def close(self) -> None:
        if not self.drain(self._shutdown_timeout_s):
            log.warning("kvpool: shutting down with pool transfers still running")
        self._loader.shutdown(wait=False, cancel_futures=True)
        self._saver.shutdown(wait=False, cancel_futures=True)
        if self._client is not None:
            self._client.close()
            self._client = None
