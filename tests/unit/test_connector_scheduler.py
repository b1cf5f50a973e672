"""The connector's scheduler half on vLLM's real BlockPool: exact load/save plans and block references.

The master is replaced by a lookup table here because this file checks planning only; the e2e tests
run the same code against a real master, nodes and vLLM.
"""

import threading
from contextlib import contextmanager
from types import SimpleNamespace

from vllm.v1.core.block_pool import BlockPool

from kvpool.connector.health import PoolHealth
from kvpool.connector.keys import object_keys
from kvpool.connector.metadata import KVPoolWorkerMetadata
from kvpool.connector.plan import Geometry
from kvpool.connector.scheduler import SchedulerSide
from kvpool.core.errors import UnavailableError

BS = 4
HASHES = [bytes([i]) * 32 for i in range(1, 20)]


class Lookups:
    """lookup_prefix answers from a set of stored keys (leading hits), counting calls."""

    def __init__(self, stored: set[str] | None = None, down: bool = False) -> None:
        self.stored, self.down, self.calls, self.pings = stored or set(), down, 0, 0

    def ping(self) -> None:
        self.pings += 1
        if self.down:
            raise UnavailableError("master did not answer")

    def lookup_prefix(self, keys: list[str], promotion_wait_s: float = 0.0, ttl_s: float = 0.0) -> int:
        self.calls += 1
        if self.down:
            raise UnavailableError("master did not answer")
        n = 0
        while n < len(keys) and keys[n] in self.stored:
            n += 1
        return n

    def close(self) -> None:
        pass


def make(lookups: Lookups, blocks_per_object: int = 1, **kwargs) -> tuple[SchedulerSide, BlockPool]:
    # the lookup thread answers these fakes at once: a long wait makes the plans deterministic here
    kwargs.setdefault("lookup_answer_wait_s", 5.0)
    kwargs.setdefault("lookup_on_arrival", True)  # the tests of on_new_request's lookup
    health = kwargs.pop("health", PoolHealth("test", 60.0, 60.0))
    side = SchedulerSide(
        Geometry(BS, blocks_per_object), make_client=lambda: lookups,
        health=health, num_workers=1, save_decode=True, load_async=True, **kwargs,
    )  # fmt: skip
    pool = BlockPool(num_gpu_blocks=32, enable_caching=True, hash_block_size=BS)
    side.bind_block_pool(pool)
    return side, pool


