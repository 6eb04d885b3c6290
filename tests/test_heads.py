"""The language-model head chunked along the tokens (memopt.lm_head, passes/lm_heads.py):
the ops against autograd through F.cross_entropy, the pattern found in dynamo's graph
(and what is left as it is), eager's loss and gradients under budgets that chunk it, and
the measured step within the budget and the plan."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import memopt
import memopt.lm_head  # noqa: F401  (registers the ops)
from memopt.errors import BudgetError
from memopt.measure import allocation_peak
from support import TinyLM, V



def _reference(h, w, b, target, ignore_index, reduction, upcast, grad_logits=None):
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    b = b.detach().requires_grad_() if b is not None else None
    logits = F.linear(h, w, b)
    x = logits.float() if upcast else logits
    loss = F.cross_entropy(x, target, ignore_index=ignore_index, reduction=reduction)
    total = loss + ((logits * grad_logits).sum() if grad_logits is not None else 0)
    total.backward()
    return loss.detach(), logits.detach(), [t.grad for t in (h, w, b) if t is not None]


@pytest.mark.parametrize("chunk", [1000, 64, 7])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("want_logits", [False, True])
def test_ops_equal_autograd_through_cross_entropy(chunk, reduction, want_logits):
    """Every chunk size, one chunk (log-probabilities kept) included: eager's loss,
    logits and gradients, ignored targets and an incoming gradient of the logits too."""
    torch.manual_seed(0)
    rows, d = 200, 24
    h, w, b = torch.randn(rows, d), torch.randn(V, d) * 0.3, torch.randn(V)
    target = torch.randint(0, V, (rows,))
    target[::9] = -100
    grad_logits = torch.randn(rows, V) if want_logits else None
    loss, logits, grads = _reference(h, w, b, target, -100, reduction, False, grad_logits)
    got_loss, got_logits, handle = torch.ops.memopt.head_fwd(
        chunk, True, want_logits, True, False, -100, reduction, h, w, b, target)
    got = torch.ops.memopt.head_bwd(chunk, False, -100, reduction, handle, torch.ones(()),
                                    grad_logits, h, w, b, target, True, True, True)
    torch.testing.assert_close(got_loss, loss)
    if want_logits:
        torch.testing.assert_close(got_logits, logits)
    for a, e in zip(got, grads):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)


def test_ops_upcast_from_bfloat16():
    """Logits cast to float32 before the loss (transformers' loss functions): the loss
    in float32, the gradients cast back as autograd casts them."""
    torch.manual_seed(0)
    h, w = torch.randn(64, 16, dtype=torch.bfloat16), torch.randn(V, 16, dtype=torch.bfloat16)
    target = torch.randint(0, V, (64,))
    loss, _, grads = _reference(h, w, None, target, -100, "mean", True)
    got_loss, _, handle = torch.ops.memopt.head_fwd(16, True, False, True, True, -100, "mean",
                                                    h, w, None, target)
    got = torch.ops.memopt.head_bwd(16, True, -100, "mean", handle, torch.ones(()), None, h,
                                    w, None, target, True, True, False)
    assert got_loss.dtype == torch.float32
    torch.testing.assert_close(got_loss, loss, rtol=1e-3, atol=1e-3)
    for a, e in zip(got, grads):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), e.float(), rtol=2e-2, atol=2e-3)


def _inputs():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, V, (8, 96), generator=g)
    targets = torch.randint(0, V, (8, 96), generator=g)
    targets[0, :20] = -100
    return tokens, targets


def _loss(out):
    return out[0] if isinstance(out, tuple) else out


def _step(module, tokens, targets, seed=3):
    torch.manual_seed(seed)
    loss = _loss(module(tokens, targets))
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("kwargs", [
    {}, {"returns_logits": True}, {"reduction": "sum", "bias": False},
    {"form": "nll_loss", "returns_logits": True}, {"dropout": 0.2}])
@pytest.mark.parametrize("budget", [None, 0.7])
def test_compiled_head_keeps_eager_gradients(kwargs, budget):
    """Under a budget the head runs in chunks (plan.heads); with none it is one chunk that
    recomputes nothing where the model returns its logits (which then get no zero gradient,
    memopt.lm_head.attach_logits), and left as it is elsewhere. Loss and every gradient
    equal eager's, over two steps."""
    torch.manual_seed(0)
    model = TinyLM(V, **{"dropout": 0.0, **kwargs})
    eager = copy.deepcopy(model)
    compiled = memopt.compile(copy.deepcopy(model), budget=budget)
    tokens, targets = _inputs()
    for step in range(2):
        ref = _step(eager, tokens, targets, seed=step)
        got = _step(compiled, tokens, targets, seed=step)
        torch.testing.assert_close(got, ref)
        for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    heads = compiled.memopt_plan.heads
    if budget is None and kwargs.get("returns_logits"):
        (head,) = heads
        assert (head.chunks, head.recompute_flops, head.returns_logits) == (1, 0, True), head
    elif budget is None:
        assert heads == ()
    else:
        (head,) = heads
        assert (head.tokens, head.vocab) == (8 * 96, V)
        assert head.chunks > 1 and head.recompute_flops > 0, head
        assert "head head:" in compiled.memopt_plan.summary()


def test_patterns_left_as_they_are_still_train():
    """Label smoothing is not chunked (one debug line says why); the model still trains
    with eager's gradients under the budget."""
    torch.manual_seed(0)
    model = TinyLM(V, dropout=0.0, form="label_smoothing")
    eager = copy.deepcopy(model)
    compiled = memopt.compile(copy.deepcopy(model), budget=0.7)
    tokens, targets = _inputs()
    torch.testing.assert_close(_step(compiled, tokens, targets), _step(eager, tokens, targets))
    for p, q in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6)
    assert compiled.memopt_plan.heads == ()


