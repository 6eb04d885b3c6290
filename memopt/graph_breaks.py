"""A forward split by graph breaks: each graph planned again once the whole forward is
known, by a ReplanPolicy, in rounds until what each holds for the others settles.

Dynamo calls the backend once per graph of a forward with graph breaks (DESIGN.md,
"Pitfalls"); each graph's saved tensors stay live while the later graphs run, and what
those hold is not known until the forward ends. The first forward plans every graph
lean (`ReplanPolicy.LEAN`, else `LOWEST`); when it ends, `replan_forward` plans each
graph again with what the rest of the step holds around each of its runs
(memopt.steps), the graphs before one that misses the budget made lean for it.
"""

from __future__ import annotations

import enum
import logging
from typing import TYPE_CHECKING

from .budget import format_bytes
from .errors import BudgetError
from .steps import Outside

if TYPE_CHECKING:  # pragma: no cover
    from .compiled_graph import CompiledGraph

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


#: Rounds of planning every graph of a forward again, each with the saved bytes the
#: round before gave the others (a graph running more than once in a forward sees graphs
#: that run after its first run).
ROUNDS = 3


def step_baseline(runs: list[CompiledGraph]) -> int:
    """The baseline peak of the whole step (no memopt passes in any graph), which a
    fraction budget is of: the largest over the runs of a graph's baseline, with what the
    graphs before it would save unoptimized in place of what their plans save."""
    peak, extra = 0, 0
    for graph in runs:
        peak = max(peak, graph.plan.baseline_peak_bytes + extra)
        extra += graph.plan.baseline_saved_bytes - graph.plan.held_bytes
    return peak


class DoesNotFit(Exception):
    """A graph's plan misses the budget; `position`: its last run in the forward."""

    def __init__(self, graph: CompiledGraph, position: int) -> None:
        super().__init__(graph.label())
        self.graph, self.position = graph, position


def replan_jointly(runs: list[CompiledGraph], bases: list[Outside],
                   policies: dict[int, ReplanPolicy], step_baseline: int | None) -> None:
    """Plan every graph of a forward again with all of them known: each by its policy in
    `policies` (by id), with what the rest of the step holds around each of its runs
    (`bases`, from memopt.steps, plus the saved bytes of the runs before it as planned
    now), in rounds until the saved bytes settle. Raises DoesNotFit for the first graph
    whose plan misses the budget, at its last run's position."""
    order = list(dict.fromkeys(runs))
    #: within one re-plan a graph's need only grows: a graph that runs several times holds
    #: its own saved bytes around its later runs, so a leaner plan (for a larger need)
    #: lowers its need, and planning again for that lower need would flip back to a plan
    #: whose own saved bytes its later runs cannot hold (measured 9% over a budget)
    assumed: dict[int, Outside] = {}
    for _ in range(ROUNDS):
        before = {id(g): g.plan.held_bytes for g in order}
        for graph in order:
            need = _need(graph, runs, bases)
            need = assumed[id(graph)] = need.max(assumed.get(id(graph), need))
            policy = policies[id(graph)]
            if graph.provisional or graph.outside != need or graph.policy != policy \
                    or graph.step_baseline != step_baseline:
                log.info("memopt: planning %s again with the whole forward known (%s): %s "
                         "held around its forward, %s around its backward", graph.label(),
                         policy.value, format_bytes(need.forward), format_bytes(need.backward))
                graph.replan(need, policy, step_baseline)
        if all(g.plan.held_bytes == before[id(g)] for g in order):
            break
    for graph in order:
        last = max(i for i, r in enumerate(runs) if r is graph)
        if not graph.plan.fits:
            raise DoesNotFit(graph, last)
        if not graph.outside.covers(_need(graph, runs, bases)):  # rounds ran out
            log.info("memopt: %s did not settle in %d rounds: planned for what its runs "
                     "hold at most", graph.label(), ROUNDS)
            graph.replan(graph.outside.max(_need(graph, runs, bases)), policies[id(graph)],
                         step_baseline)
            if not graph.plan.fits:
                raise DoesNotFit(graph, last)


def _need(graph: CompiledGraph, runs: list[CompiledGraph], bases: list[Outside]) -> Outside:
    """What the rest of the step holds around `graph`'s runs at most: each run's base
    plus the saved bytes of every run before it, as the graphs are planned now."""
    need = Outside()
    for i, run in enumerate(runs):
        if run is graph:
            need = need.max(bases[i].plus(sum(r.plan.held_bytes for r in runs[:i])))
    return need


def replan_forward(runs: list[CompiledGraph], bases: list[Outside],
                   step_baseline: int | None) -> BudgetError | None:
    """Re-plan a forward's graphs (replan_jointly) until they fit: where one misses, the
    graphs before it that were planned GREEDY become LEAN for it. Policies settled by
    earlier forwards stay; the first forward's guesses do not. Returns the BudgetError of
    a graph that misses with every graph before it lean (None: every graph fits)."""
    policies = {id(g): ReplanPolicy.GREEDY if g.provisional else g.policy for g in runs}
    while True:
        try:
            replan_jointly(runs, bases, policies, step_baseline)
            return None
        except DoesNotFit as miss:
            # the graphs before the one that misses hold as little as they can for it
            earlier = [g for g in dict.fromkeys(runs[:miss.position])
                       if policies[id(g)] == ReplanPolicy.GREEDY and g is not miss.graph]
            if not earlier:
                return miss.graph.budget_error()
            for g in earlier:
                policies[id(g)] = ReplanPolicy.LEAN