def request(rid: str, num_tokens: int, num_computed: int = 0) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, num_tokens=num_tokens, num_prompt_tokens=num_tokens,
                           num_computed_tokens=num_computed, block_hashes=HASHES[: num_tokens // BS])  # fmt: skip


def blocks(ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(get_block_ids=lambda: (ids,))


def step(rid: str, computed_before: int, scheduled: int, table: list[int], new: bool = True) -> SimpleNamespace:
    new_reqs = [SimpleNamespace(req_id=rid, num_computed_tokens=computed_before)] if new else []
    cached = SimpleNamespace(req_ids=[] if new else [rid], num_computed_tokens=[] if new else [computed_before])
    return SimpleNamespace(
        scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached, num_scheduled_tokens={rid: scheduled},
        scheduled_spec_decode_tokens={}, kv_connector_block_state=SimpleNamespace(get_block_ids=lambda r: (table,)),
    )  # fmt: skip


def test_lookup_is_repeatable_and_leaves_the_last_token():
    lookups = Lookups({k for k in object_keys(HASHES, 1, 0, 4)})
    side, _ = make(lookups)
    req = request("r", num_tokens=16)  # 4 blocks, all in the pool
    assert side.get_num_new_matched_tokens(req, 0) == (12, True)  # block 3 holds the last token
    assert side.get_num_new_matched_tokens(req, 0) == (12, True)  # asked again: same answer
    assert side.get_num_new_matched_tokens(req, 12) == (0, False)  # local hit as long: no round trip
    assert lookups.calls == 1  # the second answer came from the request's hint


def test_lookup_hint_expires_and_is_dropped_at_admission():
    now = [0.0]
    lookups = Lookups({k for k in object_keys(HASHES, 1, 0, 2)})
    side, _ = make(lookups, lookup_cache_ttl_s=1.0, clock=lambda: now[0])
    req = request("r", num_tokens=16)
    assert side.get_num_new_matched_tokens(req, 0) == (8, True)
    lookups.stored |= set(object_keys(HASHES, 1, 0, 4))  # the pool gains the rest
    now[0] = 0.5
    assert side.get_num_new_matched_tokens(req, 0) == (8, True)  # within the TTL: the old answer
    assert lookups.calls == 1
    now[0] = 1.6
    assert side.get_num_new_matched_tokens(req, 0) == (12, True)  # expired: asked again
    assert lookups.calls == 2
    side.update_state_after_alloc(req, blocks([1, 2, 3, 4]), 12)
    assert side.get_num_new_matched_tokens(req, 0) == (12, True)  # admitted since: asked again
    assert lookups.calls == 3
    side.get_num_new_matched_tokens(request("other", num_tokens=16), 0)  # hints are per request
    assert lookups.calls == 4


class StalledLookups(Lookups):
    """A master that does not answer until released."""

    def __init__(self, stored: set[str]) -> None:
        super().__init__(stored)
        self.release = threading.Event()

    def lookup_prefix(self, keys: list[str], promotion_wait_s: float = 0.0, ttl_s: float = 0.0) -> int:
        self.release.wait(10)
        return super().lookup_prefix(keys)


@contextmanager
def stalled_side(**kwargs):
    """A scheduler side whose master answers only once `lookups.release` is set."""
    lookups = StalledLookups({k for k in object_keys(HASHES, 1, 0, 4)})
    side, _ = make(lookups, **kwargs)
    try:
        yield side, lookups
    finally:
        lookups.release.set()
        side.close()


def test_a_stalled_master_never_stalls_the_step_and_its_late_answer_is_a_miss():
    now = [0.0]
    with stalled_side(lookup_answer_wait_s=0.01, lookup_give_up_s=0.5, clock=lambda: now[0]) as (side, _):
        req = request("r", num_tokens=16)
        assert side.get_num_new_matched_tokens(req, 0) == (None, False)  # in flight: ask again later
        now[0] = 0.4
        assert side.get_num_new_matched_tokens(req, 0) == (None, False)
        now[0] = 0.6
        assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # given up: computed without the pool
        data = side.stats.take().data
        assert data["lookups_deferred"] == 2 and data["lookups_given_up"] == 1


def test_a_lookup_starts_when_the_request_arrives_and_its_first_step_takes_the_answer():
    with stalled_side() as (side, lookups):
        lookups.release.set()
        req = request("r", num_tokens=16)
        side.on_new_request(req)  # returns at once; the lookup runs on its thread
        for _ in range(500):
            if lookups.calls:
                break
            threading.Event().wait(0.01)
        assert lookups.calls == 1  # sent before vLLM's first step asked
        assert side.get_num_new_matched_tokens(req, 0) == (12, True)
        assert lookups.calls == 1  # the step took the answer of the lookup made on arrival
        assert side.stats.take().data["lookups_prefetched"] == 1


def test_a_lookup_still_in_flight_from_arrival_is_waited_for_not_sent_twice():
    with stalled_side(lookup_answer_wait_s=0.01) as (side, lookups):
        req = request("r", num_tokens=16)
        side.on_new_request(req)
        assert side.get_num_new_matched_tokens(req, 0) == (None, False)  # in flight: ask again
        lookups.release.set()
        answers = [side.get_num_new_matched_tokens(req, 0)]  # the next steps
        while answers[-1] == (None, False) and len(answers) < 500:
            answers.append(side.get_num_new_matched_tokens(req, 0))
        assert answers[-1] == (12, True)
        assert lookups.calls == 1  # the steps waited for the lookup made on arrival, none sent another


def test_no_lookup_is_started_for_a_request_too_short_to_load_or_while_the_pool_is_down():
    lookups = Lookups()
    side, _ = make(lookups)
    side.on_new_request(request("short", num_tokens=4))  # one block, holding the last token: nothing to load
    health = PoolHealth("test", 60.0, 60.0)
    while health.available:
        health.record_unavailable("down")
    down, _ = make(lookups, health=health)
    down.on_new_request(request("r", num_tokens=16))
    side.close()
    down.close()
    assert lookups.calls == 0


def test_the_lookup_thread_connects_before_the_first_request_and_a_down_master_only_delays_that():
    for down in (False, True):
        lookups = Lookups({k for k in object_keys(HASHES, 1, 0, 4)}, down=down)
        side, _ = make(lookups)
        for _ in range(500):
            if lookups.pings:
                break
            threading.Event().wait(0.01)
        assert lookups.pings == 1 and lookups.calls == 0  # connected; nothing looked up yet
        lookups.down = False  # the master is up by the first request
        assert side.get_num_new_matched_tokens(request("r", num_tokens=16), 0) == (12, True)
        side.close()


def test_lookup_hint_off_asks_every_time():
    lookups = Lookups({k for k in object_keys(HASHES, 1, 0, 4)})
    side, _ = make(lookups, lookup_cache_ttl_s=0.0)
    req = request("r", num_tokens=16)
    side.get_num_new_matched_tokens(req, 0)
    side.get_num_new_matched_tokens(req, 0)
    assert lookups.calls == 2


def test_load_plan_targets_only_blocks_past_the_local_hit():
    lookups = Lookups({k for k in object_keys(HASHES, 2, 0, 3)})
    side, _ = make(lookups, blocks_per_object=2)
    req = request("r", num_tokens=26)  # 6 full blocks = 3 objects of 2 blocks
    assert side.get_num_new_matched_tokens(req, 4) == (20, True)  # local: 1 block; pool: 3 objects
    side.update_state_after_alloc(req, blocks([5, 6, 7, 8, 9, 10, 11]), 20)
    meta = side.build_connector_meta(step("other", 0, 0, []))
    (load,) = meta.loads
    assert load.keys == object_keys(HASHES, 2, 0, 3)
    assert load.block_ids == [[None, 6], [7, 8], [9, 10]]  # block 5 is the shared local hit
    assert side.build_connector_meta(step("other", 0, 0, [])).loads == []  # emitted once


def test_saves_pin_blocks_until_every_worker_reports():
    side, pool = make(Lookups())
    table = [b.block_id for b in pool.get_new_blocks(4)]
    req = request("r", num_tokens=14)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    side.update_state_after_alloc(req, blocks(table), 0)
    (save,) = side.build_connector_meta(step("r", 0, 10, table)).saves  # 10 tokens: 2 full blocks
    assert save.keys == object_keys(HASHES, 1, 0, 2) and save.parents == [None, save.keys[0]]
    assert save.block_ids == [[table[0]], [table[1]]]
    assert [pool.blocks[b].ref_cnt for b in table] == [2, 2, 1, 1]
    (save2,) = side.build_connector_meta(step("r", 10, 4, table, new=False)).saves  # 14 tokens: block 2
    assert save2.block_ids == [[table[2]]] and save2.parents == [save.keys[1]]
    assert side.has_pending_saves()
    side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=KVPoolWorkerMetadata({save.job_id: 1})))
    side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=KVPoolWorkerMetadata({save2.job_id: 1})))
    assert [pool.blocks[b].ref_cnt for b in table] == [1, 1, 1, 1] and not side.has_pending_saves()


