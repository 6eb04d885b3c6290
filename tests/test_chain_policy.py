"""How memopt.compile chooses a recurrent chain's chunks (passes/chains.py): the chunk
lengths, the exact count of recomputed time steps, and the bisection over chunk length
(Gruslys et al. 2016, Sec. 3.1: the last chunk is the core and is never recomputed)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import memopt
from memopt.allocation import allocation_peak
from memopt.allocator.chain import chunk_sizes
from memopt.passes.chains import (ChainSite, ChunkCosts, Linear, configure,
                                  longest_fitting_chunk)
from memopt.recurrent import ops
from models import allocated_step


def _site(steps: int, hidden_bytes: int = 1000) -> ChainSite:
    return ChainSite(fwd="chain_fwd", bwds=("chain_bwd",), chain=0, name="rnn",
                     module_type="LSTM", steps=steps, hidden_bytes=hidden_bytes, step_flops=0,
                     output_bytes_per_step=100, param_bytes=0, unsplittable=False)


def _costs(first: int, per_step: int) -> ChunkCosts:
    """Bytes linear in the chunk length; a call costs 1 ms plus 0.1 ms a step."""
    return ChunkCosts(Linear(first, per_step), Linear(first // 2, per_step // 3),
                      Linear(first, per_step // 2), Linear(1_100_000, 100_000),
                      Linear(1_100_000, 100_000))


@given(steps=st.integers(1, 3000), chunk=st.integers(1, 4000))
def test_chunk_sizes_put_the_remainder_first(steps, chunk):
    sizes = chunk_sizes(steps, chunk)
    full = min(chunk, steps)
    assert sum(sizes) == steps
    assert all(s == full for s in sizes[1:]) and 1 <= sizes[0] <= full
    assert len(sizes) == -(-steps // full)


@settings(max_examples=60, deadline=None)
@given(steps=st.integers(1, 300), chunk=st.integers(1, 300))
def test_recompute_steps_every_boundary_kept(steps, chunk):
    """m = t: every chunk but the last (full) one is run once more: T - L steps."""
    config = configure(_site(steps), _costs(10, 5), chunk, m=steps)
    assert config.m == config.t
    assert config.recompute_steps == steps - min(chunk, steps)


@settings(max_examples=60, deadline=None)
@given(steps=st.integers(1, 300), chunk=st.integers(1, 300), m=st.integers(1, 300))
def test_estimated_time_counts_every_call(steps, chunk, m):
    """C(t, m) chunk forwards and t chunk backwards, each at 1 ms + 0.1 ms a step."""
    config = configure(_site(steps), _costs(10, 5), chunk, m)
    calls = config.policy.cost + config.t
    steps_run = steps + config.recompute_steps + steps
    assert config.seconds == pytest.approx(1e-3 * calls + 1e-4 * steps_run)


@settings(max_examples=60, deadline=None)
@given(steps=st.integers(1, 200), chunk=st.integers(1, 200))
def test_recompute_steps_one_slot(steps, chunk):
    """m = 1 (only h_0 kept): backpropagating chunk k recomputes chunks 0..k-1 from h_0,
    so chunk k runs t - k times in all."""
    config = configure(_site(steps), _costs(10, 5), chunk, m=1)
    sizes = chunk_sizes(steps, chunk)
    t = len(sizes)
    assert config.recompute_steps == sum((t - 1 - k) * s for k, s in enumerate(sizes))


def test_longest_fitting_chunk_bisects_held_bytes():
    """With a limit on the held bytes, the bisection returns the longest chunk whose
    m = t policy fits, checked against every chunk length. (A hidden state much smaller
    than a step's internal state, as in LSTMs: the held bytes then grow with the chunk.)"""
    site, internal = _site(500, hidden_bytes=1), _costs(1000, 300)
    for limit in (20_000, 45_678, 80_001):
        def fits(c, limit=limit):
            return c.held_bytes <= limit

        every = [L for L in range(1, 501) if fits(configure(site, internal, L, 500))]
        got = longest_fitting_chunk(site, internal, fits, 1, 500)
        assert got is not None and got.chunk == max(every), (limit, got.chunk, max(every))
    assert longest_fitting_chunk(site, internal, lambda c: c.chunk <= 7, 7, 8) is None


class _LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.rnn = nn.LSTM(16, 32, num_layers=2)
        self.head = nn.Linear(32, 50)

    def forward(self, tokens, targets):
        y, _ = self.rnn(self.embed(tokens))
        return nn.functional.cross_entropy(self.head(y).flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("fraction", [0.9, 0.75])
def test_uneven_chunks_keep_eager_gradients(fraction):
    """A prime sequence length (no chunk divides it) under binding budgets: the plan's
    chunks, the remainder first, give eager's loss and gradients, and the plan's count
    of recomputed steps is the executor's."""
    torch.manual_seed(0)
    model = _LM()
    tokens, targets = torch.randint(0, 50, (97, 16)), torch.randint(0, 50, (97, 16))
    loss = model(tokens, targets)
    ref = torch.autograd.grad(loss, list(model.parameters()))
    free = memopt.plan(model, tokens, targets)
    compiled = memopt.compile(model, budget=int(fraction * free.predicted_peak_bytes))
    got_loss = compiled(tokens, targets)
    got = torch.autograd.grad(got_loss, list(model.parameters()))
    (chain,) = compiled.memopt_plan.chains
    assert chain.t > 1 and chain.recompute_steps > 0, chain
    assert compiled.memopt_plan.predicted_peak_bytes <= compiled.memopt_plan.budget_bytes
    stats = ops.LAST_STATS[max(ops.LAST_STATS)]
    assert stats.forward_steps == chain.cost
    torch.testing.assert_close(got_loss, loss)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


class _Regression(nn.Module):
    """An LSTM and the MSE of its outputs, the loss inside forward (planned with it)."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.rnn = nn.LSTM(32, 64)
        self.register_buffer("target", torch.randn(steps, 16, 64), persistent=False)

    def forward(self, xs):
        return nn.functional.mse_loss(self.rnn(xs)[0], self.target)


@pytest.mark.parametrize("fraction", [0.6, 0.35])
def test_measured_allocations_stay_within_the_budget(fraction):
    """The allocated bytes of a step (what a budget counts and a GPU charges) stay
    within budgets that bind the chain, and the plan predicts them within 10%: the
    chain's model counts its kernels' temporaries (ChunkCosts.forward / backward)."""
    torch.manual_seed(0)
    model = _Regression(120)
    xs = torch.randn(120, 16, 32)
    resident = sum(t.untyped_storage().nbytes()
                   for t in (*model.parameters(), *model.buffers(), xs))
    fixed = resident + sum(p.numel() * 4 for p in model.parameters())
    eager = allocated_step(model, xs, resident)
    budget = fixed + int(fraction * (eager - fixed))
    compiled = memopt.compile(model, budget=budget)
    for p in model.parameters():  # plan the step measured below: gradients set to None
        p.grad = None
    compiled(xs).backward()  # compiles and plans (not under a profiler: they do not nest)
    measured = allocated_step(compiled, xs, resident)
    plan = compiled.memopt_plan
    (chain,) = plan.chains
    assert chain.t > 1, chain
    assert measured <= budget, (measured, budget)
    assert abs(plan.predicted_peak_bytes - measured) <= 0.10 * measured, (
        plan.predicted_peak_bytes, measured)


def test_allocation_peak_counts_bytes_handed_out():
    with allocation_peak("cpu") as seen:
        a = torch.empty(1 << 20)           # 4 MiB, never written
        b = torch.empty(1 << 18)           # 1 MiB more: 5 MiB at once
        del a
    assert seen.peak == 5 << 20 and seen.end == 1 << 20
    del b
