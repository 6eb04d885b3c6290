"""A forward split by graph breaks: each graph planned again once the whole forward is
known, by a ReplanPolicy, in rounds until what each holds for the others settles. A graph
that runs several times in a forward (a repeated block, memopt.blocks) has one plan for
every run, priced with its own earlier runs (`required`).

Dynamo calls the backend once per graph of a forward with graph breaks (DESIGN.md,
"Pitfalls"); each graph's saved tensors stay live while the later graphs run, and what
those hold is not known until the forward ends. The first forward plans every graph
lean (`ReplanPolicy.LEAN`, else `LOWEST`); when it ends, `replan_forward` plans each
graph again with what the rest of the step holds around each of its runs
(memopt.steps), the graphs before one that misses the budget made lean for it.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
from typing import TYPE_CHECKING, Callable, Collection

from .budget import HEADROOM, format_bytes
from .errors import BudgetError
from .steps import Outside

if TYPE_CHECKING:  # pragma: no cover
    from .compiled_graph import CompiledGraph
    from .memory_plan import MemoryPlan

log = logging.getLogger("memopt")


class ReplanPolicy(enum.Enum):
    """How a graph of a forward with graph breaks is planned."""

    #: the least recomputation that fits (Chen's search): a graph alone in its step
    GREEDY = "greedy"
    #: recompute everything it can (Chen Alg. 2 with m(v) = 1 everywhere): it holds the
    #: least for the graphs after it
    LEAN = "lean"
    #: its lowest-peak plan, whatever the budget (planner.PlanRequest.lowest_peak)
    LOWEST = "lowest"


#: After the first forward's fitting re-plan: (runs, bases, policies, step baseline) ->
#: the runs as the next forwards run them, planned (memopt.run_plans.split_later_runs)
Refine = Callable[[list["CompiledGraph"], list[Outside], dict[int, "ReplanPolicy"],
                   "int | None"], list["CompiledGraph"]]

#: Rounds of planning every graph of a forward again, each with the saved bytes the
#: round before gave the others (a graph running more than once in a forward sees graphs
#: that run after its first run).
ROUNDS = 3


def step_baseline(runs: list[CompiledGraph]) -> int:
    """The baseline peak of the whole step (no memopt passes in any graph), which a
    fraction budget is of: the largest over the runs of a graph's baseline, with what the
    graphs before it would save unoptimized in place of what their plans save. A graph
    planned for one run (the first forward's plans) counted what was held at its first
    run: at a later run of it, what the runs since then hold is added. Left out, a loop
    of 6 layers broken by dynamo into one graph run 6 times named 17.5 MB where eager's
    step measured 22.4 MB, and a fraction budget asked for less than its fraction of it
    (its first step then measured 1.19x a 0.65 budget; found from outside on a
    Wav2Vec2 with transformers 4.46)."""
    peak, extra, held, since = 0, 0, 0, {}
    for graph in runs:
        plan = graph.plan
        first = since.setdefault(id(graph), held)  # what was held at its first run
        later = 0 if graph.outside.own else held - first  # (planned for each run: Outside)
        peak = max(peak, plan.baseline_peak_bytes + extra + later)
        extra += plan.baseline_saved_bytes - plan.held_bytes
        held += plan.held_bytes
    return peak


class DoesNotFit(Exception):
    """A graph's plan misses the budget; `position`: its last run in the forward."""

    def __init__(self, graph: CompiledGraph, position: int) -> None:
        super().__init__(graph.label())
        self.graph, self.position = graph, position


def _stays(graph: CompiledGraph, need: Outside, policy: ReplanPolicy,
           lazy: Collection[int]) -> bool:
    """Whether `graph`'s plan is kept as it is around `need`: pinned while its twin is
    planned, and covering what its runs hold (memopt.run_plans); or, in `lazy` (that
    search's tries), a plan that recomputes nothing and fits with what its runs hold now
    (planning it again would keep the same; its predicted peak is then stale by the
    difference). Raises DoesNotFit for a graph in `lazy` whose plan recomputes nothing and
    no longer fits: the try costs it recomputation, which the search does not take."""
    plan = graph.plan
    if graph.policy != policy or not plan.fits:
        return False
    if graph.pinned and graph.outside.covers(need):
        return True
    if id(graph) not in lazy or plan.recompute_flops or plan.budget_bytes is None:
        return False
    held = plan.held_bytes
    grown = max(0, need.after_backward - graph.outside.after_backward,
                *(n - o for n, o in zip(need.around(held), graph.outside.around(held))))
    if plan.predicted_peak_bytes + grown > plan.budget_bytes - plan.headroom_bytes:
        raise DoesNotFit(graph, -1)
    return True


#: A plan made around a little more than its graph's runs hold now is kept (the fraction of
#: its predicted peak): eager code between graphs whose bytes change from step to step (a
#: PackedSequence's rows, memopt.recurrent.packed) would otherwise plan and compile every
#: graph of the forward again at every new size, and keep each plan.
NEARLY = 0.05


def _nearly(planned: Outside, need: Outside, plan) -> bool:
    """Whether a plan made around `planned` still stands for `need`: equal, or covering it
    (it fits) by at most NEARLY of its predicted peak around every run (more, and planning
    again would keep more or recompute less)."""
    if planned == need:
        return True
    slack = NEARLY * plan.predicted_peak_bytes
    return planned.covers(need) and planned.own == need.own and all(
        0 <= a - b <= slack for a, b in ((planned.forward, need.forward),
                                        (planned.backward, need.backward),
                                        (planned.after_backward, need.after_backward)))


def replan_jointly(runs: list[CompiledGraph], bases: list[Outside],
                   policies: dict[int, ReplanPolicy], step_baseline: int | None,
                   lazy: Collection[int] = ()) -> None:
    """Plan every graph of a forward again with all of them known: each by its policy in
    `policies` (by id), with what the rest of the step holds around each of its runs
    (`bases`, from memopt.steps, plus the saved bytes of the runs before it as planned
    now; a graph that runs several times counts its own earlier runs by its plan's saved
    bytes, `required`), in rounds until the saved bytes settle. Raises DoesNotFit for the
    first graph whose plan misses the budget, at its last run's position. `lazy`: ids of
    graphs whose plans are kept while they recompute nothing and still fit (_stays), for
    a search's tries."""
    order = list(dict.fromkeys(runs))
    #: within one re-plan a graph's need only grows, so that the rounds settle
    assumed: dict[int, Outside] = {}
    for _ in range(ROUNDS):
        before = {id(g): g.plan.held_bytes for g in order}
        for graph in order:
            need = required(graph, runs, bases, weighted=True)
            need = assumed[id(graph)] = need.max(assumed.get(id(graph), need))
            policy = policies[id(graph)]
            if _stays(graph, need, policy, lazy):
                continue
            if graph.provisional or not _nearly(graph.outside, need, graph.plan) \
                    or graph.policy != policy or graph.step_baseline != step_baseline:
                held = need.around(graph.plan.held_bytes)
                log.info("memopt: planning %s again with the whole forward known (%s): %s "
                         "held around its forward, %s around its backward%s", graph.label(),
                         policy.value, format_bytes(held[0]), format_bytes(held[1]),
                         f" (up to {need.repeats} of its own runs)" if need.repeats else "")
                graph.replan(need, policy, step_baseline)
        if all(g.plan.held_bytes == before[id(g)] for g in order):
            break
    for graph in order:
        last = max(i for i, r in enumerate(runs) if r is graph)
        if not graph.plan.fits:
            raise DoesNotFit(graph, last)
        need = required(graph, runs, bases)
        if not graph.outside.covers(need) and not _stays(graph, need, policies[id(graph)],
                                                         lazy):  # rounds ran out
            log.info("memopt: %s did not settle in %d rounds: planned for what its runs "
                     "hold at most", graph.label(), ROUNDS)
            graph.replan(graph.outside.max(required(graph, runs, bases, weighted=True)),
                         policies[id(graph)], step_baseline)
            if not graph.plan.fits:
                raise DoesNotFit(graph, last)


def _held(runs: list[CompiledGraph], i: int, base: Outside, graph: CompiledGraph | None = None
          ) -> tuple[int, int]:
    """Saved bytes of the runs before run `i` (other than `graph`'s own), as planned now,
    around its forward and around its backward: a run whose autograd node was freed by
    then (base.dead_forward, base.dead_backward; memopt.steps) holds none."""
    before = [(j, r) for j, r in enumerate(runs[:i]) if r is not graph]
    return (sum(r.plan.held_bytes for j, r in before if j not in base.dead_forward),
            sum(r.plan.held_bytes for j, r in before if j not in base.dead_backward))


def need_of(graph: CompiledGraph, runs: list[CompiledGraph], bases: list[Outside]) -> Outside:
    """What the rest of the step holds around `graph`'s runs at most: each run's base
    plus the saved bytes of every run before it still alive, as the graphs are planned now."""
    need = Outside()
    for i, run in enumerate(runs):
        if run is graph:
            need = need.max(bases[i].plus(*_held(runs, i, bases[i])))
    return need


def required(graph: CompiledGraph, runs: list[CompiledGraph], bases: list[Outside],
             weighted: bool = False) -> Outside:
    """What `graph`'s plan must count around it: need_of; for a graph that runs several
    times in the forward (a repeated block, memopt.blocks; one plan for every run), what
    the rest holds around each of its runs besides its own earlier runs, which the
    planner counts with the saved bytes of each plan it weighs (Outside.own,
    allocator.lifetimes.held_outside): a plan that keeps less holds less around its later
    runs. `weighted`: with its weight for the graphs after it (`CompiledGraph.weight`,
    replan_forward): its own earlier runs counted (1 + weight / 4) times as often."""
    if sum(r is graph for r in runs) < 2:
        return need_of(graph, runs, bases)
    weight = graph.weight if weighted else 0
    own, after, before = [], 0, 0
    for i, run in enumerate(runs):
        if run is graph:
            base = bases[i].plus(*_held(runs, i, bases[i], graph))
            own.append((len(own) * (4 + weight) // 4, base.forward, base.backward))
            after = max(after, base.after_backward)
            before = max(before, base.before_backward)
    return Outside(0, 0, after, tuple(own), before)


def earlier_calls(runs: list[CompiledGraph], bases: list[Outside], calls: int,
                  alive_bytes: int, grad_bytes: int, param_grad_bytes: int
                  ) -> tuple[list[CompiledGraph], list[Outside]]:
    """A forward's runs and bases with those of `calls` earlier calls of the module whose
    backward has not run (memopt.pending: two calls before one backward) before them,
    each as this call's: every graph then runs `calls` + 1 times before one backward and
    is planned as a repeated block's is (`required`), each earlier run holding what its
    plan saves; this call's runs also hold the earlier calls' inputs and outputs still
    alive (`alive_bytes`), and their backward those outputs' gradients (`grad_bytes`):
    the caller's loss makes every call's output gradient before any graph's backward
    runs (a contrastive loop measured one output over its plan without them). The
    earlier calls' backward runs last, with the parameters' gradients the later calls'
    made (`param_grad_bytes`) and the later calls' inputs and outputs, as large as the
    earlier's, alive (1.06x the minimum named without them)."""
    n = len(runs)

    def shifted(base: Outside, k: int, held: int = 0, grads: int = 0) -> Outside:
        return dataclasses.replace(  # plus() drops the dead sets
            base.plus(held, held + grads),
            dead_forward=frozenset(j + k * n for j in base.dead_forward),
            dead_backward=frozenset(j + k * n for j in base.dead_backward))

    last = [shifted(b, calls, alive_bytes, grad_bytes) for b in bases]
    earlier = [shifted(b, k, alive_bytes, param_grad_bytes) for k in range(calls) for b in bases]
    return runs * (calls + 1), earlier + last


#: How often replan_forward raises a repeated graph's weight (its own earlier runs counted
#: a quarter as often again each time, up to twice) for a graph after it that misses the
#: budget, before planning it lean
MAX_WEIGHT = 4


def as_run(graph: CompiledGraph, need: Outside, own_runs_before: int) -> MemoryPlan:
    """The plan of a graph that runs several times, planned with its own earlier runs
    weighted (`required`), with its timeline and predicted peak around `need` instead:
    what its runs hold with this plan's saved bytes (need_of), never more than it was
    planned around; its outside bytes those of the other graphs, beside
    `own_runs_before` runs of its own."""
    plan, timeline = graph.plan, graph.plan.timeline
    planned_forward, planned_backward = graph.outside.around(plan.held_bytes)
    cut_forward = planned_forward - need.forward
    cut_backward = planned_backward - need.backward
    own_now = own_runs_before * plan.held_bytes
    fields = {"own_runs_before": own_runs_before,
              "outside_forward_bytes": max(0, need.forward - own_now),
              "outside_backward_bytes": max(0, need.backward - own_now)}
    if timeline is None or "other_graphs" not in timeline.kinds \
            or (cut_forward <= 0 and cut_backward <= 0):
        return plan.model_copy(update=fields)
    k = timeline.kinds.index("other_graphs")
    column = tuple(max(0, v - max(0, cut_forward if step < timeline.num_forward_steps
                                  else cut_backward))
                   for step, v in zip(timeline.steps, timeline.live[k]))
    new = timeline.model_copy(update={"live": (*timeline.live[:k], column,
                                               *timeline.live[k + 1:])})
    lower = max(timeline.totals) - max(new.totals)
    return plan.model_copy(update={
        "timeline": new, "predicted_peak_bytes": plan.predicted_peak_bytes - lower, **fields})


def replan_forward(runs: list[CompiledGraph], bases: list[Outside],
                   step_baseline: int | None,
                   refine: Refine | None = None) -> BudgetError | None:
    """Re-plan a forward's graphs (replan_jointly) until they fit: where one misses, the
    graphs before it that were planned GREEDY hold less for it: a repeated graph (whose
    runs each keep its saved bytes) counts them more often (`weight`, up to MAX_WEIGHT
    times), the others, and then it, become LEAN, and last the graphs before it LOWEST.
    Policies and weights settled by earlier forwards stay; the first forward's guesses
    do not. After the first forward fits, `refine` may plan it further
    (memopt.run_plans.split_later_runs: a second plan for a repeated graph's later runs)
    and `runs` is changed in place to what it returns. Returns the BudgetError of a graph
    that misses with every graph before it at its lowest peak (None: every graph fits)."""
    policies = {id(g): ReplanPolicy.GREEDY if g.provisional else g.policy for g in runs}
    first = any(g.provisional for g in runs)
    planned = {id(g): g.plan for g in runs}
    if first:
        for graph in runs:
            graph.weight = 0
    while True:
        try:
            replan_jointly(runs, bases, policies, step_baseline)
            if first:
                _recompute_less(runs, bases, policies, step_baseline)
                if refine is not None:
                    runs[:] = refine(runs, bases, policies, step_baseline)
            for graph in dict.fromkeys(runs):  # as it runs: what its runs hold
                k = sum(r is graph for r in runs)
                if k > 1 and graph.plan is not planned.get(id(graph)):  # planned just now
                    graph.plan = as_run(graph, need_of(graph, runs, bases), k - 1)
            return None
        except DoesNotFit as miss:
            earlier = [g for g in dict.fromkeys(runs[:miss.position])
                       if policies[id(g)] == ReplanPolicy.GREEDY and g is not miss.graph]
            if not earlier:
                if policies[id(miss.graph)] == ReplanPolicy.GREEDY:
                    # then it: LEAN, and LOWEST where LEAN misses (CompiledGraph.replan).
                    # Left GREEDY, a first graph that LOWEST fits was refused here (its
                    # budget_error found the fit: an AssertionError; HF Jamba at 0.7)
                    policies[id(miss.graph)] = ReplanPolicy.LEAN
                    continue
                # last, the graphs before it at their lowest peaks: a LEAN plan recomputes
                # Chen's mirror set but fits a chain to its own graph's budget, and the
                # chunks it keeps are what the graph after it misses by (an nn.LSTM with
                # forward hooks at 0.7 was refused, naming 0.978, where 0.6 fitted)
                lean = [g for g in dict.fromkeys(runs[:miss.position])
                        if policies[id(g)] == ReplanPolicy.LEAN and g is not miss.graph]
                if not lean:
                    return miss.graph.budget_error()
                for g in lean:
                    policies[id(g)] = ReplanPolicy.LOWEST
                continue
            for g in earlier:
                if sum(r is g for r in runs) > 1 and g.weight < MAX_WEIGHT:
                    g.weight += 1
                else:
                    policies[id(g)] = ReplanPolicy.LEAN


#: Budgets step_minimum plans a forward at before it names the last one tried
MINIMUM_TRIES = 6


def step_minimum(missed: BudgetError, misses_at: Callable[[int], BudgetError | None],
                 baseline: int) -> BudgetError:
    """The BudgetError for a forward with graph breaks that misses its budget, naming the
    smallest budget its whole step is planned within. replan_forward stops at the first
    graph that misses; that graph's minimum counts the graphs before it, made lean, and
    not the ones after it, which can miss at that minimum in turn (a Mixtral with router
    logits: 3,918,295 bytes named, then 4,438,100 at the next step). So the forward is
    planned again at each minimum named (`misses_at(bytes)`: the forward planned as a
    first forward at that byte budget, its BudgetError or None where every graph fits),
    up to MINIMUM_TRIES times, and the last minimum tried is the one named (where the
    tries do not settle, one checked by _settled_at), with the
    whole step's `baseline` (step_baseline: what a fraction is of; the missing graph's
    own made `smallest_fraction` None or too high)."""
    tried, seconds = missed.minimum_bytes, missed.plan_seconds
    for _ in range(MINIMUM_TRIES):
        again = misses_at(tried)
        if again is None:
            break
        seconds += again.plan_seconds
        tried = max(again.minimum_bytes, tried + 1)
    else:  # not settled: each try named a higher one (HF Encodec: 2.9 MB ... 11.3 MB)
        tried = _settled_at(misses_at, tried, baseline)
    error = missed.with_minimum(tried, baseline)
    error.plan_seconds = seconds
    return error


#: _settled_at: each budget it checks this much above the one before
SETTLE_STEP = 1.25


def _settled_at(misses_at: Callable[[int], BudgetError | None], last: int,
                baseline: int) -> int:
    """After step_minimum's tries: the first of `last` (the minimum the last try named),
    then budgets SETTLE_STEP apart, that the forward is planned within, up to a budget
    above the whole step's `baseline` (no memopt passes: every graph fits it without
    recomputing); `last`, as before, where none is."""
    above = math.ceil(baseline / (1 - max(HEADROOM.values())))
    nbytes = last
    while True:
        if misses_at(nbytes) is None:
            return nbytes
        if nbytes >= above:
            return last
        nbytes = min(max(math.ceil(nbytes * SETTLE_STEP), nbytes + 1), max(above, last + 1))


def _recompute_flops(runs: list[CompiledGraph]) -> int:
    return sum(run.plan.recompute_flops for run in runs)


def _recompute_less(runs: list[CompiledGraph], bases: list[Outside],
                    policies: dict[int, ReplanPolicy], step_baseline: int | None) -> None:
    """After the first fitting re-plan: each graph took the least recomputation that fits
    around what the graphs before it keep, so a repeated block that keeps all it can may
    leave a graph after it to recompute much more (a language-model head chunked: its
    projection twice) than the block would by keeping a little less. Try each repeated
    GREEDY graph with recomputing graphs after it at a higher weight (up to MAX_WEIGHT),
    keep the weights with the least recomputation in the whole step."""
    best = _recompute_flops(runs)
    for graph in dict.fromkeys(runs):
        last = max(i for i, r in enumerate(runs) if r is graph)
        later = sum(r.plan.recompute_flops for r in runs[last + 1:])
        if sum(r is graph for r in runs) < 2 or policies[id(graph)] != ReplanPolicy.GREEDY \
                or later <= sum(r.plan.recompute_flops for r in runs if r is graph):
            continue  # the graphs after it recompute no more than its runs do: as it is
        kept = graph.weight
        while graph.weight < MAX_WEIGHT:
            graph.weight += 1
            try:
                replan_jointly(runs, bases, policies, step_baseline)
            except DoesNotFit:
                break
            if _recompute_flops(runs) < best:
                best, kept = _recompute_flops(runs), graph.weight
        if graph.weight != kept:
            graph.weight = kept  # the best again
            replan_jointly(runs, bases, policies, step_baseline)
