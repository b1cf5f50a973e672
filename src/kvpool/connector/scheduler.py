"""The scheduler half: asks the pool what it has, plans loads and saves, holds saved blocks.

Parts: one RequestState per request (request_state.py) in `_requests`, made in `_state_of` and
dropped in `request_finished`; lookups on their own thread (lookups.py); requests waiting in
vLLM's queue (waiting.py); the blocks pinned for saves (pins.py); a hybrid model's per-group
plans (hybrid.py).

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
- With vLLM's MultiConnector beside NixlConnector (P/D), a decode request arrives with
  `kv_transfer_params["do_remote_prefill"]`: NixlConnector (listed first) loads its prompt from the
  prefill instance, and the prefill instance's own KVPoolConnector saved that prompt to the pool.
  This side then neither looks it up (no round trip delays the decode) nor saves the prompt's
  objects again; the decode-phase KV (the agent's output) is saved as usual, so the next turn's
  prefill finds prompt and output in the pool. NixlConnector clears the flag in its own
  `update_state_after_alloc`, which MultiConnector calls first: it is read when vLLM asks.
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

from kvpool.connector.groups import GroupRule, decode_state_saves, state_saves
from kvpool.connector.health import PoolHealth
from kvpool.connector.hybrid import GroupQuery, HybridPlans
from kvpool.connector.keys import object_keys
from kvpool.connector.lookups import ASK_AGAIN, DEFERRED, GIVEN_UP, REUSED, AsyncLookups
from kvpool.connector.metadata import KVPoolMetadata, KVPoolWorkerMetadata
from kvpool.connector.pins import SavePins
from kvpool.connector.plan import (
    Geometry,
    LoadSpec,
    SaveSpec,
    external_tokens,
    lookup_window,
    plan_load,
    savable_objects,
)
from kvpool.connector.request_state import RequestState
from kvpool.connector.session_hints import BadHint, TTLKeys, hint_of
from kvpool.connector.stats import StatsRecorder
from kvpool.connector.waiting import WaitingRequests
from kvpool.core import protocol
from kvpool.core.errors import KVPoolError, UnavailableError

log = logging.getLogger(__name__)

_COUNTED = {DEFERRED: "lookups_deferred", REUSED: "lookups_cached", GIVEN_UP: "lookups_given_up"}
NULL_BLOCK_ID = 0  # vLLM's placeholder block (v1/attention/backends/utils.py); never holds KV


def is_remote_prefill(request) -> bool:
    """A P/D decode request whose prompt KV a prefill instance sends (vLLM's kv_transfer_params)."""
    params = getattr(request, "kv_transfer_params", None)
    return bool(params) and bool(params.get("do_remote_prefill"))


class SchedulerSide:
    def __init__(
        self, geom: Geometry, *, make_client: Callable[[], object], health: PoolHealth,
        num_workers: int, save_decode: bool, load_async: bool, lookup_cache_ttl_s: float = 1.0,
        lookup_answer_wait_s: float = 0.002, lookup_give_up_s: float = 0.5, max_pinned_fraction: float = 0.25,
        clock: Callable[[], float] = time.monotonic, rank_namespaces: Sequence[str] = (),
        lookup_on_arrival: bool = False, touch_waiting_s: float = 0.0,
        group_rules: dict[int, GroupRule] | None = None, hit_rule=None,
    ) -> None:
        # hybrid models (several KV-cache groups, or one that is not full attention): hybrid.py
        self._hybrid = HybridPlans(geom, group_rules, hit_rule) if group_rules else None
        self._lookup_on_arrival = lookup_on_arrival
        self._waiting = WaitingRequests(touch_waiting_s) if touch_waiting_s > 0 else None
        # TP/PP > 1: each rank stores its shard under its own namespace; a prefix is a hit only
        # as far as every rank has it (vLLM's scheduler takes one answer for all ranks)
        self._rank_namespaces = list(rank_namespaces)
        self._promotion_wait_s = 0.6 * lookup_give_up_s
        self.geom = geom
        self.stats = StatsRecorder()
        self._make_client = make_client
        self._client = None
        self._health = health
        self._save_decode = save_decode
        self._load_async = load_async
        self._pins = SavePins(num_workers, max_pinned_fraction)
        self._requests: dict[str, RequestState] = {}  # request_state.py: made in _state_of, dropped in request_finished
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
        self._late_saves: list[SaveSpec] = []  # planned in request_finished

    def bind_block_pool(self, block_pool) -> None:
        self._pins.bind(block_pool)

    def _state_of(self, request_id: str) -> RequestState:
        state = self._requests.get(request_id)
        if state is None:
            state = self._requests[request_id] = RequestState(request_id)
        return state

    # ---- loads ---------------------------------------------------------------------------------

    def on_new_request(self, request) -> None:
        """vLLM added the request: look it up now (with `lookup_on_arrival`; lookups.py) and start
        its waiting clock (with `touch_waiting_s`; waiting.py)."""
        if self._waiting is not None:
            self._waiting.arrived(request.request_id, request, self._clock())
        if not self._lookup_on_arrival or is_remote_prefill(request):
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

    def _keys_of(self, request, window: int, ttl_s: float = 0.0):
        """The keys of the request's first `window` objects, made only if a lookup is sent."""
        if self._hybrid is not None:
            return lambda: self._hybrid.query(request.block_hashes, window)
        if ttl_s:
            return lambda: TTLKeys(object_keys(request.block_hashes, self.geom.blocks_per_object, 0, window), ttl_s)
        return lambda: object_keys(request.block_hashes, self.geom.blocks_per_object, 0, window)

    # ---- session hints -------------------------------------------------------------------------

    def _read_hint(self, request, state: RequestState) -> None:
        """Once per request: its session hint (kv_transfer_params); a turn with a session arrives."""
        if state.hint_read:
            return
        state.hint_read = True
        try:
            state.hint = hint_of(getattr(request, "kv_transfer_params", None))
        except BadHint as e:
            self.stats.add(bad_hints=1)
            log.warning("kvpool: request %s: ignoring its session hint (%s)", request.request_id, e)
            return
        if state.hint is None:
            return
        self.stats.add(hinted_requests=1)
        if state.hint.session:
            self._send_events([protocol.SessionEvent(state.hint.session, request.request_id, protocol.TURN_ARRIVED,
                                                     state.hint.ttl_s)])  # fmt: skip

    def _send_events(self, events: list) -> None:
        """One way, from the lookup thread, in order with the lookups (one message per rank namespace)."""
        namespaces = self._rank_namespaces if len(self._rank_namespaces) > 1 else [None]

        def send() -> None:
            client = self._lookup_client()
            for namespace in namespaces:
                client.send_session_events(events, namespace=namespace)

        self._lookups_async.run_soon(send)

    def _turn_done(self, request, state: RequestState | None) -> None:
        hint = state.hint if state is not None else None
        if hint is None or not hint.session:
            return
        events = [protocol.SessionEvent(hint.session, request.request_id, protocol.TURN_DONE)]
        if hint.end:
            events.append(protocol.SessionEvent(hint.session, request.request_id, protocol.SESSION_END))
        self._send_events(events)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        rid = request.request_id
        state = self._state_of(rid)
        state.lookup = None
        state.local_hit_tokens = num_computed_tokens
        self._read_hint(request, state)
        if state.load_failed:
            return 0, False
        if is_remote_prefill(request):
            state.remote_prefill = True
            return 0, False
        window = lookup_window(self.geom, request.num_tokens, len(request.block_hashes))
        if window * self.geom.tokens_per_object <= num_computed_tokens or not self._health.should_try():
            return 0, False
        ttl_s = state.hint.ttl_s if state.hint is not None else 0.0
        num_hit, how = self._lookups_async.ask(rid, window, self._keys_of(request, window, ttl_s))
        if how in _COUNTED:
            self.stats.add(**{_COUNTED[how]: 1})
        if num_hit is ASK_AGAIN:
            return None, False
        state.lookup = (num_computed_tokens, num_hit)
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
        if isinstance(keys, GroupQuery):
            return self._hybrid.hit_blocks(client, keys, self._rank_namespaces)
        # keys on a node's disk are promoted to DRAM meanwhile: wait for them within the budget the
        # request may wait for its answer anyway (vLLM asks again every step until then)
        wait = self._promotion_wait_s
        ttl_s = getattr(keys, "ttl_s", 0.0)  # TTLKeys: the request's hits are kept that long
        if len(self._rank_namespaces) <= 1:
            return client.lookup_prefix(keys, promotion_wait_s=wait, ttl_s=ttl_s)
        num_hit = len(keys)
        for namespace in self._rank_namespaces:  # each asks only about what every earlier rank has
            num_hit = client.lookup_prefix(keys[:num_hit], namespace=namespace, promotion_wait_s=wait,
                                           ttl_s=ttl_s) if num_hit else 0
        return num_hit

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
        state = self._state_of(rid)
        state.request = request
        # a local hit was computed (or loaded) by this instance before and saved then: putting it
        # again would only cost a round trip per step (PUT_EXISTS). If the pool evicted it since,
        # it stays evicted: the pool's choice, not ours to undo.
        self._mark_saved(state, state.take_local_hit() // self.geom.tokens_per_object)
        if state.remote_prefill:
            self._mark_saved(state, request.num_prompt_tokens // self.geom.tokens_per_object)
            self.stats.add(remote_prefills=1)
            state.remote_prefill = False  # counted once; a preempted request recomputes and saves as usual
        lookup = state.take_lookup()
        if lookup is None:
            return
        num_local, num_hit = lookup
        self._mark_saved(state, num_hit)  # objects [0, num_hit) are in the pool
        if num_external_tokens <= 0:
            return
        if self._hybrid is not None:
            self._pending_loads.append(self._hybrid.load(request, blocks.get_block_ids(), num_local,
                                                         num_external_tokens))
            self.stats.add(lookup_hit_tokens=num_external_tokens)
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

    def _mark_saved(self, state: RequestState, num_objects: int) -> None:
        """Objects [0, num_objects) need no save."""
        if self._hybrid is not None:
            self._hybrid.mark_saved(state, num_objects)
        else:
            state.mark_saved(num_objects)

    # ---- saves ---------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output) -> KVPoolMetadata:
        self._touch_waiting()
        meta = KVPoolMetadata(loads=self._pending_loads, saves=self._late_saves)
        self._pending_loads, self._late_saves = [], []
        if not self._pins.bound or not self._health.available:
            return meta  # no pool: nothing is saved (a pool that returns gets the next blocks)
        computed_before = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed_before.update(zip(cached.req_ids, cached.num_computed_tokens))
        block_state = scheduler_output.kv_connector_block_state
        hybrid = self._hybrid
        for rid, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(rid)
            if state is None or not state.admitted or rid not in computed_before or block_state is None:
                continue
            request = state.request
            num_spec = len(scheduler_output.scheduled_spec_decode_tokens.get(rid, ()))
            computed_after = computed_before[rid] + num_scheduled - num_spec
            limit = None if self._save_decode else request.num_prompt_tokens
            ready = savable_objects(self.geom, computed_after, len(request.block_hashes), limit)
            if ready > state.next_save:
                room = self._save_room()
                if room <= 0:
                    self.stats.add(saves_deferred=1)
                    continue
                ready = min(ready, state.next_save + room)  # the rest in a later step
                block_table = block_state.get_block_ids(rid)
                if block_table and hybrid is not None:
                    # windows and states are stored at the end of prefill chunks, and at the finish
                    prefill = computed_before[rid] < request.num_prompt_tokens
                    spec = self._plan_group_save(request, state, ready, block_table,
                                                 hybrid.rules if prefill else hybrid.full_rules)
                    if spec is not None:
                        meta.saves.append(spec)
                    if not prefill and computed_after == ready * self.geom.block_size:
                        self._plan_states(request, state, decode_state_saves(block_table, hybrid.rules, ready), meta)
                elif block_table:
                    spec = self._plan_save(request, state, ready, list(block_table[0]))
                    if spec is not None:
                        meta.saves.append(spec)
        if hybrid is not None:
            self._plan_state_saves(getattr(block_state, "boundary_state_offloads", None) or {}, meta)
        return meta

    def _plan_state_saves(self, offloads: dict, meta: KVPoolMetadata) -> None:
        """Mamba states vLLM committed at block boundaries this step (groups.state_saves); their
        blocks are pinned like any save's, since vLLM keeps them only until this pass ends."""
        for rid, entries in offloads.items():
            state = self._requests.get(rid)
            if state is None or not state.admitted:
                continue
            request = state.request
            self._plan_states(request, state, state_saves(entries, self._hybrid.rules, self.geom.block_size,
                                                          len(request.block_hashes)), meta)

    def _plan_states(self, request, state: RequestState, objects, meta: KVPoolMetadata) -> None:
        if objects:
            meta.saves.append(self._pin_objects(request, state, objects))

    def _save_room(self) -> int:
        """How many more objects' blocks may be pinned for saves now."""
        return self._pins.room_blocks() // self.geom.blocks_per_object

    def _plan_save(self, request, state: RequestState, stop: int, block_table: list[int]) -> SaveSpec | None:
        k, start = self.geom.blocks_per_object, state.next_save
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
        state.next_save = stop
        return self._pin_save(request, state, keys, parents, per_object, [b for blocks in per_object for b in blocks])

    def _plan_group_save(self, request, state: RequestState, boundary: int, block_tables,
                         rules: dict[int, GroupRule]) -> SaveSpec | None:
        """Hybrid models: each group's blocks for a save at `boundary` blocks (hybrid.py)."""
        objects = self._hybrid.save(state, boundary, block_tables, rules)
        return self._pin_objects(request, state, objects) if objects else None

    def _pin_objects(self, request, state: RequestState, objects) -> SaveSpec:
        """A save of single-block objects (groups.BlockObject), keyed by hybrid.keys_and_parents."""
        keys, parents = self._hybrid.keys_and_parents(request.block_hashes, objects)
        flat = [o.block_id for o in objects]
        return self._pin_save(request, state, keys, parents, [[b] for b in flat], flat, [o.group for o in objects])

    def _pin_save(self, request, state: RequestState, keys, parents, per_object, flat, groups=None) -> SaveSpec:
        job_id = self._pins.pin(flat)
        state.save_jobs.add(job_id)
        hint = state.hint
        if hint is None:
            return SaveSpec(job_id, request.request_id, list(keys), parents, per_object, groups)
        return SaveSpec(job_id, request.request_id, list(keys), parents, per_object, groups, hint.session, hint.ttl_s)

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, KVPoolWorkerMetadata):
            return
        for rid in meta.failed_loads:
            state = self._requests.get(rid)
            if state is not None and state.admitted:
                state.load_failed = True
        for job_id, count in meta.completed_save_jobs.items():
            self._pins.reported(job_id, count)

    def request_finished(self, request, block_ids) -> tuple[bool, None]:
        """`block_ids`: the request's blocks, a list; for a hybrid model, one list per group."""
        rid = request.request_id
        state = self._requests.pop(rid, None)
        self._lookups_async.forget(rid)
        if self._waiting is not None:
            self._waiting.finished(rid)
        self._turn_done(request, state)
        if state is not None and state.admitted and self._pins.bound and self._health.available:
            # Objects computed in the last steps whose hashes came late (async scheduling): plan
            # them now, while the blocks are still the request's; the references keep them alive.
            limit = None if self._save_decode else request.num_prompt_tokens
            ready = savable_objects(self.geom, request.num_computed_tokens, len(request.block_hashes), limit)
            if self._hybrid is not None:  # the last boundary's windows and states too
                spec = self._plan_group_save(request, state, ready, block_ids, self._hybrid.rules)
                if spec is not None:
                    self._late_saves.append(spec)
            elif ready > state.next_save and self._save_room() < ready - state.next_save:
                self.stats.add(saves_dropped=1)  # its blocks go back to vLLM now rather than wait
            elif ready > state.next_save:
                spec = self._plan_save(request, state, ready, list(block_ids))
                if spec is not None:
                    self._late_saves.append(spec)
        return False, None

    def has_pending_saves(self) -> bool:
        return self._pins.has_pending()

    def close(self) -> None:
        self._lookups_async.close()
        if self._client is not None:
            self._client.close()
            self._client = None
