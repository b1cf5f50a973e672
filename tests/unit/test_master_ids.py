"""Ids that outlive one request (master/ids.py): every segment id, lease id and write token carries
its incarnation's random prefix, so two masters (a restart, a standby) never hand out the same id."""

import pytest

from kvpool.core import protocol as p
from kvpool.master import MasterConfig, MasterCore
from kvpool.master.ids import IdSource, new_epoch

EPOCH_A = (5 << 32) | 7
EPOCH_B = (6 << 32) | 7  # same low bits: only the prefix tells them apart


def issue_ids(epoch: int) -> tuple[MasterCore, list[int], list[int], list[int]]:
    """Two segments, three puts, two leased lookups: (core, segment ids, tokens, lease ids)."""
    core = MasterCore(MasterConfig(alignment_bytes=64, node_ttl_s=1000.0), epoch=epoch)
    segments = [core.handle(p.MountSegment(n, "host", 1024, 0, f"agent-{n}", b""), 0.0).segment_id
                for n in ("n1", "n2")]
    started = core.handle(p.PutStart("t", ["a", "b", "c"], [64] * 3, [None] * 3), 0.0)
    core.handle(p.PutEnd("t", ["a", "b", "c"], started.tokens, [0] * 3), 0.0)
    leases = [core.handle(p.LookupPrefix("t", ["a", "b"]), 1.0).lease_id,
              core.handle(p.LookupPrefix("t", ["c"]), 1.0).lease_id]
    return core, segments, list(started.tokens), leases


def test_two_incarnations_never_share_an_id_of_any_kind():
    core_a, *ids_a = issue_ids(EPOCH_A)
    core_b, *ids_b = issue_ids(EPOCH_B)
    all_a = [i for kind in ids_a for i in kind]
    all_b = [i for kind in ids_b for i in kind]
    assert len(set(all_a)) == len(all_a) == 7  # one counter for every kind: distinct within a master too
    assert set(all_a).isdisjoint(all_b)
    assert all(core_a.ids.issued_here(i) and not core_b.ids.issued_here(i) for i in all_a)
    assert all(core_b.ids.issued_here(i) and not core_a.ids.issued_here(i) for i in all_b)
    assert all(0 < i < 1 << 63 for i in all_a + all_b)  # they travel as signed int64
    assert (core_a.stats(0.0).epoch, core_b.stats(0.0).epoch) == (EPOCH_A, EPOCH_B)


def test_ids_are_the_epochs_high_bits_and_a_counter_from_one():
    ids = IdSource(EPOCH_A)
    assert [ids.next() for _ in range(3)] == [(5 << 32) | 1, (5 << 32) | 2, (5 << 32) | 3]
    assert ids.issued_here((5 << 32) | 999) and not ids.issued_here((6 << 32) | 1) and not ids.issued_here(1)
    assert ids.epoch == EPOCH_A


def test_ids_are_not_reissued_when_the_counter_runs_out():
    ids = IdSource(EPOCH_A)
    first = ids.next()
    ids._next = (1 << 32) - 2  # as after ~4.3e9 ids (one per leased lookup: days for a busy master)
    later = [ids.next() for _ in range(2)]
    assert later[0] == (5 << 32) | ((1 << 32) - 1)
    assert first not in later and all(ids.issued_here(i) for i in later)


@pytest.mark.parametrize("epoch", [0, -1, 7, (1 << 32) - 1, 1 << 63, (1 << 64) | (5 << 32)])
def test_an_epoch_without_a_63_bit_nonzero_prefix_is_refused(epoch):
    with pytest.raises(ValueError, match="epoch must be a 63-bit number"):
        IdSource(epoch)
    with pytest.raises(ValueError, match="epoch must be a 63-bit number"):
        MasterCore(MasterConfig(), epoch=epoch)


def test_drawn_epochs_are_valid_and_differ():
    epochs = {new_epoch() for _ in range(20)}
    assert len(epochs) == 20
    for epoch in epochs:
        IdSource(epoch)  # would raise if invalid
    assert MasterCore(MasterConfig()).epoch != MasterCore(MasterConfig()).epoch