def _allocated(module, tokens, targets, resident):
    for p in module.parameters():
        p.grad = None
    with allocation_peak("cpu") as seen:
        out = module(tokens, targets)  # held through backward, as training loops hold it
        _loss(out).backward()
    return seen.peak + resident


@pytest.mark.parametrize("returns_logits", [False, True])
def test_chunked_head_lowers_the_minimum_and_the_measured_step(returns_logits):
    """At memopt's minimum the measured step is within the budget and within 10% of
    the plan, and well below the minimum with the head left whole (the head's logits,
    log-probabilities and their gradients were most of it)."""
    torch.manual_seed(0)
    model = TinyLM(V, dropout=0.0, returns_logits=returns_logits)
    tokens, targets = _inputs()
    resident = sum(t.untyped_storage().nbytes()
                   for t in (*model.parameters(), tokens, targets))
    eager = _allocated(model, tokens, targets, resident)
    with pytest.raises(BudgetError) as err:
        memopt.plan(model, tokens, targets, budget=1)
    minimum = err.value.minimum_bytes
    compiled = memopt.compile(model, budget=minimum)
    for p in model.parameters():  # plan the step measured below: gradients set to None
        p.grad = None
    _step(compiled, tokens, targets)  # compiles and plans (not under the profiler)
    measured = _allocated(compiled, tokens, targets, resident)
    plan = compiled.memopt_plan
    assert plan.heads and plan.heads[0].chunks > 1
    assert measured <= minimum, (measured, minimum)
    assert abs(plan.predicted_peak_bytes - measured) <= 0.10 * measured, (
        plan.predicted_peak_bytes, measured)
    # the logits alone are 8 x 96 x V floats; eager holds about four such tensors
    logits = 8 * 96 * V * 4
    assert measured < eager - (1.5 if returns_logits else 2.5) * logits, (measured, eager)


