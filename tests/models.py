"""The corpus of small training workloads the memopt tests run against eager PyTorch.

Each `Case` builds a fresh model and fresh example inputs; the tests seed the
global RNG before calling either, so two calls give identical models and inputs.
Everything here runs in well under a second in eager mode on CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.workloads import ResNet  # the ResNet of the optimum-gap benchmark

# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, d_in: int = 32, d_hidden: int = 64, d_out: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.act1 = nn.GELU()
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.act2 = nn.Tanh()
        self.fc3 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.act2(self.fc2(self.act1(self.fc1(x)))))


class ConvBN(nn.Module):
    """Convolutions with BatchNorm2d: running stats are buffers the step mutates."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(16)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


class SelfAttention(nn.Module):
    """Hand-written multi-head attention with dropout on the attention probabilities."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attn_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = self.qkv(x).split(d, dim=-1)
        q = q.view(b, t, h, d // h).transpose(1, 2)
        k = k.view(b, t, h, d // h).transpose(1, 2)
        v = v.view(b, t, h, d // h).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // h)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = self.attn_drop(att) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: attention and an MLP, each with nn.Dropout(0.1)."""

    def __init__(self, d_model: int = 32, n_heads: int = 4, dropout: float = 0.1) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, n_heads, dropout)
        self.drop1 = nn.Dropout(dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop1(self.attn(self.ln1(x)))
        return x + self.mlp(self.ln2(x))


class LSTMLoop(nn.Module):
    """An nn.LSTMCell unrolled in a Python loop over T steps (a recurrent chain)."""

    def __init__(self, d_in: int = 8, d_hidden: int = 16, d_out: int = 4) -> None:
        super().__init__()
        self.d_hidden = d_hidden
        self.cell = nn.LSTMCell(d_in, d_hidden)
        self.head = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t_steps, batch, _ = x.shape
        h = x.new_zeros(batch, self.d_hidden)
        c = x.new_zeros(batch, self.d_hidden)
        outs = []
        for t in range(t_steps):
            h, c = self.cell(x[t], (h, c))
            outs.append(h)
        return self.head(torch.stack(outs))


class InplaceViews(nn.Module):
    """User code full of in-place ops and views on intermediates."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.relu = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(d, d)
        self.fc3 = nn.Linear(d // 2, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, d = x.shape
        h = self.relu(self.fc1(x))          # in-place activation on an intermediate
        y = self.fc2(h)
        y += h                              # x += y
        y.mul_(2)                           # in-place on an intermediate
        y[:, : d // 4] *= 0.5               # in-place through a slice view
        z = y.view(b, 4, d // 4).transpose(1, 2).reshape(b, d)   # view, transpose, reshape
        z = z[:, 1::2]                      # strided slice (a view)
        z = z.contiguous().view(b, 2, d // 4).sum(dim=1).repeat(1, 2)
        return self.fc3(z).tanh_()


class TupleOutputs(nn.Module):
    """Several outputs, one of them a view of another."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 24)
        self.head_a = nn.Linear(24, 5)
        self.head_b = nn.Linear(24, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        feat = torch.sigmoid(self.body(x))
        return self.head_a(feat), self.head_b(feat).relu(), feat[:, :6]


class DictOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(16, 24)
        self.cls = nn.Linear(24, 4)
        self.reg = nn.Linear(24, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = F.silu(self.encoder(x))
        return {"logits": self.cls(h), "value": self.reg(h).squeeze(-1), "features": h}


class InputGrad(nn.Module):
    """forward(x, mask): x requires grad (e.g. adversarial training); mask does not."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x * mask))
        return self.fc2(h) * x + x.pow(2).sum(dim=-1, keepdim=True)


class LoRALinear(nn.Module):
    def __init__(self, d_in: int, d_out: int, rank: int = 4, alpha: float = 8.0) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, d_in) / math.sqrt(d_in))
        # Non-zero (unlike the usual zero init) so that lora_a gets a non-zero gradient.
        self.lora_b = nn.Parameter(torch.randn(d_out, rank) * 0.1)
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t() * self.scale


class FrozenLoRA(nn.Module):
    """A frozen backbone with trainable LoRA adapters and a trainable head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.embed.requires_grad_(False)
        self.norm = nn.LayerNorm(32)
        self.norm.requires_grad_(False)
        self.layer1 = LoRALinear(32, 32)
        self.layer2 = LoRALinear(32, 32)
        self.head = nn.Linear(32, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(x))
        h = F.gelu(self.layer1(h))
        h = F.gelu(self.layer2(h))
        return self.head(h)


class ItemBranch(nn.Module):
    """Data-dependent Python control flow: cannot be captured as one graph."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if h.sum().item() > 0:
            return h * 2
        return h


# --------------------------------------------------------------------------
# The corpus
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    make_model: Callable[[], nn.Module]
    make_inputs: Callable[[], tuple[Any, ...]]

    def __repr__(self) -> str:
        return self.name


def _randn(*shape: int, requires_grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape).requires_grad_(requires_grad)


CORPUS: tuple[Case, ...] = (
    Case("mlp", MLP, lambda: (_randn(8, 32),)),
    Case("conv_bn", ConvBN, lambda: (_randn(4, 3, 12, 12),)),
    Case("resnet", ResNet, lambda: (_randn(2, 3, 12, 12),)),
    Case("transformer", TransformerBlock, lambda: (_randn(2, 8, 32),)),
    Case("lstm_loop", LSTMLoop, lambda: (_randn(16, 4, 8),)),
    Case("inplace_views", InplaceViews, lambda: (_randn(6, 32),)),
    Case("tuple_outputs", TupleOutputs, lambda: (_randn(5, 16),)),
    Case("dict_outputs", DictOutputs, lambda: (_randn(5, 16),)),
    Case("input_grad", InputGrad,
         lambda: (_randn(4, 16, requires_grad=True), (torch.rand(4, 16) > 0.3).float())),
    Case("frozen_lora", FrozenLoRA, lambda: (_randn(6, 16),)),
)

CASES: dict[str, Case] = {case.name: case for case in CORPUS}


def allocated_step(model: nn.Module, xs: torch.Tensor, resident: int) -> int:
    """One training step's allocated peak on CPU (memopt.measure.allocation_peak: what a budget
    counts), ``resident`` bytes (parameters, buffers, inputs) included; ``model(xs)``
    is the loss."""
    from memopt.measure import allocation_peak  # noqa: PLC0415

    for p in model.parameters():
        p.grad = None
    with allocation_peak("cpu") as seen:
        model(xs).backward()
    return seen.peak + resident
