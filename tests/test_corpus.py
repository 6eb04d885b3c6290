"""Numerical equality with eager PyTorch over the model corpus (STYLE.md section 7, tier 3).

Every test builds two identical models, trains one eagerly and the other through
`memopt.compile`, seeds the global RNG identically before each forward (so
dropout draws the same masks), and compares outputs, parameter gradients, input
gradients, buffers (BatchNorm running statistics) and, where an optimizer runs,
the parameters after every step.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt
from models import CASES, CORPUS, Case

FP32 = {"rtol": 1e-5, "atol": 1e-6}

# bfloat16 keeps 8 significant bits: one rounding is a relative error of up to
# 2**-8 = 3.9e-3, and a result goes through a few roundings (the matmul output,
# the cast of its input, the sum of bias and product), which is where torch's own
# default bf16 tolerance, rtol=1.6e-2, comes from. Eager and the captured graph
# may round at different points (AOTAutograd decomposes some ops, and sums
# gradients of reused values in its own order), so the absolute error of a value
# near zero is bounded by the magnitude of the terms that cancelled, not by the
# value: atol is rtol times the largest magnitude of the expected tensor.
BF16_RTOL = 1.6e-2


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def leaves(out: Any) -> list[torch.Tensor]:
    """The tensors of a (nested) output, in a fixed order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for key in out for t in leaves(out[key])]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in leaves(v)]
    return []


_LOSS_WEIGHTS: dict[tuple[tuple[int, ...], int], torch.Tensor] = {}


def _weights(shape: tuple[int, ...], index: int) -> torch.Tensor:
    """A fixed random tensor per output position, drawn from its own generator
    (the global RNG, which dropout reads, is not touched)."""
    key = (shape, index)
    if key not in _LOSS_WEIGHTS:
        gen = torch.Generator().manual_seed(1234 + index)
        _LOSS_WEIGHTS[key] = torch.randn(shape, generator=gen)
    return _LOSS_WEIGHTS[key]


def default_loss(out: Any) -> torch.Tensor:
    """A random projection of every floating output: every output element gets a
    distinct, non-trivial gradient (a plain .sum() would hide, e.g., a LayerNorm's)."""
    total = None
    for i, t in enumerate(leaves(out)):
        if t.is_floating_point():
            term = (t.float() * _weights(tuple(t.shape), i)).sum()
            total = term if total is None else total + term
    assert total is not None, "model has no floating-point output"
    return total


def clone_inputs(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """Independent leaf copies (same values, same requires_grad)."""
    return tuple(
        x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
        for x in inputs
    )


def assert_same_structure(actual: Any, expected: Any) -> None:
    assert type(actual) is type(expected), (type(actual), type(expected))
    if isinstance(expected, dict):
        assert list(actual) == list(expected)
        for key in expected:
            assert_same_structure(actual[key], expected[key])
    elif isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_same_structure(a, e)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str,
                 tol: dict[str, float] | None) -> None:
    """fp32 tolerances by default; tol=None means the bf16 rule above."""
    if tol is None:
        scale = expected.detach().float().abs().max().item() if expected.numel() else 0.0
        tol = {"rtol": BF16_RTOL, "atol": BF16_RTOL * max(scale, 1e-6)}
    torch.testing.assert_close(actual, expected, msg=lambda m: f"{what}: {m}", **tol)


def assert_outputs_close(actual: Any, expected: Any, tol: dict[str, float] | None) -> None:
    assert_same_structure(actual, expected)
    for i, (a, e) in enumerate(zip(leaves(actual), leaves(expected))):
        assert a.shape == e.shape and a.dtype == e.dtype, (i, a.shape, e.shape, a.dtype, e.dtype)
        assert_close(a, e, f"output {i}", tol)


def assert_grads_close(model: nn.Module, eager: nn.Module, tol: dict[str, float] | None) -> None:
    ours = dict(model.named_parameters())
    for name, p_eager in eager.named_parameters():
        p = ours[name]
        if p_eager.grad is None:
            assert p.grad is None, f"grad of {name}: eager has None, memopt has a tensor"
        else:
            assert p.grad is not None, f"grad of {name}: memopt has None, eager has a tensor"
            assert_close(p.grad, p_eager.grad, f"grad of {name}", tol)


