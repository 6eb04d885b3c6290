"""Keep, recompute or offload: the planner's third answer to a budget (Step 6c of
memopt.planner.plan).

Chen et al. 2016's search (planner.chen) picks what to recompute; offloading a saved
value to host memory (memopt.allocator.offload) frees the same bytes for no FLOPs where
the link keeps up with the compute. For a budget, `best_mix` builds the step of a few
mirror sets, the search's choice, no recomputation at all, and (where the choice misses
the budget) the lowest-peak one, offloads on each what the budget needs
(allocator.offload.choose, on the exact build's schedule), and takes the least predicted
time that fits: its compute (the op roofline of passes.offload, recomputed ops
included) plus what the backward waits for the link. A plan with nothing offloaded
wins ties, so offload is never taken where it buys nothing.

    best_mix(mirrors, build, target, link, compute, granularity) -> Mix | None
    apply(built, mix) -> Built   (the graphs rewritten, the schedule's offloaded storages
                                  split at their copy out and their copy back)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from memopt.allocator.offload import Link, OffloadSchedule, Transfer, choose
from memopt.passes.liveness import StepSchedule, StorageLife
from memopt.passes.offload import ComputeModel, candidates, rewrite, step_seconds

from .. import offload as runtime
from ..memory_plan import LinkRecord, OffloadRecord
from .build import Built, Mirror, intervals


@dataclass(frozen=True)
class Mix:
    """A mirror set, its build, and what it offloads (`names`: each transfer's value)."""

    mirror: Mirror
    built: Built
    schedule: OffloadSchedule
    names: tuple[str, ...]
    bw_first: dict[str, int]
    link: Link

    @property
    def offloaded(self) -> bool:
        return bool(self.schedule.transfers)


def offload_step(mirror: Mirror, built: Built, target: int, link: Link,
                 compute: ComputeModel, granularity: int) -> Mix:
    """`built` (the build of `mirror`) with what `target` needs offloaded (nothing where
    it fits already)."""
    sched = built.schedule
    found = candidates(sched, built.fw, built.bw, built.saved_names)
    name_of = {c.index: name for c, name in found}
    result = choose(intervals(sched, granularity), len(sched.steps), [c for c, _ in found],
                    step_seconds(sched, built.fw, built.bw, compute), link, target,
                    num_forward=sched.num_forward_steps)
    names = tuple(name_of[t.index] for t in result.transfers)
    return Mix(mirror=mirror, built=built, schedule=result, names=names,
               bw_first={name_of[c.index]: c.bw_first for c, _ in found
                         if c.index in {t.index for t in result.transfers}}, link=link)


def best_mix(mirrors: Sequence[Mirror], build: Callable[[Mirror], Built], target: int,
             link: Link, compute: ComputeModel, granularity: int) -> tuple[Mix | None, int]:
    """The fastest predicted mix that fits `target` over `mirrors` with offload (None
    where none fits; ties go to the plan that offloads less), and the lowest peak any
    reached (what a BudgetError then names)."""
    best: tuple[tuple[float, int], Mix] | None = None
    lowest = None
    for mirror in dict.fromkeys(mirrors):
        mix = offload_step(mirror, build(mirror), target, link, compute, granularity)
        peak = mix.schedule.peak_bytes
        lowest = peak if lowest is None else min(lowest, peak)
        if peak > target:
            continue
        key = (mix.schedule.seconds, len(mix.names))
        if best is None or key < best[0]:
            best = (key, mix)
    return (None if best is None else best[1]), (lowest or 0)


def apply(mix: Mix) -> Built:
    """The mix's build with its graphs rewritten (passes.offload) and each offloaded
    storage split in its schedule: on the device until its copy out is done, again from
    its prefetch step."""
    built, sched = mix.built, mix.built.schedule
    transfers = list(zip(mix.schedule.transfers, mix.names))
    assert all(t.frees for t, _ in transfers), "allocator.offload.choose keeps only these"
    storages = list(sched.storages)
    for t, name in transfers:
        s = storages[t.index]
        storages[t.index] = dataclasses.replace(s, end=t.freed_after)
        storages.append(StorageLife(name=f"bw.{name}.prefetched", nodes=(f"bw.{name}",),
                                    nbytes=s.nbytes, start=t.prefetch_at, end=s.end,
                                    kind=s.kind))
    schedule = StepSchedule(steps=sched.steps, num_forward_steps=sched.num_forward_steps,
                            storages=tuple(storages), fusion_estimates=sched.fusion_estimates)
    rewrite(built.fw, built.bw, sched, transfers, mix.bw_first, runtime)
    return dataclasses.replace(built, schedule=schedule, peak_bytes=mix.schedule.peak_bytes)


def records(mix: Mix) -> tuple[tuple[OffloadRecord, ...], LinkRecord]:
    """The plan's records: each offloaded value, and the link."""
    steps = mix.built.schedule.steps

    def rec(t: Transfer, name: str) -> OffloadRecord:
        return OffloadRecord(name=name, nbytes=t.nbytes, freed_after=steps[t.freed_after],
                             prefetch_at=steps[t.prefetch_at],
                             first_read=steps[mix.bw_first[name]],
                             freed_step=t.freed_after, prefetch_step=t.prefetch_at,
                             d2h_start_s=t.d2h_start_s, d2h_end_s=t.d2h_end_s,
                             h2d_start_s=t.h2d_start_s, h2d_end_s=t.h2d_end_s, wait_s=t.wait_s)
    s = mix.schedule
    return (tuple(rec(t, n) for t, n in zip(s.transfers, mix.names)),
            LinkRecord(d2h_bytes_per_s=mix.link.d2h_bytes_per_s,
                       h2d_bytes_per_s=mix.link.h2d_bytes_per_s, compute_s=s.compute_s,
                       wait_s=s.wait_s, busy_s=s.link_busy_s, occupancy=s.link_occupancy))
