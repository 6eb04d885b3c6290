"""Steps without the forward's trace once a one-graph step has settled (memopt.settled).

A steady training step of a model that is one graph runs without `ForwardTrace` (its
Python work grew with the parameter count). Each test here changes one thing the skipped
trace would have counted and checks the plan counts it: remove the matching check from
`StepCall.admits` or `ModelTensors.refresh` and the test fails. The kept-gradient sink's
binding (memopt.grads.GradSink.bind), cached the same way, is checked against moved
parameter data; gradients are checked against eager throughout.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import memopt

WIDTH = 64
BIG = 256 * 256 * 4  # bytes of a 256 x 256 fp32 tensor


class Unused(nn.Module):
    """An MLP whose forward takes a keyword argument it never reads."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH))

    def forward(self, x: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        return self.net(x)


class Frozen(nn.Module):
    """A frozen layer under a trainable head."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen, self.head = nn.Linear(256, 256), nn.Linear(256, 8)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.frozen(x)))


class Branches(nn.Module):
    """Two layers with a Python branch on a value between them: two graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if h.mean().item() > -1e9:
            h = h * 2
        return self.b(h)


def _compiled(make: type) -> tuple[nn.Module, nn.Module, nn.Module]:
    torch.manual_seed(0)
    eager = make()
    model = copy.deepcopy(eager)
    return eager, model, memopt.compile(model)


def _step(module: nn.Module, x: torch.Tensor, kept: bool = False, **kwargs) -> None:
    if not kept:
        module.zero_grad(set_to_none=True)
    module(x, **kwargs).square().mean().backward()


def _x(rows: int = 8) -> torch.Tensor:
    return torch.randn(rows, WIDTH)


def _log(compiled: nn.Module):
    return compiled._memopt_backend.plan_log


def _outside(compiled: nn.Module) -> int:
    """What the newest plan counts held outside its graph during the forward."""
    return compiled.memopt_plans[-1].outside_forward_bytes


def _same_grads(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_a_steady_step_runs_without_the_trace() -> None:
    eager, _, compiled = _compiled(Unused)
    x = _x()
    for _ in range(5):
        _step(compiled, x)
        _step(eager, x)
    assert _log(compiled).traced == 1  # the first step only
    assert _log(compiled).last_runs  # the step plan still names the graph that ran
    assert compiled.memopt_plan is compiled.memopt_plans[-1]
    _same_grads(compiled, eager)


def test_a_keyword_argument_the_graph_does_not_take_is_counted_when_it_grows() -> None:
    _, _, compiled = _compiled(Unused)
    x = _x()
    for _ in range(2):
        _step(compiled, x, extra=torch.zeros(4))
    assert _outside(compiled) < BIG
    _step(compiled, x, extra=torch.zeros(BIG // 4))  # traced again: planned with it
    assert _outside(compiled) >= BIG
    traced = _log(compiled).traced
    _step(compiled, x, extra=torch.zeros(BIG // 4))  # covered now: no trace
    assert _log(compiled).traced == traced


def test_a_new_shape_after_settling_is_planned_with_what_the_step_holds() -> None:
    """dynamo compiles a graph for the new shape inside a call that began untraced: the
    trace is built then, from the call's start."""
    _, _, compiled = _compiled(Unused)
    extra = torch.zeros(BIG // 4)
    for _ in range(2):
        _step(compiled, _x(8), extra=extra)
    planned = len(compiled.memopt_plans)
    _step(compiled, _x(16), extra=extra)
    assert len(compiled.memopt_plans) == planned + 1
    assert _outside(compiled) >= BIG


def test_a_gradient_on_a_frozen_parameter_is_counted() -> None:
    eager, _, compiled = _compiled(Frozen)
    x = torch.randn(4, 256)
    for _ in range(2):
        _step(compiled, x)
    assert _outside(compiled) < BIG
    for module in (compiled, eager):
        module.zero_grad(set_to_none=True)  # every .grad, the frozen one's too
        module.frozen.weight.grad = torch.zeros_like(module.frozen.weight)
        _step(module, x, kept=True)  # no trainable parameter holds a .grad
    assert _outside(compiled) >= BIG
    _same_grads(compiled, eager)


def test_a_parameter_added_after_compile_is_counted() -> None:
    _, model, compiled = _compiled(Unused)
    x = _x()
    for _ in range(2):
        _step(compiled, x)
    assert _outside(compiled) < BIG
    model.spare = nn.Parameter(torch.zeros(BIG // 4))  # never read by forward
    _step(compiled, x)
    assert _outside(compiled) >= BIG


def test_an_unused_parameter_whose_data_grows_is_counted() -> None:
    _, model, compiled = _compiled(Unused)
    model.spare = nn.Parameter(torch.zeros(4))  # never read by forward
    x = _x()
    for _ in range(2):
        _step(compiled, x)
    assert _outside(compiled) < BIG
    model.spare.data = torch.zeros(BIG // 4)  # the same parameter, more bytes
    _step(compiled, x)
    assert _outside(compiled) >= BIG


def test_kept_gradients_are_added_in_place_after_the_parameters_move() -> None:
    """The sink binds a call's parameters only when they differ from the last call's: by
    object and by data pointer, so `p.data = ...` binds again."""
    eager, model, compiled = _compiled(Unused)
    x = _x()
    for module in (compiled, eager):
        _step(module, x)
        for i in range(4):
            if i == 2:
                for p in module.parameters():
                    p.data = p.data.clone()
            _step(module, x, kept=True)
    _same_grads(compiled, eager)
    sinks = [g.sink for g in _log(compiled).graphs_built if g.sink is not None]
    assert sinks and sum(s.added for s in sinks) == 4 * len(list(model.parameters()))
    assert sum(s.returned for s in sinks) == 0


def test_graph_breaks_keep_the_trace() -> None:
    eager, _, compiled = _compiled(Branches)
    x = _x()
    for _ in range(3):
        _step(compiled, x)
        _step(eager, x)
    assert _log(compiled).traced == 3
    _same_grads(compiled, eager)


def test_the_trace_built_late_replays_the_runs_let_through(monkeypatch) -> None:
    """A trace that something needs after a settled graph ran equals the one the step
    would have recorded from its start."""
    _, _, compiled = _compiled(Unused)
    x = _x()
    _step(compiled, x)
    backend = compiled._memopt_backend
    seen = []
    ends = backend.forward_ends

    def capture(returned):
        call = backend.plan_log.call
        seen.append((bool(call.skipped), call.trace()))
        ends(returned)

    monkeypatch.setattr(backend, "forward_ends", capture)
    _step(compiled, x)  # settled: the run was let through, then replayed
    graph = _log(compiled).last_runs[0]
    graph.settled = None
    _step(compiled, x)  # traced from its start
    (late, replayed), (early, traced) = seen
    assert late and not early
    assert replayed.resident == traced.resident
    assert [r.inputs for r in replayed.runs] == [r.inputs for r in traced.runs]
    assert replayed.runs[0].base == traced.runs[0].base


@pytest.mark.parametrize("budget", [None, 0.9])
def test_settled_steps_match_eager_under_a_budget(budget: float | None) -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU())
                            for _ in range(6)])
    model = copy.deepcopy(eager)
    compiled = memopt.compile(model, budget=budget)
    for k in range(4):
        x = torch.randn(256, WIDTH, generator=torch.Generator().manual_seed(k))
        for module in (compiled, eager):
            _step(module, x, kept=k % 2 == 1)
    _same_grads(compiled, eager)
    # one step of each kind (.grad set to None, kept); under the budget one more: the
    # caller's `.square().mean()` holds four output-sized tensors, the assumption three
    # (memopt.caller_loss), so the step after its measurement plans it again
    assert _log(compiled).traced == (2 if budget is None else 3)
