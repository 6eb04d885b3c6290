"""Values laid out as their kernels lay them out (passes/runtime_layouts.py).

On CPU, BatchNorm's forward and backward kernels return contiguous outputs for a
transposed input where their FakeTensors keep the input's strides. A view traced after
them then copies at runtime (passes.runtime_views runs views as reshapes), and the copy
was in no plan: random models with a BatchNorm over a transposed input measured up to
1.045x the budgets memopt accepted, HF PatchTST 24,116 bytes over its prediction at every
budget (found from outside). These tests check the pass on a traced graph and the budget
of a step through such a BatchNorm.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from memopt.passes.runtime_layouts import restore_runtime_layouts
from memopt.passes.workspace import WorkspaceCache
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import memopt
from memopt.measure import allocation_peak


def _norm_then_reshape(x, w, b):
    h = F.batch_norm(x.transpose(1, 2), None, None, w, b, training=True).transpose(1, 2)
    return h.reshape(-1, 8) * 2


def _views(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target is torch.ops.aten.view.default]


def test_a_view_after_a_kernel_laid_out_otherwise_reads_a_counted_copy():
    """The BatchNorm's value takes the kernel's contiguous strides, the view after its
    transpose reads a clone (a value liveness counts), and the graph computes what the
    function does."""
    x, w, b = torch.randn(2, 25, 8), torch.randn(8), torch.randn(8)
    gm = make_fx(_norm_then_reshape, tracing_mode="fake")(x, w, b)
    norm = next(n for n in gm.graph.nodes if "batch_norm" in str(n.target))
    assert not norm.meta["val"][0].is_contiguous()  # as traced: the input's strides
    result = restore_runtime_layouts(gm, WorkspaceCache())
    assert (result.relaid, result.copies) == (1, 1)
    assert norm.meta["val"][0].is_contiguous()
    (view,) = _views(gm)
    assert view.args[0].target is torch.ops.aten.clone.default
    torch.testing.assert_close(gm(x, w, b), _norm_then_reshape(x, w, b))
    again = restore_runtime_layouts(gm, WorkspaceCache())
    assert (again.relaid, again.copies) == (0, 0)  # the graph now says what runs


def test_a_graph_laid_out_as_traced_is_left_as_it_is():
    def f(x, w):
        return (x.transpose(1, 2) @ w).reshape(-1, 8)

    gm = make_fx(f, tracing_mode="fake")(torch.randn(2, 8, 25), torch.randn(8, 8))
    code = gm.code
    assert restore_runtime_layouts(gm, WorkspaceCache()).relaid == 0
    assert gm.code == code


class _NormOverTime(nn.Module):
    """A BatchNorm over a transposed sequence, then a reshape into a convolution (the
    random model that measured 1.045x its budget)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.conv = nn.Conv2d(8, 8, 1)
        self.head = nn.Linear(8, 10)

    def forward(self, x, y):
        h = self.bn(torch.tanh(self.inp(x)).transpose(1, 2)).transpose(1, 2)
        h = self.conv(h.transpose(1, 2).reshape(2, 8, 5, 5)).flatten(2).transpose(1, 2)
        return F.cross_entropy(self.head(h[:, -1]), y)


def _captured(model: nn.Module, x: torch.Tensor, y: torch.Tensor, budget: object) -> nn.Module:
    """`model` compiled under `budget`, its first step (capture and plan) taken."""
    compiled = memopt.compile(model, budget=budget)
    torch.manual_seed(1)
    compiled(x, y).backward()
    return compiled


def _check_step(make: Any, x: torch.Tensor, y: torch.Tensor, budget: float) -> None:
    """A step of `make()` compiled at `budget` (or at the minimum memopt names where
    that is below it) measures within 1% of its prediction and under its budget, with
    eager's gradients."""
    torch.manual_seed(31)
    eager = make()
    model = copy.deepcopy(eager)
    resident = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in (*model.parameters(), *model.buffers(), x, y)}.values())
    try:
        compiled = _captured(model, x, y, budget)
    except memopt.BudgetError as err:  # per-thread buffers: the minimum follows threads
        model = copy.deepcopy(eager)
        compiled = _captured(model, x, y, err.minimum_bytes)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with allocation_peak("cpu") as seen:
        compiled(x, y).backward()
    plan = compiled.memopt_plan
    measured = seen.peak + resident
    assert measured <= plan.budget_bytes
    assert abs(measured - plan.predicted_peak_bytes) <= 0.01 * plan.predicted_peak_bytes
    torch.manual_seed(1)
    eager(x, y).backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_a_step_through_a_norm_over_a_transposed_input_keeps_its_budget():
    """Measured 9,808 bytes against an accepted 9,382 (1.045x) and 17% over the
    prediction before the pass (at one thread)."""
    torch.manual_seed(1234)
    _check_step(_NormOverTime, torch.randn(2, 25, 8), torch.randint(0, 10, (2,)), 0.95)


