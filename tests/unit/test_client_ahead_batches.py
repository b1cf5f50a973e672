"""client/ahead.py's AheadBatches, pure bookkeeping: which held batch a put may use, what must be
given back, and when a writer asks for one (batch_ahead.py does the I/O)."""

from kvpool.client.ahead import FRESH_S, AheadBatches
from kvpool.core.protocol import PUT_ALLOCATED, PUT_NO_SPACE, PutStartReply, Replica

SIZES = (4096, 4096)


def _reply(statuses=(PUT_ALLOCATED, PUT_ALLOCATED), tokens=(11, 12)) -> PutStartReply:
    replicas = [[Replica(1, 4096 * i, 4096)] if st == PUT_ALLOCATED else [] for i, st in enumerate(statuses)]
    return PutStartReply(list(statuses), replicas, tokens=list(tokens), put_timeout_s=1.0, lands=True,
                         parents_ahead=True)


def test_a_granted_batch_is_taken_once_by_the_same_sizes_from_the_same_master_while_fresh():
    held = AheadBatches()
    assert held.grant(["k0", "k1"], SIZES, _reply(), 10.0, 7, 7) == []
    slot, stale = held.take(SIZES, 7, 10.0 + FRESH_S / 2)
    assert stale is None and slot.keys == ("k0", "k1") and slot.tokens == (11, 12)
    assert slot.lands and slot.parents_ahead and slot.deadline_s < 11.0
    assert held.take(SIZES, 7, 10.0) == (None, None)  # taken: nothing held any more


def test_other_sizes_another_master_or_a_stale_batch_are_given_back():
    for sizes, epoch, now in (((4096,), 7, 10.0), (SIZES, 8, 10.0), (SIZES, 7, 10.01 + FRESH_S), (SIZES, None, 10.0)):
        held = AheadBatches()
        held.grant(["k0", "k1"], SIZES, _reply(), 10.0, 7, 7)
        slot, stale = held.take(sizes, epoch, now)
        assert slot is None and stale.keys == ("k0", "k1")


def test_a_partial_grant_or_a_master_change_in_flight_is_given_back_and_a_new_grant_returns_the_old():
    held = AheadBatches()
    assert held.grant(["k0", "k1"], SIZES, _reply((PUT_ALLOCATED, PUT_NO_SPACE), (11, 0)), 1.0, 7, 7) == [("k0", 11)]
    assert held.grant(["k0", "k1"], SIZES, _reply(), 1.0, 7, 8) == [("k0", 11), ("k1", 12)]
    assert held.grant(["k0", "k1"], SIZES, None, 1.0, 7, 7) == []
    assert held.drop() is None
    assert held.grant(["a0", "a1"], SIZES, _reply(), 1.0, 7, 7) == []
    assert held.grant(["b0", "b1"], SIZES, _reply(tokens=(21, 22)), 1.0, 7, 7) == [("a0", 11), ("a1", 12)]
    assert held.drop().keys == ("b0", "b1")


def test_a_writer_asks_ahead_only_when_a_batch_repeats_sizes_all_of_whose_keys_were_new():
    held = AheadBatches()
    assert not held.wants(SIZES)
    held.saw(SIZES, all_new=True)
    assert held.wants(SIZES) and not held.wants((4096,))
    held.saw(SIZES, all_new=False)  # most of a prefix chain existed: holding ahead would waste writes
    assert not held.wants(SIZES)