def assert_params_close(model: nn.Module, eager: nn.Module, tol: dict[str, float] | None,
                        when: str) -> None:
    ours = dict(model.named_parameters())
    for name, p_eager in eager.named_parameters():
        assert_close(ours[name].detach(), p_eager.detach(), f"{when}: parameter {name}", tol)


def assert_buffers_equal(model: nn.Module, eager: nn.Module, when: str) -> None:
    ours = dict(model.named_buffers())
    theirs = dict(eager.named_buffers())
    assert list(ours) == list(theirs)
    for name, b_eager in theirs.items():
        b = ours[name]
        assert b.dtype == b_eager.dtype
        assert torch.equal(b, b_eager), (
            f"{when}: buffer {name} differs: memopt {b.flatten()[:4].tolist()} ... "
            f"eager {b_eager.flatten()[:4].tolist()} ... "
            f"(max diff {(b.double() - b_eager.double()).abs().max().item():.3g})"
        )


def batch_norm_steps(model: nn.Module) -> set[int]:
    return {int(m.num_batches_tracked) for m in model.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)}


@dataclass
class Run:
    """What `check_matches_eager` leaves behind for further checks."""

    eager: nn.Module
    model: nn.Module          # the module memopt compiled (shares state with `compiled`)
    compiled: nn.Module
    plans: list[memopt.MemoryPlan] = field(default_factory=list)


def step(module: nn.Module, inputs: tuple[Any, ...], *, seed: int, autocast: torch.dtype | None,
         loss_fn: Callable[[Any], torch.Tensor]) -> Any:
    """One forward (seeded, optionally under autocast) and backward; returns the output."""
    torch.manual_seed(seed)
    if autocast is not None:
        with torch.autocast("cpu", dtype=autocast):
            out = module(*inputs)
    else:
        out = module(*inputs)
    loss_fn(out).backward()
    return out


def check_matches_eager(
    make_model: Callable[[], nn.Module],
    make_inputs: Callable[[], tuple[Any, ...]],
    *,
    budget: object = None,
    steps: int = 1,
    autocast: torch.dtype | None = None,
    loss_fn: Callable[[Any], torch.Tensor] = default_loss,
    make_optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    compile_fn: Callable[[nn.Module], nn.Module] | None = None,
) -> Run:
    """Train `steps` steps eagerly and through memopt from identical states; compare
    outputs, gradients (parameters and inputs), buffers and, with an optimizer,
    parameters after every step."""
    tol = FP32 if autocast is None else None
    torch.manual_seed(0)
    eager = make_model()
    model = copy.deepcopy(eager)
    compiled = (compile_fn or (lambda m: memopt.compile(m, budget=budget)))(model)
    opt_eager = make_optimizer(eager.parameters()) if make_optimizer else None
    opt_ours = make_optimizer(compiled.parameters()) if make_optimizer else None
    run = Run(eager=eager, model=model, compiled=compiled)

    for k in range(steps):
        torch.manual_seed(100 + k)
        inputs = make_inputs()
        in_eager, in_ours = clone_inputs(inputs), clone_inputs(inputs)
        for m in (eager, model):
            m.zero_grad(set_to_none=True)
        out_eager = step(eager, in_eager, seed=1000 + k, autocast=autocast, loss_fn=loss_fn)
        out_ours = step(compiled, in_ours, seed=1000 + k, autocast=autocast, loss_fn=loss_fn)

        assert_outputs_close(out_ours, out_eager, tol)
        assert_grads_close(model, eager, tol)
        for i, (a, e) in enumerate(zip(in_ours, in_eager)):
            if isinstance(e, torch.Tensor) and e.requires_grad:
                assert e.grad is not None and a.grad is not None, f"input {i} has no grad"
                assert_close(a.grad, e.grad, f"grad of input {i}", tol)
        assert_buffers_equal(model, eager, f"after step {k + 1}")
        if batch_norm_steps(eager):
            assert batch_norm_steps(model) == {k + 1}, "BatchNorm counted a step twice (or not)"

        plan = getattr(compiled, "memopt_plan", None)
        if hasattr(compiled, "memopt_plan"):
            assert plan is not None, "no memory plan after a training step"
            assert plan.predicted_peak_bytes > 0
            run.plans.append(plan)

        if opt_eager is not None:
            opt_eager.step()
            opt_ours.step()
            assert_params_close(model, eager, tol, f"after optimizer step {k + 1}")
    return run


