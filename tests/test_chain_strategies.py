"""BPTT-ISM and BPTT-MSM (Gruslys et al. 2016, Sec. 3.2-3.4) inside memopt.compile: the
planner prices them beside HSM (passes/chain_policy.py), and a chain run under either gives
eager's loss and gradients, within the budget, as predicted.

A strategy is forced by narrowing the planner's grid (chain_pass.configurations) to it;
the planner still chooses the chunk length and m among those."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from memopt.allocator.gruslys import solve
from memopt.passes import chain_policy as chain_pass
from models import allocated_step
from support import ChainRegression, GRUCellLoop, LanguageModel, LSTMCellLoop, regression_at
from torch import nn

import memopt
from memopt.recurrent import ops


def _only(monkeypatch, strategy: str) -> None:
    """The planner sees only ``strategy``'s policies (and no HSM bisection)."""
    grid = chain_pass.configurations
    monkeypatch.setattr(chain_pass, "configurations", lambda site, costs: [
        c for c in grid(site, costs) if c.policy.strategy == strategy])
    monkeypatch.setattr(chain_pass, "longest_fitting_chunk", lambda *a, **k: None)


def _stores_internal_states(chain) -> bool:
    """Whether the record's policy keeps a chunk's graph besides the core's."""
    policy = solve(chain.t, chain.m, chain.strategy, chain.alpha, chain.beta)
    sched = policy.schedule
    return any(op == "store_internal" and sched[n + 1] != ("backward", i, i + 1)
               for n, (op, i, _) in enumerate(sched))


def _check_grads(got_loss, got, ref_loss, ref) -> None:
    torch.testing.assert_close(got_loss, ref_loss, rtol=1e-4, atol=1e-6)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


MODELS = {
    "lstm": (lambda: LanguageModel(nn.LSTM(16, 32, num_layers=2)), 0.92),
    "gru": (lambda: LanguageModel(nn.GRU(16, 32)), 0.92),
    "lstm_cell_loop": (LSTMCellLoop, 0.6),
    "gru_cell_loop": (GRUCellLoop, 0.6),
}


def _inputs(kind: str):
    if kind.endswith("loop"):
        return (torch.randn(48, 16, 8),)
    return torch.randint(0, 50, (128, 32)), torch.randint(0, 50, (128, 32))


#: every model and both strategies; the default suite runs each strategy on a module chain
#: and on a cell loop (the LSTM's, 12-14 s each, are -m slow)
CASES = [pytest.param(kind, strategy, marks=() if (kind, strategy) in {
    ("gru", "msm"), ("gru_cell_loop", "ism")}
    else pytest.mark.slow) for kind in sorted(MODELS) for strategy in ("ism", "msm")]


@pytest.mark.parametrize("kind,strategy", CASES)
def test_forced_strategy_gives_eager_gradients(monkeypatch, kind, strategy):
    """nn.LSTM / nn.GRU split in chunks and detected LSTMCell / GRUCell loops, run under
    ISM or MSM policies that keep chunks' internal states: eager's loss and gradients
    (fp32, rtol 1e-4), and the op ran the plan's policy (its forward count is C(t, m))."""
    make, fraction = MODELS[kind]
    torch.manual_seed(0)
    model = make()
    args = _inputs(kind)
    ref_loss = model(*args)
    ref = torch.autograd.grad(ref_loss, list(model.parameters()))
    free = memopt.plan(model, *args).predicted_peak_bytes
    _only(monkeypatch, strategy)
    _steps_dominate(monkeypatch)  # measured times could make m = 1 (nothing kept) fastest
    compiled = memopt.compile(model, budget=int(fraction * free))
    loss = compiled(*args)
    got = torch.autograd.grad(loss, list(model.parameters()))
    plan = compiled.memopt_plan
    (chain,) = plan.chains
    assert chain.strategy == strategy and chain.t > 1, chain
    assert (chain.alpha is not None) == (strategy == "msm")
    assert _stores_internal_states(chain), chain
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    assert ops.LAST_STATS[max(ops.LAST_STATS)].forward_steps == chain.cost
    assert f"BPTT-{strategy.upper()}" in plan.summary()
    _check_grads(loss, got, ref_loss, ref)
    assert not ops._STASH


def _steps_dominate(monkeypatch) -> None:
    """Chunk times where each step costs 1 ms and a call 10 us (a slow step, a cheap
    launch), fixed instead of measured so that the choice does not depend on the
    machine's load: recomputed steps are then what costs time."""
    measured = chain_pass.chunk_costs

    def costs(joint, site, room=None):
        return dataclasses.replace(
            measured(joint, site, room), forward_ns=chain_pass.Linear(1_010_000, 1_000_000),
            backward_ns=chain_pass.Linear(2_020_000, 2_000_000))

    monkeypatch.setattr(chain_pass, "chunk_costs", costs)


