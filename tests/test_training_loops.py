"""Budgets hold in the training loops people write.

Each pattern runs the same loop on a compiled model and on an eager copy, checks that
the gradients and the updated parameters equal eager's, and measures the allocated
peak of the second micro-step (the first one that finds `.grad` kept from the step
before, where a compiled backward used to hold two copies of the gradients) against the
plan that ran it and against the budget: measured <= budget, and within 10% of the
prediction. On two models: one whose parameters dominate the step (a transformer at a
small batch) and one whose activations do (an MLP at a large batch), plus a
third-party model from `transformers`.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt
from memopt.measure import allocation_peak
from models import TransformerBlock
from support import FP32, minimum_that_holds
from benchmarks.zoo import ZOO


# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------


class Transformer(nn.Module):
    """Two pre-norm blocks and a head; at batch 2 x 16 the parameters dominate."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(TransformerBlock(192, 4, 0.1), TransformerBlock(192, 4, 0.1))
        self.head = nn.Linear(192, 192)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def _mlp() -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Dropout(0.1))
                           for _ in range(6)], nn.Linear(128, 4))


@dataclass(frozen=True)
class Workload:
    name: str
    make_model: Callable[[], nn.Module]
    make_input: Callable[[int], torch.Tensor]   # micro-batch k -> its input

    def loss(self, module: nn.Module, k: int) -> torch.Tensor:
        torch.manual_seed(1000 + k)  # the same dropout masks for eager and compiled
        return module(self.make_input(k)).square().mean()


def _input(*shape: int) -> Callable[[int], torch.Tensor]:
    def make(k: int) -> torch.Tensor:
        return torch.randn(*shape, generator=torch.Generator().manual_seed(k))
    return make


WORKLOADS = {
    "params": Workload("params", Transformer, _input(2, 16, 192)),
    "activations": Workload("activations", _mlp, _input(1024, 128)),
}


def _share(workload: Workload) -> tuple[float, float]:
    """(parameter bytes, eager's step peak) of a workload: which one dominates."""
    torch.manual_seed(0)
    model = workload.make_model()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params, _measure(lambda: workload.loss(model, 0).backward(), model)


def test_the_two_workloads_are_what_they_claim() -> None:
    """Parameters and their gradients make most of one workload's eager peak and little
    of the other's."""
    params, peak = _share(WORKLOADS["params"])
    assert 2 * params > 0.8 * peak
    params, peak = _share(WORKLOADS["activations"])
    assert 2 * params < 0.2 * peak


# --------------------------------------------------------------------------
# Measuring one micro-step
# --------------------------------------------------------------------------


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _measure(run: Callable[[], None], model: nn.Module, inputs: tuple = ()) -> int:
    """Allocated peak of `run()`, plus what lives before it: parameters, buffers, the
    `.grad` tensors kept from earlier micro-steps, and `inputs` made before it."""
    resident = list(model.parameters()) + list(model.buffers())
    resident += [p.grad for p in model.parameters() if p.grad is not None]
    resident += [t for t in inputs if isinstance(t, torch.Tensor)]
    before = _storage_bytes(resident)
    with allocation_peak("cpu") as seen:
        run()
    return seen.peak + before


# --------------------------------------------------------------------------
# The loop patterns
# --------------------------------------------------------------------------


@dataclass
class Loop:
    """A training loop: `steps` optimizer steps of `micro` micro-batches each."""

    zero: str            # "none": zero_grad(set_to_none=True); "zeros": set_to_none=False
    micro: int = 1
    frozen: bool = False  # freeze every other parameter tensor before compiling
    evaluate: bool = False  # a no_grad evaluation forward after every optimizer step
    steps: int = 2


PATTERNS = {
    "grads_set_to_none": Loop(zero="none"),
    "grads_zeroed_in_place": Loop(zero="zeros"),
    "accumulate_3_micro_batches": Loop(zero="none", micro=3),
    "accumulate_into_zeroed_grads": Loop(zero="zeros", micro=2),
    "frozen_subset_accumulating": Loop(zero="zeros", micro=2, frozen=True),
    "no_grad_eval_between_steps": Loop(zero="zeros", evaluate=True),
}


