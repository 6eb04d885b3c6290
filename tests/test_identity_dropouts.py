"""Dropouts that return their input (passes/identity_dropouts.py).

`F.dropout(a, p=0.0, training=True)` (HF MPT's attention probabilities) returns `a`
itself in eager; AOTAutograd's decomposition copied it, and the copy was saved beside
`a`: MPT measured 1.18x eager's peak with no budget (found from outside).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from memopt.passes.identity_dropouts import remove_identity_dropouts
from torch import fx, nn

import memopt
from memopt.measure import allocation_peak
from support import check_matches_eager


def _dynamo_graph(f, x: torch.Tensor) -> fx.GraphModule:
    """dynamo's graph of `f` (what memopt's backend is handed)."""
    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(f, backend=keep, fullgraph=True)(x)
    return graphs[0]


def test_only_the_dropouts_that_return_their_input_are_removed():
    def f(x):
        a = F.dropout(x, p=0.0, training=True)
        b = F.dropout3d(a, 0.3, False)
        c = torch.dropout(b, 0.0, True)
        d = nn.Dropout(0.0)(c)
        e = F.alpha_dropout(d)  # training=False by default
        return F.dropout(e, p=0.1, training=True) + F.dropout3d(e.unsqueeze(0))[0]

    x = torch.randn(2, 3, 4, 5)
    gm = _dynamo_graph(f, x)
    assert remove_identity_dropouts(gm) == 5
    left = [n.target for n in gm.graph.nodes if n.op == "call_function"
            and "dropout" in getattr(n.target, "__name__", "")]
    assert left == [F.dropout, F.dropout3d]
    torch.manual_seed(0)
    want = f(x)
    torch.manual_seed(0)
    torch.testing.assert_close(gm(x)[0], want)  # the same random numbers drawn


class _Attention(nn.Module):
    """MPT's attention core: softmax, a dropout of probability 0, a matmul, and a large
    tail so that the peak comes while the saved tensors are alive."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.head = nn.Linear(32, 96), nn.Linear(32, 1000)

    def forward(self, x):
        q, k, v = self.qkv(x).view(4, 64, 3, 4, 8).permute(2, 0, 3, 1, 4)
        a = F.softmax(q @ k.transpose(-1, -2), dim=-1)
        a = F.dropout(a, p=0.0, training=self.training)
        return self.head((a @ v).reshape(4, 64, 32)).relu().sum()


def _peak(run, model: nn.Module, x: torch.Tensor) -> int:
    run(x).backward()
    model.zero_grad(set_to_none=True)
    with allocation_peak("cpu") as seen:
        run(x).backward()
    return seen.peak


@pytest.mark.parametrize("budget", [None, 0.9])
def test_a_dropout_of_probability_zero_keeps_no_copy(budget):
    """memopt with no budget: at or below eager's peak (1.065x before: one copy of the
    probabilities saved); under a budget within it. Eager's gradients."""
    torch.manual_seed(0)
    eager = _Attention()
    x = torch.randn(4, 64, 32)
    model = copy.deepcopy(eager)
    compiled = memopt.compile(model, budget=budget)
    measured = _peak(compiled, model, x)
    if budget is None:
        assert measured <= _peak(eager, eager, x)
    else:
        resident = sum(p.untyped_storage().nbytes() for p in model.parameters()) \
            + x.untyped_storage().nbytes()
        assert measured + resident <= compiled.memopt_plan.budget_bytes
    eager.zero_grad(set_to_none=True)
    eager(x).backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.parametrize("budget", [None, 0.9])
def test_accumulated_steps_with_an_identity_dropout_match_eager(budget):
    """Three steps adding into kept `.grad` (the later steps are planned apart): eager's
    outputs and accumulated gradients at each."""
    check_matches_eager(_Attention, lambda: (torch.randn(4, 64, 32),), budget=budget,
                        steps=3, accumulate=True)
