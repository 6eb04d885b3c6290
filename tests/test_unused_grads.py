"""memopt.unused_grads: no zero gradients for the outputs no loss reads (HF Moonshine
with its key/value caches returned measured 1.019x eager's peak with no budget from them;
0.997x now)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import memopt
from memopt.measure import allocation_peak
from support import check_matches_eager

B, D = 512, 256


class ExtraOutputs(nn.Module):
    """A loss and, beside it, outputs no loss reads: a hidden state, its transpose (a view
    AOTAutograd regenerates) and a large product, each a tangent of the compiled graph."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor):
        h = torch.tanh(self.a(x))
        y = self.b(h)
        return y.square().mean(), h, y.t(), torch.cat([h, y] * 4)


def _loss(out) -> torch.Tensor:
    return out[0]


def _inputs() -> tuple[torch.Tensor]:
    return (torch.randn(B, D),)


@pytest.mark.parametrize("budget", [None, 0.985])
def test_gradients_equal_eagers(budget) -> None:
    check_matches_eager(ExtraOutputs, _inputs, budget=budget, steps=2, loss_fn=_loss)


def test_no_zero_gradients_are_allocated_for_unused_outputs() -> None:
    """The measurement: eager allocates none; memopt's step holds what eager holds
    (its outputs, as the loop keeps them) and no (8B, D) zero beside them."""
    torch.manual_seed(0)
    model, (x,) = ExtraOutputs(), _inputs()
    eager = copy.deepcopy(model)
    compiled = memopt.compile(model)
    peaks = {}
    for name, module, owner in (("eager", eager, eager), ("memopt", compiled, model)):
        for _ in range(2):  # the first step plans
            owner.zero_grad(set_to_none=True)
            with allocation_peak("cpu") as seen:
                out = module(x)
                out[0].backward()
            del out
        peaks[name] = seen.peak
    zeros = 8 * B * D * 4  # the concatenation's zero gradient, autograd's before
    assert peaks["memopt"] <= peaks["eager"] + zeros // 8, peaks
    assert compiled.memopt_plan.predicted_peak_bytes >= peaks["memopt"]


class _LSTMHead(nn.Module):
    """An LSTM whose final states are returned and not used: its chain op reads their
    zero gradients, which are then real tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(8, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor):
        out, (h, c) = self.rnn(x)
        return self.head(out).square().mean(), h, c


@pytest.mark.parametrize("budget", [None, 0.7])
def test_a_chain_reading_unused_gradients_equals_eager(budget) -> None:
    check_matches_eager(_LSTMHead, lambda: (torch.randn(4, 24, 8),), budget=budget,
                        steps=2, loss_fn=_loss)


def test_every_output_used_still_equals_eager() -> None:
    def all_of(out):
        return out[0] + out[1].mean() + out[2].sum() * 1e-3 + out[3].mean()

    check_matches_eager(ExtraOutputs, _inputs, budget=None, steps=2, loss_fn=all_of)
