"""passes.shared_saves: a value the forward computes twice, saved twice by eager, is saved
once (transformers' Pegasus and Marian convert one mask per attention layer: 1.025x
eager's peak with no budget before, docs/limits.md)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memopt
from memopt.measure import allocation_peak
from memopt.passes.shared_saves import duplicates, saved_pairs
from memopt.planner import verifying
from support import check_matches_eager

B, D, L = 1024, 64, 4


class MaskPerLayer(nn.Module):
    """Each layer converts the same boolean mask to floats and multiplies by it, so
    each layer's float copy is saved for the backward (as in Pegasus's attention)."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(L))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = self.drop(torch.tanh(layer(x)) * keep.to(x.dtype))
        return x


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(B, D), torch.rand(B, D) > 0.3


def _mask_bytes() -> int:
    return B * D * 4


def test_each_layers_mask_is_saved_once() -> None:
    torch.manual_seed(0)
    plan = memopt.plan(MaskPerLayer(), *_inputs(), budget=None)
    masks = [s for s in plan.saved if s.op == "aten._to_copy" and s.nbytes]
    assert len(masks) == 1, [(s.name, s.op, s.nbytes) for s in plan.saved]
    assert "saved once for its equals" in masks[0].reason
    assert masks[0].reason.count("_to_copy") == L - 1, masks[0].reason


def test_the_shared_plan_is_below_eagers_peak_by_the_copies() -> None:
    """The measurement, not the plan's word: eager holds L masks, memopt one (its peak
    also holds one product more than eager's, at the step where the backward starts)."""
    torch.manual_seed(0)
    model, inputs = MaskPerLayer(), _inputs()
    compiled = memopt.compile(model, budget=None)
    with allocation_peak("cpu") as eager:
        model(*inputs).sum().backward()
    model.zero_grad(set_to_none=True)
    compiled(*inputs).sum().backward()  # the first step compiles
    model.zero_grad(set_to_none=True)
    with allocation_peak("cpu") as ours:
        compiled(*inputs).sum().backward()
    assert ours.peak <= eager.peak - (L - 2) * _mask_bytes() + _mask_bytes() // 2, (
        ours.peak, eager.peak)


@pytest.mark.parametrize("budget", [None, 0.75])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_gradients_equal_eagers(budget, dropout) -> None:
    check_matches_eager(lambda: MaskPerLayer(dropout), _inputs, budget=budget, steps=2)


def test_accumulated_steps_equal_eagers() -> None:
    check_matches_eager(MaskPerLayer, _inputs, budget=None, steps=3, accumulate=True)


def test_the_simulator_shares_as_the_build_does() -> None:
    """Every candidate the search scores is built too and compared (passes.simulate)."""
    torch.manual_seed(0)
    with verifying():
        for budget in (None, 0.75, 1):  # 1 byte: the whole search, then a BudgetError
            try:
                memopt.plan(MaskPerLayer(0.1), *_inputs(), budget=budget)
            except memopt.BudgetError:
                assert budget == 1


def _joint_of(fn, *inputs):
    graphs = []

    def partition(joint, _inputs, *, num_fwd_outputs, **_):
        graphs.append((joint, num_fwd_outputs))
        from torch._functorch.partitioners import default_partition
        return default_partition(joint, _inputs, num_fwd_outputs=num_fwd_outputs)

    from functorch.compile import aot_function, nop
    aot_function(fn, fw_compiler=nop, partition_fn=partition)(*inputs)[0].sum().backward()
    return graphs[0]


@pytest.mark.parametrize("second, equal", [
    (lambda x: torch.tanh(x) * 2.0, True),              # the same computation
    (lambda x: torch.tanh(x) * 2, False),               # an int, not a float
    (lambda x: torch.tanh(x) * -2.0, False),            # another constant
    (lambda x: torch.nn.functional.dropout(torch.tanh(x), 0.5) * 2.0, False),  # a draw
    (lambda x: torch.tanh(x + 0.0) * 2.0, False),       # another input
])
def test_only_the_same_computation_is_a_duplicate(second, equal) -> None:
    def fn(x):
        return torch.tanh(x) * 2.0 * x, second(x) * x

    joint, n = _joint_of(fn, torch.randn(8, requires_grad=True))
    first = duplicates(joint, n)
    muls = [node.name for node in joint.graph.nodes if node.target is torch.ops.aten.mul.Tensor]
    assert (muls[2] in first and first[muls[2]] == muls[0]) is equal, (first, muls)


def test_only_saved_pairs_are_merged() -> None:
    first = {"b": "a", "c": "a", "e": "d"}
    assert saved_pairs(("a", "b", "c"), first) == {"b": "a", "c": "a"}
    assert saved_pairs(("b", "c", "e"), first) == {"c": "b"}  # the first saved serves
    assert saved_pairs(("a", "d"), first) == {}
