"""Random ops whose values nothing uses (passes/dead_draws.py).

Eager draws for them; AOTAutograd removed them, so every later dropout drew another mask:
HF CANINE's classifier (its character branch, with four dropouts, unused) had another loss
and 52 other gradients at every budget, as under torch.compile (found from outside).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt
from memopt.measure import allocation_peak
from support import check_matches_eager


class _UnusedDraws(nn.Module):
    """A dropout, a rand_like, a randn_like and a bernoulli whose results are thrown
    away, between the layers of a small MLP with dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 4)

    def forward(self, x):
        h = torch.relu(self.a(x))
        F.dropout(h, 0.5, True)               # unused: eager still draws
        torch.rand_like(h)
        h = F.dropout(torch.relu(self.b(h)), 0.2, self.training)
        torch.randn_like(h)
        torch.bernoulli(torch.sigmoid(h))
        return F.dropout(self.c(h), 0.3, self.training).square().mean()


@pytest.mark.parametrize("budget", [None, 0.8], ids=["no-budget", "0.8"])
def test_unused_random_ops_draw_as_in_eager(budget):
    """Eager's loss, gradients and generator state after the step; under a budget that
    recomputes, the measured peak within it."""
    torch.manual_seed(0)
    eager = _UnusedDraws()
    model = copy.deepcopy(eager)
    compiled = memopt.compile(model, budget=budget)
    x = torch.randn(128, 32)
    torch.manual_seed(5)
    compiled(x).backward()  # capture and plan
    model.zero_grad(set_to_none=True)
    resident = sum(p.untyped_storage().nbytes() for p in model.parameters()) \
        + x.untyped_storage().nbytes()
    torch.manual_seed(1)
    with allocation_peak("cpu") as seen:
        loss = compiled(x)
        loss.backward()
    after = torch.rand(4)
    torch.manual_seed(1)
    want = eager(x)
    want.backward()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(after, torch.rand(4))
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    if budget is not None:
        assert seen.peak + resident <= compiled.memopt_plan.budget_bytes


@pytest.mark.parametrize("budget", [None, 0.8], ids=["no-budget", "0.8"])
def test_accumulated_steps_with_unused_draws_match_eager(budget):
    """Three steps adding into kept `.grad` (the later steps are planned apart): every
    dropout's mask, so every loss and accumulated gradient, is eager's."""
    check_matches_eager(_UnusedDraws, lambda: (torch.randn(128, 32),), budget=budget,
                        steps=3, accumulate=True)


class _BrokenWithDropout(nn.Module):
    """Dropout on both sides of a graph break: two graphs, each planned again after the
    first step (outside dynamo's compilation), where the backward kept a dead dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 256), nn.Linear(256, 256), nn.Linear(256, 4)

    def forward(self, x):
        h = F.dropout(F.gelu(self.a(x)), 0.2, self.training)
        torch._dynamo.graph_break()
        h = F.dropout(F.gelu(self.b(h)), 0.2, self.training)
        return self.c(h)


@pytest.mark.parametrize("budget", [None, 0.9], ids=["no-budget", "0.9"])
def test_a_plan_made_again_draws_as_eager(budget):
    """Each step leaves the generator where eager's leaves it (check_matches_eager), and
    a loop seeded once gets eager's losses at every step: the second step's plan was made
    outside dynamo, and its backward drew a dead dropout (found from outside)."""
    check_matches_eager(_BrokenWithDropout, lambda: (torch.randn(256, 32),), budget=budget,
                        steps=3)
    torch.manual_seed(0)
    eager = _BrokenWithDropout()
    model = copy.deepcopy(eager)
    compiled = memopt.compile(model, budget=budget)
    losses = {}
    for name, module in (("eager", eager), ("memopt", compiled)):
        torch.manual_seed(1)  # once: every later mask depends on every earlier draw
        losses[name] = []
        for _ in range(4):
            loss = module(torch.randn(256, 32)).square().mean()
            loss.backward()
            losses[name].append(loss.item())
    assert losses["memopt"] == pytest.approx(losses["eager"], rel=1e-6), losses
