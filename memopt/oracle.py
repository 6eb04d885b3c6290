"""How far memopt's plans are from the best possible: the exact recomputation oracle.

memopt's planner (Chen et al. 2016, Alg. 3 with the Appendix A grid over B, and Sec.
4.4's recursion) tries a few dozen candidates. This module solves the same problem
exactly for graphs small enough: the least recomputed FLOPs whose simulated peak fits
a budget, over memopt's plan space (each forward value saved, or recomputed once in
the backward before its first use), as a Checkmate-style MILP (Jain et al. 2020;
memopt.allocator.milp) solved by HiGHS. It needs the `[solver]` extra
(`pip install -e ".[solver]"`, highspy).

    from memopt.oracle import Oracle
    oracle = Oracle(model, x)              # captures one training step, no run
    best = oracle.optimum(budget_bytes)    # MILP plan, checked by the step simulator
    mine = oracle.memopt(budget_bytes)     # memopt's own plan at the same budget
    print(mine.recompute_flops / best.recompute_flops - 1)   # the gap

Both sides are scored by the same step simulator (passes.simulate) with in-place
rewrites off, since the MILP does not model them: the budget is on the simulated peak,
and the FLOPs are the simulator's. The MILP's byte accounting is built from the
simulator's schedule (memopt.passes.oracle); its plan is always re-simulated, and when
the simulated peak exceeds the budget (the MILP orders a stage's recomputations by
topological order, the simulator by Alg. 2's first use) the MILP is solved again with
the budget lowered by the excess. `OraclePlan.exact` says whether the model's peak
agreed with the simulator's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .allocator.milp import RecomputeProblem, RecomputeSolution, solve
from .errors import BudgetError, InputError
from .passes.oracle import recompute_problem
from .passes.simulate import StepModel
from .planner import observing


@dataclass(frozen=True)
class OraclePlan:
    """One plan at one budget, as the step simulator scores it (in-place off)."""

    budget_bytes: int
    peak_bytes: int | None          # None: no plan fits
    recompute_flops: int | None
    optimal: bool = False           # the MILP proved its cost minimal (oracle only)
    bound_flops: float | None = None  # HiGHS's lower bound on the FLOPs (oracle only)
    seconds: float = 0.0
    exact: bool = True              # the MILP's own peak was the simulator's (oracle only)
    status: str = ""                # HiGHS's ("Optimal", "Infeasible", "Time limit reached")

    @property
    def fits(self) -> bool:
        return self.peak_bytes is not None


class Oracle:
    """One training step of `model` on `inputs`, captured once, for exact plans."""

    def __init__(self, model: torch.nn.Module, *inputs: Any,
                 example_kwargs: dict[str, Any] | None = None) -> None:
        from .api import plan

        self._model, self._inputs, self._kwargs = model, inputs, example_kwargs
        with observing() as seen:
            base = plan(model, *inputs, example_kwargs=example_kwargs, inplace=False)
        if len(seen) != 1:
            raise InputError(f"memopt.oracle solves one graph; this step has {len(seen)} "
                             "(graph breaks): plan it with fullgraph code")
        self.step: StepModel = seen[0].model
        self.baseline_bytes = base.baseline_peak_bytes
        self.problem: RecomputeProblem
        self.problem, self._units = recompute_problem(self.step)
        self._names = [self.step.protos[i].name for i in self._units]

    def simulate(self, recomputed: frozenset[str]) -> tuple[int, int]:
        """(peak, recomputed FLOPs) of recomputing these forward nodes, in-place off."""
        sim = self.step.simulate(recomputed, (), False)
        return sim.peak_bytes, sim.recompute_flops

    def optimum(self, budget_bytes: int, *, time_limit: float = 60.0,
                retries: int = 4) -> OraclePlan:
        """The MILP's plan at `budget_bytes`, re-simulated; see the module docstring."""
        target, seconds, exact = budget_bytes, 0.0, True
        for _ in range(retries + 1):
            solution: RecomputeSolution = solve(self.problem, target, time_limit=time_limit)
            seconds += solution.seconds
            if not solution.feasible:
                return OraclePlan(budget_bytes, None, None, seconds=seconds, exact=exact,
                                  status=solution.status)
            names = frozenset(self._names[u] for u in solution.recomputed)
            peak, flops = self.simulate(names)
            if peak <= budget_bytes:
                return OraclePlan(budget_bytes, peak, flops, optimal=solution.optimal and exact,
                                  bound_flops=solution.bound, seconds=seconds, exact=exact,
                                  status=solution.status)
            exact = False  # the model let through a plan the simulator puts above the budget
            target -= peak - budget_bytes
        return OraclePlan(budget_bytes, None, None, seconds=seconds, exact=False)

    def memopt(self, budget_bytes: int) -> OraclePlan:
        """memopt's own plan at `budget_bytes` (Alg. 3 + grid, in-place off, no headroom)."""
        from .api import plan

        try:
            result = plan(self._model, *self._inputs, example_kwargs=self._kwargs,
                          budget=budget_bytes, inplace=False, headroom=0.0)
        except BudgetError:
            return OraclePlan(budget_bytes, None, None)
        return OraclePlan(budget_bytes, result.predicted_peak_bytes, result.recompute_flops,
                          seconds=result.plan_seconds or 0.0)

    def memopt_minimum(self) -> int:
        """The least budget memopt's search fits (in-place off, no headroom)."""
        from .api import plan

        try:
            plan(self._model, *self._inputs, example_kwargs=self._kwargs, budget=1,
                 inplace=False, headroom=0.0)
        except BudgetError as err:
            return err.minimum_bytes
        return 1
