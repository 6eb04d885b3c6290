"""Recurrent chains (Gruslys et al. 2016) executed: the executor, the chain ops, and
nn.LSTM / nn.GRU / nn.RNN / marked cell loops inside memopt.compile.

The solver's own tests (the paper's equations and boundary conditions, checked
against an independent brute force) are in test_recurrent_solver.py.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

import memopt
from memopt.recurrent import ChainStats, run_chain, solve
from memopt.recurrent import ops
from memopt.recurrent.modules import ChainedRNN, Recurrent
from support import LanguageModel

T = 11


class MinimalGRU(nn.Module):
    """A custom cell: not a torch cell, two parameters, a tanh and a sigmoid."""

    def __init__(self, n_in: int, n_h: int) -> None:
        super().__init__()
        self.w = nn.Linear(n_in + n_h, 2 * n_h)

    def forward(self, x, h):
        z, c = self.w(torch.cat([x, h], -1)).chunk(2, -1)
        z = torch.sigmoid(z)
        return (1 - z) * h + z * torch.tanh(c)


def _cell_step(cell):
    names = [n for n, _ in cell.named_parameters()]

    def step(params, state, x):
        arg = state if len(state) > 1 else state[0]
        new = torch.func.functional_call(cell, dict(zip(names, params)), (x, arg))
        new = tuple(new) if isinstance(new, tuple) else (new,)
        return new[0], new
    return step


CELLS = {
    "lstm": lambda: (nn.LSTMCell(5, 7), 2),
    "gru": lambda: (nn.GRUCell(5, 7), 1),
    "custom": lambda: (MinimalGRU(5, 7), 1),
}


def _full_bptt(cell, xs, state):
    ys = []
    for x in xs:
        new = cell(x, state if len(state) > 1 else state[0])
        state = tuple(new) if isinstance(new, tuple) else (new,)
        ys.append(state[0])
    return ys, state


def _loss(ys, final):
    return sum((y ** 2).sum() * (i + 1) for i, y in enumerate(ys)) + final[-1].sum()


@pytest.mark.parametrize("kind", sorted(CELLS))
@pytest.mark.parametrize("strategy,ms", [("hsm", (1, 2, 3, T)), ("ism", (1, 2, 4, T)),
                                         ("msm", (1, 2, 4, 9, 3 * T))])
def test_executor_gradients_equal_full_bptt(kind, strategy, ms):
    torch.manual_seed(0)
    cell, n_state = CELLS[kind]()
    cell = cell.double()
    xs = torch.randn(T, 3, 5, dtype=torch.double, requires_grad=True)
    state = tuple(torch.randn(3, 7, dtype=torch.double, requires_grad=True)
                  for _ in range(n_state))
    params = list(cell.parameters())
    ref = torch.autograd.grad(_loss(*_full_bptt(cell, xs.unbind(0), state)),
                              [xs, *state, *params])
    kw = {"alpha": 3, "beta": 2} if strategy == "msm" else {}
    for m in ms:
        policy = solve(T, m, strategy, **kw)
        stats = ChainStats()
        ys, final = run_chain(_cell_step(cell), state, xs.unbind(0), policy, params=params,
                              stats=stats)
        got = torch.autograd.grad(_loss(ys, final), [xs, *state, *params])
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b)
        assert stats.forward_steps == policy.cost, (strategy, m)
        assert stats.peak_units <= m, (strategy, m)


def test_executor_replays_dropout_masks():
    """A recomputed step draws the same dropout mask as its first run: a policy that
    recomputes gives the gradients of one that stores everything, same seed."""
    torch.manual_seed(0)
    cell = nn.GRUCell(4, 6).double()
    names = [n for n, _ in cell.named_parameters()]

    def step(params, state, x):
        h = torch.func.functional_call(cell, dict(zip(names, params)), (x, state[0]))
        return nn.functional.dropout(h, 0.5), (nn.functional.dropout(h, 0.2),)

    xs = torch.randn(T, 2, 4, dtype=torch.double)
    h0 = (torch.zeros(2, 6, dtype=torch.double),)
    grads = []
    for m in (T, 1, 3):
        torch.manual_seed(7)
        ys, final = run_chain(step, h0, xs.unbind(0), solve(T, m), params=list(cell.parameters()))
        after = torch.rand(())  # the caller's RNG stream continues as without recomputation
        grads.append((torch.autograd.grad(_loss(ys, final), list(cell.parameters())), after))
    for g, after in grads[1:]:
        for a, b in zip(g, grads[0][0]):
            torch.testing.assert_close(a, b)
        assert after == grads[0][1]


def test_executor_rejects_mismatched_policy():
    cell = nn.GRUCell(2, 2)
    with pytest.raises(ValueError, match="policy is for 5 steps"):
        run_chain(_cell_step(cell), (torch.zeros(1, 2),), torch.zeros(3, 1, 2).unbind(0),
                  solve(5, 2), params=list(cell.parameters()))


RNNS = {
    "lstm2": lambda: nn.LSTM(4, 6, num_layers=2),
    "lstm_proj_bf": lambda: nn.LSTM(4, 6, proj_size=3, batch_first=True),
    "gru2": lambda: nn.GRU(4, 6, num_layers=2),
    "rnn_relu": lambda: nn.RNN(4, 6, nonlinearity="relu"),
}


@pytest.mark.parametrize("kind", sorted(RNNS))
def test_chain_ops_equal_the_fused_module(kind):
    """Chunks of the fused kernel, under HSM policies down to m = 1, give nn.LSTM's
    outputs and gradients (float64: exact up to summation order)."""
    torch.manual_seed(0)
    rnn = RNNS[kind]().double()
    wrapped = ChainedRNN(rnn)
    x = torch.randn(2, 9, 4, dtype=torch.double) if rnn.batch_first else \
        torch.randn(9, 2, 4, dtype=torch.double)
    x.requires_grad_()
    y, hidden = rnn(x)
    hidden = hidden if isinstance(hidden, tuple) else (hidden,)
    loss = (y ** 2).sum() + sum(h.sum() for h in hidden)
    ref = torch.autograd.grad(loss, [x, *rnn.parameters()])
    params = [getattr(wrapped, n) for n in wrapped.weight_names]
    h0 = [torch.zeros_like(h) for h in hidden]
    for chunk, m in ((9, 1), (3, 1), (2, 2), (1, 1), (1, 9)):
        out = torch.ops.memopt.chain_fwd(wrapped.chain_id, chunk, m, "hsm", True, h0, x, params)
        torch.testing.assert_close(out[0], y)
        loss = (out[0] ** 2).sum() + sum(h.sum() for h in out[1:-1])
        got = torch.autograd.grad(loss, [x, *rnn.parameters()])
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b)
        t = -(-9 // chunk)
        assert ops.LAST_STATS[wrapped.chain_id].forward_steps == solve(t, min(m, t)).cost
    assert not ops._STASH


def test_unused_chain_state_is_released():
    """A forward whose backward never runs leaves nothing in the side table."""
    wrapped = ChainedRNN(nn.GRU(3, 4))
    params = [getattr(wrapped, n) for n in wrapped.weight_names]
    x = torch.randn(6, 2, 3)
    out = torch.ops.memopt.chain_fwd(wrapped.chain_id, 2, 2, "hsm", True,
                                     [torch.zeros(1, 2, 4)], x, params)
    assert len(ops._STASH) == 1
    del out
    gc.collect()
    assert not ops._STASH


def _grads(model, *args):
    loss = model(*args)
    return loss, torch.autograd.grad(loss, list(model.parameters()))


@pytest.mark.parametrize("rnn", [lambda: nn.LSTM(16, 32, num_layers=2),
                                 lambda: nn.GRU(16, 32)])
def test_compile_chains_rnn_under_a_budget(rnn):
    """memopt.compile finds the RNN, splits it into a chain when the budget binds,
    and gives eager's loss and gradients (fp32: bias gradients are summed chunk by
    chunk, so the tolerance is fp32 summation-order, rtol 1e-4)."""
    torch.manual_seed(0)
    model = LanguageModel(rnn())
    tokens, targets = torch.randint(0, 50, (128, 32)), torch.randint(0, 50, (128, 32))
    ref_loss, ref = _grads(model, tokens, targets)
    free = memopt.compile(model)
    loss, got = _grads(free, tokens, targets)
    (chain,) = free.memopt_plan.chains
    assert (chain.t, chain.recompute_steps) == (1, 0)
    tight = memopt.compile(model, budget=int(0.92 * free.memopt_plan.predicted_peak_bytes))
    loss2, got2 = _grads(tight, tokens, targets)
    plan = tight.memopt_plan
    (chain,) = plan.chains
    assert chain.t > 1 and chain.recompute_steps > 0, chain
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    stats = ops.LAST_STATS[max(ops.LAST_STATS)]
    assert stats.forward_steps == chain.cost  # the stored states were used, not rebuilt
    for a, b in zip((loss, loss2), (ref_loss, ref_loss)):
        torch.testing.assert_close(a, b)
    for g in (got, got2):
        for a, b in zip(g, ref):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert "chain rnn" in plan.summary()
    assert not ops._STASH


def test_compiled_rnn_trains_and_evaluates():
    """Several optimizer steps, then eval under no_grad (an inference graph: nothing
    kept), then training again; the user's model is not modified."""
    torch.manual_seed(0)
    model = LanguageModel(nn.LSTM(16, 32, dropout=0.0, num_layers=2))
    twin = LanguageModel(nn.LSTM(16, 32, num_layers=2))
    twin.load_state_dict(model.state_dict())
    compiled = memopt.compile(model, budget=0.92)
    opt_a = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(twin.parameters(), lr=0.1)
    tokens, targets = torch.randint(0, 50, (128, 32)), torch.randint(0, 50, (128, 32))
    for _ in range(3):
        for m, opt in ((compiled, opt_a), (twin, opt_b)):
            opt.zero_grad()
            m(tokens, targets).backward()
            opt.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert isinstance(model.rnn, nn.LSTM)
    compiled.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(tokens, targets), twin.eval()(tokens, targets))
    assert not ops._STASH