def test_a_failed_load_is_not_planned_again():
    lookups = Lookups({k for k in object_keys(HASHES, 1, 0, 3)})
    side, _ = make(lookups)
    req = request("r", num_tokens=14)
    assert side.get_num_new_matched_tokens(req, 0) == (12, True)
    side.update_state_after_alloc(req, blocks([1, 2, 3, 4]), 12)
    side.build_connector_meta(step("other", 0, 0, []))
    side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=KVPoolWorkerMetadata({}, {"r"})))
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # vLLM recomputes instead


def test_unreachable_master_means_no_pool_until_the_back_off_ends():
    lookups = Lookups(down=True)
    side, pool = make(lookups, health=PoolHealth("test", 60.0, 60.0, failures_to_degrade=1))
    req = request("r", num_tokens=14)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert side.get_num_new_matched_tokens(request("r2", num_tokens=14), 0) == (0, False)
    assert lookups.calls == 1  # backing off: no round trip for the next request
    table = [b.block_id for b in pool.get_new_blocks(4)]
    side.update_state_after_alloc(req, blocks(table), 0)
    assert side.build_connector_meta(step("r", 0, 14, table)).saves == []  # nothing saved meanwhile
    assert side.stats.take().data["pool_unavailable"] == 1


def test_a_local_hit_is_not_saved_again():
    side, pool = make(Lookups())
    table = [b.block_id for b in pool.get_new_blocks(4)]
    req = request("r", num_tokens=14)
    assert side.get_num_new_matched_tokens(req, 8) == (0, False)  # vLLM has 2 blocks already
    side.update_state_after_alloc(req, blocks(table), 0)
    (save,) = side.build_connector_meta(step("r", 8, 6, table)).saves
    assert save.keys == object_keys(HASHES, 1, 2, 3) and save.block_ids == [[table[2]]]


