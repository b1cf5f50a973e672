"""put_from batches written into allocations held ahead (client/batch_ahead.py, issue 14), with
real processes: a master, nodes and clients, over shared memory and over the segment lane (whose
PutEnd travels with the write, landing.py). After two batches of the same sizes, each next one is
its write and one PutEnd; every byte read is compared with what its writer wrote."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvpool.client import PUT_ALLOCATED, PUT_EXISTS, Client, ahead
from pool_worker import pattern, wait_until
from test_integrity import _stats

KiB = 1024
SIZE = 128 * KiB


def _put(client: Client, keys: list[str], size: int, seed_prefix: str = "") -> list[int]:
    """put_from of `keys` (each object the pattern of seed_prefix + key) with its default parents."""
    buf = np.concatenate([pattern(seed_prefix + k, size) for k in keys])
    client.register(buf)
    return client.put_from(keys, [[buf.ctypes.data + i * size] for i in range(len(keys))], [[size]] * len(keys))


def _ahead_puts(client: Client) -> float:
    return client._metrics.puts_ahead._value.get()


@pytest.mark.parametrize("path", ["auto", "lane"])
def test_batches_of_the_same_sizes_after_the_second_are_written_ahead_and_read_back(pool, path):
    batches = [[f"s{n}/{i}" for i in range(3)] for n in range(6)]
    with Client(pool.address, f"batch-{path}", path=path) as writer:
        for keys in batches:  # put_from's default parents: a chain, linked by the master at the end
            assert _put(writer, keys, SIZE) == [PUT_ALLOCATED] * 3
        assert _ahead_puts(writer) == 4  # the second batch asked for the third's allocations, and so on
        stats = writer.stats()
        assert (stats.num_objects, stats.num_pending) == (18, 3)  # three held for the next batch
        assert stats.refused_landings == 0
        assert all(writer.lookup_prefix(keys) == 3 for keys in batches)
        assert writer.lookup_prefix([ahead.KEY_PREFIX]) == 0  # a held name is never a hit
    wait_until(lambda: _stats(pool.address).num_pending == 0, 5, "the closed writer's batch given back")
    with Client(pool.address, f"batch-{path}") as reader:
        for keys in batches:
            assert [reader.get(k) for k in keys] == [pattern(k, SIZE).tobytes() for k in keys]


def test_a_key_that_exists_is_not_overwritten_and_its_allocation_is_given_back(pool):
    with Client(pool.address, "exists") as writer:
        assert _put(writer, ["a/0", "a/1"], SIZE) == [PUT_ALLOCATED] * 2
        assert _put(writer, ["b/0", "b/1"], SIZE) == [PUT_ALLOCATED] * 2  # asked for the next batch's
        before = _ahead_puts(writer)
        assert _put(writer, ["a/0", "c/1"], SIZE, seed_prefix="new") == [PUT_EXISTS, PUT_ALLOCATED]
        assert _ahead_puts(writer) == before + 1  # written ahead; "a/0"'s bytes went to its held allocation
        assert writer.get("a/0") == pattern("a/0", SIZE).tobytes()  # a put never overwrites
        assert writer.get("c/1") == pattern("newc/1", SIZE).tobytes()
        wait_until(lambda: writer.stats().num_pending == 2, 5, "the unused allocation given back (two held)")
        assert writer.stats().num_objects == 5


def test_other_sizes_or_a_stale_batch_go_the_usual_way_and_batch_ahead_false_holds_none(pool):
    with Client(pool.address, "shape") as writer:
        assert _put(writer, ["x/0", "x/1"], SIZE) == [PUT_ALLOCATED] * 2
        assert _put(writer, ["y/0", "y/1"], SIZE) == [PUT_ALLOCATED] * 2
        assert _put(writer, ["z/0", "z/1", "z/2"], SIZE) == [PUT_ALLOCATED] * 3  # other sizes: given back
        wait_until(lambda: writer.stats().num_pending == 0, 5, "the held batch given back")
        assert _put(writer, ["w/0", "w/1", "w/2"], SIZE) == [PUT_ALLOCATED] * 3  # repeats: asks ahead
        time.sleep(ahead.FRESH_S + 0.05)
        assert _put(writer, ["v/0", "v/1", "v/2"], SIZE) == [PUT_ALLOCATED] * 3  # too old: the usual way
        assert _ahead_puts(writer) == 0
        for key in ("x/1", "z/2", "w/0", "v/2"):
            assert writer.get(key) == pattern(key, SIZE).tobytes()
    with Client(pool.address, "off", batch_ahead=False) as plain:
        for n in range(4):
            assert _put(plain, [f"o{n}/0", f"o{n}/1"], SIZE) == [PUT_ALLOCATED] * 2
        assert _ahead_puts(plain) == 0 and plain.stats().num_pending == 0
