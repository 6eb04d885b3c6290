"""memopt.compile with reversible RNNs (MacKay et al. 2018): the stacks
run as two opaque ops, the plan shows them as reversible (no hidden-state slots, the
buffers at their bound), gradients equal eager's, and the allocated bytes stay within
the prediction and the budget."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

import memopt
import memopt.nn
from memopt.nn import ops
from memopt.nn.fixed_point import R_Z
from models import allocated_step
from support import REVERSIBLE
from support import ReversibleRegression



def _forget_everything(rnn) -> None:
    """Forget gates near 0: every step forgets the cap's bits, the buffers' worst case."""
    with torch.no_grad():
        for cell in rnn.cells:
            for gates in cell.gates:
                h = cell.half_size
                gates.bias[:h] = -30.0                    # RevGRU z / RevLSTM f
                if isinstance(cell, memopt.nn.RevLSTMCell):
                    gates.bias[3 * h:4 * h] = -30.0       # RevLSTM p


@pytest.mark.parametrize("dropout", [0.0, 0.4])
@pytest.mark.parametrize("kind", REVERSIBLE)
def test_compiled_gradients_equal_eager(kind, dropout):
    """Eager's loss and gradients; with dropout between the layers, from the same RNG
    state (the same seeds, so the same masks), and the step leaves the caller's RNG
    state where eager's step does (two steps: the first one plans); in eval mode,
    eager's undropped loss."""
    torch.manual_seed(0)
    model = ReversibleRegression(kind, steps=15, dropout=dropout)
    xs = torch.randn(8, 15, 12, requires_grad=True)
    compiled = memopt.compile(model)
    for _ in range(2):
        torch.manual_seed(1)
        loss = model(xs)
        grads = torch.autograd.grad(loss, [xs, *model.parameters()])
        eager_rng = torch.get_rng_state()
        torch.manual_seed(1)
        compiled_loss = compiled(xs)
        compiled_grads = torch.autograd.grad(compiled_loss, [xs, *model.parameters()])
        assert torch.equal(torch.get_rng_state(), eager_rng)
        torch.testing.assert_close(compiled_loss, loss, rtol=0, atol=0)
        for a, b in zip(compiled_grads, grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if dropout:
        model.eval()
        with torch.no_grad():
            undropped = model(xs)
            assert not torch.equal(undropped, loss)
            assert torch.equal(compiled(xs), undropped)


@pytest.mark.parametrize("kind", REVERSIBLE)
def test_plan_shows_a_reversible_stack(kind):
    torch.manual_seed(0)
    model = ReversibleRegression(kind, steps=40, batch=4)
    xs = torch.randn(4, 40, 12)
    plan = memopt.plan(model, xs)
    (rev,) = plan.reversible
    spec = ops.spec_of(model.rnn._stack)
    assert (rev.module, rev.module_type, rev.steps, rev.layers) == (
        "rnn", type(model.rnn).__name__, 40, 2)
    assert not plan.chains
    assert rev.buffer_bound_bytes == ops.buffer_bound_bytes(spec, 40, 4)
    assert rev.held_bytes == rev.buffer_bound_bytes + ops.state_bytes(spec, 4)
    # cap 3: 18 steps a word, 3 levels for 40 steps; plain BPTT stores 4 bytes a unit a step
    units = 4 * 16 * spec.n_halves * 2
    assert rev.buffer_bound_bytes == 3 * units * 8
    assert rev.stored_state_bytes == 40 * units * 4
    assert rev.workspace_bytes > 0 and rev.forward_workspace_bytes > 0
    assert "reversible rnn" in plan.summary() and "no hidden-state slots" in plan.summary()


@pytest.mark.parametrize("cap", [1, 2, 3, 5, None])
@pytest.mark.parametrize("steps", [1, 5, 19, 60])
def test_buffer_bound_holds_and_is_reached(cap, steps):
    """The bound (ops.buffer_bound_bytes) is never exceeded, and when every step forgets
    the cap's bits the buffers come within one level of words of it (a word fills a
    little slower than the bound's c bits a step: h(0) = 0 gives the first step's
    multiplication nothing to store)."""
    torch.manual_seed(steps)
    rnn = memopt.nn.RevGRU(3, 8, max_forget_bits=cap)
    xs = torch.randn(steps, 2, 3)
    bound = ops.buffer_bound_bytes(ops.spec_of(rnn._stack), steps, 2)
    rnn(xs)
    assert rnn.buffer_size.nbytes <= bound
    _forget_everything(rnn)
    with torch.no_grad():
        rnn.cells[0].gates[0].weight.zero_()
        rnn.cells[0].gates[1].weight.zero_()
    rnn(xs * 10)
    assert rnn.buffer_size.nbytes <= bound
    level = rnn.buffer_size.units * 8
    assert bound - rnn.buffer_size.nbytes <= level, (rnn.buffer_size, bound)
    if steps >= 3 * ((63 - R_Z) // (cap or R_Z) + 1):
        assert rnn.buffer_size.nbytes >= 3 * level


# The default suite measures one reversible cell with dropout; the rest under -m slow
# (lstm-0.0: 18 s on 2 cores).
@pytest.mark.parametrize(("kind", "dropout"), [pytest.param("gru", 0.0, marks=pytest.mark.slow),
                                             pytest.param("lstm", 0.0, marks=pytest.mark.slow),
                                             ("gru", 0.3)])
def test_measured_allocations_within_prediction_and_budget(kind, dropout):
    """The allocated peak of a compiled step is at most the predicted peak, and within
    10% of it when the buffers reach their bound; a budget above memopt's minimum is
    honored. With dropout the masks are rebuilt a step at a time, not held."""
    torch.manual_seed(0)
    model = ReversibleRegression(kind, steps=120, batch=16, dropout=dropout)
    _forget_everything(model.rnn)
    xs = torch.randn(16, 120, 12)
    resident = sum(t.untyped_storage().nbytes()
                   for t in (*model.parameters(), *model.buffers(), xs))
    compiled = memopt.compile(model)
    compiled(xs).backward()
    measured = allocated_step(compiled, xs, resident)
    predicted = compiled.memopt_plan.predicted_peak_bytes
    assert measured <= predicted * 1.02, (measured, predicted)
    assert predicted - measured <= 0.10 * measured, (predicted, measured)
    (rev,) = compiled.memopt_plan.reversible
    assert rev.dropout == dropout
    assert ("masks rebuilt from seeds" in compiled.memopt_plan.summary()) == bool(dropout)
    budget = int(predicted / (1 - 0.06)) + 4096
    tight = memopt.compile(model, budget=budget)
    for p in model.parameters():  # plan the step measured below: gradients set to None
        p.grad = None
    tight(xs).backward()
    assert allocated_step(tight, xs, resident) <= budget


def test_copies_compute_with_their_own_parameters():
    torch.manual_seed(0)
    rnn = memopt.nn.RevLSTM(4, 6)
    twin = copy.deepcopy(rnn)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(-1)
    xs = torch.randn(7, 2, 4)
    out, _ = rnn(xs)
    twin_out, _ = twin(xs)
    assert not torch.equal(out, twin_out)
    assert torch.equal(rnn(xs)[0], out)
    assert twin._slot != rnn._slot and twin.buffer_size is not None


def test_forward_without_backward_releases_its_buffers():
    rnn = memopt.nn.RevGRU(3, 4)
    xs = torch.randn(30, 2, 3)
    before = len(ops._STASH)
    with torch.no_grad():
        rnn(xs)
    assert len(ops._STASH) == before            # nothing kept without autograd
    out, h_n = rnn(xs)
    assert len(ops._STASH) == before + 1        # kept for backward
    del out, h_n
    gc.collect()
    assert len(ops._STASH) == before            # freed with the graph
    out, _ = rnn(xs)
    out.sum().backward()
    assert len(ops._STASH) == before            # consumed by backward


def test_memopt_nn_is_an_attribute():
    import importlib
    assert importlib.import_module("memopt").nn is memopt.nn


class _Autocast(nn.Module):
    """A linear layer, a reversible stack and a head, the forward under bf16 autocast."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin, self.rnn, self.head = nn.Linear(6, 6), REVERSIBLE[kind](6, 8), nn.Linear(8, 2)

    def forward(self, xs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, _ = self.rnn(self.lin(xs))
            return self.head(out).float().square().mean()


@pytest.mark.parametrize("kind", REVERSIBLE)
def test_autocast_runs_the_stack_in_its_parameters_dtype(kind):
    """Under autocast the input is cast to the parameters' dtype and the ops turn
    autocast off, so the backward's gates equal the forward's (else the reversal check
    raises); compiled equals eager."""
    torch.manual_seed(0)
    model = _Autocast(kind)
    xs = torch.randn(9, 3, 6)
    loss = model(xs)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    compiled_loss = memopt.compile(model)(xs)
    compiled_grads = torch.autograd.grad(compiled_loss, list(model.parameters()))
    assert torch.equal(loss, compiled_loss)
    for a, b in zip(compiled_grads, grads):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)


class _Mixed(nn.Module):
    """Two reversible stacks around an nn.LSTM (a Gruslys chain), an initial state given."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.rev_lstm = memopt.nn.RevLSTM(16, 24, num_layers=2)
        self.lstm = nn.LSTM(24, 24)
        self.rev_gru = memopt.nn.RevGRU(24, 8)
        self.head = nn.Linear(8, 50)

    def forward(self, tokens, targets, hx):
        out, (h, c) = self.rev_lstm(self.emb(tokens), hx)
        out, _ = self.rev_gru(self.lstm(out)[0])
        loss = nn.functional.cross_entropy(self.head(out).flatten(0, 1), targets.flatten())
        return loss + h.square().mean() + c.square().mean()


def test_mixed_with_a_chain_and_new_lengths():
    """Reversible stacks beside a chain, an initial state that needs its gradient, new
    sequence lengths (planned again): eager's loss and gradients every time."""
    torch.manual_seed(0)
    model = _Mixed()
    compiled = memopt.compile(model)
    for steps in (20, 31):
        tokens, targets = (torch.randint(0, 50, (steps, 3)) for _ in range(2))
        hx = tuple(torch.randn(2, 3, 24, requires_grad=True) for _ in range(2))
        wrt = [*hx, *model.parameters()]
        loss = model(tokens, targets, hx)
        grads = torch.autograd.grad(loss, wrt)
        compiled_loss = compiled(tokens, targets, hx)
        compiled_grads = torch.autograd.grad(compiled_loss, wrt)
        assert torch.equal(loss, compiled_loss)
        for a, b in zip(compiled_grads, grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        plan = compiled.memopt_plan
        assert [(r.module, r.steps) for r in plan.reversible] == [
            ("rev_lstm", steps), ("rev_gru", steps)]
        assert [(c.module, c.steps) for c in plan.chains] == [("lstm", steps)]
