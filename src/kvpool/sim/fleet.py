"""The fleet: sessions, a router, instances and the pool on one virtual clock (a heapq of events).

Rules:
- Closed loop per session, as the agents in the traces: a session's first turn arrives at its
  `trace_offset_s` x time_scale, each next turn when the previous answer ended plus the turn's
  think time x time_scale.
- Routing is the router's own code (kvpool.router.policy): each arrival builds BackendViews of
  the instances and asks the policy. The pool is the master's own code (pool.py).
- Block keys are chain identities interned by the workload kit's PrefixCache (the same identity
  `kvpool trace analyze` uses); a sim block of `block_tokens` is named by its last trace block.
- A turn's output KV is named when the next turn shows its ids (the trace gives no ids to output
  tokens): then it enters the cache of the instance that decoded it and, with `save_decode`,
  the pool, at the next turn's arrival. With no think time that is the moment it was written.
- Pool loads and P/D transfers take the receiving instance's NIC in turn (one transfer at a time),
  at min(NIC, pool bandwidth) after one lookup latency.
- No I/O: `run` returns a SimResult; `on_progress(turns_done)` lets a shell draw a progress bar.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from kvpool.router.policy import BackendView, CostModel, RouteRequest, make_policy
from kvpool.sim.config import FleetConfig
from kvpool.sim.cost import StepCost
from kvpool.sim.instance import Instance
from kvpool.sim.pool import PoolModel
from kvpool.sim.request import TRANSFERRING, Request, SessionState
from kvpool.workload.analysis import PrefixCache, _common_prefix
from kvpool.workload.model import Session

ARRIVE, STEP_END, LOAD_DONE, TRANSFER_DONE, ENQUEUE = 0, 1, 2, 3, 4


@dataclass(frozen=True)
class RequestRecord:
    session_index: int
    turn_index: int
    instance: str
    arrival_s: float
    first_token_s: float
    finish_s: float
    prompt_tokens: int
    output_tokens: int
    local_hit_tokens: int
    pool_hit_tokens: int
    preemptions: int

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.finish_s - self.arrival_s


@dataclass(frozen=True)
class SimResult:
    config: FleetConfig
    records: list[RequestRecord]
    makespan_s: float
    num_devices: int
    busy_s: dict[str, float]
    preemptions: int
    pool_evictions: int
    local_evictions: int
    events: int
    unfinished: int


class Fleet:
    def __init__(self, config: FleetConfig, sessions: Sequence[Session]) -> None:
        self.config = config
        self.sessions = [SessionState(i, s) for i, s in enumerate(sessions)]
        sched = config.scheduler
        self.bt = sched.block_tokens
        for s in sessions:
            if self.bt % s.block_size:
                raise ValueError(f"block_tokens ({self.bt}) must be a multiple of the trace's block size "
                                 f"({s.block_size}, session {s.session_id})")
        model, acc = config.model_spec, config.accelerator_spec
        self.model = model
        self.acc = acc
        self.kv_bytes_per_token = model.kv_bytes_per_token
        self.instances: list[Instance] = []
        self.decoders: list[Instance] = []
        roles = (["prefill"] * config.num_prefill_instances if config.disaggregated else ["mixed"] * config.num_instances)
        for role in roles:
            self._add_instance(role)
        if config.disaggregated:
            for _ in range(config.num_decode_instances):
                self.decoders.append(self._add_instance("decode", routed=False))
        self.pool = PoolModel(config.pool, self.bt * int(round(self.kv_bytes_per_token))) if config.pool.enabled else None
        self.chains = PrefixCache()
        self.heap: list[tuple[float, int, int, object, int]] = []
        self.held: deque[Request] = deque()  # late binding: arrived, not yet routed (config.max_waiting)
        self.seq = 0
        self.now_s = 0.0
        self.records: list[RequestRecord] = []
        self.step_start: dict[int, float] = {}
        self.events = 0
        names = [inst.name for inst in self.instances]
        cost = self.instances[0].cost
        pool_bw = self._load_bytes_s(self.instances[0])
        self.policy = make_policy(config.router, names, CostModel(
            prefill_s_per_token=cost.prefill_s(8192) / 8192,
            pool_load_s_per_token=self.kv_bytes_per_token / pool_bw,
            decode_s_per_token=cost.decode_s(64, 8192) / 64,
        ))
        self._wants_local = config.router == "cache_aware"
        self._decode_rr = 0

    def _add_instance(self, role: str, routed: bool = True) -> Instance:
        c = self.config
        devices = c.instance_devices(role)
        index = len(self.instances) + len(self.decoders)
        inst = Instance(index, f"{role}{index}", role, StepCost(self.model, self.acc, devices), c.kv_tokens(role),
                        c.scheduler, devices, devices * self.acc.interconnect_bytes_s, self)
        if routed:
            self.instances.append(inst)
        return inst

    def _load_bytes_s(self, inst: Instance) -> float:
        pool = self.config.pool
        return min(inst.nic_bytes_s, pool.node_bandwidth_bytes_s * pool.num_nodes)

    # ---- events --------------------------------------------------------------------------------

    def _push(self, at_s: float, kind: int, obj: object, version: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (at_s, self.seq, kind, obj, version))

    def kick(self, inst: Instance, now_s: float) -> None:
        duration = inst.plan(now_s)
        if duration is None:
            inst.busy = False
            return
        inst.busy = True
        inst.version += 1
        self.step_start[inst.index] = now_s
        inst.step_end_s = now_s + duration
        self._push(now_s + duration, STEP_END, inst, inst.version)

    def reschedule(self, inst: Instance, end_s: float) -> None:
        inst.version += 1
        inst.step_end_s = end_s
        self._push(end_s, STEP_END, inst, inst.version)

    def run(self, on_progress: Callable[[int], None] | None = None) -> SimResult:
        scale = self.config.time_scale
        for s in self.sessions:
            if s.session.turns:
                self._push(s.session.trace_offset_s * scale, ARRIVE, s)
        heap = self.heap
        limit = self.config.max_sim_time_s
        done_before = 0
        while heap:
            at_s, _, kind, obj, version = heapq.heappop(heap)
            if at_s > limit:
                break
            self.now_s = at_s
            self.events += 1
            if kind == STEP_END:
                if version != obj.version:
                    continue
                obj.apply(self.step_start[obj.index], at_s)
                self.kick(obj, at_s)
            elif kind == ARRIVE:
                self._arrive(obj, at_s)
            elif kind == LOAD_DONE:
                self._load_done(obj, at_s)
            elif kind == ENQUEUE:
                obj.instance.enqueue(obj, at_s)
            else:
                self._transfer_done(obj, at_s)
            if self.held:
                self._send_held(at_s)
            if on_progress is not None and len(self.records) != done_before:
                done_before = len(self.records)
                on_progress(done_before)
        planned = sum(len(s.session.turns) for s in self.sessions)
        return SimResult(
            config=self.config,
            records=self.records,
            makespan_s=max((r.finish_s for r in self.records), default=0.0),
            num_devices=self.config.num_devices,
            busy_s={i.name: i.busy_s for i in self.instances + self.decoders},
            preemptions=sum(i.preemptions for i in self.instances + self.decoders),
            pool_evictions=self.pool.evictions if self.pool is not None else 0,
            local_evictions=sum(i.cache.evictions for i in self.instances),
            events=self.events,
            unfinished=planned - len(self.records),
        )

    # ---- a turn --------------------------------------------------------------------------------

    def _keys(self, state: SessionState, ids: list[int]) -> list[int]:
        session = state.session
        known = (state.last_ids, state.last_nodes) if state.last_ids is not None else None
        _, nodes = self.chains.add(session, ids, known)
        state.last_ids, state.last_nodes = ids, nodes
        group = self.bt // session.block_size
        if group == 1:
            return nodes
        return nodes[group - 1 :: group]

    def _arrive(self, state: SessionState, now_s: float) -> None:
        session = state.session
        turn = session.turns[state.next_turn]
        keys = self._keys(state, turn.block_ids)
        prompt = session.input_tokens(turn)
        if state.next_turn and self.config.scheduler.cache_decode_kv:
            self._name_output_kv(state, keys, now_s)
        req = Request(state, state.next_turn, prompt, max(1, turn.output_tokens), keys, now_s)
        state.next_turn += 1
        if self.config.max_waiting and (self.held or not any(map(self._has_room, self.instances))):
            self.held.append(req)  # late binding: waits at the router (kvpool.router.dispatch)
            return
        self._send(req, now_s)

    def _has_room(self, inst: Instance) -> bool:
        return len(inst.unanswered) < self.config.max_waiting

    def _send_held(self, now_s: float) -> None:
        """Late binding: route held requests, oldest first, while an instance has room."""
        while self.held and any(map(self._has_room, self.instances)):
            self._send(self.held.popleft(), now_s)

    def _send(self, req: Request, now_s: float) -> None:
        inst = self._route(req, now_s)
        inst.inflight_prompt_tokens += req.prompt_tokens
        req.routed_to = inst
        inst.unanswered[id(req)] = now_s
        overhead_s = inst.cost.request_overhead_s
        if overhead_s > 0:
            req.instance = inst
            self._push(now_s + overhead_s, ENQUEUE, req)  # HTTP, tokenisation: before the scheduler sees it
        else:
            inst.enqueue(req, now_s)

    def _name_output_kv(self, state: SessionState, keys: list[int], now_s: float) -> None:
        reused = min(len(keys), state.kv_tokens // self.bt)
        start = len(state.last_keys)
        last = state.last_instance
        if reused > start and last is not None and last.role == "mixed":
            last.cache.insert_free(keys[start:reused])
        if self.pool is not None:
            saved = min(state.pool_saved, _common_prefix(state.last_keys, keys))
            if self.config.pool.save_decode and reused > saved:
                self.pool.put(keys[saved:reused], keys[saved - 1] if saved else None, now_s)
                saved = reused
            state.pool_saved = saved

    def _route(self, req: Request, now_s: float) -> Instance:
        pool_tokens = 0
        if self.pool is not None and self._wants_local:
            pool_tokens = self.pool.lookup(req.keys, now_s, lease=False)[0] * self.bt
        views = [
            BackendView(
                name=inst.name,
                healthy=not self.config.max_waiting or self._has_room(inst),
                inflight_prompt_tokens=inst.inflight_prompt_tokens,
                inflight_decode_tokens=inst.inflight_decode_tokens,
                local_prefix_tokens=inst.cache.probe(req.keys) * self.bt if self._wants_local else 0,
                oldest_wait_s=inst.oldest_wait_s(now_s) if self.config.observed_wait else 0.0,
            )
            for inst in self.instances
        ]
        decision = self.policy.choose(
            RouteRequest(session_id=req.session.session.session_id, prompt_tokens=req.prompt_tokens,
                         pool_prefix_tokens=pool_tokens),
            views,
        )
        return self.instances[decision.index]

    # ---- pool ----------------------------------------------------------------------------------

    def pool_lookup(self, req: Request, limit: int, now_s: float) -> int:
        num_hit, lease_id = self.pool.lookup(req.keys[:limit], now_s, lease=True)
        req.lease_id = lease_id
        req.pool_blocks = num_hit
        req.pool_checked = True
        if num_hit == 0:
            return 0
        return num_hit

    def start_load(self, req: Request, inst: Instance, local_blocks: int, pool_blocks: int, now_s: float) -> None:
        nbytes = (pool_blocks - local_blocks) * self.bt * self.kv_bytes_per_token
        pool = self.config.pool
        start = max(now_s + pool.lookup_latency_s, inst.link_free_s)
        end = start + nbytes / self._load_bytes_s(inst) + pool.load_overhead_s
        inst.link_free_s = end
        self._push(end, LOAD_DONE, req)

    def _load_done(self, req: Request, now_s: float) -> None:
        self.pool.release(req.lease_id, now_s)
        req.lease_id = 0
        req.num_computed = req.num_blocks * self.bt
        req.instance.enqueue(req, now_s, front=True)

    def prefill_done(self, req: Request, inst: Instance, now_s: float) -> None:
        if self.pool is not None and self.config.pool.save_prefill:
            state = req.session
            if req.turn_index == 0 or not self.config.scheduler.cache_decode_kv:
                state.pool_saved = min(state.pool_saved, _common_prefix(state.last_keys, req.keys))
            # a lookup tells what is there now (evicted blocks are written again); without one
            # (the local cache had it all), what this session wrote and has not lost track of
            start = min(req.pool_blocks if req.pool_checked else state.pool_saved, len(req.keys))
            self.pool.put(req.keys[start:], req.keys[start - 1] if start else None, now_s)
            state.pool_saved = len(req.keys)
        if inst.role != "prefill":
            return
        req.prefill_instance = inst
        inst.hand_off(req)
        req.state = TRANSFERRING
        dec = min(self.decoders, key=lambda d: (d.inflight_decode_tokens, d.index))
        nbytes = req.prompt_tokens * self.kv_bytes_per_token
        start = max(now_s, dec.link_free_s)
        end = start + nbytes / min(inst.nic_bytes_s, dec.nic_bytes_s)
        dec.link_free_s = end
        req.instance = dec
        self._push(end, TRANSFER_DONE, req)

    def _transfer_done(self, req: Request, now_s: float) -> None:
        dec = req.instance
        req.num_computed = req.target = req.prompt_tokens
        dec.inflight_decode_tokens += req.output_tokens
        dec.enqueue(req, now_s)

    def finished(self, req: Request, inst: Instance, now_s: float) -> None:
        req.finish_s = now_s
        state = req.session
        state.kv_tokens = req.prompt_tokens + req.output_tokens
        state.last_keys = req.keys
        state.last_instance = inst
        self.records.append(RequestRecord(
            state.index, req.turn_index, (req.prefill_instance or inst).name, req.arrival_s,
            req.first_token_s if req.first_token_s is not None else now_s, now_s, req.prompt_tokens,
            req.output_tokens, req.local_hit_tokens, req.pool_hit_tokens, req.preemptions,
        ))
        if state.next_turn < len(state.session.turns):
            think = state.session.turns[state.next_turn].think_time_s
            state.think_history_s.append(think)
            self._push(now_s + think * self.config.time_scale, ARRIVE, state)


def simulate(config: FleetConfig, sessions: Sequence[Session], on_progress: Callable[[int], None] | None = None) -> SimResult:
    return Fleet(config, sessions).run(on_progress)
