"""passes.constant_masks: an SDPA mask built from constants that masks nothing is passed as
eager passes it, not at all (transformers 5.17 builds such a mask under tracing only, and
on CUDA it sent the traced attention down the decomposed path: docs/limits.md)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt
from memopt.passes.constant_masks import drop_constant_masks
from support import check_matches_eager

B, H, S, D = 2, 4, 16, 8


class Attention(nn.Module):
    """Self-attention whose mask is made as `mask` says; like transformers 5.17 with
    `mask="hf"`: no mask when run eagerly, and under tracing one from constants that
    masks nothing, its last dimension of stride 0."""

    def __init__(self, mask: str, dropout: float = 0.1) -> None:
        super().__init__()
        self.qkv = nn.Linear(H * D, 3 * H * D)
        self.out = nn.Linear(H * D, H * D)
        self.mask, self.dropout = mask, dropout

    def _mask(self, x: torch.Tensor) -> torch.Tensor | None:
        rows = torch.arange(S, device=x.device)[None, None, :, None] if self.mask in (
            "hf", "causal") else None
        if self.mask == "hf":
            return (rows >= 0).expand(B, -1, S, S) if torch.compiler.is_compiling() else None
        if self.mask == "float_zeros":
            return torch.zeros(1, 1, S, S, device=x.device)
        if self.mask == "causal":  # masks the future: kept
            return rows >= torch.arange(S, device=x.device)[None, None, None, :]
        if self.mask == "from_input":  # depends on the step's values: kept
            return (x[:, None, :, :1] > -100).expand(B, -1, S, S)
        if self.mask == "random":  # drawn at each step: kept
            return torch.rand(1, 1, S, S, device=x.device) >= 0
        raise ValueError(self.mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(B, S, 3, H, D).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self._mask(x),
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(B, S, H * D))


def _dropped(mask: str) -> tuple[int, str]:
    graphs = []

    def capture(gm, _inputs):
        graphs.append((drop_constant_masks(gm), gm.code))
        return gm.forward

    torch.compile(Attention(mask), backend=capture)(torch.randn(B, S, H * D))
    (count, code), = graphs
    return count, code


@pytest.mark.parametrize("mask, dropped", [("hf", 1), ("float_zeros", 1), ("causal", 0),
                                           ("from_input", 0), ("random", 0)])
def test_only_a_constant_mask_that_masks_nothing_is_dropped(mask: str, dropped: int) -> None:
    count, code = _dropped(mask)
    assert count == dropped, code
    if dropped:
        assert "attn_mask = None" in code and "arange" not in code and "zeros" not in code


def _train(module: nn.Module, x: torch.Tensor, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    loss = module(x).square().mean()
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("budget", [None, 0.9])
def test_a_dropped_mask_gives_eagers_loss_and_gradients(budget: float | None) -> None:
    """The HF-like module with attention dropout: memopt's step equals eager's, which runs
    without a mask, and the mask's ops are not in the graph it plans."""
    torch.manual_seed(0)
    eager = nn.Sequential(Attention("hf"), nn.GELU(), Attention("hf"))
    model = copy.deepcopy(eager)
    compiled = memopt.compile(model, budget=budget)
    x = torch.randn(B, S, H * D)
    for seed in (1, 2):
        for m in (eager, model):
            m.zero_grad(set_to_none=True)
        torch.testing.assert_close(_train(compiled, x, seed), _train(eager, x, seed))
        for p, q in zip(model.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    names = {s.name for s in compiled.memopt_plan.storages}
    assert not [n for n in names if "arange" in n or n == "fw.ge" or n.startswith("fw.ge_")], \
        sorted(names)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_dropped_mask_runs_the_fused_kernel_on_cuda() -> None:
    """On CUDA eager runs SDPA's fused kernel (no mask): with the mask dropped memopt's
    graph does too, drawing eager's dropout and holding no more than eager."""
    from memopt.measure import allocation_peak  # noqa: PLC0415

    torch.manual_seed(0)
    eager = nn.Sequential(*[Attention("hf") for _ in range(4)]).cuda()
    model = copy.deepcopy(eager)
    compiled = memopt.compile(model)
    x = torch.randn(B, S, H * D, device="cuda")
    _train(compiled, x, 1)  # plans
    peaks = []
    for m, run in ((eager, eager), (model, compiled)):
        m.zero_grad(set_to_none=True)
        with allocation_peak("cuda") as seen:
            _train(run, x, 2)
        peaks.append(seen.peak)
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    assert peaks[1] <= peaks[0], peaks


@pytest.mark.parametrize("budget", [None, 0.9])
def test_accumulated_steps_with_a_dropped_mask_match_eager(budget):
    """Three steps adding into kept `.grad` (the later steps are planned apart): eager's
    outputs and accumulated gradients at each."""
    check_matches_eager(lambda: nn.Sequential(Attention("hf"), nn.GELU(), Attention("hf")),
                        lambda: (torch.randn(B, S, H * D),), budget=budget, steps=3,
                        accumulate=True)


def test_a_mask_on_the_meta_device_is_left_as_traced() -> None:
    """On the meta device (memopt.plan of a model there) a mask's values cannot be read:
    it stays as traced, and capture goes on (transformers 4.46's GPT-2 raised from here)."""
    graphs = []

    def capture(gm, _inputs):
        graphs.append(drop_constant_masks(gm))
        return gm.forward

    model = Attention("float_zeros").to("meta")
    torch.compile(model, backend=capture)(torch.randn(B, S, H * D, device="meta"))
    assert graphs == [0]
