"""Graph breaks planned under one budget (memopt.steps, memopt.backend).

dynamo splits a forward with a `.item()` branch or a hook that reads a value into
several graphs; memopt plans each with what the other graphs hold around it, plans them
all again once the first forward has shown every graph, and shows each graph and where
its break is in `model.memopt_plan` (a StepPlan). These tests check eager's gradients
(several optimizer steps, gradient accumulation with kept gradients), the measured
allocated peak of the steps after the first against the budget and the plan, the plan's
account of the breaks, the errors, and a third-party model broken by a hook.
"""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch
from torch import nn

import memopt
from benchmarks.zoo import ZOO, resident_bytes
from memopt.measure import allocation_peak
from memopt.memory_plan import StepPlan

WIDTH = 128


def _layers(n: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(n)])


class Branches(nn.Module):
    """Two stacks with a Python branch on a value between them: two graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = _layers(6), _layers(6), nn.Linear(WIDTH, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.mean().item() > -1e9:  # BREAK_LINE: dynamo breaks the graph here
            h = h * 2
        return self.head(self.b(h))


BREAK_LINE = next(i for i, line in enumerate(inspect.getsource(Branches).splitlines())
                  if "BREAK_LINE" in line) + inspect.getsourcelines(Branches)[1]


class Logged(nn.Module):
    """A block that logs a statistic of its output (a graph break inside it)."""

    def __init__(self, log: bool) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Dropout(0.1))
        self.log = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.f(x)
        if self.log:
            self.norm = x.norm().item()
        return x * 1.0


class Repeated(nn.Module):
    """Six blocks, every other one logging: the same graphs run several times a forward."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Logged(i % 2 == 1) for i in range(6)])
        self.head = nn.Linear(WIDTH, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Appends(nn.Module):
    """Logs a statistic into a list it keeps (`self.logged.append(x.item())`, as training
    scripts log metrics): a graph break, and a guard on the list's length that fails at
    every call, so dynamo traces the forward again each time. It returns its loss (a
    loss computed outside the module is not in the plan: docs/budgets.md)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _layers(6), _layers(6)
        self.logged: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        self.logged.append(h.norm().item())
        return self.b(h).square().mean()


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.drop(torch.relu(self.up(x)))) + x


class LoopBreaks(nn.Module):
    """A break in the loop over its blocks (an early-exit check on `.item()`): dynamo
    compiles each block's frame, one graph run by five of the six blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
            if x.norm().item() > 1e9:
                break
        return x


def _input(k: int) -> torch.Tensor:
    return torch.randn(512, WIDTH, generator=torch.Generator().manual_seed(k))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _train(module: nn.Module, model: nn.Module, *, steps: int, micro: int = 1,
           measure: int | None = None) -> list[int]:
    """`steps` SGD steps of `micro` micro-batches (gradients zeroed in place between
    steps when micro > 1, set to None otherwise); the allocated peak of every micro-step
    of step `measure` and after, resident bytes included (kept `.grad` among them).
    `module.predicted` gets the predicted peak of the plan each measured micro-step ran
    (the plan as it stood before it: a forward's end may plan the graphs again for the
    steps after it)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    peaks = []
    for step in range(steps):
        opt.zero_grad(set_to_none=micro == 1)
        for m in range(micro):
            x = _input(step * micro + m)
            torch.manual_seed(100 + step * micro + m)  # the same dropout masks
            if measure is not None and step >= measure:
                resident = [*model.parameters(), x]
                resident += [p.grad for p in model.parameters() if p.grad is not None]
                held = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                            for t in resident}.values())
                plan = getattr(module, "memopt_plan", None)
                with allocation_peak("cpu") as seen:
                    _loss(module(x)).backward()
                peaks.append(seen.peak + held)
                if plan is not None:
                    module.__dict__.setdefault("predicted", []).append(plan.predicted_peak_bytes)
            else:
                _loss(module(x)).backward()
        opt.step()
    return peaks


def _assert_same_parameters(model: nn.Module, eager: nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)


def _compiled(make: type, budget: object) -> tuple[nn.Module, nn.Module, nn.Module]:
    torch.manual_seed(0)
    eager = make()
    model = copy.deepcopy(eager)
    return eager, model, memopt.compile(model, budget=budget)


def test_the_plan_shows_every_graph_and_where_each_break_is() -> None:
    eager, model, compiled = _compiled(Branches, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train(compiled, model, steps=1)
    plan = compiled.memopt_plan
    assert isinstance(plan, StepPlan) and len(plan.graphs) == 2 and plan.runs == (0, 1)
    (brk,) = plan.breaks
    assert brk.filename == __file__ and brk.lineno == BREAK_LINE
    assert "item" in brk.reason
    first, second = plan.graphs
    assert second.outside_forward_bytes >= first.held_bytes > 0  # what graph 1 keeps
    assert plan.predicted_peak_bytes == max(g.predicted_peak_bytes for g in plan.graphs)
    # what a one-graph plan says, for the step: code reading a plan works either way
    assert plan.forward_flops == first.forward_flops + second.forward_flops > 0
    assert plan.recompute_flops == 0 and plan.heads == () and plan.kernels == "aten"
    # DDP's buckets and the optimizer's state, which every graph counts (an AttributeError
    # on a StepPlan before, found from outside under DDP)
    assert plan.ddp_bucket_bytes == plan.ddp_bucket_counted_bytes == 0
    assert plan.optimizer_state_bytes == 0
    text = plan.summary()
    assert f"{__file__}:{BREAK_LINE}" in text and "graph 2" in text
    assert StepPlan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize("fraction", [None, 0.7], ids=["no_budget", "0.7_of_no_budget"])
def test_breaks_planned_under_one_budget(fraction: float | None) -> None:
    """A byte budget below the plan without one: every step after the first measures
    within it and within 10% of the plan, with eager's parameters after three steps."""
    budget = None
    if fraction is not None:
        _, model, probe = _compiled(Branches, None)
        _train(probe, model, steps=1)
        budget = int(fraction * probe.memopt_plan.predicted_peak_bytes)
    eager, model, compiled = _compiled(Branches, budget)
    peaks = _train(compiled, model, steps=3, measure=1)
    _train(eager, eager, steps=3)
    _assert_same_parameters(model, eager)
    for peak, predicted in zip(peaks, compiled.predicted, strict=True):
        if budget is not None:
            assert peak <= budget, (peak, budget)
        assert abs(peak - predicted) <= 0.10 * predicted, (peaks, compiled.predicted)


def test_repeated_graphs_accumulate_kept_gradients_within_budget() -> None:
    """Graphs that run several times a forward (a break inside a repeated block), with
    gradients kept between micro-steps: eager's parameters, and the budget held."""
    budget = 6_000_000
    eager, model, compiled = _compiled(Repeated, budget)
    peaks = _train(compiled, model, steps=3, micro=2, measure=1)
    _train(eager, eager, steps=3, micro=2)
    _assert_same_parameters(model, eager)
    plan = compiled.memopt_plan
    assert isinstance(plan, StepPlan) and len(plan.runs) > len(plan.graphs)
    assert all(g.existing_grad_bytes > 0 for g in plan.graphs if g.grads_added_in_place)
    for peak in peaks:
        assert peak <= budget, (peak, budget)


@pytest.mark.parametrize("micro", [pytest.param(1, marks=pytest.mark.slow), 2],
                         ids=["grads_set_to_none", "accumulating"])  # its first step: grads None
def test_a_forward_traced_again_every_call_keeps_its_plan(micro: int) -> None:
    """dynamo traces Appends' forward again at every call (its list grew); memopt reuses
    the plan of the identical graphs instead of planning each call anew: more calls than
    dynamo's recompile limit train, every measured step runs the plan it reports, within
    the budget, and a warning names the cause once; with gradient accumulation too (the
    kept-gradient step is planned once more, then reused)."""
    _, model, probe = _compiled(Appends, None)
    _train(probe, model, steps=1)
    budget = int(0.7 * probe.memopt_plan.predicted_peak_bytes)
    eager, model, compiled = _compiled(Appends, budget)
    with pytest.warns(UserWarning, match="traces this model's forward again"):
        peaks = _train(compiled, model, steps=10 // micro, micro=micro, measure=1)
    _train(eager, eager, steps=10 // micro, micro=micro)
    _assert_same_parameters(model, eager)
    # planned once each (the kept-gradient step's twin graphs besides, when accumulating)
    assert len(compiled._memopt_backend.plan_log.graphs_built) == 2 * micro
    for peak, predicted in zip(peaks, compiled.predicted, strict=True):
        assert peak <= budget, (peak, budget)
        assert abs(peak - predicted) <= 0.05 * predicted, (peaks, compiled.predicted)


def test_a_fraction_budget_is_of_the_whole_step() -> None:
    eager, model, compiled = _compiled(Repeated, 0.8)
    peaks = _train(compiled, model, steps=3, measure=1)
    _train(eager, eager, steps=3)
    _assert_same_parameters(model, eager)
    plan = compiled.memopt_plan
    assert len({g.budget_bytes for g in plan.graphs}) == 1  # one budget for every graph
    for peak in peaks:
        assert peak <= plan.budget_bytes


def test_a_graph_run_by_several_blocks_settles_within_the_budget() -> None:
    """A graph that runs several times a forward holds its own saved bytes around its
    later runs: its re-plans must not flip between a lean plan and a greedier one its
    later runs cannot hold (they did: steps measured 4% over 0.95 of the
    unplanned peak). Every step after the first within the budget and the plan, with
    eager's parameters (dropout on)."""
    eager, model, compiled = _compiled(LoopBreaks, 0.95)
    peaks = _train(compiled, model, steps=5, measure=1)
    _train(eager, eager, steps=5)
    _assert_same_parameters(model, eager)
    plan = compiled.memopt_plan
    assert isinstance(plan, StepPlan) and len(plan.runs) > len(plan.graphs)
    for peak, predicted in zip(peaks, compiled.predicted, strict=True):
        assert peak <= plan.budget_bytes, (peaks, plan.budget_bytes)
        assert peak <= predicted, (peaks, compiled.predicted)


def test_a_budget_that_cannot_hold_names_the_graph() -> None:
    _, model, compiled = _compiled(Branches, 1_000_000)
    with pytest.raises(memopt.BudgetError) as info:
        _train(compiled, model, steps=2)
    assert "graph" in info.value.step
    assert info.value.minimum_bytes > 1_000_000


@pytest.mark.parametrize("make,kernels", [
    pytest.param(Branches, "aten", id="two_graphs"),
    pytest.param(LoopBreaks, "aten", id="repeated"),
    pytest.param(Branches, "inductor", id="two_graphs_inductor", marks=pytest.mark.slow)])
def test_a_refused_first_step_names_a_minimum_the_whole_step_is_planned_within(
        make: type, kernels: str) -> None:
    """A byte budget out of reach is refused at the first step, before its backward runs
    (no `.grad` made), naming a minimum that counts every graph: compiled again at it, the
    steps run and measure within it with eager's parameters. The first step once named the
    minimum of the graphs it had seen, which the next step refused again (a Mixtral with
    router logits: 3,918,295 bytes, then 4,438,100; this model: 4 bytes more, its loss).
    The error's baseline is the whole step's, so a fraction fits too (the missing graph's
    own made `smallest_fraction` None). Under inductor a graph whose kernels miss runs op by
    op where that fits, as a one-graph step does (an AssertionError from memopt before)."""
    _, model, probe = _compiled(make, None)
    _train(probe, model, steps=1)
    low = int(0.3 * probe.memopt_plan.predicted_peak_bytes)
    torch.manual_seed(0)
    model = make()
    with pytest.raises(memopt.BudgetError) as info:
        _train(memopt.compile(model, budget=low, kernels=kernels), model, steps=1)
    assert all(p.grad is None for p in model.parameters())  # before the backward
    assert info.value.smallest_fraction is not None, str(info.value)
    budget = info.value.minimum_bytes
    torch.manual_seed(0)
    eager = make()
    model = copy.deepcopy(eager)
    compiled = memopt.compile(model, budget=budget, kernels=kernels)
    peaks = _train(compiled, model, steps=3, measure=1)
    _train(eager, eager, steps=3)
    _assert_same_parameters(model, eager)
    assert max(peaks) <= budget, (peaks, budget)


def test_a_forward_dynamo_runs_eagerly_is_refused_under_a_budget() -> None:
    """A break inside a loop over torch.nn modules makes dynamo run the whole frame
    eagerly: nothing to plan. Under a budget that is an error, without one a warning."""

    class Loop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = _layers(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
                if x.sum().item() > 1e9:
                    x = x / 2
            return x

    x = _input(0)
    with pytest.raises(memopt.CaptureError):
        _loss(memopt.compile(Loop(), budget=10**9)(x)).backward()
    with pytest.warns(UserWarning):
        _loss(memopt.compile(Loop())(x)).backward()


@pytest.mark.slow  # 10 s; tests/test_zoo.py trains distilbert_item, broken by .item()
def test_a_third_party_model_broken_by_a_hook() -> None:
    """HF Llama (benchmarks/zoo.py) with a forward hook that reads a value from layer 1
    (activation statistics, as monitoring code does): graph breaks inside the model.
    At 0.8 of its unplanned peak: eager's gradients, the budget held."""
    stats: list[float] = []

    def hook(module, args, output) -> None:
        stats.append(output[0].abs().max().item() if isinstance(output, tuple)
                     else output.abs().max().item())

    case = ZOO["llama"]()
    eager = copy.deepcopy(case.model)
    for m in (case.model, eager):
        m.model.layers[1].register_forward_hook(hook)
    compiled = memopt.compile(case.model, budget=0.8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        case.run_step(compiled)  # plans graph by graph, then all together
        for p in case.model.parameters():
            p.grad = None
        with allocation_peak("cpu") as seen:
            torch.manual_seed(1)
            case.run_step(compiled)
    plan = compiled.memopt_plan
    assert isinstance(plan, StepPlan) and plan.breaks
    measured = seen.peak + resident_bytes(case)
    assert measured <= plan.budget_bytes, (measured, plan.budget_bytes)
    assert abs(measured - plan.predicted_peak_bytes) <= 0.10 * plan.predicted_peak_bytes
    torch.manual_seed(1)
    case.run_step(eager)
    for (name, p), q in zip(case.model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


class _ThreeParts(nn.Module):
    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.parts = nn.ModuleList(nn.Sequential(*[nn.Linear(width, width) for _ in range(3)])
                                   for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.parts[0](x))
        torch._dynamo.graph_break()
        x = torch.tanh(self.parts[1](x))
        torch._dynamo.graph_break()
        return torch.tanh(self.parts[2](x)).square().mean()


@pytest.mark.parametrize("width,rows", [(256, 512), (64, 256)])
def test_a_step_with_kept_gradients_names_a_minimum_it_is_planned_within(width, rows):
    """A forward with graph breaks whose first step finds `.grad` kept (from an eager step:
    the step accumulation runs) runs the backend's twin (with_existing_grads): the search
    for the whole step's minimum re-planned its graphs at the refused budget, and named a
    minimum that missed again (a 9-layer MLP: 7,736,668 bytes, then 8,801,213; 64 wide:
    701,990, then 786,457; found from outside). The minimum named is accepted, and the
    steps run within it."""
    x = torch.randn(rows, width)

    def kept() -> nn.Module:
        torch.manual_seed(0)
        model = _ThreeParts(width)
        model(x).backward()  # .grad kept
        return model

    with pytest.raises(memopt.BudgetError) as info:
        memopt.compile(kept(), budget=1000)(x)
    model = kept()
    budget = info.value.minimum_bytes
    compiled = memopt.compile(model, budget=budget)
    resident = sum(t.untyped_storage().nbytes() for t in (*model.parameters(), x))
    resident += sum(p.grad.untyped_storage().nbytes() for p in model.parameters())
    peaks = []
    for _ in range(3):
        with allocation_peak("cpu") as seen:
            compiled(x).backward()
        peaks.append(seen.peak + resident)
    assert max(peaks[1:]) <= budget, (peaks, budget)


class _Rerun(torch.autograd.Function):
    """A reversible-style layer: forward without autograd, backward runs it again with
    it (HF Reformer's _ReversibleFunction does this, with a graph break inside its
    forward), so dynamo runs it eagerly between memopt's graphs."""

    @staticmethod
    def forward(ctx, x, weight):
        torch._dynamo.graph_break()
        ctx.save_for_backward(x, weight)
        return torch.tanh(x @ weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
            y = torch.tanh(x @ weight)
        return torch.autograd.grad(y, (x, weight), grad)


class _Tanh(torch.autograd.Function):
    """The same layer with its backward as a formula: dynamo traces it into the graph."""

    @staticmethod
    def forward(ctx, x, weight):
        y = torch.tanh(x @ weight)
        ctx.save_for_backward(x, weight, y)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, y = ctx.saved_tensors
        g = grad * (1 - y * y)
        return g @ weight.t(), x.t() @ g


class _WithFunction(nn.Module):
    def __init__(self, function: type[torch.autograd.Function]) -> None:
        super().__init__()
        self.function = function
        self.inp = nn.Linear(64, 64)
        self.weight = nn.Parameter(torch.randn(64, 64) / 8)
        self.out = nn.Linear(64, 1)

    def forward(self, x):
        h = self.function.apply(torch.relu(self.inp(x)), self.weight)
        return self.out(torch.relu(h)).square().mean()


@pytest.mark.parametrize("function", [_Rerun, _Tanh], ids=["eager", "traced"])
def test_a_function_run_eagerly_between_graphs_refuses_a_budget(function):
    """A torch.autograd.Function that dynamo does not trace (a graph break inside it) runs
    eagerly between memopt's graphs, and what its backward allocates is in no plan (HF
    Reformer's reversible layers run again there: its accepted budgets measured 1.53x and
    1.74x; found from outside). Under a budget the first call raises InputError naming the
    Function; without one it trains with eager's gradients. One dynamo traces is planned
    like the rest, under a budget too."""
    x = torch.randn(256, 64)
    torch.manual_seed(0)
    eager = _WithFunction(function)
    model = copy.deepcopy(eager)
    eager(x).backward()
    if function is _Rerun:
        with pytest.raises(memopt.InputError, match="_Rerun") as info:
            memopt.compile(copy.deepcopy(eager), budget=0.7)(x)
        assert "budget=None" in str(info.value)
    compiled = memopt.compile(model, budget=None if function is _Rerun else 0.85)
    compiled(x).backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


class _CumulativeNorm(nn.Module):
    """BatchNorm1d(momentum=None) (a cumulative average): `float(num_batches_tracked)`
    breaks dynamo's graph inside BatchNorm.forward, and the batch norm runs eagerly
    between memopt's graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(3))
        self.norms = nn.ModuleList(nn.BatchNorm1d(64, momentum=None) for _ in range(3))
        self.out = nn.Linear(64, 10)

    def forward(self, x):  # unrolled: dynamo runs a loop with a break in it eagerly
        x = self.norms[0](torch.tanh(self.layers[0](x)))
        x = self.norms[1](torch.tanh(self.layers[1](x)))
        x = self.norms[2](torch.tanh(self.layers[2](x)))
        return self.out(x).square().mean()


def test_eager_code_between_graphs_is_counted_as_its_backward_runs():
    """The eager batch norm's backward runs between two graphs' backwards, with what it
    saved, the gradient handed to it and the one it makes, and an input-sized buffer of
    its kernel: none of it was in a plan, and the step measured 1.23x the minimum memopt
    named (found from outside). The minimum named now holds, and eager's gradients and
    running statistics are kept."""
    x = torch.randn(2048, 64)

    def build() -> nn.Module:
        torch.manual_seed(0)
        return _CumulativeNorm()

    with pytest.raises(memopt.BudgetError) as info:
        memopt.compile(build(), budget=0.3)(x)
    budget = info.value.minimum_bytes
    eager, model = build(), build()
    compiled = memopt.compile(model, budget=budget)
    compiled(x).backward()
    eager(x).backward()
    resident = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in (*model.parameters(), *model.buffers(), x)}.values())
    for p in model.parameters():
        p.grad = None
    with allocation_peak("cpu") as seen:
        compiled(x).backward()
    assert seen.peak + resident <= budget, (seen.peak + resident, budget)
    eager.zero_grad(set_to_none=True)
    eager(x).backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    for (name, b), c in zip(model.named_buffers(), eager.buffers()):
        torch.testing.assert_close(b, c, msg=name)


@pytest.mark.slow
def test_a_first_graph_that_fits_only_at_its_lowest_peak_names_a_minimum():
    """HF Jamba (attention, Mamba, experts; two graphs): at 0.7 its first graph missed as
    planned (GREEDY) and no graph before it could hold less, so the forward was refused
    without that graph itself trying LEAN and LOWEST; its budget_error then found that
    LOWEST fits, and raised a bare AssertionError at every budget (found from outside).
    It names a minimum, which is accepted. 1-2 minutes."""
    transformers = pytest.importorskip("transformers")
    config = transformers.JambaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
        use_cache=False, num_experts=4, num_experts_per_tok=2, expert_layer_period=2,
        expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8,
        mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8, output_router_logits=True,
        router_aux_loss_coef=0.02, attention_dropout=0.0)
    ids = torch.randint(3, 320, (2, 64))

    def step(budget: object) -> None:
        torch.manual_seed(0)
        model = transformers.JambaForCausalLM(config).train()
        memopt.compile(model, budget=budget)(input_ids=ids, labels=ids).loss.backward()

    with pytest.raises(memopt.BudgetError) as info:
        step(0.7)
    step(info.value.minimum_bytes)


def test_eager_code_between_graphs_is_counted_in_a_step_into_kept_gradients():
    """The same model, every step into `.grad` kept from the one before (accumulation):
    the minimum named for that step is accepted, and the steps run within it."""
    x = torch.randn(2048, 64)

    def kept() -> nn.Module:
        torch.manual_seed(0)
        model = _CumulativeNorm()
        model(x).backward()  # .grad kept
        return model

    with pytest.raises(memopt.BudgetError) as info:
        memopt.compile(kept(), budget=1000)(x)
    budget = info.value.minimum_bytes
    model = kept()
    compiled = memopt.compile(model, budget=budget)
    compiled(x).backward()
    resident = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in (*model.parameters(), *model.buffers(), x)}.values())
    resident += sum(p.grad.untyped_storage().nbytes() for p in model.parameters())
    for _ in range(2):
        with allocation_peak("cpu") as seen:
            compiled(x).backward()
        assert seen.peak + resident <= budget, (seen.peak + resident, budget)


class _Box:
    """Not a pytree node: a returned cache object, as transformers' EncoderDecoderCache."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class _ReturnsABox(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(6))
        self.head = nn.Linear(256, 8)

    def forward(self, x: torch.Tensor):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        torch._dynamo.graph_break()
        y = self.head(x)
        return y.square().mean(), _Box(y.repeat(1, 128))  # the last graph's, kept


def test_tensors_an_output_object_holds_are_counted_as_returned():
    """The caller keeps the output, and with it the object's tensor, which the last graph
    made: while the first graph's backward runs it is alive. Uncounted (only pytree leaves
    were), the step measured 1.7% over the minimum memopt named; HF SpeechT5 1.39%,
    its returned cache's keys and values (found from outside)."""
    torch.manual_seed(0)
    model, x = _ReturnsABox(), torch.randn(512, 256)
    with pytest.raises(memopt.BudgetError) as err:
        memopt.compile(model, budget=1)(x)[0].backward()
    model.zero_grad(set_to_none=True)
    compiled = memopt.compile(model, budget=err.value.minimum_bytes)
    resident = sum(t.untyped_storage().nbytes() for t in (*model.parameters(), x))
    for _ in range(2):  # the first step plans
        model.zero_grad(set_to_none=True)
        with allocation_peak("cpu") as seen:
            out = compiled(x)
            out[0].backward()
        del out
    assert seen.peak + resident <= err.value.minimum_bytes, (seen.peak + resident,
                                                             err.value.minimum_bytes)


def test_a_step_planned_under_a_profiler_says_so_once(caplog: pytest.LogCaptureFixture,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A step measured with allocation_peak plans every graph of its forward inside the
    profiler, each several times: that kernel workspaces are estimated is logged once at
    warning level, and at debug level after (458 warnings in an MoE's first step before,
    found from outside)."""
    from memopt.passes import allocated

    monkeypatch.setattr(allocated, "_SAID", set())
    torch.manual_seed(0)
    compiled = memopt.compile(Branches())
    caplog.set_level("DEBUG", logger="memopt")
    with warnings.catch_warnings(), allocation_peak("cpu"):
        warnings.simplefilter("ignore")
        compiled(torch.randn(64, WIDTH)).sum().backward()
    said = [r for r in caplog.records if "cannot track allocations" in r.getMessage()]
    assert [r.levelname for r in said].count("WARNING") == 1, said
    assert len(said) > 1  # it was planned more than once under the profiler


def test_a_ctc_models_first_step_holds_a_fraction_budget():
    """HF Wav2Vec2ForCTC: its CTC loss breaks the forward into 4 graphs, whose first plans
    are made before the step's baseline is known. Planned with Chen's mirror set `all`
    and no budget, the encoder's peaked above keeping everything (2,970,352 bytes against
    2,850,272) and the first step measured 1.25x a 0.7 budget (found from outside); each
    first plan now aims at the fraction of its own graph's baseline
    (PlanRequest.first_fraction). With transformers 4.x (CI's lowest) the forward breaks
    into 7 graphs and its first step is a known miss by 2.6% (an xfail, docs/limits.md);
    the steps after it are held there too. About 20 s."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Wav2Vec2Config(
        vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, conv_dim=(32, 32, 32), conv_stride=(5, 2, 2),
        conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
        hidden_dropout=0.1, attention_dropout=0.1, activation_dropout=0.1,
        feat_proj_dropout=0.1, layerdrop=0.0, mask_time_prob=0.0, pad_token_id=0,
        ctc_loss_reduction="mean")
    torch.manual_seed(0)
    model = transformers.Wav2Vec2ForCTC(config).train()
    x, y = torch.randn(2, 1600), torch.randint(1, 32, (2, 10))
    resident = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in (*model.parameters(), *model.buffers(), x)}.values())
    compiled = memopt.compile(model, budget=0.7)
    measured = []
    for _ in range(3):
        with allocation_peak("cpu") as seen:
            compiled(input_values=x, labels=y).loss.backward()
        measured.append(seen.peak + resident)
        model.zero_grad(set_to_none=True)
    budget = compiled.memopt_plan.budget_bytes
    assert max(measured[1:]) <= budget, (measured, budget)
    if measured[0] > budget and int(transformers.__version__.split(".")[0]) < 5:
        # docs/limits.md: transformers 4.x breaks the forward at its encoder layers, whose
        # one graph runs twice in the first step, the second run at its leanest plan
        # (CompiledGraph._interim_twin), which peaks higher in the last run (1.026x); the
        # steps after it run a second plan for the later run
        pytest.xfail(f"first step {measured[0]:,} bytes against {budget:,} (docs/limits.md)")
    assert measured[0] <= budget, (measured, budget)
