"""Scan loops as Gruslys chains (passes.cell_loops, issue 28 item 1): a loop that carries a
state through per-step slices of tensors computed before it, reading no parameter (a
selective scan, Mamba's sequential path), is found in the captured graph and run as one
chain. Its per-step inputs are sliced in place (memopt.recurrent.ops.ChainSpec.sliced), not
packed into a copy. Eager's gradients with no budget and under budgets that split the
chain; the measured step within the budget; the plan the same size for any loop length."""

import copy

import pytest
import torch
from torch import nn

import memopt
from memopt.measure import allocation_peak
from test_passes import _SelectiveScan

#: A Mamba-like selective scan: dA and dBu computed before the loop, the state
#: ``h = dA[:, :, t] * h + dBu[:, :, t]`` and the output ``h @ C[:, t, :]`` (a mid-tuple
#: index), stacked along the last dim; no parameter inside the loop.
Scan = _SelectiveScan


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return torch.autograd.grad(model(x), [x, *model.parameters()])


def _peak(module, x: torch.Tensor) -> int:
    with allocation_peak("cpu") as seen:
        module(x).backward()
    return seen.peak


def _case(steps: int = 48):
    torch.manual_seed(0)
    return Scan(d=16), torch.randn(2, steps, 16, requires_grad=True)


def _minimum(model: nn.Module, x: torch.Tensor) -> int:
    with pytest.raises(memopt.BudgetError) as err:
        memopt.plan(model, x.detach(), budget=1)
    return err.value.minimum_bytes


@pytest.mark.parametrize("budget_of", ["none", "above_minimum", "minimum"])
def test_a_scan_without_parameters_runs_as_a_chain_with_eager_gradients(budget_of):
    """With no budget the chain is one chunk; at memopt's minimum and 5% above it, split.
    (This small scan's no-budget plan is below the minimum: with no budget its backward
    op does not keep dBu, which a budgeted plan keeps for the chunks it recomputes:
    docs/limits.md.)"""
    model, x = _case()
    ref = _grads(model, x)
    budget = None
    if budget_of != "none":
        low = _minimum(model, x)
        budget = low if budget_of == "minimum" else int(1.05 * low)
    compiled = memopt.compile(copy.deepcopy(model), budget=budget)
    got = torch.autograd.grad(compiled(x), [x, *compiled.parameters()])
    (chain,) = compiled.memopt_plan.chains
    assert chain.module_type == "detected loop" and chain.steps == 48, chain
    assert (chain.t == 1) == (budget is None), chain
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_scan_chain_holds_its_budget_and_no_more_than_eager_with_none():
    """Measured: with no budget at or below eager's peak (0.86x: the chain's step unbinds
    each per-step input once, where eager builds a full-size gradient for each step's
    slice), and at memopt's minimum within the budget and the plan."""
    model, x = _case(64)
    x = x.detach()
    eager = copy.deepcopy(model)
    eager(x).backward()
    for p in eager.parameters():
        p.grad = None
    eager_peak = _peak(eager, x)
    free = memopt.compile(copy.deepcopy(model))
    free(x).backward()
    for p in free.parameters():  # each measured step starts with no .grad, as eager's
        p.grad = None
    assert _peak(free, x) <= eager_peak
    compiled = memopt.compile(copy.deepcopy(model), budget=_minimum(model, x))
    compiled(x).backward()
    for p in compiled.parameters():
        p.grad = None
    plan = compiled.memopt_plan
    resident = sum(p.untyped_storage().nbytes() for p in model.parameters()) \
        + x.untyped_storage().nbytes()
    measured = _peak(compiled, x) + resident
    assert measured <= plan.budget_bytes, (measured, plan.budget_bytes)
    # the plan within a host scalar or two (1 KiB), as the other measured tests allow
    assert measured <= plan.predicted_peak_bytes + 1024, (measured, plan.predicted_peak_bytes)


def test_the_plan_of_a_scan_does_not_grow_with_the_loop():
    """One step is priced once: the planned graph has as many ops for 32 steps as for 128
    (unrolled it would have four times as many)."""
    sizes = []
    for steps in (32, 128):
        model, x = _case(steps)
        plan = memopt.plan(model, x.detach())
        sizes.append(plan.num_forward_steps + plan.num_backward_steps)
        assert len(plan.chains) == 1 and plan.chains[0].steps == steps
    assert sizes[0] == sizes[1], sizes


def test_loops_false_leaves_the_scan_unrolled():
    model, x = _case(16)
    plan = memopt.plan(model, x.detach(), loops=False)
    assert not plan.chains
    assert plan.num_forward_steps > 16 * 4


