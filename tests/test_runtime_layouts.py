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

import pytest
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


def _loss(model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    """The step's loss: the model's output, or a transformers output's `.loss`."""
    torch.manual_seed(1)
    out = model(**inputs)
    return out if isinstance(out, torch.Tensor) else out.loss


def _measured_step(eager: nn.Module, inputs: dict[str, Any], budget: object,
                   keep_grads: bool) -> tuple[nn.Module, nn.Module, int]:
    """A copy of `eager` compiled at `budget`, its first step taken, then its second
    step's measured peak (with the resident bytes: parameters, buffers, inputs and the
    gradients kept)."""
    model = copy.deepcopy(eager)
    compiled = memopt.compile(model, budget=budget)
    _loss(compiled, inputs).backward()  # capture and plan
    if not keep_grads:
        model.zero_grad(set_to_none=True)
    resident = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in (*model.parameters(), *model.buffers(), *inputs.values(),
                              *(p.grad for p in model.parameters() if p.grad is not None))
                    }.values())
    with allocation_peak("cpu") as seen:
        _loss(compiled, inputs).backward()
    return model, compiled, seen.peak + resident


def _check_step(make: Any, inputs: dict[str, Any], budget: object,
                keep_grads: bool = False) -> None:
    """A step of `make()` compiled at `budget` (or at the minimum memopt names where
    that is below it) measures within 1% of its prediction and under its budget, with
    eager's gradients; `keep_grads`: the measured step adds into the first step's
    gradients (memopt's kept-gradient plan) instead of starting from None."""
    torch.manual_seed(31)
    eager = make()
    for _ in range(3):  # each step's plan may name a higher minimum (kept gradients)
        try:
            model, compiled, measured = _measured_step(eager, inputs, budget, keep_grads)
            break
        except memopt.BudgetError as err:  # per-thread buffers: it follows threads
            budget = err.minimum_bytes
    else:
        pytest.fail(f"no budget accepted for both steps (last named: {budget} bytes)")
    plan = compiled.memopt_plan
    if budget is not None:
        assert measured <= plan.budget_bytes
    assert abs(measured - plan.predicted_peak_bytes) <= 0.01 * plan.predicted_peak_bytes
    for _ in range(2 if keep_grads else 1):
        _loss(eager, inputs).backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_a_step_through_a_norm_over_a_transposed_input_keeps_its_budget():
    """Measured 9,808 bytes against an accepted 9,382 (1.045x) and 17% over the
    prediction before the pass (at one thread)."""
    torch.manual_seed(1234)
    _check_step(_NormOverTime, dict(x=torch.randn(2, 25, 8), y=torch.randint(0, 10, (2,))),
                0.95)


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
    _check_step(_SpanConv, dict(x=torch.randn(4, 64, 32), y=torch.randint(0, 3, (4,))), 0.9)


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


@pytest.mark.parametrize("keep_grads", [False, True], ids=["grads-none", "grads-kept"])
def test_a_weight_gradient_autograd_copies_into_its_layout_is_counted(keep_grads):
    """The copy is charged as the backward ends: within 1% of the prediction and within
    the budget (the named minimum: 0.9 is below it). Into kept gradients memopt adds in
    place (no copy, nothing charged): the second step holds its plan too."""
    torch.manual_seed(1234)
    inputs = dict(x=torch.randint(0, 300, (2, 16)), y=torch.randint(0, 5, (2,)))
    _check_step(_ConvOverTokens, inputs, 0.9, keep_grads)


def _patchtst() -> nn.Module:
    """HF PatchTST: its BatchNorm normalizes a transposed sequence (the model that
    measured 24,116 bytes over its prediction at every budget)."""
    from transformers import PatchTSTConfig, PatchTSTForPrediction
    return PatchTSTForPrediction(PatchTSTConfig(
        num_input_channels=3, context_length=64, patch_length=8, patch_stride=8,
        prediction_length=16, d_model=32, num_hidden_layers=2, num_attention_heads=2,
        ffn_dim=64, norm_type="batchnorm", dropout=0.1, loss="mse"))


def _convbert() -> nn.Module:
    """HF ConvBERT: its span convolution is an nn.Unfold (the model that measured 1.036x
    its named minimum)."""
    from transformers import ConvBertConfig, ConvBertForSequenceClassification
    return ConvBertForSequenceClassification(ConvBertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, embedding_size=32, max_position_embeddings=64, num_labels=3,
        conv_kernel_size=5, head_ratio=2))


@pytest.mark.parametrize("budget", [pytest.param(None, marks=pytest.mark.slow), 0.8])
def test_transformers_models_with_such_kernels_keep_their_plans(budget):
    """The two third-party models these passes were found on, at no budget and 0.8:
    within 1% of the prediction, within the budget, eager's gradients."""
    torch.manual_seed(0)
    series = dict(past_values=torch.randn(2, 64, 3), future_values=torch.randn(2, 16, 3))
    _check_step(_patchtst, series, budget)
    text = dict(input_ids=torch.randint(0, 100, (2, 16)),
                attention_mask=torch.ones(2, 16, dtype=torch.long),
                labels=torch.randint(0, 3, (2,)))
    _check_step(_convbert, text, budget)
