"""Records, chains and candidate selection on their own: the lifecycle table, parent and child
counts, and the evictor's order with nothing but records (no index, no segments)."""

import pytest

from kvpool.core.protocol import Replica, pack_replicas
from kvpool.master import chains
from kvpool.master.eviction import Evictor
from kvpool.master.quotas import TenantAccount, TenantSpace
from kvpool.master.records import (COMPLETE, GONE, IN_HEAP, LANDING, LIFECYCLE, PENDING, PINNED, IllegalTransition,
                                   ObjectRecord, move)


def record(space, key, now_s, state=COMPLETE, flags=0):
    rec = ObjectRecord(space, key, pack_replicas([Replica(1, 0, 64)]), state, flags, now_s)
    space[key] = rec
    return rec


@pytest.fixture
def space():
    return TenantSpace("t", TenantAccount("t", None))


def test_the_lifecycle_table_allows_only_forward_moves(space):
    assert LIFECYCLE[PENDING] == {LANDING, COMPLETE, GONE}
    assert LIFECYCLE[LANDING] == {COMPLETE, GONE}
    assert LIFECYCLE[COMPLETE] == {GONE}
    assert LIFECYCLE[GONE] == set()
    rec = record(space, "a", 0.0, state=PENDING)
    assert move(rec, LANDING) == PENDING and move(rec, COMPLETE) == LANDING
    with pytest.raises(IllegalTransition):
        move(rec, PENDING)
    move(rec, GONE)
    with pytest.raises(IllegalTransition):
        move(rec, GONE)


def test_a_parent_becomes_a_tail_when_its_last_dram_child_goes(space):
    parent, a, b = record(space, "p", 0.0), record(space, "a", 1.0), record(space, "b", 2.0)
    for child in (a, b):
        chains.hold_parent(parent)
        chains.attach(child, parent)
    assert parent.num_children == 2
    assert chains.detach(a) is None
    assert chains.to_disk(b) is parent  # its last DRAM child went to disk
    assert (parent.num_children, parent.disk_children) == (0, 1)
    chains.to_dram(b)
    assert (parent.num_children, parent.disk_children) == (1, 0)


def test_selection_hands_out_complete_unpinned_tails_oldest_first_and_puts_kept_ones_back(space):
    evictor = Evictor()
    old, pinned, pending, new = (record(space, "old", 1.0), record(space, "pinned", 0.5, flags=PINNED),
                                 record(space, "pending", 0.2, state=PENDING), record(space, "new", 3.0))
    for rec in (new, pending, pinned, old):
        evictor.push(rec)
    selection = evictor.select(10.0)
    first = selection.next()
    assert first is old
    selection.keep(first)
    assert selection.next() is new
    selection.taken(new)
    assert selection.next() is None
    selection.close()
    assert old.heaps & IN_HEAP and not new.heaps & IN_HEAP
    assert (evictor.evictions, evictor.evicted_bytes) == (1, 64)
    assert evictor.select(10.0).next() is old  # kept: back in the heap