def _measured(compiled, model, xs, resident: int) -> int:
    for p in model.parameters():  # plan the step measured below: gradients set to None
        p.grad = None
    compiled(xs).backward()  # compiles and plans (not under a profiler: they do not nest)
    return allocated_step(compiled, xs, resident)


@pytest.mark.slow  # ~25 s; the default suite forces ISM and MSM on every kind of chain
def test_planner_takes_internal_states_where_they_are_faster(monkeypatch):
    """With time in the recomputed steps, budgets a few times memopt's minimum are met
    fastest by keeping some chunks' internal states (no rerun in backward) than by any
    HSM policy: the planner takes ISM or MSM there, its estimated time below the best
    HSM plan's at the same budget; each step is measured within its budget and within
    10% of the prediction, with eager's gradients."""
    _steps_dominate(monkeypatch)
    torch.manual_seed(0)
    model = ChainRegression(120)
    xs = torch.randn(120, 16, 32)
    resident = sum(t.untyped_storage().nbytes()
                   for t in (*model.parameters(), *model.buffers(), xs))
    with pytest.raises(memopt.BudgetError) as low:
        memopt.plan(model, xs, budget=1)
    ref = torch.autograd.grad(model(xs), list(model.parameters()))
    picked = []
    for factor in (3.2, 4.0):  # 2.9 took HSM once h_0 counted as held (2026-11-28)
        budget = int(factor * low.value.minimum_bytes)
        compiled = memopt.compile(model, budget=budget)
        measured = _measured(compiled, model, xs, resident)
        plan = compiled.memopt_plan
        (chain,) = plan.chains
        assert measured <= budget, (factor, measured, budget)
        assert abs(plan.predicted_peak_bytes - measured) <= 0.10 * measured, (
            factor, plan.predicted_peak_bytes, measured)
        got = torch.autograd.grad(compiled(xs), list(model.parameters()))
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        picked.append(chain)
    assert all(c.strategy in ("ism", "msm") and _stores_internal_states(c) for c in picked), \
        picked
    _only(monkeypatch, "hsm")
    for factor, chain in zip((2.9, 4.0), picked):
        hsm = memopt.plan(model, xs, budget=int(factor * low.value.minimum_bytes)).chains[0]
        assert hsm.strategy == "hsm" and hsm.estimated_seconds > chain.estimated_seconds, (
            hsm, chain)
        assert hsm.recompute_steps > chain.recompute_steps


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ism", "msm"])
@pytest.mark.parametrize("fraction", [0.6, 0.35, 0.2])
def test_forced_strategy_measured_within_budget(monkeypatch, strategy, fraction):
    """ISM and MSM plans of an LSTM at budgets binding the chain: the step's allocated
    bytes stay within the budget, and the plan predicts them within 10%."""
    model, xs, resident, budget = regression_at(fraction)
    _only(monkeypatch, strategy)
    compiled = memopt.compile(model, budget=budget)
    measured = _measured(compiled, model, xs, resident)
    plan = compiled.memopt_plan
    (chain,) = plan.chains
    assert chain.strategy == strategy and chain.t > 1, chain
    assert plan.predicted_peak_bytes <= budget
    assert measured <= budget, (measured, budget)
    assert abs(plan.predicted_peak_bytes - measured) <= 0.10 * measured, (
        plan.predicted_peak_bytes, measured)


def test_chain_record_keeps_msm_units_through_json():
    """ChainRecord's alpha and beta round-trip through JSON, and a record written
    before they existed (no alpha, no beta) still loads."""
    from memopt.memory_plan import ChainRecord

    fields = {"module": "rnn", "module_type": "LSTM", "steps": 10, "chunk": 2, "t": 5,
              "m": 12, "strategy": "msm", "cost": 7, "recompute_steps": 4,
              "estimated_seconds": 0.1, "recompute_flops": 0, "hidden_bytes": 8,
              "internal_bytes": 40, "held_bytes": 100, "forward_workspace_bytes": 1,
              "workspace_bytes": 2, "reason": "fits"}
    record = ChainRecord(alpha=5, beta=4, **fields)
    assert ChainRecord.model_validate_json(record.model_dump_json()) == record
    old = ChainRecord.model_validate_json(ChainRecord(**fields).model_dump_json(
        exclude={"alpha", "beta"}))
    assert (old.alpha, old.beta) == (None, None)
