"""One serving instance: vLLM-like scheduling of its requests, step by step, on simulated time.

Rules (vLLM v1's scheduler, reduced):
- Each step has a token budget. Running requests go first, in admission order: a decode takes one
  token, a prefill a chunk of what is left (chunked prefill); then waiting requests are admitted
  in arrival order while budget, sequence slots and KV blocks last (a head that does not fit
  blocks the queue, as in vLLM's FCFS).
- Admission looks up the local prefix cache, then (aggregated or prefill instances with a pool)
  the pool for the blocks past the local hit; a pool hit allocates blocks and waits for the load
  (LOADING), then rejoins the queue's head. Hits are capped at prompt - 1 tokens with
  `recompute_last_token`, as vLLM does.
- A request that needs a block when none is free preempts the last admitted running request
  (recompute: its blocks go back, cached ones stay cached, and it waits at the queue's head).
- A step made only of decodes, with no admission possible, is run as a segment of k steps at once
  (up to the first finish or the last block that fits): per-event work stays small. An arrival
  cuts the segment at the next step boundary, so it waits no longer than in a real engine.
- No I/O. The fleet (fleet.py) owns the clock, the pool and the routing; this module calls back
  `fleet.start_load`, `fleet.prefill_done` and `fleet.finished`.
"""

from __future__ import annotations

from collections import deque

from kvpool.router.policy import oldest_wait_s
from kvpool.sim.config import SchedulerConfig
from kvpool.sim.cost import StepCost
from kvpool.sim.kvcache import BlockCache
from kvpool.sim.request import DONE, LOADING, RUNNING, WAITING, Request


