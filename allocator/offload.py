"""Offload: a saved value copied to host memory after the forward and brought back
before the backward reads it, scheduled on a link beside the compute it overlaps.

Keep, recompute or offload: Chen et al. 2016 (Sec. 4) keeps or recomputes each value;
a third answer moves it off the device for the stretch of the step that does not read
it. The copy costs no device time while the link keeps up with the compute (the copy
runs on a side stream); where it does not, the backward waits. This module is the
schedule of those copies and what they free, over plain data (no torch):

    schedule(intervals, num_steps, candidates, chosen, step_seconds, link)
        -> OffloadSchedule: each copy's times, the steps its device bytes are freed
           after and allocated again before, the rewritten intervals, the peak, the
           seconds the backward waits and how busy the link is.
    choose(..., target) -> the offloaded set: the largest values live at the peak,
           one at a time, while the peak is over `target` and offloading lowers it.

Time model: step i starts at the sum of the steps before it (step_seconds, a FLOP and
byte model of each op: memopt.passes.offload) plus what the backward has waited so far.
One side stream carries every copy in the order the main stream issues them: a value's
copy to host is issued as the step that produces it ends, its copy back at its prefetch
step, and a copy starts when the link is free and what it copies is ready. A value's
device bytes stay allocated until its last forward read and its copy to host are both
done (the allocator may not reuse a block a copy still reads), and are allocated again
at its prefetch step. The prefetch step is the latest that lets the copy back finish
before the first backward read with the link running back to back (as late as
possible: the least device memory), never before the value's bytes were freed.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from .liveness import Interval, live_bytes_profile


@dataclass(frozen=True)
class Link:
    """A host link: bytes per second each way and a fixed cost per copy (seconds)."""

    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    latency_s: float = 10e-6

    def __post_init__(self) -> None:
        if not (self.d2h_bytes_per_s > 0 and self.h2d_bytes_per_s > 0):
            raise ValueError(f"a link's bandwidths must be > 0, got {self.d2h_bytes_per_s} "
                             f"and {self.h2d_bytes_per_s} bytes/s")
        if self.latency_s < 0:
            raise ValueError(f"a link's latency must be >= 0, got {self.latency_s}")

    def d2h_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.d2h_bytes_per_s

    def h2d_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.h2d_bytes_per_s


@dataclass(frozen=True)
class Candidate:
    """A saved value that may be offloaded: interval `index` of the step, `nbytes` of it,
    produced at step `start`, last read by the forward at `fw_last`, first read by the
    backward at `bw_first` (num_forward <= bw_first <= end)."""

    index: int
    nbytes: int
    start: int
    fw_last: int
    bw_first: int

    def __post_init__(self) -> None:
        if not self.start <= self.fw_last < self.bw_first:
            raise ValueError(f"an offload candidate needs start <= fw_last < bw_first, got "
                             f"{self.start}, {self.fw_last}, {self.bw_first}")


@dataclass(frozen=True)
class Transfer:
    """One offloaded value's copies (seconds from the step's start) and steps."""

    index: int
    nbytes: int
    d2h_start_s: float
    d2h_end_s: float
    freed_after: int      # its device bytes are free from the step after this one
    prefetch_at: int      # allocated again, its copy back issued, before this step runs
    h2d_start_s: float
    h2d_end_s: float
    wait_s: float         # how long the backward waited for it at its first read
    frees: bool = True    # False: its copy out ends after its prefetch step, nothing freed


@dataclass(frozen=True)
class OffloadSchedule:
    transfers: tuple[Transfer, ...]
    intervals: tuple[Interval, ...]   # the step's, each offloaded one split in two
    peak_bytes: int
    peak_step: int
    compute_s: float                  # the steps' own seconds
    wait_s: float                     # what the backward waited for copies back
    link_busy_s: float                # seconds the link copies

    @property
    def seconds(self) -> float:
        """The step's predicted time: its compute and what it waited for the link."""
        return self.compute_s + self.wait_s

    @property
    def link_occupancy(self) -> float:
        """The link's busy share of the step's time."""
        return self.link_busy_s / self.seconds if self.seconds > 0 else 0.0


def _step_at(starts: Sequence[float], t: float) -> int:
    """The step running at time `t` (the last one starting at or before it)."""
    return max(0, bisect.bisect_right(starts, t) - 1)


def _prefetch_steps(chosen: Sequence[Candidate], starts: Sequence[float], link: Link,
                    num_forward: int) -> dict[int, int]:
    """As late as possible: copies back in first-read order, each finishing by its first
    read and before the next one starts; none before the backward's first step."""
    steps: dict[int, int] = {}
    deadline = float("inf")
    for c in sorted(chosen, key=lambda c: (c.bw_first, c.index), reverse=True):
        end = min(starts[c.bw_first], deadline)
        begin = end - link.h2d_s(c.nbytes)
        deadline = begin
        steps[c.index] = max(num_forward, _step_at(starts, begin))
    return steps