def test_head_chunk_chosen_with_the_mirror_set(monkeypatch):
    """planner.joint_heads: a head's chunk and the mirror set chosen together never
    recompute more than the head choosing first (within the tie, which goes to fewer
    chunks), and where Chen's search fits the step with the head whole, it stays whole:
    a body of 256 hidden units at 90% recomputed 0.57 of a forward with the head split
    in two, 0.007 with it whole. The measured step holds the budget with eager's
    gradients."""
    from memopt.planner import joint_heads, plan as planner

    torch.manual_seed(0)
    model = TinyLM(V, dropout=0.0, hidden=256)
    tokens, targets = _inputs()

    def plans(budget):
        joint = memopt.plan(model, tokens, targets, budget=budget)
        with monkeypatch.context() as m:
            m.setattr(planner, "choose_heads_jointly", lambda heads, mirror, search, *a: (
                mirror, search))
            first = memopt.plan(model, tokens, targets, budget=budget)
        return joint, first

    for budget in (0.6,):  # a tie: 4 chunks at 0.574 first, 2 at 0.580 jointly
        joint, first = plans(budget)
        tie = joint_heads.TIE_FRACTION * joint.forward_flops
        assert joint.recompute_flops <= first.recompute_flops + tie, budget
        assert joint.predicted_peak_bytes <= joint.budget_bytes
    joint, first = plans(0.9)
    assert first.heads[0].chunks > 1 and joint.heads[0].chunks == 1
    assert joint.recompute_flops < 0.1 * first.recompute_flops, (joint, first)
    assert "with the mirror set" in joint.heads[0].reason

    eager = copy.deepcopy(model)
    compiled = memopt.compile(model, budget=0.9)
    torch.testing.assert_close(_step(compiled, tokens, targets), _step(eager, tokens, targets))
    for (name, p), q in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    resident = sum(t.untyped_storage().nbytes()
                   for t in (*model.parameters(), tokens, targets))
    measured = _allocated(compiled, tokens, targets, resident)
    plan = compiled.memopt_plan
    assert plan.heads[0].chunks == 1 and measured <= plan.budget_bytes, (measured, plan)
    assert abs(plan.predicted_peak_bytes - measured) <= 0.05 * measured


@pytest.mark.parametrize("form,returns_logits", [
    ("cross_entropy", False), ("nll_loss", False), ("cross_entropy", True)])
def test_head_chunked_under_bf16_autocast(form, returns_logits):
    """Under torch.autocast (bf16) the head runs chunked like in float32 (its casts made
    explicit: the projection in bf16, the loss in float32), so the smallest budget is no
    higher than float32's (it was 1.5-1.6x with the head left whole); loss and gradients
    within bf16 tolerances of eager under the same autocast, over two steps, and the
    returned logits are eager's dtype."""
    torch.manual_seed(0)
    model = TinyLM(V, dropout=0.0, form=form, returns_logits=returns_logits)
    tokens, targets = _inputs()

    def minimum(autocast):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            with pytest.raises(BudgetError) as err:
                memopt.plan(model, tokens, targets, budget=1)
        return err.value.minimum_bytes

    assert minimum(True) <= minimum(False)
    eager = copy.deepcopy(model)
    compiled = memopt.compile(copy.deepcopy(model), budget=0.7)
    for step in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want, got = eager(tokens, targets), compiled(tokens, targets)
        if returns_logits:
            assert got[1].dtype == want[1].dtype == torch.bfloat16
        _loss(want).backward()
        _loss(got).backward()
        torch.testing.assert_close(_loss(got), _loss(want), rtol=1e-4, atol=1e-4)
    plan = compiled.memopt_plan
    assert plan.heads and plan.heads[0].chunks > 1
    for (name, p), q in zip(eager.named_parameters(), compiled.original_module.parameters()):
        scale = p.grad.abs().max()
        assert (q.grad - p.grad).abs().max() <= 2e-2 * scale, name


def test_a_heads_costs_are_measured_once_per_shape(monkeypatch):
    """passes.lm_heads.head_costs measures a head's transients once per process for its
    shapes and options: planning a model again (a re-plan, a repeated block's second
    plan, a second compilation) reads them back, and the plan is the same."""
    from memopt.passes import lm_heads

    calls = []
    measured = lm_heads._measured_costs

    def counting(*args, **kwargs):
        calls.append(args[0].rows)
        return measured(*args, **kwargs)

    monkeypatch.setattr(lm_heads, "_measured_costs", counting)
    monkeypatch.setattr(lm_heads, "_COSTS", {})
    torch.manual_seed(0)
    model = TinyLM(V, dropout=0.0)
    tokens = torch.randint(0, V, (8, 96))
    targets = torch.randint(0, V, (8, 96))
    first = memopt.plan(model, tokens, targets, budget=0.6)
    assert len(calls) == 1
    again = memopt.plan(model, tokens, targets, budget=0.6)
    assert len(calls) == 1 and again.heads == first.heads
    memopt.plan(model, tokens[:4], targets[:4], budget=0.6)  # other shapes: measured
    assert len(calls) == 2


