"""One state object per simulated request (a session's turn), and per session."""

from __future__ import annotations

from kvpool.workload.model import Session

WAITING = 0
LOADING = 1  # blocks allocated, KV on its way from the pool
RUNNING = 2
TRANSFERRING = 3  # disaggregated: prefill done, KV on its way to a decode instance
DONE = 4


class SessionState:
    __slots__ = ("index", "session", "next_turn", "last_ids", "last_nodes", "last_keys", "kv_tokens",
                 "last_instance", "think_history_s", "pool_saved")

    def __init__(self, index: int, session: Session) -> None:
        self.index = index
        self.session = session
        self.next_turn = 0
        self.last_ids: list[int] | None = None  # the previous turn's block ids and chain nodes (interning)
        self.last_nodes: list[int] | None = None
        self.last_keys: list[int] = []  # the previous turn's block keys (sim blocks)
        self.kv_tokens = 0  # tokens whose KV the previous turn left (prompt + output)
        self.last_instance: object | None = None
        self.think_history_s: list[float] = []
        self.pool_saved = 0  # leading blocks of the current chain already written to the pool


class Request:
    __slots__ = ("session", "turn_index", "prompt_tokens", "output_tokens", "keys", "arrival_s", "first_token_s",
                 "finish_s", "local_hit_tokens", "pool_hit_tokens", "num_computed", "target", "outputs_done",
                 "held_keys", "anon", "state", "instance", "prefill_instance", "preemptions", "lease_id",
                 "looked_up", "pool_blocks", "pool_checked", "prefilled", "pool_asked", "routed_to")

    def __init__(self, session: SessionState, turn_index: int, prompt_tokens: int, output_tokens: int,
                 keys: list[int], arrival_s: float) -> None:
        self.session = session
        self.turn_index = turn_index
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.keys = keys  # full sim blocks of the prompt, chain keys
        self.arrival_s = arrival_s
        self.first_token_s: float | None = None
        self.finish_s: float | None = None
        self.local_hit_tokens = 0
        self.pool_hit_tokens = 0
        self.num_computed = 0  # tokens whose KV this instance has (hit, loaded or computed)
        self.target = prompt_tokens  # tokens to prefill (a preempted request recomputes its output too)
        self.outputs_done = 0
        self.held_keys: list[int] = []  # keyed blocks held in the instance's cache
        self.anon = 0  # anonymous blocks held
        self.state = WAITING
        self.instance = None
        self.prefill_instance = None
        self.routed_to = None  # the instance the router chose (its observed wait counts this request)
        self.preemptions = 0
        self.lease_id = 0
        self.looked_up = False  # hits counted (first admission)
        self.pool_blocks = 0  # leading blocks the pool had at its lookup
        self.pool_checked = False
        self.prefilled = False
        self.pool_asked = False  # the connector's lookup was sent (answered at the next step)

    @property
    def num_blocks(self) -> int:
        return len(self.held_keys) + self.anon
