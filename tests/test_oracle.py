"""The exact recomputation oracle (memopt.oracle, allocator/milp.py).

The MILP must give the optimum of memopt's plan space as the step simulator scores it:
on chains small enough to enumerate every subset of recomputed values, its FLOPs at
each budget equal the brute-force minimum. memopt's own search is then measured
against it, and `solver="milp"` takes the MILP's plan inside memopt.compile with
eager's gradients (BatchNorm twins, dropout).
"""

from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch
from models import CASES
from support import check_matches_eager

import memopt
from benchmarks.workloads import mlp

pytest.importorskip("highspy")  # the [solver] extra; CI installs it with [dev]

from memopt.allocator.milp import RecomputeProblem, solve

from memopt.oracle import Oracle


def _brute_force(oracle: Oracle) -> list[tuple[int, int]]:
    """(peak, FLOPs) of every subset of recomputable units, by the simulator."""
    p = oracle.problem
    units = [u for u in range(p.num_units) if p.recomputable[u]]
    assert len(units) <= 12, "too many units to enumerate"
    return [oracle.simulate(frozenset(oracle._names[u] for u in subset))
            for r in range(len(units) + 1) for subset in itertools.combinations(units, r)]


@pytest.mark.parametrize("layers", [3, 5])
def test_the_milp_finds_the_brute_force_optimum_on_chains(layers: int) -> None:
    w = mlp("cpu", layers=layers, width=32, batch=1024)  # activations dominate
    oracle = Oracle(w.model, *w.args)
    every = _brute_force(oracle)
    lowest, highest = min(p for p, _ in every), max(p for p, _ in every)
    checked = 0
    for fraction in (0.0, 0.1, 0.3, 0.6, 0.9):
        budget = int(lowest + fraction * (highest - lowest))
        best = min(f for p, f in every if p <= budget)
        plan = oracle.optimum(budget)
        assert plan.fits and plan.peak_bytes <= budget
        assert plan.recompute_flops == best, (budget, plan, best)
        assert plan.optimal and plan.exact
        checked += best > 0
    assert checked >= 3  # the budgets bind: something is recomputed
    below = oracle.optimum(lowest - 1)  # below every subset: proven, no plan
    assert not below.fits and below.status == "Infeasible"


def test_the_milp_can_be_shown_wrong() -> None:
    """The brute-force comparison fails on a wrong model: a stage's reads dropped."""
    w = mlp("cpu", layers=3, width=32, batch=1024)
    oracle = Oracle(w.model, *w.args)
    every = _brute_force(oracle)
    lowest = min(p for p, _ in every)
    p = oracle.problem
    wrong = RecomputeProblem(**{**p.__dict__, "reads": tuple(() for _ in p.reads)})
    solution = solve(wrong, lowest)
    assert solution.feasible and solution.cost < min(f for pk, f in every if pk <= lowest)


def test_memopt_is_never_below_the_optimum_and_the_gap_is_measured() -> None:
    c = CASES["resnet"]
    torch.manual_seed(0)
    oracle = Oracle(c.make_model(), *c.make_inputs())
    lowest, base = oracle.memopt_minimum(), oracle.baseline_bytes
    gaps = []
    for fraction in (0.5,):
        budget = int(lowest + fraction * (base - lowest))
        mine, best = oracle.memopt(budget), oracle.optimum(budget)
        assert mine.fits and best.fits and best.peak_bytes <= budget
        if best.optimal:
            assert best.recompute_flops <= mine.recompute_flops
        gaps.append(mine.recompute_flops / max(best.recompute_flops, 1))
    assert max(gaps) >= 1.0


@pytest.mark.parametrize("model", ["cnn", pytest.param("transformer2", marks=pytest.mark.slow)])
def test_the_default_search_is_within_5_percent_of_the_optimum(model: str) -> None:
    """benchmarks.optimum_gap's rows above memopt's minimum: the default search (no
    solver) recomputes at most 5% more FLOPs than the proved optimum. Before the
    peak-directed path walked with verified steps (a step that raises the peak undone)
    the CNN's were +465% and +540%."""
    from benchmarks.optimum_gap import FRACTIONS, MODELS

    oracle = Oracle(*_flat(MODELS[model]()))
    lowest, base = oracle.memopt_minimum(), oracle.baseline_bytes
    unproved = []
    for fraction in FRACTIONS[1:]:
        budget = int(lowest + fraction * (base - lowest))
        mine, best = oracle.memopt(budget), oracle.optimum(budget, time_limit=60)
        assert mine.fits and best.fits
        if not best.optimal:  # HiGHS ran out of time: no optimum to compare with
            unproved.append(fraction)
            continue
        assert mine.recompute_flops <= 1.05 * best.recompute_flops, (
            fraction, mine.recompute_flops, best.recompute_flops)
    # a solver that proves nothing must not pass this test: every row unproved fails it,
    # and each unproved row is reported
    assert len(unproved) < len(FRACTIONS) - 1, f"no row proved optimal: {unproved}"
    if unproved:
        warnings.warn(f"{model}: the optimum is unproved at fractions {unproved} "
                      f"(HiGHS's time limit): the 5% claim is unchecked there", stacklevel=1)


def _flat(built: tuple) -> tuple:
    model, inputs = built
    return (model, *inputs)


@pytest.mark.parametrize("name, budget", [
    pytest.param("resnet", 0.7, marks=pytest.mark.slow),  # by default: the kept-gradient test
    pytest.param("transformer", 0.98, marks=pytest.mark.slow)])
def test_solver_milp_trains_with_eager_gradients_under_the_budget(name: str,
                                                                  budget: float) -> None:
    """BatchNorm (twins, running statistics) and dropout (saved masks) under the MILP's
    plan: eager's gradients and buffers, the plan within its budget, and no more FLOPs
    than Alg. 3's plan at the same budget."""
    case = CASES[name]
    run = check_matches_eager(case.make_model, case.make_inputs, steps=2, compile_fn=lambda m:
                              memopt.compile(m, budget=budget, solver="milp"))
    plan = run.compiled.memopt_plan
    assert any(c.level == 3 for c in plan.search)
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    assert plan.recompute_flops <= min(c.recompute_flops for c in plan.search
                                       if c.fits and c.level != 3)


def test_solver_option_is_checked() -> None:
    with pytest.raises(ValueError, match="solver"):
        memopt.compile(torch.nn.Linear(2, 2), solver="cplex")


@pytest.mark.slow  # 13 s on 2 cores; the MILP's other tests run by default
def test_solver_milp_plans_the_step_with_kept_gradients() -> None:
    """Gradient accumulation: the second micro-batch adds into kept `.grad` tensors (the
    plan's existing_grads, a step of its own); solver="milp" solves that step too, both
    micro-batches give eager's gradients and BatchNorm's running statistics, and the
    plan recomputes no more than the search's best."""
    case = CASES["resnet"]
    torch.manual_seed(0)
    eager = case.make_model()
    model = copy.deepcopy(eager)
    compiled = memopt.compile(model, budget=0.7, solver="milp")
    for micro in range(2):
        torch.manual_seed(micro)
        inputs = case.make_inputs()
        for module in (compiled, eager):
            module(*[x.clone() for x in inputs]).sum().backward()
    plan = compiled.memopt_plans[-1]
    assert plan.existing_grad_bytes > 0
    assert any(c.level == 3 for c in plan.search), "the MILP's plan was not scored"
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    assert plan.recompute_flops <= min(c.recompute_flops for c in plan.search
                                       if c.fits and c.level != 3)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    for (name, b), c in zip(model.named_buffers(), eager.buffers()):
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6, msg=name)
