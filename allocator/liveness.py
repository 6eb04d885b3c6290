"""Live intervals of buffers over a schedule, and the live-bytes lower bound.

A buffer is an `Interval` of schedule steps during which it holds memory. The
peak of live bytes over the steps is the lower bound that any allocator (tag
sharing or arena offsets) can reach for a fixed schedule: every buffer live at
the peak step needs its own bytes. This is the liveness analysis that Chen et
al. 2016, Sec. 3, Fig. 2 ("apply liveness analysis ... and enable memory
sharing") builds on; the profile is a difference array, as in inductor's
`estimate_peak_memory`.

Pure Python on plain ints: never imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Interval:
    """A buffer of `size` bytes, allocated before step `start` executes and freed after
    step `end` executes (both inclusive). `start < 0` marks a resident buffer, live
    before the first step (inputs, parameters)."""

    size: int
    start: int
    end: int

    def __post_init__(self) -> None:
        if self.size < 0:
            raise ValueError(f"Interval.size must be >= 0, got {self.size}")
        if self.end < self.start:
            raise ValueError(f"Interval.end must be >= start, got [{self.start}, {self.end}]")


@dataclass(frozen=True, slots=True)
class PeakResult:
    """The largest live-bytes step (the first one on ties) and who is live there."""

    peak_bytes: int
    peak_step: int  # -1 when there are no steps
    live_at_peak: tuple[int, ...]  # indices into the intervals, ascending


def live_bytes_profile(intervals: Sequence[Interval], num_steps: int) -> tuple[int, ...]:
    """Live bytes at each step 0..num_steps-1, in O(len(intervals) + num_steps).

    An interval with start < 0 counts from step 0; ends past the last step are clipped.
    """
    if num_steps < 0:
        raise ValueError(f"num_steps must be >= 0, got {num_steps}")
    diff = [0] * (num_steps + 1)
    last = num_steps - 1
    for iv in intervals:
        s, e = max(iv.start, 0), min(iv.end, last)
        if s <= e:
            diff[s] += iv.size
            diff[e + 1] -= iv.size
    profile, live = [], 0
    for d in diff[:num_steps]:
        live += d
        profile.append(live)
    return tuple(profile)


def peak_live_bytes(intervals: Sequence[Interval], num_steps: int) -> PeakResult:
    """The peak of `live_bytes_profile`: the lower bound for any allocation of this schedule."""
    profile = live_bytes_profile(intervals, num_steps)
    if not profile:
        return PeakResult(peak_bytes=0, peak_step=-1, live_at_peak=())
    peak = max(profile)
    step = profile.index(peak)
    live = tuple(i for i, iv in enumerate(intervals) if max(iv.start, 0) <= step <= iv.end)
    return PeakResult(peak_bytes=peak, peak_step=step, live_at_peak=live)


class PeakOfSizes:
    """The peak of a fixed schedule as a function of a few buffers' sizes.

    A planner pricing many configurations of one op, where only the bytes the op holds
    and allocates change (a recurrent chain's policies: memopt.planner.chain_family),
    needs the peak for each set of sizes, not a new liveness analysis each time.
    `fixed` are the schedule's other buffers; `variable[k]` the intervals whose size is
    the k-th value passed to `__call__` (each rounded up to `granularity` bytes, one
    buffer per interval as the allocator rounds them). The steps split into the segments
    between the variable intervals' ends; each segment's value is its largest fixed live
    bytes plus the variables covering it, so a call costs O(segments), which is
    O(len(variable intervals)), whatever the schedule's length.
    """

    def __init__(self, fixed: Sequence[Interval], variable: Sequence[Sequence[tuple[int, int]]],
                 num_steps: int, granularity: int = 1) -> None:
        profile = live_bytes_profile(fixed, num_steps)
        last = num_steps - 1
        clipped = [[(max(s, 0), min(e, last)) for s, e in spans] for spans in variable]
        cuts = sorted({0, num_steps, *(b for spans in clipped for s, e in spans
                                       if s <= e for b in (s, e + 1))})
        self.granularity = granularity
        #: per segment: (its largest fixed live bytes, how many intervals of each variable
        #: cover it)
        self.segments = []
        for lo, hi in zip(cuts, cuts[1:]):
            if lo >= hi or lo >= num_steps:
                continue
            counts = tuple(sum(1 for s, e in spans if s <= lo <= e) for spans in clipped)
            self.segments.append((max(profile[lo:hi]), counts))

    def __call__(self, *sizes: int) -> int:
        g = self.granularity
        rounded = [-(-size // g) * g for size in sizes]
        return max((base + sum(c * r for c, r in zip(counts, rounded))
                    for base, counts in self.segments), default=0)
