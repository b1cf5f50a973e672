"""The collector's pauses as counted for the master's metrics (gc_pauses.py)."""

import gc

from kvpool.master.gc_pauses import CollectorPauses


def test_collections_are_counted_per_generation_and_close_stops_counting():
    pauses = CollectorPauses()
    try:
        gc.collect(0)
        gc.collect(2)
        assert pauses.counts[0] >= 1 and pauses.counts[2] >= 1
        assert pauses.seconds[2] > 0 and pauses.longest_s > 0
        names = {f.name for f in pauses.families()}
        assert names == {"kvpool_master_gc_pauses", "kvpool_master_gc_pause_seconds", "kvpool_master_gc_pause_max_seconds"}
    finally:
        pauses.close()
    before = list(pauses.counts)
    gc.collect(2)
    assert pauses.counts == before
    pauses.close()  # twice: harmless
