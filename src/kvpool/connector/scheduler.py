"""The scheduler half: asks the pool what it has, plans loads and saves, holds saved blocks.

Facts this relies on (vLLM 0.32, v1/core/sched/scheduler.py):
- `get_num_new_matched_tokens(request, n)` runs for a request whose num_computed_tokens is 0, with
  `n` the block-aligned local prefix-cache hit. It may run again for the same request (when the
  allocation fails, the request is retried next step), so it only records its latest answer.
  Returning (k, True) puts the request in WAITING_FOR_REMOTE_KVS until the worker lists it in
  `finished_recving`; vLLM then caches the loaded blocks and, on a whole-prompt hit, recomputes the
  last token. Returning (k, False) makes the load synchronous (before this step's forward).
- `update_state_after_alloc(request, blocks, k)` follows every admission (also with k == 0, and
  for MultiConnector children that were not chosen); `blocks` is the request's block table.
- `build_connector_meta` runs before `request.num_computed_tokens` advances; the scheduled tokens'
  KV exists once the step's forward pass is done. `scheduler_output.kv_connector_block_state`
  resolves the block table of every scheduled request.
- `request.block_hashes` grow as tokens become known, during decode too (Request.
  append_output_token_ids -> update_block_hashes), one hash per full block.
- Save sources stay valid because we take a reference on their blocks in vLLM's block pool
  (`touch`) when planning a save and drop it (`free_blocks`, tail first) once every worker has
  reported the job in its KVPoolWorkerMetadata: a finished or preempted request's blocks are then
  not reused while a write reads them. `has_pending_push_work` keeps the engine stepping until all
  references are dropped. (vLLM's other mechanism, request_finished -> True + finished_sending,
  would not protect blocks of a preempted request, and saves happen during the request's life.)
- vLLM counts `external_prefix_cache_{queries,hits}` from what this class returns: queries are the
  request's tokens beyond the local hit, hits the tokens we report.
- `get_num_new_matched_tokens` may answer (None, False): vLLM skips the request this step and asks
  again next step. Lookups therefore run on their own thread (lookups.py) and the engine step waits
  for one at most `lookup_answer_wait_s` (2 ms by default): a slow or stalled master delays the
  requests that wait for its answer, up to `lookup_give_up_s`, and then they are computed; it
  never stalls the step, and so never the requests already running.
- A request that waits in vLLM's queue longer than `touch_waiting_s` has its prefix looked up
  again every `touch_waiting_s` without anyone waiting for the answer (waiting.py), so the pool's
  LRU does not evict the prefix of the request it is about to serve. `on_new_request` (vLLM's
  add_request) starts the clock; admission or finish stops it.
- A hybrid model (several KV-cache groups) keeps one object per (group, block): one `Exists`
  round trip per rank namespace answers every group, vLLM's coordinator picks the hit
  (hit_rule.py), each group's rule picks what a save stores (groups.py), Mamba states come from
  vLLM's boundary-state hand-offs, and loads are asynchronous (failures go to `failed_recving`).
- Saves never starve admission: blocks pinned for saves (planned, not yet reported copied) are
  bounded by `max_pinned_fraction` of vLLM's blocks. Past it, a running request's save waits for
  a later step (`saves_deferred`; its blocks stay the request's anyway) and a finished request's is
  dropped (`saves_dropped`), so its blocks go back to vLLM at once. The worker reports a save as
  soon as its copy is done, before the master's acknowledgement (worker.py), so pins are short.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from kvpool.connector.groups import (
    GroupRule,
    blocks_to_load,
    blocks_to_save,
    decode_state_saves,
    group_block_key,
    state_saves,
    intersect_present,
    lookup_keys,
    present_blocks,
)
from kvpool.connector.health import PoolHealth
from kvpool.connector.keys import object_keys
from kvpool.connector.lookups import ASK_AGAIN, DEFERRED, GIVEN_UP, REUSED, AsyncLookups
from kvpool.connector.metadata import KVPoolMetadata, KVPoolWorkerMetadata
from kvpool.connector.plan import (
    Geometry,
    LoadSpec,
    RequestTracker,
    SaveSpec,
    external_tokens,
    lookup_window,
    plan_load,
    savable_objects,
)
from kvpool.connector.stats import StatsRecorder
from kvpool.connector.waiting import WaitingRequests
from kvpool.core.errors import KVPoolError, UnavailableError

log = logging.getLogger(__name__)

_COUNTED = {DEFERRED: "lookups_deferred", REUSED: "lookups_cached", GIVEN_UP: "lookups_given_up"}
NULL_BLOCK_ID = 0  # vLLM's placeholder block (v1/attention/backends/utils.py); never holds KV


class SchedulerSide:
    def __init__(
        self, geom: Geometry, *, make_client: Callable[[], object], health: PoolHealth,
        num_workers: int, save_decode: bool, load_async: bool, lookup_cache_ttl_s: float = 1.0,
        lookup_answer_wait_s: float = 0.002, lookup_give_up_s: float = 0.5, max_pinned_fraction: float = 0.25,
        clock: Callable[[], float] = time.monotonic, rank_namespaces: Sequence[str] = (),
        lookup_on_arrival: bool = False, touch_waiting_s: float = 0.0,
        group_rules: dict[int, GroupRule] | None = None, hit_rule=None,
    ) -> None:
        # hybrid models (several KV-cache groups, or one that is not full attention): one object per
        # (group, block), groups.py; the hit every group can serve is vLLM's own rule (hit_rule.py)
        self._group_rules = group_rules or None
        if self._group_rules is not None:
            if geom.blocks_per_object != 1:
                raise ValueError("a hybrid model's pool objects are single blocks: leave tokens_per_object unset")
            if hit_rule is None:
                raise ValueError("a hybrid model needs vLLM's hit rule")
            # full-attention groups first: a load's leading objects are the prefix
            self._group_order = sorted(self._group_rules, key=lambda g: self._group_rules[g].kind != "full")
            self._full_rules = {g: r for g, r in self._group_rules.items() if r.kind == "full"}
            self._first_full = next(iter(self._full_rules), None)
        self._hit_rule = hit_rule
        self._lookup_on_arrival = lookup_on_arrival
        self._waiting = WaitingRequests(touch_waiting_s) if touch_waiting_s > 0 else None
        # TP/PP > 1: each rank stores its shard under its own namespace; a prefix is a hit only
        # as far as every rank has it (vLLM's scheduler takes one answer for all ranks)
        self._rank_namespaces = list(rank_namespaces)
        self._promotion_wait_s = 0.6 * lookup_give_up_s
        self._max_pinned_fraction = max_pinned_fraction
        self._num_pinned_blocks = 0
        self.geom = geom
        self.stats = StatsRecorder()
        self._make_client = make_client
        self._client = None
        self._health = health
        self._num_workers = num_workers
        self._save_decode = save_decode
        self._load_async = load_async
        self._block_pool = None
        self._requests: dict[str, object] = {}  # req id -> vLLM Request, while it lives
        self._trackers: dict[str, RequestTracker] = {}
        self._lookups: dict[str, tuple[int, int]] = {}  # req id -> (local tokens, pool hit objects)
        self._local_hits: dict[str, int] = {}  # req id -> vLLM's local hit (tokens) at admission
        # vLLM asks again every step while a request waits for blocks; the master's answer is reused
        # until the request is admitted or for lookup_cache_ttl_s. A stale hit only makes a load fail
        # (reported, recomputed); a stale miss only skips the pool for this request.
        self._clock = clock
        self._lookups_async = AsyncLookups(
            self._lookup_now, self._lookup_done, answer_wait_s=lookup_answer_wait_s,
            give_up_s=lookup_give_up_s, reuse_s=lookup_cache_ttl_s, clock=clock, warm_up=self._connect,
            on_touch=self._touch_done,
        )
        self._pending_loads: list[LoadSpec] = []
        # requests whose pool load came back short: vLLM recomputes them, and asking the pool again
        # would plan the same failing load forever (the master may list a dead node's objects
        # until the node's TTL ends)
        self._load_failed: set[str] = set()
        self._late_saves: list[SaveSpec] = []  # planned in request_finished
        self._pinned: dict[int, tuple[list[int], int]] = {}  # job id -> (block ids, workers to report)
        self._next_job_id = 0

    def bind_block_pool(self, block_pool) -> None:
        self._block_pool = block_pool

    # ---- loads ---------------------------------------------------------------------------------

    def on_new_request(self, request) -> None:
        """vLLM added the request: look it up now (with `lookup_on_arrival`; lookups.py) and start
        its waiting clock (with `touch_waiting_s`; waiting.py)."""
        if self._waiting is not None:
            self._waiting.arrived(request.request_id, request, self._clock())
        if not self._lookup_on_arrival:
            return
        window = lookup_window(self.geom, request.num_tokens, len(request.block_hashes))
        if window <= 0 or not self._health.should_try():
            return
        self._lookups_async.prefetch(request.request_id, window, self._keys_of(request, window))
        self.stats.add(lookups_prefetched=1)

    def _touch_waiting(self) -> None:
        """Once per engine step: touch the prefixes of requests that have waited long (waiting.py)."""
        if self._waiting is None or not self._health.available:
            return
        for request in self._waiting.due(self._clock()):
            window = lookup_window(self.geom, request.num_tokens, len(request.block_hashes))
            if window > 0:
                self._lookups_async.touch(self._keys_of(request, window))
                self.stats.add(prefix_touches=1)

    def _touch_done(self, ok: bool, num_hit: int) -> None:
        if ok:
            self.stats.add(prefix_touched_objects=num_hit)
        else:
            self.stats.add(prefix_touch_failures=1)

    def _keys_of(self, request, window: int):
        """The keys of the request's first `window` objects, made only if a lookup is sent."""
        if self._group_rules is not None:
            return lambda: _GroupQuery(request.block_hashes[:window], lookup_keys(
                request.block_hashes, self._group_order, window), self._group_order)
        return lambda: object_keys(request.block_hashes, self.geom.blocks_per_object, 0, window)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        rid = request.request_id
        self._lookups.pop(rid, None)
        self._local_hits[rid] = num_computed_tokens
        if rid in self._load_failed:
            return 0, False
        window = lookup_window(self.geom, request.num_tokens, len(request.block_hashes))
        if window * self.geom.tokens_per_object <= num_computed_tokens or not self._health.should_try():
            return 0, False
        num_hit, how = self._lookups_async.ask(rid, window, self._keys_of(request, window))
        if how in _COUNTED:
            self.stats.add(**{_COUNTED[how]: 1})
        if num_hit is ASK_AGAIN:
            return None, False
        self._lookups[rid] = (num_computed_tokens, num_hit)
        num_external = external_tokens(self.geom, num_hit, num_computed_tokens)
        return num_external, self._load_async and num_external > 0

    def _lookup_client(self):
        """The lookup thread's client, made there on first use."""
        if self._client is None:
            self._client = self._make_client()
        return self._client

    def _connect(self) -> None:
        """On the lookup thread, before any lookup: make the client and its connection."""
        self._lookup_client().ping()

    def _lookup_now(self, keys) -> int:
        """On the lookup thread: one round trip."""
        client = self._lookup_client()
        if isinstance(keys, _GroupQuery):
            return self._lookup_groups(client, keys)
        # keys on a node's disk are promoted to DRAM meanwhile: wait for them within the budget the
        # request may wait for its answer anyway (vLLM asks again every step until then)
        wait = self._promotion_wait_s
        if len(self._rank_namespaces) <= 1:
            return client.lookup_prefix(keys, promotion_wait_s=wait)
        num_hit = len(keys)
        for namespace in self._rank_namespaces:  # each asks only about what every earlier rank has
            num_hit = client.lookup_prefix(keys[:num_hit], namespace=namespace, promotion_wait_s=wait) if num_hit else 0
        return num_hit

    def _lookup_groups(self, client, query: "_GroupQuery") -> int:
        """Hybrid models: which (group, block) objects exist, in one round trip per rank namespace;
        then the hit every group can serve, in blocks, by vLLM's rule."""
        num_blocks = len(query.hashes)
        answers = [present_blocks(query.groups, num_blocks, client.exists(query.keys, namespace=namespace))
                   for namespace in (self._rank_namespaces or [None])]
        hit_tokens = self._hit_rule.longest_hit(query.hashes, num_blocks, intersect_present(answers))
        return hit_tokens // self.geom.block_size

    def _lookup_done(self, ok: bool, error: BaseException | None, latency_s: float) -> None:
        if ok:
            self._health.record_success()
            self.stats.add(lookups=1)
            self.stats.observe("lookup_latency_s", latency_s)
        elif isinstance(error, UnavailableError):
            self._health.record_unavailable(error)
            self.stats.add(lookups=1, lookup_failures=1, pool_unavailable=1)
        else:
            if isinstance(error, KVPoolError):
                log.warning("kvpool: lookup failed (%s); treating it as a miss", error)
            else:
                log.error("kvpool: unexpected lookup error (%r); treating it as a miss", error)
            self.stats.add(lookups=1, lookup_failures=1)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        rid = request.request_id
        self._lookups_async.forget(rid)  # admitted: a later admission (after preemption) asks again
        if self._waiting is not None:
            self._waiting.admitted(rid)
        self._requests[rid] = request
        tracker = self._trackers.setdefault(rid, RequestTracker(rid))
        # a local hit was computed (or loaded) by this instance before and saved then: putting it
        # again would only cost a round trip per step (PUT_EXISTS). If the pool evicted it since,
        # it stays evicted: the pool's choice, not ours to undo.
        num_local_objects = self._local_hits.pop(rid, 0) // self.geom.tokens_per_object
        self._mark_saved(tracker, num_local_objects)
        lookup = self._lookups.pop(rid, None)
        if lookup is None:
            return
        num_local, num_hit = lookup
        self._mark_saved(tracker, num_hit)  # objects [0, num_hit) are in the pool
        if num_external_tokens <= 0:
            return
        if self._group_rules is not None:
            self._plan_group_load(request, blocks.get_block_ids(), num_local, num_external_tokens)
            return
        k = self.geom.blocks_per_object
        first_object = num_local // self.geom.block_size // k
        end_object = (num_local + num_external_tokens) // self.geom.tokens_per_object
        keys = object_keys(request.block_hashes, k, first_object, end_object)
        (block_ids,) = blocks.get_block_ids()
        self._pending_loads.append(
            plan_load(self.geom, rid, keys, first_object, num_local, num_external_tokens, list(block_ids))
        )
        self.stats.add(lookup_hit_tokens=num_external_tokens)

    def _mark_saved(self, tracker: RequestTracker, num_objects: int) -> None:
        """Objects [0, num_objects) need no save (a hybrid model: nor the groups' windows or
        states at that boundary, which the hit needed)."""
        tracker.next_save = max(tracker.next_save, num_objects)
        if self._group_rules is not None:
            for g in self._group_rules:
                tracker.saved_until[g] = max(tracker.saved_until.get(g, 0), num_objects)

    def _plan_group_load(self, request, block_tables, num_local: int, num_external_tokens: int) -> None:
        """Hybrid models: read every block vLLM allocated between the local hit and the pool hit."""
        bs = self.geom.block_size
        objects = blocks_to_load(block_tables, self._group_order, num_local // bs,
                                 (num_local + num_external_tokens) // bs)
        hashes = request.block_hashes
        self._pending_loads.append(LoadSpec(
            request.request_id, [group_block_key(o.group, hashes[o.index]) for o in objects],
            [[o.block_id] for o in objects], [o.group for o in objects]))
        self.stats.add(lookup_hit_tokens=num_external_tokens)

    # ---- saves ---------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output) -> KVPoolMetadata:
        self._touch_waiting()
        meta = KVPoolMetadata(loads=self._pending_loads, saves=self._late_saves)
        self._pending_loads, self._late_saves = [], []
        if self._block_pool is None or not self._health.available:
            return meta  # no pool: nothing is saved (a pool that returns gets the next blocks)
        computed_before = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed_before.update(zip(cached.req_ids, cached.num_computed_tokens))
        block_state = scheduler_output.kv_connector_block_state
        for rid, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            request, tracker = self._requests.get(rid), self._trackers.get(rid)
            if request is None or tracker is None or rid not in computed_before or block_state is None:
                continue
            num_spec = len(scheduler_output.scheduled_spec_decode_tokens.get(rid, ()))
            computed_after = computed_before[rid] + num_scheduled - num_spec
            limit = None if self._save_decode else request.num_prompt_tokens
            ready = savable_objects(self.geom, computed_after, len(request.block_hashes), limit)
            if ready > tracker.next_save:
                room = self._save_room()
                if room <= 0:
                    self.stats.add(saves_deferred=1)
                    continue
                ready = min(ready, tracker.next_save + room)  # the rest in a later step
                block_table = block_state.get_block_ids(rid)
                if block_table and self._group_rules is not None:
                    # windows and states are stored at the end of prefill chunks, and at the finish
                    prefill = computed_before[rid] < request.num_prompt_tokens
                    spec = self._plan_group_save(request, tracker, ready, block_table,
                                                 self._group_rules if prefill else self._full_rules)
                    if spec is not None:
                        meta.saves.append(spec)
                    if not prefill and computed_after == ready * self.geom.block_size:
                        self._plan_states(request, tracker, decode_state_saves(block_table, self._group_rules, ready),
                                          meta)
                elif block_table:
                    spec = self._plan_save(request, tracker, ready, list(block_table[0]))
                    if spec is not None:
                        meta.saves.append(spec)
        if self._group_rules is not None:
            self._plan_state_saves(getattr(block_state, "boundary_state_offloads", None) or {}, meta)
        return meta

    def _plan_state_saves(self, offloads: dict, meta: KVPoolMetadata) -> None:
        """Mamba states vLLM committed at block boundaries this step (groups.state_saves); their
        blocks are pinned like any save's, since vLLM keeps them only until this pass ends."""
        for rid, entries in offloads.items():
            request, tracker = self._requests.get(rid), self._trackers.get(rid)
            if request is None or tracker is None:
                continue
            self._plan_states(request, tracker, state_saves(entries, self._group_rules, self.geom.block_size,
                                                            len(request.block_hashes)), meta)

    def _plan_states(self, request, tracker: RequestTracker, objects, meta: KVPoolMetadata) -> None:
        if objects:
            meta.saves.append(self._pin_objects(request, tracker, objects))

    def _save_room(self) -> int:
        """How many more objects' blocks may be pinned for saves now."""
        limit = int(self._max_pinned_fraction * self._block_pool.num_gpu_blocks)
        return (limit - self._num_pinned_blocks) // self.geom.blocks_per_object

    def _plan_save(self, request, tracker: RequestTracker, stop: int, block_table: list[int]) -> SaveSpec | None:
        k, start = self.geom.blocks_per_object, tracker.next_save
        per_object: list[list[int]] = []
        for obj in range(start, stop):
            blocks = block_table[obj * k : (obj + 1) * k]
            if len(blocks) < k or NULL_BLOCK_ID in blocks:
                break  # not allocated here (should not happen for computed tokens); stop the chain
            per_object.append(blocks)
        if not per_object:
            return None
        stop = start + len(per_object)
        keys = object_keys(request.block_hashes, k, max(start - 1, 0), stop)
        parents: list[str | None] = keys[:-1] if start > 0 else [None, *keys[:-1]]
        keys = keys[1:] if start > 0 else keys
        tracker.next_save = stop
        return self._pin_save(request, tracker, keys, parents, per_object, [b for blocks in per_object for b in blocks])

    def _plan_group_save(self, request, tracker: RequestTracker, boundary: int, block_tables,
                         rules: dict[int, GroupRule]) -> SaveSpec | None:
        """Hybrid models: each group's blocks for a save at `boundary` blocks (groups.py)."""
        objects, tracker.saved_until = blocks_to_save(block_tables, rules, tracker.saved_until, boundary)
        if self._first_full is not None:
            tracker.next_save = tracker.saved_until.get(self._first_full, 0)
        return self._pin_objects(request, tracker, objects) if objects else None

    def _pin_objects(self, request, tracker: RequestTracker, objects) -> SaveSpec:
        """A save of single-block objects (groups.BlockObject). A full-attention block's parent is
        the block before it; any other's is the full-attention block at its place, so it is
        evicted before the prefix it extends."""
        hashes, first_full = request.block_hashes, self._first_full
        keys, parents = [], []
        for o in objects:
            keys.append(group_block_key(o.group, hashes[o.index]))
            if self._group_rules[o.group].kind == "full":
                parents.append(group_block_key(o.group, hashes[o.index - 1]) if o.index else None)
            else:
                parents.append(group_block_key(first_full, hashes[o.index]) if first_full is not None else None)
        flat = [o.block_id for o in objects]
        return self._pin_save(request, tracker, keys, parents, [[b] for b in flat], flat, [o.group for o in objects])

    def _pin_save(self, request, tracker: RequestTracker, keys, parents, per_object, flat, groups=None) -> SaveSpec:
        job_id, self._next_job_id = self._next_job_id, self._next_job_id + 1
        self._block_pool.touch([self._block_pool.blocks[b] for b in flat])
        self._pinned[job_id] = (flat, self._num_workers)
        self._num_pinned_blocks += len(flat)
        tracker.pending_jobs.add(job_id)
        return SaveSpec(job_id, request.request_id, list(keys), parents, per_object, groups)

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, KVPoolWorkerMetadata):
            return
        self._load_failed |= meta.failed_loads & self._requests.keys()
        for job_id, count in meta.completed_save_jobs.items():
            pinned = self._pinned.get(job_id)
            if pinned is None:
                log.warning("kvpool: a worker reported unknown save job %d", job_id)
                continue
            block_ids, remaining = pinned[0], pinned[1] - count
            if remaining > 0:
                self._pinned[job_id] = (block_ids, remaining)
                continue
            del self._pinned[job_id]
            self._num_pinned_blocks -= len(block_ids)
            # tail first, so vLLM evicts a prefix's end before its start
            self._block_pool.free_blocks(self._block_pool.blocks[b] for b in reversed(block_ids))

    def request_finished(self, request, block_ids) -> tuple[bool, None]:
        """`block_ids`: the request's blocks, a list; for a hybrid model, one list per group."""
        rid = request.request_id
        tracker = self._trackers.pop(rid, None)
        self._requests.pop(rid, None)
        self._lookups.pop(rid, None)
        self._lookups_async.forget(rid)
        if self._waiting is not None:
            self._waiting.finished(rid)
        self._local_hits.pop(rid, None)
        self._load_failed.discard(rid)
        if tracker is not None and self._block_pool is not None and self._health.available:
            # Objects computed in the last steps whose hashes came late (async scheduling): plan
            # them now, while the blocks are still the request's; the references keep them alive.
            limit = None if self._save_decode else request.num_prompt_tokens
            ready = savable_objects(self.geom, request.num_computed_tokens, len(request.block_hashes), limit)
            if self._group_rules is not None:  # the last boundary's windows and states too
                spec = self._plan_group_save(request, tracker, ready, block_ids, self._group_rules)
                if spec is not None:
                    self._late_saves.append(spec)
            elif ready > tracker.next_save and self._save_room() < ready - tracker.next_save:
                self.stats.add(saves_dropped=1)  # its blocks go back to vLLM now rather than wait
            elif ready > tracker.next_save:
                spec = self._plan_save(request, tracker, ready, list(block_ids))
                if spec is not None:
                    self._late_saves.append(spec)
        return False, None

    def has_pending_saves(self) -> bool:
        return bool(self._pinned)

    def close(self) -> None:
        self._lookups_async.close()
        if self._client is not None:
            self._client.close()
            self._client = None


class _GroupQuery:
    """A hybrid model's lookup: the window's block hashes and every group's keys for them."""

    __slots__ = ("hashes", "keys", "groups")

    def __init__(self, hashes, keys: list[str], groups: list[int]) -> None:
        self.hashes, self.keys, self.groups = list(hashes), keys, groups

    def __len__(self) -> int:
        return len(self.hashes)