def run_loop(workload: Workload, module: nn.Module, model: nn.Module, loop: Loop,
             measure_at: tuple[int, int] | None = None) -> int | None:
    """Run `loop`; measure micro-step `measure_at` = (step, micro) if given."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05,
                          momentum=0.9)
    measured = None
    for step in range(loop.steps):
        opt.zero_grad(set_to_none=loop.zero == "none")
        for micro in range(loop.micro):
            k = step * loop.micro + micro

            def one() -> None:
                workload.loss(module, k).backward()

            if measure_at == (step, micro):
                measured = _measure(one, model)
            else:
                one()
        opt.step()
        if loop.evaluate:
            with torch.no_grad():
                module.eval()
                module(workload.make_input(99))
                module.train()
    return measured


def _budget(workload: Workload, model: nn.Module) -> int:
    """A budget that binds in the step with kept gradients: a third of the way from
    memopt's minimum there up to its baseline (an absolute byte budget, the same for
    every micro-step)."""
    x = workload.make_input(0)
    baseline = memopt.plan(model, x, existing_grads=True).baseline_peak_bytes
    with pytest.raises(memopt.BudgetError) as info:
        memopt.plan(model, x, budget=1, existing_grads=True)
    minimum = info.value.minimum_bytes
    assert minimum < baseline
    return minimum + (baseline - minimum) // 3


@pytest.mark.parametrize("workload_name", sorted(WORKLOADS))
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_budget_holds_and_gradients_match_in_loop(pattern: str, workload_name: str) -> None:
    workload, loop = WORKLOADS[workload_name], PATTERNS[pattern]
    torch.manual_seed(0)
    eager = workload.make_model()
    if loop.frozen:
        for i, p in enumerate(eager.parameters()):
            p.requires_grad_(i % 2 == 0)
    model = copy.deepcopy(eager)
    budget = _budget(workload, model)
    compiled = memopt.compile(model, budget=budget)
    # micro-step 2: the second micro-batch of an accumulation, else the second step
    at = (0, 1) if loop.micro > 1 else (1, 0)
    measured = run_loop(workload, compiled, model, loop, measure_at=at)
    run_loop(workload, eager, eager, loop)

    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=f"parameter {name}")
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5,
                                       msg=f"gradient of {name}")
    plan = compiled.memopt_plans[-1]  # the training plan micro-step 2 ran
    kept = loop.zero == "zeros" or loop.micro > 1
    assert (plan.existing_grad_bytes > 0) == kept
    if kept:
        assert plan.grads_added_in_place == sum(1 for p in model.parameters()
                                                if p.requires_grad)
    assert measured <= budget, f"measured {measured} B over the budget {budget} B"
    assert abs(measured - plan.predicted_peak_bytes) <= 0.10 * plan.predicted_peak_bytes, (
        f"measured {measured} B, predicted {plan.predicted_peak_bytes} B")


def test_kept_gradients_do_not_cost_a_second_copy() -> None:
    """budget=None on the parameter-heavy model, gradients zeroed in place: memopt's
    micro-step 2 measures no more than eager's (it used to hold every gradient twice,
    1.39x eager on an MLP whose parameters dominate)."""
    workload, loop = WORKLOADS["params"], PATTERNS["grads_zeroed_in_place"]
    torch.manual_seed(0)
    eager = workload.make_model()
    model = copy.deepcopy(eager)
    ours = run_loop(workload, memopt.compile(model), model, loop, measure_at=(1, 0))
    theirs = run_loop(workload, eager, eager, loop, measure_at=(1, 0))
    assert ours <= theirs * 1.005, (ours, theirs)


@pytest.mark.parametrize("solver", ["search", pytest.param("milp", marks=pytest.mark.slow)])
def test_a_third_party_transformer_accumulates_within_its_budget(solver: str) -> None:
    """HF Llama (tests/zoo.py) over two micro-batches at 85% of its baseline. With
    solver="milp" and one second for HiGHS (which finds no plan for its 374 units in
    that time) the search's plan stands."""
    if solver == "milp":
        pytest.importorskip("highspy")
    case = ZOO["llama"]()
    eager = copy.deepcopy(case.model)
    options = {"solver": "milp", "solver_seconds": 1} if solver == "milp" else {}
    compiled = memopt.compile(case.model, budget=0.85, **options)

    def micro(module: nn.Module) -> None:
        out = module(*case.args, **case.kwargs)  # held through backward, as plans assume
        case.loss(out).backward()

    micro(compiled)
    micro(eager)
    measured = _measure(lambda: micro(compiled), case.model,
                        (*case.args, *case.kwargs.values()))
    micro(eager)
    plan = compiled.memopt_plan
    assert plan.existing_grad_bytes > 0
    # the budget binds: met by the search (no MILP plan in 1 s), or by the head in chunks
    assert (plan.search or plan.heads) and not any(c.level == 3 for c in plan.search)
    for (name, p), q in zip(case.model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert measured <= plan.budget_bytes
    assert abs(measured - plan.predicted_peak_bytes) <= 0.10 * plan.predicted_peak_bytes


# --------------------------------------------------------------------------
# Where the backward must leave the gradient to autograd
# --------------------------------------------------------------------------


def _compiled_mlp() -> tuple[nn.Module, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    model = copy.deepcopy(eager)
    return eager, memopt.compile(model), torch.randn(4, 8)


def test_autograd_grad_does_not_touch_existing_grads() -> None:
    eager, compiled, x = _compiled_mlp()
    compiled(x).sum().backward()
    eager(x).sum().backward()
    before = [p.grad.clone() for p in compiled.parameters()]
    got = torch.autograd.grad(compiled(x).sum(), list(compiled.parameters()))
    ref = torch.autograd.grad(eager(x).sum(), list(eager.parameters()))
    for a, b, g, p in zip(got, ref, before, compiled.parameters()):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(p.grad, g)  # untouched


def test_backward_with_inputs_accumulates_only_those() -> None:
    eager, compiled, x = _compiled_mlp()
    compiled(x).sum().backward()
    eager(x).sum().backward()
    first = list(compiled.parameters())[0]
    others = [p.grad.clone() for p in list(compiled.parameters())[1:]]
    compiled(x).sum().backward(inputs=[first])
    eager(x).sum().backward(inputs=[list(eager.parameters())[0]])
    torch.testing.assert_close(first.grad, list(eager.parameters())[0].grad)
    for p, g in zip(list(compiled.parameters())[1:], others):
        torch.testing.assert_close(p.grad, g)


def test_gradient_hooks_still_see_every_gradient() -> None:
    eager, compiled, x = _compiled_mlp()
    seen: list[torch.Tensor] = []
    posted: list[int] = []
    weight = list(compiled.parameters())[0]
    weight.register_hook(lambda g: seen.append(g.clone()))
    list(compiled.parameters())[2].register_post_accumulate_grad_hook(
        lambda p: posted.append(1))
    for _ in range(2):
        compiled(x).sum().backward()
        eager(x).sum().backward()
    assert len(seen) == 2 and len(posted) == 2
    torch.testing.assert_close(seen[1], seen[0])
    for p, q in zip(compiled.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_a_hook_that_returns_a_new_gradient_holds_the_minimum_named() -> None:
    """A parameter's gradient hook runs as autograd accumulates the gradient, after the
    graph's backward; one that returns a new tensor (``g * 2``) holds it beside the
    gradient. The plan holds the largest hooked gradient once more then
    (ModelTensors.hooked_grad_bytes; an MLP measured 1.032x the minimum named without it,
    found from outside), says once that a hook's other allocations are not counted, and
    the minimum named holds, with eager's gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                          nn.Linear(256, 10))
    eager = copy.deepcopy(model)
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))  # the weights dominate
    for module in (model, eager):
        for p in module.parameters():
            p.register_hook(lambda g: g * 2)

    def step(module: nn.Module) -> int:
        for p in module.parameters():
            p.grad = None
        return _measure(lambda: F.cross_entropy(module(x), y).backward(), module, (x,))

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        compiled, peaks, budget = minimum_that_holds(
            lambda b: memopt.compile(model, budget=b), step, steps=3)
    assert max(peaks) <= budget, (peaks, budget)
    assert any("gradient hooks" in str(w.message) for w in said)
    step(eager)
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        step(compiled)
    assert not any("gradient hooks" in str(w.message) for w in again)  # once per module
    for p, q in zip(compiled.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **FP32)


def test_grads_set_to_none_between_forward_and_backward() -> None:
    """`out = model(x); opt.zero_grad(); loss.backward()`: the forward saw kept
    gradients, the backward finds none and hands the new ones to autograd."""
    eager, compiled, x = _compiled_mlp()
    for module in (compiled, eager):
        module(x).sum().backward()
        out = module(x)
        for p in module.parameters():
            p.grad = None
        out.sum().backward()
    for p, q in zip(compiled.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_two_calls_before_one_backward_are_said() -> None:
    """Two calls before one backward (a siamese loss) held both calls' saved tensors,
    and a second backward through a kept graph added into the first one's .grad,
    silently over a binding budget (1.64x and 1.43x on a 6-block MLP, found from
    outside). Each is now said once per module (the first: its step is not held, the
    next ones are planned with it, refused here where 0.9 no longer fits); a loop with
    one backward per call says nothing, and the gradients stay eager's."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU())
    x1, x2 = torch.randn(256, 32), torch.randn(256, 32)
    compiled = memopt.compile(copy.deepcopy(eager), budget=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one backward per call: nothing said
        for _ in range(3):
            out = compiled(x1)  # the last call's output is still alive at the next call
            out.square().mean().backward()
            compiled.zero_grad(set_to_none=True)
    for m in (compiled, eager):
        m.zero_grad(set_to_none=True)
    with pytest.warns(UserWarning, match="started before the backward of an earlier call"):
        (compiled(x1) * compiled(x2)).mean().backward()
    (eager(x1) * eager(x2)).mean().backward()
    for p, q in zip(compiled.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    # a graph kept for a second backward (torch refuses it where AOTAutograd donated the
    # saved buffers to the backward: off here, as the plans that save none run it)
    with torch._functorch.config.patch(donated_buffer=False):
        kept = memopt.compile(copy.deepcopy(eager), budget=0.9)
        loss = kept(x1).square().mean()
        loss.backward(retain_graph=True)
        with pytest.warns(UserWarning, match="second backward"):
            loss.backward()
    with pytest.raises(memopt.BudgetError):  # both calls planned: 0.9 no longer fits
        compiled(x1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a graph dropped without its backward: nothing
        fresh = memopt.compile(copy.deepcopy(eager), budget=0.9)
        fresh(x2)
        fresh(x1).square().mean().backward()


@pytest.mark.parametrize("budget", [None, 0.95])
def test_module_hooks_registered_after_the_first_step_run(budget: object) -> None:
    """A forward hook and a forward pre-hook registered on submodules after the first
    step change the loss and gradients from the next step on, as in eager. Dynamo's
    default leaves module hooks unguarded: they never ran, silently (the loss 2.7x off,
    found from outside; torch.compile does the same by default). A full backward hook
    registered then runs too with no budget; under one it is refused by name (dynamo runs
    the hooked module eagerly, and its backward is in no plan)."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 4))
    model = copy.deepcopy(eager)
    compiled = memopt.compile(model, budget=budget)
    x = torch.randn(512, 16)
    compiled(x).sum().backward()
    eager(x).sum().backward()
    for m in (eager, model):
        m[4].register_forward_hook(lambda mod, inp, out: out * 3.0)
        m[0].register_forward_pre_hook(lambda mod, inp: (inp[0] + 1.0,))
    for _ in range(2):
        for m in (eager, model):
            m.zero_grad(set_to_none=True)
        got, ref = compiled(x).sum(), eager(x).sum()
        got.backward()
        ref.backward()
        torch.testing.assert_close(got, ref)
        for p, q in zip(model.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    called: list[str] = []
    for m in (eager, model):
        m[2].register_full_backward_hook(lambda mod, gin, gout: called.append("bw"))
    eager(x).sum().backward()
    if budget is not None:
        with pytest.raises(memopt.InputError, match="register_full_backward_hook"):
            compiled(x).sum().backward()
        return
    compiled(x).sum().backward()
    assert called == ["bw", "bw"]
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_functional_call_counts_the_modules_own_parameters_kept_aside() -> None:
    """`torch.func.functional_call(compiled, {name: p * 0.5}, x)`: while it runs, the
    module's parameters are the tensors passed and its own are kept aside, alive; memopt
    counted only the passed ones and the step measured 1.34x the budget it accepted (found
    from outside). Counted (settled.ModelTensors.displaced), the budget it accepts holds."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                          nn.Linear(256, 1))
    x = torch.randn(64, 128)
    params = list(model.named_parameters())

    def step(module: nn.Module) -> None:
        out = torch.func.functional_call(module, {n: p * 0.5 for n, p in params}, (x,))
        out.square().mean().backward()
        for p in model.parameters():
            p.grad = None

    budget: object = 0.01
    for _ in range(6):  # each refusal names what the step it saw needs
        compiled = memopt.compile(model, budget=budget)
        try:
            step(compiled)
            step(compiled)
            break
        except memopt.BudgetError as err:
            budget = err.minimum_bytes
    resident = sum(p.untyped_storage().nbytes() for p in model.parameters()) \
        + x.untyped_storage().nbytes()
    peaks = []
    for _ in range(3):
        with allocation_peak("cpu") as seen:
            step(compiled)
        peaks.append(seen.peak + resident)
    # the first steps of a compiled module under functional_call measured up to 1.6x the
    # steady one (the step that compiles: not diagnosed, docs/limits.md); the rest held
    plan = compiled.memopt_plan
    assert max(peaks[1:]) <= plan.budget_bytes, (peaks, plan.budget_bytes)


def _contrastive_refusal(budget: float | int) -> memopt.BudgetError:
    """The BudgetError a contrastive loop over two calls of an MLP gets at `budget`."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(),
                          nn.Linear(128, 64))
    compiled = memopt.compile(model, budget=budget)
    x1 = torch.randn(1024, 128)
    x2 = x1 + 0.1 * torch.randn(1024, 128)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            try:
                a = F.normalize(compiled(x1), dim=-1)
                b = F.normalize(compiled(x2), dim=-1)
                F.cross_entropy(a @ b.t() / 0.1, torch.arange(1024)).backward()
            except memopt.BudgetError as err:
                return err
    raise AssertionError(f"{budget} was accepted")


def test_a_refused_byte_budget_names_the_fraction_a_fraction_is_of() -> None:
    """Two calls before one backward: a refusal of a byte budget and of a fraction name
    the same step's baseline, so a fraction it offers is one that is accepted. The byte
    budget's named its re-planned graph's own baseline (23.4 MB against 10.3 MB) and
    offered fractions from 0.687, which were refused (found from outside)."""
    by_bytes, by_fraction = _contrastive_refusal(15_000_000), _contrastive_refusal(0.9)
    assert by_bytes.baseline_bytes == by_fraction.baseline_bytes, (by_bytes, by_fraction)
    assert by_bytes.smallest_fraction is None  # the loss's similarity matrix is most of it


def test_two_calls_before_one_backward_hold_the_minimum_named_from_the_next_step() -> None:
    """A contrastive loop, `loss(m(x1), m(x2))`: the second call holds the first call's
    saved tensors, input and output, and its backward the first output's gradient. The
    second call's graph is planned again as a run after the first's
    (graph_breaks.earlier_calls): the minimum named at the second step holds at every
    step after the first of a module compiled with it, with eager's gradients (1.29x at
    every step before, found from outside)."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                          nn.Linear(256, 100))
    x1, x2 = torch.randn(512, 128), torch.randn(512, 128)
    y = torch.randint(0, 100, (512,))

    def step(module: nn.Module) -> int:
        params = list(module.parameters())
        for p in params:
            p.grad = None
        resident = sum(t.untyped_storage().nbytes() for t in (*params, x1, x2))
        with allocation_peak("cpu") as seen:
            a, b = module(x1), module(x2)
            (F.cross_entropy(a, y) + (a - b).pow(2).mean()).backward()
            del a, b
        return seen.peak + resident

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # said once per module: the first step is not held
        compiled, peaks, budget = minimum_that_holds(  # the minimum moves as it settles
            lambda b: memopt.compile(copy.deepcopy(eager), budget=b), step, steps=4,
            attempts=5)
    assert max(peaks[1:]) <= budget, (peaks, budget)
    step(eager)
    for p, q in zip(compiled.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **FP32)
