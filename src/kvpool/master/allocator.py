"""Offset allocator for one segment: best-fit over free ranges, coalescing on free.

Rules:
- Pure bookkeeping over integers: no I/O, no clock. The object index is the only caller and the
  only owner of allocated ranges (it remembers offset and size; this module does not, to keep the
  per-object memory in one place).
- Sizes are rounded up to `alignment_bytes`; offsets are multiples of it.
- Best fit (the smallest free range that holds the request; the lowest offset among equals), not
  first fit: KV blocks mostly share one size, so best fit reuses holes of exactly that size and
  keeps the large ranges whole for the occasional large object. It is also O(log n) with a sorted
  list of (size, offset) and `bisect`, where first fit would need a linear scan or a tree.
- A freed range merges with its free neighbours at once, so freeing everything restores one range.
- `on_change`, when set, hears the change in used bytes after every allocation, free and rebuild:
  the segment table keeps the pool's total and its placement order with it (no scan per put).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable


class RangeAllocator:
    __slots__ = ("size_bytes", "alignment_bytes", "free_bytes", "on_change", "_start_to_size", "_end_to_start",
                 "_by_size")

    def __init__(self, size_bytes: int, alignment_bytes: int = 64) -> None:
        if alignment_bytes <= 0 or alignment_bytes & (alignment_bytes - 1):
            raise ValueError(f"alignment_bytes must be a power of two, got {alignment_bytes}")
        if size_bytes < alignment_bytes:
            raise ValueError(f"a segment must hold at least {alignment_bytes} bytes, got {size_bytes}")
        usable = size_bytes - size_bytes % alignment_bytes
        self.size_bytes = usable
        self.alignment_bytes = alignment_bytes
        self.free_bytes = usable
        self.on_change: Callable[[int], None] | None = None  # told each change of used bytes
        self._start_to_size: dict[int, int] = {0: usable}
        self._end_to_start: dict[int, int] = {usable: 0}
        self._by_size: list[tuple[int, int]] = [(usable, 0)]  # sorted (size, start)

    def aligned(self, size_bytes: int) -> int:
        mask = self.alignment_bytes - 1
        return (size_bytes + mask) & ~mask

    @property
    def used_bytes(self) -> int:
        return self.size_bytes - self.free_bytes

    @property
    def largest_free_bytes(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    @property
    def num_free_ranges(self) -> int:
        return len(self._by_size)

    def fragmentation(self) -> float:
        """1 - largest free range / total free; 0 when nothing or everything is free in one piece."""
        if self.free_bytes == 0:
            return 0.0
        return 1.0 - self.largest_free_bytes / self.free_bytes

    def can_allocate(self, size_bytes: int) -> bool:
        return self.largest_free_bytes >= self.aligned(size_bytes)

    def allocate(self, size_bytes: int) -> int | None:
        """The offset of a new range of `size_bytes` (rounded up), or None when no free range fits."""
        if size_bytes <= 0:
            raise ValueError(f"size_bytes must be > 0, got {size_bytes}")
        need = self.aligned(size_bytes)
        by_size = self._by_size
        i = bisect_left(by_size, (need, -1))
        if i == len(by_size):
            return None
        free_size, start = by_size.pop(i)
        del self._start_to_size[start]
        del self._end_to_start[start + free_size]
        if free_size > need:
            self._add_free(start + need, free_size - need)
        self.free_bytes -= need
        if self.on_change is not None:
            self.on_change(need)
        return start

    def free(self, offset: int, size_bytes: int) -> None:
        """Give back a range returned by `allocate(size_bytes)`; merges with free neighbours."""
        length = self.aligned(size_bytes)
        end = offset + length
        if offset < 0 or end > self.size_bytes or offset % self.alignment_bytes:
            raise ValueError(f"range [{offset}, {end}) is not inside this {self.size_bytes}-byte segment")
        if offset in self._start_to_size or end in self._end_to_start:
            raise ValueError(f"range [{offset}, {end}) is already free (double free)")
        self.free_bytes += length
        before = self._end_to_start.get(offset)
        if before is not None:
            self._remove_free(before, offset - before)
            offset = before
        after_size = self._start_to_size.get(end)
        if after_size is not None:
            self._remove_free(end, after_size)
            end += after_size
        self._add_free(offset, end - offset)
        if self.on_change is not None:
            self.on_change(-length)

    def rebuild(self, used: list[tuple[int, int]]) -> None:
        """Start over with exactly these (offset, size) ranges in use: sorted by offset, aligned,
        inside the segment and not overlapping (the caller checks; ValueError otherwise). Used once
        per recovered segment, so one pass beats `len(used)` single reservations."""
        start_to_size: dict[int, int] = {}
        end_to_start: dict[int, int] = {}
        by_size: list[tuple[int, int]] = []
        free_bytes = self.size_bytes
        position = 0
        for offset, size in used:
            length = self.aligned(size)
            if offset < position or offset % self.alignment_bytes or offset + length > self.size_bytes:
                raise ValueError(f"range [{offset}, {offset + length}) overlaps, is unaligned or outside the segment")
            if offset > position:
                start_to_size[position] = offset - position
                end_to_start[offset] = position
                by_size.append((offset - position, position))
            free_bytes -= length
            position = offset + length
        if position < self.size_bytes:
            start_to_size[position] = self.size_bytes - position
            end_to_start[self.size_bytes] = position
            by_size.append((self.size_bytes - position, position))
        by_size.sort()
        # only now, so a bad list leaves the allocator as it was
        freed = free_bytes - self.free_bytes
        self._start_to_size, self._end_to_start, self._by_size, self.free_bytes = (
            start_to_size, end_to_start, by_size, free_bytes)
        if self.on_change is not None:
            self.on_change(-freed)

    def free_ranges(self) -> list[tuple[int, int]]:
        """(offset, size) of every free range, by offset (for tests and debugging)."""
        return sorted(self._start_to_size.items())

    def _add_free(self, start: int, size: int) -> None:
        self._start_to_size[start] = size
        self._end_to_start[start + size] = start
        insort(self._by_size, (size, start))

    def _remove_free(self, start: int, size: int) -> None:
        del self._start_to_size[start]
        del self._end_to_start[start + size]
        by_size = self._by_size
        i = bisect_left(by_size, (size, start))
        del by_size[i]
