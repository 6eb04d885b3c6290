"""The step simulator equals the exact build (passes.simulate).

The planner scores every candidate of its search with `StepModel.simulate`, arrays
built once from the joint graph, instead of building each candidate's graphs; the
plan it picks is then built for real. Under `memopt.planner.verifying()` every
candidate the planner simulates is also built exactly, and any difference in the
schedule of storages (bytes, first and last step), the number of steps, the peak,
the recomputed FLOPs or the saved bytes raises. These tests plan models that reach
every part of the pipeline that way: the corpus (dropout and BatchNorm twins, views,
in-place ops, several outputs, inputs with grad, frozen parameters, a cell loop
unrolled and as a chain), with and without in-place rewrites, with kept gradients,
down to the minimum (Sec. 4.4's m(v) = 2 candidates), third-party models with
measured kernel workspaces, and random models from the fuzzer's strategy.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import memopt
from benchmarks.zoo import ZOO
from fuzz_models import build_model, make_inputs, model_specs
from memopt.planner import verifying
from models import CASES, CORPUS

#: budgets every model is planned at: binding fractions, and 1 byte (a BudgetError at
#: the end of the whole search, both levels, after every candidate has been verified)
BUDGETS = (0.7, 0.4, 1)


def _plan_everywhere(model: torch.nn.Module, inputs: tuple, budgets: tuple = BUDGETS,
                     **options: object) -> int:
    """Plan `model` at every budget of `budgets` with every candidate verified; the
    number of plans that searched."""
    searched = 0
    with verifying():
        for budget in budgets:
            try:
                plan = memopt.plan(model, *inputs, budget=budget, **options)
            except memopt.BudgetError:
                searched += 1
                continue
            searched += bool(plan.search)
    return searched


#: the corpus, with the ResNet -m slow in the two tests that plan every case (5-6 s each);
#: conv_bn plans convolutions and BatchNorm twins in the default suite
_CORPUS = [pytest.param(c, id=c.name, marks=pytest.mark.slow if c.name == "resnet" else ())
           for c in CORPUS]


@pytest.mark.parametrize("case", _CORPUS)
def test_the_corpus_simulates_as_it_builds(case) -> None:
    torch.manual_seed(0)
    model, inputs = case.make_model(), case.make_inputs()
    assert _plan_everywhere(model, inputs) >= 1


@pytest.mark.parametrize("options", [{"inplace": False}, {"existing_grads": True}],
                         ids=["no_inplace", "kept_grads"])
@pytest.mark.parametrize("name", ["transformer",
                                  pytest.param("resnet", marks=pytest.mark.slow),  # 13 + 6 s
                                  "lstm_loop"])
def test_pipeline_variants_simulate_as_they_build(name: str, options: dict) -> None:
    torch.manual_seed(0)
    case = CASES[name]
    assert _plan_everywhere(case.make_model(), case.make_inputs(), **options) >= 1


@pytest.mark.parametrize("budgets", [pytest.param((0.7,), marks=pytest.mark.slow),
                                     pytest.param(BUDGETS, marks=pytest.mark.slow)],
                         ids=["binding", "every"])  # 20 s and 27 s of exact builds
def test_an_unrolled_cell_loop_simulates_as_it_builds(budgets: tuple) -> None:
    torch.manual_seed(0)
    case = CASES["lstm_loop"]
    assert _plan_everywhere(case.make_model(), case.make_inputs(), budgets,
                            loops=False) >= 1


@pytest.mark.parametrize("name", [pytest.param("convnext", marks=pytest.mark.slow),  # 27 s
                                  pytest.param("t5", marks=pytest.mark.slow),
                                  pytest.param("bert", marks=pytest.mark.slow)])
def test_third_party_models_simulate_as_they_build(name: str) -> None:
    """Real kernel workspaces (CPU convolution backward, LayerNorm), an encoder-decoder."""
    case = ZOO[name]()
    model = copy.deepcopy(case.model)
    with verifying():
        try:
            memopt.plan(model, *case.args, example_kwargs=case.kwargs, budget=0.6)
        except memopt.BudgetError:
            pass


@settings(max_examples=6, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(spec=model_specs(max_layers=8))
def test_fuzzed_models_simulate_as_they_build(spec) -> None:
    torch.manual_seed(0)
    model = build_model(spec)
    inputs = make_inputs(spec)
    with verifying():
        for budget in (0.5, 1):
            try:
                memopt.plan(model, *inputs, budget=budget)
            except memopt.BudgetError:
                pass


def test_a_disagreement_is_caught() -> None:
    """The check can fail: a simulator that counts one FLOP more per recomputed node
    disagrees."""
    from memopt.passes.simulate_steps import Candidate

    torch.manual_seed(0)
    case = CASES["conv_bn"]
    original = Candidate._flops
    try:
        Candidate._flops = lambda self, i: original(self, i) + 1
        with verifying(), pytest.raises(memopt.PassError, match="disagrees"):
            memopt.plan(case.make_model(), *case.make_inputs(), budget=0.5)
    finally:
        Candidate._flops = original


def test_planning_scores_candidates_without_building_them() -> None:
    """Outside `verifying()`, a budget search builds one plan's graphs, not one per
    candidate: planner.build runs a fixed number of times however many candidates there are."""
    from memopt.planner import plan as planning

    torch.manual_seed(0)
    case = CASES["resnet"]
    calls = []
    original = planning.build
    try:
        planning.build = lambda *a, **k: calls.append(1) or original(*a, **k)
        plan = memopt.plan(case.make_model(), *case.make_inputs(), budget=0.8)
    finally:
        planning.build = original
    assert len(plan.search) > 5 and len(calls) == 1, (len(plan.search), len(calls))


@pytest.mark.parametrize("case", _CORPUS)
def test_inductors_fused_kernels_simulate_as_they_build(case) -> None:
    """kernels="inductor": liveness counts what inductor's fused kernels allocate
    (passes.fusion: values computed inside their readers, in-place writes, the wrapper's
    pool), in the simulator as in the exact build."""
    torch.manual_seed(0)
    model, inputs = case.make_model(), case.make_inputs()
    assert _plan_everywhere(model, inputs, kernels="inductor") >= 1
