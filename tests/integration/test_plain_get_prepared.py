"""A plain get's bytes made and faulted in while its GetValue travels (plain_values._Prepared), with
a real master and node: used when the value has the size of the client's last plain get, dropped
otherwise; the bytes returned are the value's either way, and a miss returns None."""

from __future__ import annotations

from kvpool.client import Client, plain_values
from pool_worker import pattern

KiB = 1024


def test_a_get_of_the_last_gets_size_reads_into_bytes_prepared_while_its_lookup_travelled(pool, monkeypatch):
    used = []
    take = plain_values._Prepared.take

    def counted(self, size):
        made = take(self, size)
        used.append(made is not None)
        return made

    monkeypatch.setattr(plain_values._Prepared, "take", counted)
    sizes = {"a": 300 * KiB, "b": 300 * KiB, "c": 300 * KiB, "big": 600 * KiB, "big2": 600 * KiB}
    with Client(pool.address, "prepared") as client:
        for key, size in sizes.items():
            assert client.put(key, pattern(key, size)) is True
        for key, size in sizes.items():
            assert client.get(key) == pattern(key, size).tobytes()
        assert used == [False, True, True, False, True]  # none yet; the same size; another size; again
        assert client.get("missing") is None
        assert client.get("a") == pattern("a", 300 * KiB).tobytes()
        assert used[-1] is False  # prepared for 600 KiB, found 300 KiB: dropped, read into fresh bytes
