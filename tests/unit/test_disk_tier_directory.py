"""The node directory with disk-tier ops: promotions and disk drops are handed to the tier and do
not change the directory; a promotion enters it only when recorded (after the master was told)."""

from kvpool.core import protocol as p
from kvpool.node.directory import NodeDirectory


def test_tier_ops_go_to_the_tier_and_promotions_are_recorded_only_when_done():
    directory = NodeDirectory()
    seen = []
    ops = [p.DirEntry(0, 64, "t", "a", None, 11), p.DirEntry(128, 64, "t", "b", "a", 12, p.DIR_PROMOTE),
           p.DirEntry(0, 0, "t", "c", None, 13, p.DIR_DISK_DROP)]
    directory.apply(p.DirectoryDelta(1, 1, ops), 1.0, lambda segment_id, new: seen.append((segment_id, new)))
    assert seen == [(1, ops)]
    entries, _ = directory.oldest_first(2.0)
    assert [(e.offset, e.key) for e in entries] == [(0, "a")]  # the drop at "offset 0" removed nothing
    directory.record(p.DirEntry(128, 64, "t", "b", "a", 12), 2.0)
    entries, _ = directory.oldest_first(3.0)
    assert [(e.offset, e.key) for e in entries] == [(0, "a"), (128, "b")]
    # a resent delta hands only what is new
    directory.apply(p.DirectoryDelta(1, 1, ops + [p.DirEntry(128, 0)]), 3.0, lambda s, new: seen.append((s, new)))
    assert seen[-1] == (1, [p.DirEntry(128, 0)])
    assert [e.key for e in directory.oldest_first(4.0)[0]] == ["a"]
