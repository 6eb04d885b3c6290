"""A repeated block with two plans: its later runs in a forward keep more than its first.

Every instance of a repeated block runs one captured graph (memopt.blocks), and with one
plan for every run that plan must fit at the block's last run, where the saved tensors of
all the runs before it are held. The step can then only take the few levels of saved bytes
the block's plans offer, each times the number of runs: on a 16-layer Llama at 0.8 of its
no-budget peak the one plan that fitted kept 9.4 MiB per block and recomputed 5.7 MFLOP in
each of the 16, with 55 MiB of the budget unused, where the next plan up (14.2 MiB,
1.9 MFLOP) did not fit in all 16. The flat graph's plan, free to differ per layer,
recomputed a third as much (docs/benchmarks/blocks.md).

`split_later_runs` gives the block's last `m` runs a plan of their own: a twin entry for the
same captured graph (CompiledGraph.twin), planned greedily (Chen et al. 2016, Alg. 3, the
least recomputation that fits) around what the first runs hold, while the first runs keep
the plan they have (`pinned`). The later runs are the ones to keep more: each run's peak
is what the runs before it saved plus its own working set, and a plan that recomputes
less adds less to the working set of its backward, so the lean plans go where fewer
saved tensors are held around them. `m` is searched on powers of two and then, past the
best of those, for the last `m` whose twin recomputes no more (the total falls with `m`
while the twin's plan stays the same); every try is a joint re-plan of the forward
(memopt.graph_breaks.replan_jointly), so the graphs after the block (a language-model
head) are priced with it: where they recompute more than before, the twin is counted
heavier (CompiledGraph.weight) and tried again. A try keeps the plans of the other graphs
that recompute nothing while they still fit, and fails where one no longer does (`lazy`):
planning them again to recompute (a head chunked) is what the twin's weight avoids, and
it costs most of a try's time. The split is kept only where the step then recomputes less,
and then the first runs are planned again for the fewer runs they are, where that
recomputes less still.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .graph_breaks import MAX_WEIGHT, DoesNotFit, ReplanPolicy, replan_jointly
from .steps import Outside

if TYPE_CHECKING:  # pragma: no cover
    from .compiled_graph import CompiledGraph

log = logging.getLogger("memopt")


def _flops(runs: list[CompiledGraph]) -> int:
    return sum(run.plan.recompute_flops for run in runs)


def _with_twin(runs: list[CompiledGraph], graph: CompiledGraph, twin: CompiledGraph,
               m: int) -> list[CompiledGraph]:
    """`runs` with the last `m` runs of `graph` run by `twin`."""
    k, seen, out = sum(r is graph for r in runs), 0, []
    for run in runs:
        if run is graph:
            seen += 1
            out.append(twin if seen > k - m else graph)
        else:
            out.append(run)
    return out


def split_later_runs(runs: list[CompiledGraph], bases: list[Outside],
                     policies: dict[int, ReplanPolicy],
                     step_baseline: int | None) -> list[CompiledGraph]:
    """After the first forward's fitting re-plan: each repeated graph planned GREEDY that
    recomputes gets a twin for its later runs where the step then recomputes less (module
    docstring). Returns the runs as the next forwards run them; the plans are made."""
    for graph in list(dict.fromkeys(runs)):
        k = sum(r is graph for r in runs)
        if k < 2 or graph.primary is not graph or graph.later is not None \
                or policies[id(graph)] != ReplanPolicy.GREEDY or not graph.plan.recompute_flops:
            continue  # a twin is not split again: a third plan gained nothing on the
            # 16-layer Llama (docs/benchmarks/blocks.md) and costs a search
        runs = _split(graph, k, runs, bases, policies, step_baseline)
    return runs

def _split(graph: CompiledGraph, k: int, runs: list[CompiledGraph], bases: list[Outside],
           policies: dict[int, ReplanPolicy], step_baseline: int | None
           ) -> list[CompiledGraph]:
    before = _flops(runs)
    last = max(i for i, r in enumerate(runs) if r is graph)
    later_before = _flops(runs[last + 1:])
    twin = graph.twin(k)
    policies[id(twin)] = ReplanPolicy.GREEDY
    others = {id(r) for r in runs if r is not graph}
    graph.pinned = True
    #: m -> (the step's recomputed FLOPs, the twin's, its weight) where its last m runs
    #: fit as a twin
    tried: dict[int, tuple[int, int, int] | None] = {}

    def attempt(m: int) -> tuple[int, int, int] | None:
        """The twin for the last m runs, greedy; counted heavier (CompiledGraph.weight)
        while the graphs after it recompute more than they did, as _recompute_less does."""
        if m in tried:
            return tried[m]
        split, found = _with_twin(runs, graph, twin, m), None
        twin.first_run = k - m
        for weight in range(MAX_WEIGHT + 1):
            twin.weight = weight
            try:
                replan_jointly(split, bases, policies, step_baseline, lazy=others)
            except DoesNotFit:
                continue  # a heavier weight keeps less: it may fit
            if found is None or _flops(split) < found[0]:
                found = (_flops(split), twin.plan.recompute_flops, weight)
            if _flops(split[last + 1:]) <= later_before:
                break  # the graphs after it pay nothing for what it keeps
        tried[m] = found
        return found

    grid = sorted({1 << i for i in range(k.bit_length()) if 1 << i < k} | {k - 1})
    for m in grid:
        attempt(m)
    fitting = [m for m in grid if tried[m] is not None]
    if fitting:
        best = min(fitting, key=lambda m: (tried[m][0], -m))
        low, high = best, next((m for m in grid if m > best), best)
        while high - low > 1:  # the twin's plan unchanged up to where: the total falls
            mid = (low + high) // 2
            found = attempt(mid)
            if found is not None and found[1] <= tried[best][1]:
                low = mid
            else:
                high = mid
        best = min((m for m in tried if tried[m] is not None), key=lambda m: (tried[m][0], -m))
    if not fitting or tried[best][0] >= before:
        graph.pinned = False
        replan_jointly(runs, bases, policies, step_baseline)  # the others as they were
        return runs
    split = _with_twin(runs, graph, twin, best)
    twin.first_run, twin.weight = k - best, tried[best][2]
    kept = graph.planned()
    graph.pinned = False  # its first runs may keep more now that they are fewer
    try:
        replan_jointly(split, bases, policies, step_baseline)
        unpinned = _flops(split)
    except DoesNotFit:
        unpinned = None
    if unpinned is None or unpinned > tried[best][0]:
        graph.restore(kept)  # its plan as the search priced it
        graph.pinned = True
        replan_jointly(split, bases, policies, step_baseline)
    graph.later = (twin.first_run, twin)
    log.info("memopt: %s keeps more in its last %d of %d runs (a second plan): %.3g GFLOP "
             "recomputed per step, against %.3g with one plan", graph.label(), best, k,
             _flops(split) / 1e9, before / 1e9)
    return split