def test_a_plan_made_under_a_profiler_is_made_again_outside_it():
    """A step that plans while a profiler records on CPU cannot measure its heads'
    transients or its kernels' workspaces: its estimate of a one-chunk head left out the
    logits the forward makes (a plan 695 KB, the step 1,014 KB, found from outside).
    The estimate counts them now, and as memopt.measure.allocation_peak closes every
    graph is planned again, measured: the plan is then the one a step never profiled
    makes."""
    torch.manual_seed(0)
    model = TinyLM(V, dropout=0.0)
    tokens, targets = _inputs()
    resident = sum(t.untyped_storage().nbytes()
                   for t in (*model.parameters(), tokens, targets))
    plain = memopt.compile(copy.deepcopy(model), budget=0.8)
    _step(plain, tokens, targets)
    profiled = memopt.compile(copy.deepcopy(model), budget=0.8)
    with allocation_peak("cpu"):
        _step(profiled, tokens, targets)  # plans under the profiler: estimated
        estimated = profiled.memopt_plan
    assert not any(w == 0 for h in estimated.heads
                   for w in (h.forward_workspace_bytes,) if h.chunks == 1)
    again = profiled.memopt_plan  # planned again, measured, as the profiler closed
    assert again is not estimated
    assert again.predicted_peak_bytes == plain.memopt_plan.predicted_peak_bytes
    assert again.heads == plain.memopt_plan.heads
    profiled.zero_grad(set_to_none=True)
    measured = _allocated(profiled, tokens, targets, resident)
    assert measured <= again.budget_bytes, (measured, again.budget_bytes)


def test_a_short_heads_chunks_are_priced_as_chunks():
    """A head of 64 rows: its costs were measured at 16 and 64 rows, and 64 rows run the
    one-chunk path (in place), so a 32-row chunk was priced at half what it holds (two
    (32, V) buffers in its backward); the step measured 2-3% over its budget on two MoE
    models, found from outside. Every budget accepted between memopt's minimum and the
    no-budget plan now holds, whatever chunk it takes."""
    torch.manual_seed(0)
    model = TinyLM(V, dropout=0.0)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, V, (2, 32), generator=g)
    targets = torch.randint(0, V, (2, 32), generator=g)
    resident = sum(t.untyped_storage().nbytes()
                   for t in (*model.parameters(), tokens, targets))
    top = memopt.plan(model, tokens, targets).predicted_peak_bytes
    with pytest.raises(BudgetError) as err:
        memopt.plan(model, tokens, targets, budget=1)
    low = err.value.minimum_bytes
    chunks = set()
    for k in range(5):
        budget = low + (top - low) * k // 5
        compiled = memopt.compile(copy.deepcopy(model), budget=budget)
        _step(compiled, tokens, targets)
        measured = _allocated(compiled, tokens, targets, resident)
        chunks.update(h.chunks for h in compiled.memopt_plan.heads)
        assert measured <= budget, (k, measured, budget, compiled.memopt_plan.heads)
    assert 2 in chunks, chunks  # a 32-row chunk was chosen at least once


class _AutocastInside(torch.nn.Module):
    """A classifier and its loss under an autocast region the forward enters itself."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.fc = torch.nn.Linear(32, 64), torch.nn.Linear(64, 10)

    def forward(self, x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.cross_entropy(self.fc(torch.relu(self.l1(x))), y)


def test_a_head_under_autocast_the_forward_enters_keeps_eagers_float32_loss():
    """The head pass saw only autocast around the call: under a region the forward
    enters itself, its op computed the loss in bfloat16 (2.328125 against eager's
    2.32652), found from outside. It now reads dynamo's autocast nodes: eager's loss and
    gradients, exactly."""
    torch.manual_seed(0)
    model = _AutocastInside()
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    budget = int(1.1 * memopt.plan(model, x, y).predicted_peak_bytes)  # binds the head
    compiled = memopt.compile(copy.deepcopy(model), budget=budget)
    got, want = compiled(x, y), model(x, y)
    assert compiled.memopt_plan.heads, "the classifier runs as memopt's head op"
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    got.backward()
    want.backward()
    for p, q in zip(compiled.parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