class MarkedLoop(nn.Module):
    def __init__(self, cell: nn.Module) -> None:
        super().__init__()
        self.loop = Recurrent(cell)
        self.head = nn.Linear(8, 1)

    def forward(self, xs):
        ys, state = self.loop(xs, torch.zeros(xs.shape[1], 8))
        return self.head(ys).square().mean() + state.sum()


def test_compile_marked_cell_loop():
    """A user's cell loop marked with memopt.recurrent.Recurrent is one chain inside
    memopt.compile; a binding budget splits it and keeps eager's gradients."""
    torch.manual_seed(0)
    model = MarkedLoop(MinimalGRU(6, 8))
    xs = torch.randn(64, 4, 6)
    ref_loss, ref = _grads(model, xs)
    free = memopt.compile(model)
    _grads(free, xs)
    tight = memopt.compile(model, budget=int(0.7 * free.memopt_plan.predicted_peak_bytes))
    loss, got = _grads(tight, xs)
    (chain,) = tight.memopt_plan.chains
    assert chain.t > 1 and chain.module_type == "MinimalGRU"
    torch.testing.assert_close(loss, ref_loss)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_chunked_lstm_dropout_is_replayed():
    """nn.LSTM(dropout=p) split into chunks: recomputing a chunk redraws its masks
    exactly, so every m gives the gradients of the policy that stores everything."""
    torch.manual_seed(0)
    rnn = nn.LSTM(4, 6, num_layers=2, dropout=0.5).double().train()
    wrapped = ChainedRNN(rnn)
    params = [getattr(wrapped, n) for n in wrapped.weight_names]
    x = torch.randn(9, 2, 4, dtype=torch.double)
    h0 = [torch.zeros(2, 2, 6, dtype=torch.double)] * 2
    grads = []
    for m in (9, 1, 2):
        torch.manual_seed(3)
        out = torch.ops.memopt.chain_fwd(wrapped.chain_id, 1, m, "hsm", True, h0, x, params)
        grads.append(torch.autograd.grad((out[0] ** 2).sum(), params))
    for g in grads[1:]:
        for a, b in zip(g, grads[0]):
            torch.testing.assert_close(a, b)


class _BatchFirstLM(nn.Module):
    """An embedding, a 2-layer nn.LSTM with batch_first=True, and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        self.lstm = nn.LSTM(32, 48, num_layers=2, batch_first=True)
        self.head = nn.Linear(48, 100)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.emb(ids))[0])


def test_a_batch_first_lstm_runs_under_inductor_with_eager_gradients():
    """nn.LSTM with batch_first=True returns a time-major buffer transposed; as one chunk
    the chain op returns it as it is, and its fake said contiguous: inductor's stride
    check failed at the first step (found from outside). The fakes now give the step's
    layout (recurrent.ops._step_orders)."""
    torch.manual_seed(0)
    eager = _BatchFirstLM()
    compiled = memopt.compile(copy.deepcopy(eager), kernels="inductor")
    ids = torch.randint(0, 100, (2, 24))
    for m in (eager, compiled):
        torch.nn.functional.cross_entropy(m(ids).reshape(-1, 100), ids.reshape(-1)).backward()
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