def test_a_pd_decode_request_neither_looks_up_nor_saves_its_prompt():
    """Beside NixlConnector in vLLM's MultiConnector: the prefill instance sent the prompt's KV and
    saved it to the pool; the decode side saves only what it decodes."""
    lookups = Lookups({k for k in object_keys(HASHES, 1, 0, 3)})
    side, pool = make(lookups)
    table = [b.block_id for b in pool.get_new_blocks(5)]
    req = request("r", num_tokens=14)  # 3 full prompt blocks and 2 tokens of a 4th
    req.kv_transfer_params = {"do_remote_prefill": True, "remote_block_ids": [[7, 8, 9, 10]]}
    side.on_new_request(req)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # NixlConnector loads it
    assert lookups.calls == 0
    req.kv_transfer_params["do_remote_prefill"] = False  # what NixlConnector does at admission
    side.update_state_after_alloc(req, blocks(table), 0)
    assert side.build_connector_meta(step("r", 13, 1, table)).saves == []  # the prompt: saved by the prefill
    req.num_tokens, req.block_hashes = 20, HASHES[:5]  # decoding filled block 3 and block 4
    (save,) = side.build_connector_meta(step("r", 14, 6, table, new=False)).saves
    assert save.keys == object_keys(HASHES, 1, 3, 5) and save.block_ids == [[table[3]], [table[4]]]
    assert side.stats.take().data["remote_prefills"] == 1


def test_blocks_pinned_for_saves_are_bounded_so_admission_never_starves():
    side, pool = make(Lookups(), max_pinned_fraction=0.25)  # 32 blocks: at most 8 pinned
    a_table = [b.block_id for b in pool.get_new_blocks(12)]
    a = request("a", num_tokens=48)  # 12 full blocks
    side.get_num_new_matched_tokens(a, 0)
    side.update_state_after_alloc(a, blocks(a_table), 0)
    (save,) = side.build_connector_meta(step("a", 0, 48, a_table)).saves
    assert save.block_ids == [[b] for b in a_table[:8]]  # the first 8; the rest in a later step
    b_table = [b.block_id for b in pool.get_new_blocks(8)]
    b = request("b", num_tokens=32)
    side.get_num_new_matched_tokens(b, 0)
    side.update_state_after_alloc(b, blocks(b_table), 0)
    assert side.build_connector_meta(step("b", 0, 32, b_table)).saves == []  # deferred: 8 pinned already
    b.num_computed_tokens = 32
    side.request_finished(b, b_table)  # finished while deferred: dropped, its blocks not held
    side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=KVPoolWorkerMetadata({save.job_id: 1}, set())))
    (rest,) = side.build_connector_meta(step("a", 48, 1, a_table, new=False)).saves
    assert rest.block_ids == [[b] for b in a_table[8:]]
    data = side.stats.take().data
    assert (data["saves_deferred"], data["saves_dropped"]) == (1, 1)


class RankLookups:
    """lookup_prefix per namespace (one per TP rank), recording what each was asked."""

    def __init__(self, stored: dict[str, set[str]]) -> None:
        self.stored, self.asked = stored, []

    def lookup_prefix(self, keys: list[str], namespace: str | None = None, promotion_wait_s: float = 0.0,
                      ttl_s: float = 0.0) -> int:
        self.asked.append((namespace, len(keys)))
        n = 0
        while n < len(keys) and keys[n] in self.stored[namespace]:
            n += 1
        return n

    def close(self) -> None:
        pass


def test_tensor_parallel_hit_is_what_every_rank_has():
    keys = object_keys(HASHES, 1, 0, 4)
    lookups = RankLookups({"r0": set(keys), "r1": set(keys[:2])})  # rank 1 lost blocks 2 and 3
    side, _ = make(lookups, rank_namespaces=["r0", "r1"])
    assert side.get_num_new_matched_tokens(request("a", num_tokens=17), 0) == (8, True)  # 2 blocks, not 4
    assert lookups.asked == [("r0", 4), ("r1", 4)]  # rank 1 is asked only about rank 0's hits
    lookups.stored["r0"] = set()
    side.get_num_new_matched_tokens(request("b", num_tokens=17), 0)
    assert lookups.asked[2:] == [("r0", 4)]  # rank 0 has nothing: no trip for rank 1