# --------------------------------------------------------------------------
# The corpus, one and two steps
# --------------------------------------------------------------------------


@pytest.mark.parametrize("case", CORPUS, ids=lambda c: c.name)
def test_matches_eager(case: Case) -> None:
    check_matches_eager(case.make_model, case.make_inputs)


@pytest.mark.parametrize("case", CORPUS, ids=lambda c: c.name)
def test_matches_eager_two_sgd_steps(case: Case) -> None:
    """The second step runs on updated parameters and (BatchNorm) updated statistics."""
    check_matches_eager(case.make_model, case.make_inputs, steps=2,
                        make_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05))


def test_inplace_pass_rewrote_something() -> None:
    """The corpus exercises the in-place pass (else the tests above prove little about it)."""
    case = CASES["mlp"]
    run = check_matches_eager(case.make_model, case.make_inputs)
    assert run.plans[-1].inplace, "no in-place rewrite in an MLP with GELU/Tanh"


# --------------------------------------------------------------------------
# Optimizers, gradient accumulation
# --------------------------------------------------------------------------

OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
}


@pytest.mark.parametrize("case_name", ["conv_bn", "transformer", "frozen_lora"])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_optimizer_steps(opt_name: str, case_name: str) -> None:
    case = CASES[case_name]
    check_matches_eager(case.make_model, case.make_inputs, steps=3,
                        make_optimizer=OPTIMIZERS[opt_name])


@pytest.mark.parametrize("case_name", ["conv_bn", "transformer"])
def test_gradient_accumulation(case_name: str) -> None:
    """Two forward/backward micro-batches accumulate into .grad before one step."""
    case = CASES[case_name]
    torch.manual_seed(0)
    eager = case.make_model()
    model = copy.deepcopy(eager)
    compiled = memopt.compile(model)
    opt_eager = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    opt_ours = torch.optim.SGD(compiled.parameters(), lr=0.1, momentum=0.9)
    for outer in range(2):
        opt_eager.zero_grad()
        opt_ours.zero_grad()
        for micro in range(2):
            torch.manual_seed(10 * outer + micro)
            inputs = case.make_inputs()
            seed = 500 + 10 * outer + micro
            out_e = step(eager, clone_inputs(inputs), seed=seed, autocast=None,
                         loss_fn=default_loss)
            out_o = step(compiled, clone_inputs(inputs), seed=seed, autocast=None,
                         loss_fn=default_loss)
            assert_outputs_close(out_o, out_e, FP32)
        assert_grads_close(model, eager, FP32)
        assert_buffers_equal(model, eager, f"after accumulation round {outer + 1}")
        opt_eager.step()
        opt_ours.step()
        assert_params_close(model, eager, FP32, f"after step {outer + 1}")


# --------------------------------------------------------------------------
# Modes, shapes, autocast
# --------------------------------------------------------------------------


@pytest.mark.parametrize("case_name", ["conv_bn", "transformer"])
def test_train_eval_switch(case_name: str) -> None:
    """eval() on the compiled module switches the original too; eval outputs (BatchNorm
    running stats, no dropout) match eager under no_grad and with grad enabled."""
    case = CASES[case_name]
    run = check_matches_eager(case.make_model, case.make_inputs, steps=1)
    eager, model, compiled = run.eager, run.model, run.compiled
    torch.manual_seed(7)
    (x,) = case.make_inputs()

    assert compiled.eval() is compiled
    eager.eval()
    assert not compiled.training and not model.training
    assert all(not m.training for m in model.modules())
    with torch.no_grad():
        torch.manual_seed(1)
        expected = eager(x)
        torch.manual_seed(1)
        actual = compiled(x)
    assert_outputs_close(actual, expected, FP32)
    assert_buffers_equal(model, eager, "after an eval forward under no_grad")

    eager.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    out_e = step(eager, (x,), seed=2, autocast=None, loss_fn=default_loss)
    out_o = step(compiled, (x,), seed=2, autocast=None, loss_fn=default_loss)
    assert_outputs_close(out_o, out_e, FP32)
    assert_grads_close(model, eager, FP32)
    assert_buffers_equal(model, eager, "after an eval forward with grad")

    compiled.train()
    eager.train()
    assert compiled.training and model.training
    assert all(m.training for m in model.modules())
    eager.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    out_e = step(eager, (x,), seed=3, autocast=None, loss_fn=default_loss)
    out_o = step(compiled, (x,), seed=3, autocast=None, loss_fn=default_loss)
    assert_outputs_close(out_o, out_e, FP32)
    assert_grads_close(model, eager, FP32)
    assert_buffers_equal(model, eager, "after switching back to train")


