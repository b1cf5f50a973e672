"""The connector's worker half with a scripted client: what a slow or failing pool does to saves."""

from kvpool.connector.device import KVLayout, kv_writes_fence
from kvpool.connector.health import PoolHealth
from kvpool.connector.plan import Geometry, SaveSpec
from kvpool.connector.worker import WorkerSide
from kvpool.core.errors import UnavailableError
from kvpool.core.protocol import PUT_ALLOCATED


class ScriptedClient:
    """put_from answers from a script: an exception to raise, or 'ok'. Records on_written calls."""

    def __init__(self, script: list) -> None:
        self.script, self.written = list(script), 0

    def put_from(self, keys, addrs, sizes, parents, on_written=None, session="", ttl_s=0.0):
        step = self.script.pop(0)
        if on_written is not None and step == "ok":
            on_written()
            self.written += 1
        if isinstance(step, BaseException):
            raise step
        return [PUT_ALLOCATED] * len(keys)

    def close(self) -> None:
        pass


def worker(script: list) -> tuple[WorkerSide, PoolHealth, ScriptedClient]:
    health = PoolHealth("pool", 60.0, 60.0)
    side = WorkerSide(Geometry(4, 1), health=health, load_async=False)
    side._layout = KVLayout(("l0",), (((4096, 64),),), 64, 8)
    side._client = client = ScriptedClient(script)
    return side, health, client


def save(side: WorkerSide, job_id: int) -> None:
    side._save(SaveSpec(job_id, f"r{job_id}", [f"k{job_id}"], [None], [[job_id]]), kv_writes_fence(None))


def test_one_slow_put_end_does_not_turn_the_pool_off():
    side, health, client = worker([UnavailableError("PutEnd did not answer within 2.0 s"), "ok", "ok"])
    save(side, 1)
    assert health.available  # one slow reply: that save is lost, the pool is not
    save(side, 2)
    save(side, 3)
    assert health.available and client.written == 2
    meta = side.take_worker_meta()
    assert meta.completed_save_jobs == {1: 1, 2: 1, 3: 1}  # every job's blocks go back to vLLM
    stats = side.stats.take().data
    assert (stats["saved_blocks"], stats["save_failed_blocks"], stats["pool_unavailable"]) == (2, 1, 1)
    side.close()


def test_three_failures_in_a_row_turn_the_pool_off():
    side, health, _ = worker([UnavailableError("down")] * 3)
    for job_id in (1, 2, 3):
        save(side, job_id)
    assert not health.available
    side.close()