def test_a_request_waiting_past_touch_waiting_s_has_its_prefix_looked_up_again_until_admitted():
    now = [0.0]
    lookups = Lookups({k for k in object_keys(HASHES, 1, 0, 4)})
    side, pool = make(lookups, lookup_on_arrival=False, touch_waiting_s=2.0, clock=lambda: now[0])
    touched = []

    def step_at(t: float) -> None:
        now[0] = t
        calls = lookups.calls
        side.build_connector_meta(empty)
        sent = objects = 0
        for _ in range(200):  # a touch runs on the lookup thread; let it finish before time moves on
            taken = side.stats.take()
            data = taken.data if taken is not None else {}
            sent += data.get("prefix_touches", 0)
            objects += data.get("prefix_touched_objects", 0)
            if not sent or objects:
                break
            threading.Event().wait(0.01)
        touched.append(objects)
        assert lookups.calls - calls == sent

    waiting, quick = request("waiting", num_tokens=16), request("quick", num_tokens=16)
    side.on_new_request(waiting)
    side.on_new_request(quick)
    side.update_state_after_alloc(quick, blocks([]), 0)  # admitted at once: never touched
    empty = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
                            num_scheduled_tokens={}, scheduled_spec_decode_tokens={}, kv_connector_block_state=None)  # fmt: skip
    for t in (0.0, 1.9, 2.0, 2.5, 4.1):
        step_at(t)
    assert touched == [0, 0, 3, 0, 3]  # at 2.0 and 4.1 the waiting request's 3 pool objects, refreshed
    side.update_state_after_alloc(waiting, blocks([]), 0)
    step_at(10.0)
    side.close()
    assert lookups.calls == 2 and touched[-1] == 0  # admitted: no more touches


class HintedLookups(Lookups):
    """Records what the lookup thread sends: session events and each lookup's TTL, in order."""

    def __init__(self, stored: set[str]) -> None:
        super().__init__(stored)
        self.sent: list = []

    def lookup_prefix(self, keys: list[str], promotion_wait_s: float = 0.0, ttl_s: float = 0.0) -> int:
        self.sent.append(("lookup", ttl_s))
        return super().lookup_prefix(keys, promotion_wait_s)

    def send_session_events(self, events, namespace=None) -> None:
        self.sent += [(("arrived", "done", "end")[e.kind], e.session, e.request) for e in events]


def test_a_requests_session_hint_goes_to_the_pool_with_its_lookup_saves_and_end():
    lookups = HintedLookups(set(object_keys(HASHES, 1, 0, 2)))
    side, _ = make(lookups)
    req = request("r", num_tokens=16)
    req.kv_transfer_params = {"kvpool": {"session": "agent-7", "ttl_s": 60.0, "end": True}}
    assert side.get_num_new_matched_tokens(req, 0) == (8, True)
    side.get_num_new_matched_tokens(req, 0)  # asked again while it waits: no second arrival
    side.update_state_after_alloc(req, blocks([1, 2, 3, 4]), 8)
    meta = side.build_connector_meta(step("r", 0, 16, [1, 2, 3, 4]))
    assert [(s.session, s.ttl_s) for s in meta.saves] == [("agent-7", 60.0)]
    side.request_finished(req, [1, 2, 3, 4])
    side.close()  # the lookup thread sends what is queued first
    assert lookups.sent == [("arrived", "agent-7", "r"), ("lookup", 60.0), ("done", "agent-7", "r"),
                            ("end", "agent-7", "r")]
    assert side.stats.take().data["hinted_requests"] == 1


def test_a_bad_hint_is_counted_and_the_request_served_without_it():
    lookups = HintedLookups(set(object_keys(HASHES, 1, 0, 2)))
    side, _ = make(lookups)
    req = request("r", num_tokens=16)
    req.kv_transfer_params = {"kvpool": {"session": 42}}
    assert side.get_num_new_matched_tokens(req, 0) == (8, True)
    side.close()
    assert lookups.sent == [("lookup", 0.0)]
    assert side.stats.take().data["bad_hints"] == 1