class Instance:
    def __init__(self, index: int, name: str, role: str, cost: StepCost, kv_tokens: int,
                 sched: SchedulerConfig, num_devices: int, nic_bytes_s: float, fleet) -> None:
        self.index = index
        self.name = name
        self.role = role  # "mixed", "prefill" or "decode"
        self.cost = cost
        self.sched = sched
        self.bt = sched.block_tokens
        self.cache = BlockCache(max(1, kv_tokens // sched.block_tokens))
        self.num_devices = num_devices
        self.nic_bytes_s = nic_bytes_s
        self.fleet = fleet
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.busy = False
        self.version = 0  # bumps when a scheduled step end is replaced
        self.batch: list[tuple[Request, int]] = []
        self.segment: tuple[float, int, float, float] | None = None  # (start, steps, first, last step s)
        self.step_end_s = 0.0
        self.link_free_s = 0.0
        self.inflight_prompt_tokens = 0
        self.inflight_decode_tokens = 0
        self.busy_s = 0.0
        self.steps = 0
        self.preemptions = 0
        self.polling = False  # requests wait for a pool lookup's answer: step again even if idle
        # requests routed here still without a first token, in routing order: id -> routed at (s)
        self.unanswered: dict[int, float] = {}

    def oldest_wait_s(self, now_s: float) -> float:
        """How long the oldest request routed here has waited for its first token (the router's rule)."""
        return oldest_wait_s(self.unanswered, now_s)

    # ---- queue ---------------------------------------------------------------------------------

    def enqueue(self, req: Request, now_s: float, front: bool = False) -> None:
        req.instance = self
        req.state = WAITING
        if front:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)
        if not self.busy:
            self.fleet.kick(self, now_s)
        elif self.segment is not None:
            self._cut_segment(now_s)

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.bt)

    # ---- one step ------------------------------------------------------------------------------

    def plan(self, now_s: float) -> float | None:
        """Choose the next step's batch; returns its duration, or None when there is nothing to do."""
        cache = self.cache
        budget = self.sched.max_num_batched_tokens
        batch: list[tuple[Request, int]] = []
        running = self.running
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            new = min(r.target - r.num_computed, budget) if r.num_computed < r.target else 1
            need = self._blocks_for(r.num_computed + new) - r.num_blocks
            while need > cache.free_blocks:
                victim = running[-1]
                self._preempt(victim)
                preempted = True
                if victim is r:
                    break
            if r.state != RUNNING:
                break
            if need > 0:
                cache.allocate(need)
                r.anon += need
            batch.append((r, new))
            budget -= new
            i += 1
        self.polling = False
        if not preempted:
            budget = self._admit(budget, batch, now_s)
        self.batch = batch
        self.segment = None
        if not batch:
            if self.polling:
                self.polling = False
                return self.cost.overhead_s  # an empty step: the engine polls for the lookups' answers
            return None
        tokens = 0
        units = 0.0
        kv_read = 0
        decode_only = True
        for r, new in batch:
            c = r.num_computed
            tokens += new
            units += new * c + new * (new + 1) / 2
            kv_read += c + new
            if new != 1 or c < r.target:
                decode_only = False
        step_s = self.cost.step_s(tokens, units, kv_read)
        if decode_only and not self._admissible():
            steps = self._segment_steps(batch)
            if steps > 1:
                n = len(batch)
                last_s = self.cost.step_s(tokens, units + n * (steps - 1), kv_read + n * (steps - 1))
                self.segment = (now_s, steps, step_s, last_s)
                return steps * (step_s + last_s) / 2
        return step_s

    def _admissible(self) -> bool:
        """Whether the queue's head could be admitted next step (then no multi-step segment)."""
        if not self.waiting or len(self.running) >= self.sched.max_num_seqs:
            return False
        r = self.waiting[0]
        return self.cache.free_blocks >= self._blocks_for(max(r.num_computed, 1) + 1) - r.num_blocks

    def _segment_steps(self, batch: list[tuple[Request, int]]) -> int:
        steps = min(r.output_tokens - r.outputs_done for r, _ in batch)
        if steps <= 1:
            return 1
        free = self.cache.free_blocks

        def extra(k: int) -> int:
            return sum(self._blocks_for(r.num_computed + k) - r.num_blocks for r, _ in batch)

        if extra(steps) <= free:
            return steps
        lo, hi = 1, steps  # extra(lo) <= free (the first step is allocated)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if extra(mid) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _cut_segment(self, now_s: float) -> None:
        start, steps, first_s, last_s = self.segment
        if steps <= 1:
            return  # cut already to the step in progress
        slope = (last_s - first_s) / (steps - 1)
        elapsed = now_s - start

        def done_by(m: int) -> float:
            return m * first_s + slope * m * (m - 1) / 2

        lo, hi = 1, steps
        while lo < hi:  # the first m whose end is at or after now
            mid = (lo + hi) // 2
            if done_by(mid) >= elapsed:
                hi = mid
            else:
                lo = mid + 1
        if lo < steps:
            self.segment = (start, lo, first_s, first_s + slope * (lo - 1))
            self.fleet.reschedule(self, start + done_by(lo))

    def _admit(self, budget: int, batch: list[tuple[Request, int]], now_s: float) -> int:
        cache = self.cache
        waiting = self.waiting
        running = self.running
        bt = self.bt
        skipped: list[Request] = []
        pool = self.fleet.pool
        while waiting and budget > 0 and len(running) < self.sched.max_num_seqs:
            r = waiting[0]
            if pool is not None and not r.pool_asked and self.role != "decode":
                # the pool lookup runs off the engine step: answered "ask again", the request is
                # skipped this step and considered again at the next (the connector's behaviour)
                r.pool_asked = True
                skipped.append(waiting.popleft())
                continue
            if r.num_blocks == 0 and r.num_computed == 0 and self.role != "decode":
                limit = len(r.keys)
                if self.sched.recompute_last_token:
                    limit = min(limit, (r.prompt_tokens - 1) // bt)
                local = cache.prefix_hit(r.keys, limit)
                pool_blocks = 0
                if self.fleet.pool is not None and local < limit:
                    pool_blocks = self.fleet.pool_lookup(r, limit, now_s)
                if not r.looked_up:
                    r.looked_up = True
                    r.local_hit_tokens = local * bt
                    r.pool_hit_tokens = max(0, pool_blocks - local) * bt
                hit_keys = r.keys[:local]
                cache.acquire(hit_keys)  # first: held hits leave the LRU, so they count against free blocks
                if pool_blocks > local:
                    if not cache.can_allocate(pool_blocks - local):
                        cache.release(hit_keys, 0)
                        break
                    r.held_keys = hit_keys
                    cache.allocate(pool_blocks - local)
                    r.anon = pool_blocks - local
                    r.num_computed = local * bt
                    waiting.popleft()
                    r.state = LOADING
                    self.fleet.start_load(r, self, local, pool_blocks, now_s)
                    continue
                if local and not cache.can_allocate(self._blocks_for(local * bt + 1) - local):
                    cache.release(hit_keys, 0)
                    break
                r.held_keys = hit_keys
                r.num_computed = local * bt
            elif self.role == "decode" and r.num_blocks == 0:
                need = self._blocks_for(r.num_computed + 1)
                if not cache.can_allocate(need):
                    break
                cache.allocate(need)
                r.anon = need
            if r.num_computed < r.target:
                new = min(r.target - r.num_computed, budget)
            else:
                new = 1
            need = self._blocks_for(r.num_computed + new) - r.num_blocks
            if not cache.can_allocate(need):
                if r.num_blocks and not running:
                    raise RuntimeError(
                        f"instance {self.name}: a {r.target}-token request cannot fit in "
                        f"{cache.capacity} blocks of {bt} tokens; raise the KV capacity or shorten the trace")
                break
            waiting.popleft()
            if need > 0:
                cache.allocate(need)
                r.anon += need
            r.state = RUNNING
            running.append(r)
            batch.append((r, new))
            budget -= new
        if skipped:
            waiting.extendleft(reversed(skipped))
            self.polling = True
        return budget

    def _preempt(self, r: Request) -> None:
        self.running.remove(r)
        self.cache.release(r.held_keys, r.anon)
        r.held_keys = []
        r.anon = 0
        r.target = r.prompt_tokens + r.outputs_done  # recompute: prompt and the output so far
        r.num_computed = 0
        r.preemptions += 1
        self.preemptions += 1
        r.state = WAITING
        self.waiting.appendleft(r)

    # ---- step end ------------------------------------------------------------------------------

    def apply(self, start_s: float, end_s: float) -> None:
        """The planned step (or segment) ended at `end_s`: progress, first tokens, finishes."""
        self.busy_s += end_s - start_s
        cache = self.cache
        if self.segment is not None:
            _, steps, first_s, _ = self.segment
            self.segment = None
            self.steps += steps
            for r, _ in self.batch:
                if r.outputs_done == 0:
                    _first_token(r, start_s + first_s)
                r.outputs_done += steps
                need = self._blocks_for(r.num_computed + steps) - r.num_blocks
                r.num_computed += steps
                if need > 0:
                    cache.allocate(need)
                    r.anon += need
                if r.outputs_done >= r.output_tokens:
                    self._finish(r, end_s)
            self.batch = []
            return
        self.steps += 1
        for r, new in self.batch:
            if r.state != RUNNING:
                continue
            before = r.num_computed
            r.num_computed = before + new
            if before < r.target:
                if r.num_computed < r.target:
                    continue  # a chunk of a longer prefill: no token yet
                self._prefill_end(r, end_s)
                if r.state != RUNNING:
                    continue
            if r.outputs_done == 0:
                _first_token(r, end_s)
            r.outputs_done += 1
            if r.outputs_done >= r.output_tokens:
                self._finish(r, end_s)
        self.batch = []

    def _prefill_end(self, r: Request, now_s: float) -> None:
        keys = r.keys
        held = len(r.held_keys)
        if self.role != "decode" and held < len(keys):
            new_keys = keys[held:]
            self.cache.register(new_keys)
            r.anon -= len(new_keys)
            r.held_keys = keys[:]
        if not r.prefilled:
            r.prefilled = True
            self.inflight_prompt_tokens -= r.prompt_tokens
            self.inflight_decode_tokens += r.output_tokens
            self.fleet.prefill_done(r, self, now_s)

    def _finish(self, r: Request, now_s: float) -> None:
        self.running.remove(r)
        self.cache.release(r.held_keys, r.anon)
        r.held_keys = []
        r.anon = 0
        r.state = DONE
        self.inflight_decode_tokens -= r.output_tokens
        self.fleet.finished(r, self, now_s)

    def hand_off(self, r: Request) -> None:
        """Disaggregated prefill: the request leaves this instance after its prefill."""
        self.running.remove(r)
        self.cache.release(r.held_keys, r.anon)
        r.held_keys = []
        r.anon = 0
        self.inflight_decode_tokens -= r.output_tokens


def _first_token(r: Request, at_s: float) -> None:
    r.first_token_s = at_s
    if r.routed_to is not None:
        r.routed_to.unanswered.pop(id(r), None)