def test_an_output_takes_the_storage_its_kernel_allocates():
    """CPU's `col2im` (nn.Unfold's backward) allocates its output as `empty_like` of its
    input, then resizes it smaller: a (4, 16, 16, 1) result on a 20,480-byte storage where
    the FakeTensor says 4,096. HF ConvBERT's step measured 1.036x the minimum memopt named
    (found from outside); the value now has the kernel's storage."""
    grad = torch.zeros(4, 16, 80).transpose(1, 2)

    def f(g):
        return torch.ops.aten.col2im.default(g, [16, 1], [5, 1], [1, 1], [2, 0], [1, 1]) * 2

    gm = make_fx(f, tracing_mode="fake")(grad)
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.col2im.default)
    assert node.meta["val"].untyped_storage().nbytes() == 4 * 16 * 16 * 4
    restore_runtime_layouts(gm, WorkspaceCache())
    assert node.meta["val"].untyped_storage().nbytes() == 4 * 80 * 16 * 4
    assert node.meta["val"].shape == (4, 16, 16, 1)


class _SpanConv(nn.Module):
    """ConvBERT's span-based convolution in small: an nn.Unfold over a transposed
    sequence, whose backward is `col2im` (the model that measured 1.036x its budget)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 16)
        self.unfold = nn.Unfold(kernel_size=(5, 1), padding=(2, 0))
        self.mix = nn.Linear(80, 32)
        self.head = nn.Linear(32, 3)

    def forward(self, x, y):
        h = self.inp(x).transpose(1, 2).unsqueeze(-1)         # (B, 16, S, 1)
        h = self.unfold(h).transpose(1, 2)                    # (B, S, 80)
        h = torch.tanh(self.mix(h))
        return F.cross_entropy(self.head(h.mean(1)), y)


def test_a_step_through_an_unfold_keeps_its_budget():
    """Measured 1.26x its budget before (the col2im's storage counted as its result's)."""
    _check_step(_SpanConv, torch.randn(4, 64, 32), torch.randint(0, 3, (4,)), 0.9)


class _ConvOverTokens(nn.Module):
    """A random model (the outside fuzzer's seed 160): its second Conv2d's input is a
    transposed sequence reshaped into an image, laid out channels-last, and so is the
    weight gradient of its first, which AccumulateGrad copies into the weight's layout
    (measured 1.0198x the minimum memopt named)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb1, self.pos2, self.emb3 = (nn.Embedding(300, 32), nn.Embedding(16, 32),
                                           nn.Embedding(300, 32))
        self.c2d4 = nn.Conv2d(32, 16, 3, padding=1)
        self.lin5 = nn.Linear(16, 24, bias=False)
        self.drop6 = nn.Dropout(0.1)
        self.ra7, self.rb8 = nn.Linear(24, 48), nn.Linear(48, 24)
        self.gn9 = nn.GroupNorm(4, 24)
        self.ip10 = nn.Linear(24, 24)
        self.c2d11 = nn.Conv2d(24, 32, 1, padding=0)
        self.lin12 = nn.Linear(32, 64, bias=True)
        self.emb13 = nn.Embedding(300, 64)
        self.head14 = nn.Linear(64, 5)

    def forward(self, x, y):
        h = self.emb1(x) + self.pos2(torch.arange(16)) + self.emb3(x)
        h = h - h.mean(dim=-1, keepdim=True)
        h = self.c2d4(h.transpose(1, 2).reshape(2, 32, 4, 4)).flatten(2).transpose(1, 2)
        h = self.drop6(self.lin5(h))
        h = h + self.rb8(torch.softmax(self.ra7(h), dim=-1))
        h = self.gn9(h.transpose(1, 2)).transpose(1, 2)
        t = self.ip10(h)
        t.add_(h)
        h = t.relu_()
        h = self.c2d11(h.transpose(1, 2).reshape(2, 24, 4, 4)).flatten(2).transpose(1, 2)
        h = self.lin12(h) + self.emb13(x)
        return F.cross_entropy(self.head14(h.sum(dim=1)), y)


def test_a_weight_gradient_autograd_copies_into_its_layout_is_counted():
    """The copy is charged as the backward ends: within 1% of the prediction and within
    the budget (the named minimum: 0.9 is below it)."""
    torch.manual_seed(1234)
    x, y = torch.randint(0, 300, (2, 16)), torch.randint(0, 5, (2,))
    _check_step(_ConvOverTokens, x, y, 0.9)
