"""Numerical equality with eager PyTorch over the model corpus (STYLE.md section 7, tier 3).

Every test builds two identical models, trains one eagerly and the other through
`memopt.compile`, seeds the global RNG identically before each forward (so
dropout draws the same masks), and compares outputs, parameter gradients, input
gradients, buffers (BatchNorm running statistics) and, where an optimizer runs,
the parameters after every step.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt
from models import CASES, CORPUS, Case
from support import (FP32, assert_buffers_equal, assert_grads_close, assert_outputs_close,
                     assert_params_close, check_matches_eager, clone_inputs, default_loss,
                     step)

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
