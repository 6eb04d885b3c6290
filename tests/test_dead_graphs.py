"""Graphs of a forward whose autograd node is freed before the step's backward.

A graph whose outputs nothing the loss reaches depends on (HF Encodec's encoder, whose
output the quantizer turns into integer codes with an argmax) has its autograd node, and
the tensors it saved for a backward that never runs, freed as soon as its outputs are.
memopt counted them held by every later graph: Encodec's no-budget prediction was
1.65-1.81x its measurement, and this model's 1.90x (found from outside). A run whose
compiled node is freed now holds nothing for the graphs after it
(memopt.steps.GraphRun.alive, graph_breaks.need_of).
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

import memopt
from memopt.measure import allocation_peak
from memopt.recurrent import ops


class _Codes(nn.Module):
    """Encodec in small: a convolution and an LSTM encode, an argmax quantizes (no
    gradient flows back past it), an embedding and another LSTM decode."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.lstm1 = nn.Conv1d(1, 32, 4, stride=4), nn.LSTM(32, 32, 2)
        self.book, self.lstm2 = nn.Embedding(64, 32), nn.LSTM(32, 32, 2)

    def encode(self, x):
        h = self.lstm1(self.enc(x).permute(2, 0, 1))[0]
        torch._dynamo.graph_break()
        return (h @ self.book.weight.t()).argmax(-1)

    def forward(self, x):
        return self.lstm2(self.book(self.encode(x)))[0].pow(2).mean()


def _measured(model: nn.Module, x: torch.Tensor, budget: object) -> tuple[nn.Module, int]:
    compiled = memopt.compile(model, budget=budget)
    compiled(x).backward()  # capture and plan
    model.zero_grad(set_to_none=True)
    resident = sum(t.untyped_storage().nbytes() for t in (*model.parameters(), x))
    with allocation_peak("cpu") as seen:
        compiled(x).backward()
    return compiled, seen.peak + resident


@pytest.mark.parametrize("budget", [None, "minimum"])
def test_a_graph_no_gradient_reaches_holds_nothing_for_the_graphs_after_it(budget):
    """No budget: predicted within 10% above the measurement (1.90x before, the encoder's
    chain counted held through the decoder); at the minimum memopt names: held. Eager's
    gradients (None for the encoder's parameters) either way."""
    torch.manual_seed(0)
    eager = _Codes()
    x = torch.randn(4, 1, 512)
    if budget == "minimum":
        with pytest.raises(memopt.BudgetError) as refused:
            _measured(copy.deepcopy(eager), x, 0.05)
        budget = refused.value.minimum_bytes
        del refused
        gc.collect()
        # the refused step's error, kept to raise again at the next call, once kept its
        # traceback: that step's frames, and the encoder chain's stashed run, for good
        assert not ops._STASH
    model = copy.deepcopy(eager)
    compiled, measured = _measured(model, x, budget)
    plan = compiled.memopt_plan
    assert measured <= plan.predicted_peak_bytes <= 1.10 * measured
    if budget is not None:
        assert measured <= plan.budget_bytes
    eager(x).backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, msg=name)