def test_a_scan_chain_accumulates_within_its_budget():
    """Gradient accumulation: the second micro-step finds .grad kept. At a budget a third
    of the way from memopt's minimum for that step up to its baseline, both micro-steps
    run the split chain; the accumulated gradients are eager's, and the second step
    measures within the budget and within 10% of its plan (the kept .grad counted as
    resident)."""
    model, x = _case(48)
    x = x.detach()
    eager = copy.deepcopy(model)
    baseline = memopt.plan(model, x, existing_grads=True).baseline_peak_bytes
    with pytest.raises(memopt.BudgetError) as err:
        memopt.plan(model, x, budget=1, existing_grads=True)
    budget = err.value.minimum_bytes + (baseline - err.value.minimum_bytes) // 3
    twin = copy.deepcopy(model)
    compiled = memopt.compile(twin, budget=budget)
    compiled(x).backward()
    resident = sum(t.untyped_storage().nbytes() for t in (
        *twin.parameters(), *(p.grad for p in twin.parameters()), x))
    measured = _peak(compiled, x) + resident
    for _ in range(2):
        eager(x).backward()
    for p, q in zip(twin.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    plan = compiled.memopt_plans[-1]
    assert plan.existing_grad_bytes > 0 and any(c.t > 1 for c in plan.chains), plan.chains
    assert measured <= budget, (measured, budget)
    # near the plan, as tests/test_training_loops.py asks of an accumulating step: this one
    # measures 1.7% above it (2,380 bytes since the discretization runs in the step;
    # 5,452 before; not diagnosed: docs/limits.md), inside the budget
    assert abs(measured - plan.predicted_peak_bytes) <= 0.10 * plan.predicted_peak_bytes


class _ScanReadingGateWhole(nn.Module):
    """A scan whose loss also reads its gate ``exp(a * dt)`` whole outside the loop."""

    def __init__(self, d: int = 16, n: int = 8) -> None:
        super().__init__()
        self.dt_proj = nn.Linear(d, d)
        self.a_log = nn.Parameter(torch.log(torch.arange(1, n + 1).float()).repeat(d, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = torch.nn.functional.softplus(self.dt_proj(x)).transpose(1, 2)
        da = torch.exp(-torch.exp(self.a_log)[None, :, None, :] * dt[..., None])
        dbu = dt[..., None] * x.transpose(1, 2)[..., None]
        h = x.new_zeros(x.shape[0], x.shape[2], self.a_log.shape[1])
        ys = []
        for i in range(x.shape[1]):
            h = da[:, :, i, :] * h + dbu[:, :, i, :]
            ys.append(h.sum(-1))
        return torch.stack(ys, -1).square().mean() + da.mean()


def _full_size_saved(plan, d: int, n: int) -> list[tuple]:
    """The saved (batch, d, T, n) tensors of a plan: the scan's expanded gates."""
    return [s.shape for s in plan.saved if s.decision == "saved" and s.nbytes
            and len(s.shape) == 4 and s.shape[1] == d and s.shape[3] == n]


def test_the_discretization_runs_inside_the_step():
    """The elementwise ops that build dA and dBu (batch x d x T x n) before the loop run
    inside the chain's step on slices of dt, b and u (passes.scan_inputs; Gu and Dao 2023,
    Sec. 3.3.2): no plan saves them whole, and the smallest budget is below the bytes of
    the two (it was 3.1x them, 406,876 bytes, before this pass); eager's gradients there."""
    model, x = _case(64)
    x = x.detach()
    plan = memopt.plan(model, x)
    assert not _full_size_saved(plan, 16, 8), _full_size_saved(plan, 16, 8)
    gates = 2 * (2 * 16 * 64 * 8 * 4)
    low = _minimum(model, x)
    assert low < gates, (low, gates)
    ref = _grads(model, x.requires_grad_())
    compiled = memopt.compile(copy.deepcopy(model), budget=low)
    for a, b in zip(torch.autograd.grad(compiled(x), [x, *compiled.parameters()]), ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_gate_read_whole_elsewhere_is_computed_once():
    """A gate the loss also reads whole stays one tensor (moving it would compute it twice):
    it is saved whole, and the chain reads its slices; eager's gradients."""
    torch.manual_seed(0)
    model, x = _ScanReadingGateWhole(d=16), torch.randn(2, 32, 16, requires_grad=True)
    ref = _grads(model, x)
    compiled = memopt.compile(copy.deepcopy(model))
    got = torch.autograd.grad(compiled(x), [x, *compiled.parameters()])
    assert len(compiled.memopt_plan.chains) == 1
    assert _full_size_saved(compiled.memopt_plan, 16, 8)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