SHAPES = {
    "mlp": ((8, 32), (3, 32)),
    "transformer": ((2, 8, 32), (3, 5, 32)),
}


@pytest.mark.parametrize("case_name", sorted(SHAPES))
def test_new_shape_replans(case_name: str) -> None:
    """Shapes A, B, A: a second plan appears for B, A reuses its first plan, and every
    step matches eager."""
    case = CASES[case_name]
    shape_a, shape_b = SHAPES[case_name]
    torch.manual_seed(0)
    eager = case.make_model()
    model = copy.deepcopy(eager)
    compiled = memopt.compile(model)
    for k, shape in enumerate((shape_a, shape_b, shape_a)):
        torch.manual_seed(k)
        x = torch.randn(shape)
        eager.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        out_e = step(eager, (x,), seed=10 + k, autocast=None, loss_fn=default_loss)
        out_o = step(compiled, (x,), seed=10 + k, autocast=None, loss_fn=default_loss)
        assert_outputs_close(out_o, out_e, FP32)
        assert_grads_close(model, eager, FP32)
        if k == 0:
            first = compiled.memopt_plan
            assert len(compiled.memopt_plans) == 1
        if k == 1:
            second = compiled.memopt_plan
            assert len(compiled.memopt_plans) == 2
            assert second is not first
            shapes_a = {s.shape for s in first.saved}
            shapes_b = {s.shape for s in second.saved}
            assert shapes_a != shapes_b
            # the input itself is saved (the first layer's backward reads it)
            assert tuple(shape_a) in shapes_a and tuple(shape_b) in shapes_b
        if k == 2:
            assert len(compiled.memopt_plans) == 2, "shape A was planned twice"
            assert compiled.memopt_plan is first, "memopt_plan is not the plan that ran last"


@pytest.mark.parametrize("case_name", ["mlp", "conv_bn", "transformer"])
def test_autocast_bf16(case_name: str) -> None:
    case = CASES[case_name]
    run = check_matches_eager(case.make_model, case.make_inputs, autocast=torch.bfloat16,
                              steps=2, make_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05))
    assert any(s.dtype == "bfloat16" for s in run.plans[-1].saved), (
        "the plan of an autocast step saves no bfloat16 tensor")


# --------------------------------------------------------------------------
# Dropout: the RNG
# --------------------------------------------------------------------------


class PureDropout(nn.Module):
    """Output = dropout(x * w): equal to eager bit for bit iff the mask is the same."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(64, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x * self.w, p=0.5, training=self.training)


def test_dropout_same_seed_is_exact_and_other_seed_differs() -> None:
    torch.manual_seed(0)
    eager = PureDropout()
    model = copy.deepcopy(eager)
    compiled = memopt.compile(model)
    x = torch.randn(64, 64)

    torch.manual_seed(42)
    expected = eager(x)
    default_loss(expected).backward()
    torch.manual_seed(42)
    actual = compiled(x)
    default_loss(actual).backward()
    assert torch.equal(actual, expected), "same seed, different dropout output"
    # backward used the forward's mask (it did not draw a new one)
    assert torch.equal(model.w.grad, eager.w.grad)

    torch.manual_seed(43)
    other = compiled(x)
    assert not torch.equal(other, expected), "a different seed gave the same dropout mask"
    assert not torch.equal(other == 0, expected == 0)


def test_dropout_advances_rng_like_eager() -> None:
    """Two compiled steps without reseeding draw the masks eager would draw."""
    torch.manual_seed(0)
    eager = PureDropout()
    model = copy.deepcopy(eager)
    compiled = memopt.compile(model)
    x = torch.randn(64, 64)
    torch.manual_seed(5)
    expected = [eager(x) for _ in range(2)]
    torch.manual_seed(5)
    actual = [compiled(x) for _ in range(2)]
    assert not torch.equal(expected[0], expected[1])
    for a, e in zip(actual, expected):
        assert torch.equal(a, e)
