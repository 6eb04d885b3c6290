"""Static offsets into one arena: greedy by size with best fit.

Where tag sharing (Chen et al. 2016, Sec. 3, Fig. 2) gives each tag its own
block, this packs every buffer into a single arena at a fixed offset, so blocks
of different sizes can share address ranges. The heuristic is "greedy by size"
of Pisarchyk & Lee 2020, also used by the TFLite and XLA heap simulators.

Steps (mirrored by `# Step k:` comments in `assign_offsets`):
1. Round sizes up to `alignment`; compress time to the sorted distinct starts, so
   two intervals overlap in time iff their compressed ranges overlap.
2. Visit intervals by size descending (ties by start, then index). Find the placed
   ones overlapping in time: those whose range covers its start (a stabbing query on
   a segment tree) plus those starting inside its range (buckets by start).
3. Place it in the smallest gap between their address ranges that holds it (the
   lowest such gap on ties), else on top of the highest one.
4. Record it in both indexes. Cost: O(n log n + sum over intervals of overlaps * log),
   with the per-neighbor work in C builtins (sort, map, accumulate).

Pure Python on plain ints: never imports torch.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, chain, repeat
from operator import rshift, sub

from .liveness import Interval


@dataclass(frozen=True, slots=True)
class OffsetResult:
    """Arena offset per interval (multiples of the alignment) and the arena size."""

    offsets: tuple[int, ...]
    arena_bytes: int  # max(offset + aligned size), 0 when empty


def _aligned_sizes(intervals: Sequence[Interval], alignment: int) -> list[int]:
    if alignment < 1:
        raise ValueError(f"alignment must be >= 1, got {alignment}")
    return [-(-iv.size // alignment) * alignment for iv in intervals]


def assign_offsets(intervals: Sequence[Interval], alignment: int = 1) -> OffsetResult:
    """Greedy-by-size best-fit offsets; time-overlapping intervals get disjoint ranges."""
    # Step 1: aligned sizes, compressed time, and the visiting order.
    sizes = _aligned_sizes(intervals, alignment)
    xs = sorted({iv.start for iv in intervals})
    lo = [bisect_left(xs, iv.start) for iv in intervals]
    hi = [bisect_right(xs, iv.end) - 1 for iv in intervals]
    width = 1 << max(len(xs) - 1, 0).bit_length()
    levels = range(width.bit_length())
    cover: list[list[int]] = [[] for _ in range(2 * width)]  # at canonical nodes of [lo, hi]
    born: list[list[int]] = [[] for _ in range(width)]  # placed ids by lo
    offsets = [0] * len(intervals)
    ends = [0] * len(intervals)  # offset + aligned size, once placed
    order = [i for *_, i in sorted((-iv.size, iv.start, i) for i, iv in enumerate(intervals))]
    for i in order:
        # Step 2: placed neighbors = those covering lo[i] + those starting in (lo[i], hi[i]].
        path = map(rshift, repeat(lo[i] + width), levels)
        near = list(chain.from_iterable(map(cover.__getitem__, path)))
        near += chain.from_iterable(born[lo[i] + 1 : hi[i] + 1])
        # Step 3: best fit: the smallest gap between the neighbors' address ranges, else on top.
        # tops[k]: highest end among the first k neighbors by offset; gaps[k]: room below the k-th.
        near.sort(key=offsets.__getitem__)
        tops = list(accumulate(map(ends.__getitem__, near), max, initial=0))
        gaps = list(map(sub, map(offsets.__getitem__, near), tops))
        fit = min(filter(sizes[i].__le__, gaps), default=-1)
        offsets[i] = tops[-1] if fit < 0 else tops[gaps.index(fit)]
        ends[i] = offsets[i] + sizes[i]
        # Step 4: record i in both indexes.
        born[lo[i]].append(i)
        left, right = lo[i] + width, hi[i] + 1 + width
        while left < right:
            if left & 1:
                cover[left].append(i)
                left += 1
            if right & 1:
                right -= 1
                cover[right].append(i)
            left >>= 1
            right >>= 1
    return OffsetResult(offsets=tuple(offsets), arena_bytes=max(ends, default=0))


def find_overlap(
    intervals: Sequence[Interval], offsets: Sequence[int], alignment: int = 1
) -> tuple[int, int] | None:
    """Invariant check: a pair (i < j) live at a common step with overlapping aligned
    address ranges, or None. A sweep over starts, independent of `assign_offsets`."""
    if len(offsets) != len(intervals):
        raise ValueError(f"{len(offsets)} offsets for {len(intervals)} intervals")
    sizes = _aligned_sizes(intervals, alignment)
    active: list[int] = []
    for i in sorted(range(len(intervals)), key=lambda k: intervals[k].start):
        if sizes[i] == 0:
            continue
        active = [j for j in active if intervals[j].end >= intervals[i].start]
        for j in active:
            if offsets[i] < offsets[j] + sizes[j] and offsets[j] < offsets[i] + sizes[i]:
                return (min(i, j), max(i, j))
        active.append(i)
    return None
