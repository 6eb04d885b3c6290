"""Memory sharing by tag recycling: Chen et al. 2016, Sec. 3, Fig. 2.

Chen et al. traverse the graph in topological order with a liveness counter per
node; a node takes a free tag (a memory block) when it is produced, and its tag
goes back to the pool when its counter reaches zero. Used statically, it is an
allocation plan computed before execution (a sort, then a bisect per buffer).

Steps (mirrored by `# Step k:` comments in `share_by_tags`):
1. Resident intervals (start < 0) each get a tag of their own that is never recycled.
2. Visit the steps in order. Buffers born at the step (largest first, ties by index)
   take the free tag whose size is the smallest >= theirs; if none fits, the largest
   free tag, which grows to their size; if the pool is empty, a new tag.
3. After all births of the step, buffers whose last step it is return their tags:
   a buffer freed at step i never shares with one born at step i.

Pure Python on plain ints: never imports torch.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from .liveness import Interval


@dataclass(frozen=True, slots=True)
class SharingResult:
    """A tag (shared block) per interval; a tag's size is the largest of its members."""

    tag_of: tuple[int, ...]
    tag_sizes: tuple[int, ...]
    total_bytes: int  # sum(tag_sizes): memory under tag sharing


def share_by_tags(intervals: Sequence[Interval]) -> SharingResult:
    """Chen et al. 2016, Fig. 2 tag recycling over the intervals' schedule steps."""
    sizes = [iv.size for iv in intervals]
    tag_of = [-1] * len(intervals)
    tag_sizes: list[int] = []
    births: defaultdict[int, list[int]] = defaultdict(list)
    deaths: defaultdict[int, list[int]] = defaultdict(list)
    for i, iv in enumerate(intervals):
        if iv.start < 0:
            # Step 1: a resident buffer owns its tag for the whole schedule.
            tag_of[i] = len(tag_sizes)
            tag_sizes.append(iv.size)
        else:
            births[iv.start].append(i)
            deaths[iv.end].append(i)

    free: list[tuple[int, int]] = []  # (tag size, tag), sorted
    for step in sorted(births.keys() | deaths.keys()):
        # Step 2: births take the best-fitting free tag, else grow the largest, else a new one.
        for i in sorted(births.get(step, ()), key=lambda j: (-sizes[j], j)):
            k = bisect_left(free, (sizes[i], -1))
            if k < len(free):
                tag = free.pop(k)[1]
            elif free:
                tag = free.pop()[1]
                tag_sizes[tag] = sizes[i]
            else:
                tag = len(tag_sizes)
                tag_sizes.append(sizes[i])
            tag_of[i] = tag
        # Step 3: tags of buffers dying at this step are recycled only after its births.
        for i in deaths.get(step, ()):
            insort(free, (tag_sizes[tag_of[i]], tag_of[i]))

    return SharingResult(
        tag_of=tuple(tag_of), tag_sizes=tuple(tag_sizes), total_bytes=sum(tag_sizes)
    )


def no_sharing_bytes(intervals: Sequence[Interval]) -> int:
    """Every buffer in its own block: the "no optimization" baseline of Chen et al. Fig. 5."""
    return sum(iv.size for iv in intervals)