def schedule(intervals: Sequence[Interval], num_steps: int, candidates: Sequence[Candidate],
             chosen: frozenset[int], step_seconds: Sequence[float], link: Link,
             num_forward: int = 0) -> OffloadSchedule:
    """The step with the candidates whose interval index is in `chosen` offloaded
    (`num_forward`: the backward's first step, where copies back are issued from)."""
    if len(step_seconds) != num_steps:
        raise ValueError(f"step_seconds has {len(step_seconds)} entries for {num_steps} steps")
    picked = [c for c in candidates if c.index in chosen]
    nominal = [0.0]
    for s in step_seconds:
        nominal.append(nominal[-1] + s)
    prefetch = _prefetch_steps(picked, nominal, link, num_forward)
    produced = {}
    for c in picked:
        produced.setdefault(c.start, []).append(c)
    issued: dict[int, list[Candidate]] = {}
    for c in picked:
        issued.setdefault(prefetch[c.index], []).append(c)
    first_read: dict[int, list[Candidate]] = {}
    for c in picked:
        first_read.setdefault(c.bw_first, []).append(c)
    # one pass in program order: the main stream's clock with its waits, the link's FIFO
    clock, link_free, busy = 0.0, 0.0, 0.0
    starts: list[float] = []
    d2h: dict[int, tuple[float, float]] = {}
    h2d: dict[int, tuple[float, float]] = {}
    waited: dict[int, float] = {}
    late: list[Candidate] = []  # copies back issued before their copy out could end
    for step in range(num_steps):
        for c in sorted(issued.get(step, ()), key=lambda c: (c.bw_first, c.index)):
            begin = max(link_free, clock, d2h.get(c.index, (0.0, 0.0))[1])
            if c.index not in d2h:  # prefetched before it was produced: never freed
                late.append(c)
                begin = max(link_free, clock)
            h2d[c.index] = (begin, begin + link.h2d_s(c.nbytes))
            link_free = h2d[c.index][1]
            busy += link.h2d_s(c.nbytes)
        for c in first_read.get(step, ()):
            end = h2d[c.index][1]
            waited[c.index] = max(0.0, end - clock)
            clock = max(clock, end)
        starts.append(clock)
        clock += step_seconds[step]
        for c in produced.get(step, ()):
            begin = max(link_free, clock)
            d2h[c.index] = (begin, begin + link.d2h_s(c.nbytes))
            link_free = d2h[c.index][1]
            busy += link.d2h_s(c.nbytes)
    out = list(intervals)
    transfers = []
    for c in picked:
        iv = intervals[c.index]
        freed = max(c.fw_last, _step_at(starts, d2h[c.index][1]))
        at = prefetch[c.index]
        frees = freed + 1 < at and c not in late
        if frees:
            out[c.index] = Interval(iv.size, iv.start, freed)
            out.append(Interval(iv.size, at, iv.end))
        transfers.append(Transfer(index=c.index, nbytes=c.nbytes, d2h_start_s=d2h[c.index][0],
                                  d2h_end_s=d2h[c.index][1], freed_after=freed,
                                  prefetch_at=at, h2d_start_s=h2d[c.index][0],
                                  h2d_end_s=h2d[c.index][1], wait_s=waited[c.index],
                                  frees=frees))
    profile = live_bytes_profile(out, num_steps)
    peak = max(profile) if profile else 0
    return OffloadSchedule(transfers=tuple(transfers), intervals=tuple(out), peak_bytes=peak,
                           peak_step=profile.index(peak) if profile else -1,
                           compute_s=sum(step_seconds), wait_s=sum(waited.values()),
                           link_busy_s=busy)


#: How many candidates `choose` tries at each step before it stops (the largest first):
#: each try schedules the whole step, so a graph of thousands of saved values stays linear.
TRIES = 16


def choose(intervals: Sequence[Interval], num_steps: int, candidates: Sequence[Candidate],
           step_seconds: Sequence[float], link: Link, target: int, num_forward: int = 0
           ) -> OffloadSchedule:
    """The offloaded set for `target`: while the peak is over it, the largest candidates
    live across the peak step, as many as its excess needs, where that lowers the peak;
    else the largest one whose offload lowers the bytes live there without raising the
    peak (ties: the one the backward reads last, whose copy back has longest to hide). Stops at the first step where none of the TRIES largest does; the caller
    compares the result's peak with the target (it may miss) and its seconds with
    recomputation's."""
    chosen: frozenset[int] = frozenset()
    best = schedule(intervals, num_steps, candidates, chosen, step_seconds, link, num_forward)
    while best.peak_bytes > target:
        p = best.peak_step
        live_now = live_bytes_profile(best.intervals, num_steps)[p]
        order = sorted((c for c in candidates if c.index not in chosen
                        and c.fw_last < p < c.bw_first),
                       key=lambda c: (-c.nbytes, -c.bw_first, c.index))
        # first the largest together, as many as the excess at this step needs (one
        # schedule for many values on a large graph), then one at a time
        batch, freed = [], 0
        for c in order:
            if freed >= best.peak_bytes - target:
                break
            batch.append(c.index)
            freed += c.nbytes
        tries = [frozenset(batch)] if len(batch) > 1 else []
        tries += [frozenset({c.index}) for c in order[:TRIES]]
        for more in tries:
            trial = schedule(intervals, num_steps, candidates, chosen | more,
                             step_seconds, link, num_forward)
            if trial.peak_bytes < best.peak_bytes or (
                    trial.peak_bytes == best.peak_bytes
                    and live_bytes_profile(trial.intervals, num_steps)[p] < live_now):
                chosen, best = chosen | more, trial
                break
        else:
            break
    # a value offloaded in a batch whose copy frees nothing is kept on the device instead
    useless = frozenset(t.index for t in best.transfers if not t.frees)
    if useless:
        best = schedule(intervals, num_steps, candidates, chosen - useless, step_seconds,
                        link, num_forward)
    return best
