"""The scheduler's lookups, off vLLM's engine step: ask in the background, answer when known.

vLLM 0.32 lets `get_num_new_matched_tokens` answer None ("ask again later"): the scheduler skips
the request this step and asks again the next one (v1/core/sched/scheduler.py). So:

Rules:
- One LookupState per request (its window, keys, when asked, the answer). `ask` starts a lookup
  on this module's thread and waits at most `answer_wait_s` (a few ms: the engine step's budget);
  no answer yet -> None, and the next `ask` for the same window looks again.
- An answer older than `reuse_s` is asked again (vLLM re-asks every step while a request waits
  for blocks; the pool's contents change meanwhile). A lookup unanswered after `give_up_s` is a
  miss (0): the request is computed rather than kept waiting on a slow master; a late answer is
  then dropped.
- A failed lookup is a miss too; `on_result(ok, error)` tells the caller (health, stats).
- `forget(req_id)` at admission or finish. Requests are independent: a slow lookup delays only
  its own request, never the step.
- `warm_up` (optional) runs first on the lookup thread: the connection to the master is made
  before the first request, so a first lookup is one round trip, not a connect and a lane
  discovery within its timeout. Its failure is logged; the first lookup tries again.
- `touch` sends a lookup nobody waits for (waiting.py: a request stuck in vLLM's queue keeps its
  prefix fresh in the master's LRU); counted apart (`on_touch`), skipped if older than `give_up_s`
  when the thread reaches it.
- `prefetch` starts a request's lookup without waiting (the connector's `lookup_on_arrival`, off
  by default): a later `ask` takes its answer. vLLM adds a request just before the step that
  asks about it, so starting at arrival gains little (docs/design/client.md).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

ASK_AGAIN = None
ANSWERED, REUSED, GIVEN_UP, DEFERRED = "answered", "reused", "given_up", "deferred"


class LookupState:
    __slots__ = ("window", "keys", "asked_s", "answered_s", "num_hit", "done", "touch")

    def __init__(self, window: int, keys: list[str], now_s: float, touch: bool = False) -> None:
        self.touch = touch  # nobody waits for the answer
        self.window = window
        self.keys = keys
        self.asked_s = now_s
        self.answered_s = 0.0
        self.num_hit = 0
        self.done = threading.Event()


class AsyncLookups:
    def __init__(
        self,
        lookup: Callable[[list[str]], int],
        on_result: Callable[[bool, BaseException | None, float], None],
        *,
        answer_wait_s: float = 0.002,
        give_up_s: float = 0.2,
        reuse_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        warm_up: Callable[[], None] | None = None,
        on_touch: Callable[[bool, int], None] | None = None,
    ) -> None:
        self._lookup = lookup
        self._on_touch = on_touch
        self._warm_up = warm_up
        self._on_result = on_result
        self._answer_wait_s = answer_wait_s
        self._give_up_s = give_up_s
        self._reuse_s = reuse_s
        self._clock = clock
        self._states: dict[str, LookupState] = {}
        self._queue: queue.SimpleQueue[LookupState | Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvpool-lookups", daemon=True)
        self._thread.start()

    def ask(self, req_id: str, window: int, make_keys: Callable[[], list[str]]) -> tuple[int | None, str]:
        """(pool hit objects for the request's first `window` objects, or ASK_AGAIN; how it was
        answered: ANSWERED, REUSED an earlier answer, GIVEN_UP on a slow master, or DEFERRED)."""
        now = self._clock()
        state = self._states.get(req_id)
        if state is not None and state.window == window:
            if state.done.is_set():
                if now - state.answered_s <= self._reuse_s:
                    return state.num_hit, REUSED
                state = None  # stale: ask the pool again
            elif now - state.asked_s > self._give_up_s:
                del self._states[req_id]  # a late answer goes nowhere; the next ask starts afresh
                return 0, GIVEN_UP
        else:
            state = None
        if state is None:
            state = self._start(req_id, window, make_keys, now)
        if state.done.wait(self._answer_wait_s):
            return state.num_hit, ANSWERED
        return ASK_AGAIN, DEFERRED

    def prefetch(self, req_id: str, window: int, make_keys: Callable[[], list[str]]) -> None:
        """Start the request's lookup now and return at once; a later `ask` for the same window
        takes its answer (or waits for it as for any lookup in flight)."""
        state = self._states.get(req_id)
        if state is None or state.window != window:
            self._start(req_id, window, make_keys, self._clock())

    def touch(self, make_keys: Callable[[], list[str]]) -> None:
        """Look these keys up on the thread; nobody waits for the answer (`on_touch(ok, num_hit)`)."""
        keys = make_keys()
        self._queue.put(LookupState(len(keys), keys, self._clock(), touch=True))

    def _start(self, req_id: str, window: int, make_keys: Callable[[], list[str]], now: float) -> LookupState:
        state = self._states[req_id] = LookupState(window, make_keys(), now)
        self._queue.put(state)
        return state

    def run_soon(self, work: Callable[[], None]) -> None:
        """Run `work` on the lookup thread, in turn with the lookups (session hints: sent one way, in
        order with the lookups they precede). Its failure is logged."""
        self._queue.put(work)

    def forget(self, req_id: str) -> None:
        self._states.pop(req_id, None)

    def _run(self) -> None:
        if self._warm_up is not None:
            try:
                self._warm_up()
            except Exception as exc:  # the master may start later: lookups connect then
                log.info("kvpool: could not reach the pool master at start (%s); the first lookup tries again", exc)
        while True:
            state = self._queue.get()
            if state is None:
                return
            if not isinstance(state, LookupState):
                try:
                    state()
                except Exception as exc:  # a hint lost is only a hint lost
                    log.info("kvpool: could not send session hints to the pool master (%s)", exc)
                continue
            if self._clock() - state.asked_s > self._give_up_s:
                state.done.set()  # nobody waits for it any more (the miss was answered): skip the trip
                continue
            started = time.perf_counter()
            try:
                state.num_hit = self._lookup(state.keys)
                error = None
            except BaseException as exc:  # reported, never raised into the engine
                state.num_hit, error = 0, exc
            state.answered_s = self._clock()
            if state.touch:
                if self._on_touch is not None:
                    try:
                        self._on_touch(error is None, state.num_hit)
                    except Exception:
                        log.exception("kvpool: recording a touch's outcome failed")
                continue
            try:
                self._on_result(error is None, error, time.perf_counter() - started)  # health first, then the answer
            except Exception:  # a bug there must not end the thread every later lookup needs
                log.exception("kvpool: recording a lookup's outcome failed")
            state.done.set()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(1.0)
