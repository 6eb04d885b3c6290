"""Benchmark workloads for ``memopt.measure``.

Each builder is ``build(device: str) -> Workload``: a model in train mode and
the inputs of one training step, deterministic (``torch.manual_seed(0)``).
Name one as ``"benchmarks.workloads:mlp64"`` with the repository root as the
working directory.

| name      | model                                                   | inputs                        | loss                      |
| --------- | ------------------------------------------------------- | ----------------------------- | ------------------------- |
| mlp64     | 64 x (Linear(512, 512) + GELU)                           | randn(2048, 512)              | sum of the output         |
| resnet50  | HF ResNetModel(ResNetConfig()), bottleneck [3, 4, 6, 3]  | randn(32, 3, 64, 64)          | pooler_output.sum()       |
| gpt2      | HF GPT2LMHeadModel, 12 layers, vocabulary 50257, dropout 0.1 | input_ids, labels (4, 256) | the model's LM loss       |
| llama     | HF LlamaForCausalLM: 4 layers, hidden 256, 4 heads, vocabulary 8000 | input_ids, labels (4, 128) | the model's LM loss |
| lstm      | LSTMCell(256, 256) in a Python loop over T=256 steps     | randn(256, 64, 256) (T, B, F) | MSE to a random target    |
| lstm_sum  | the same                                                | the same                      | sum of the hidden states  |
| tiny_mlp  | 4 x (Linear(64, 64) + GELU), for tests                   | randn(32, 64)                 | sum of the output         |

`ResNet` (a stem and BatchNorm basic blocks) is a model class shared by the test corpus
and `benchmarks.optimum_gap`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from memopt.measure import Workload

__all__ = ["BasicBlock", "DepthwiseBlock", "LSTMLoop", "depthwise_block", "ResNet", "gpt2", "has_llama", "llama", "lstm",
           "lstm_sum", "mlp", "mlp64", "resnet50", "tiny_mlp"]


def mlp(device: str, *, layers: int, width: int, batch: int) -> Workload:
    """``layers`` x (Linear(width, width) + GELU) on a randn(batch, width) input."""
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.GELU()]
    model = nn.Sequential(*blocks).to(device).train()
    x = torch.randn(batch, width, device=device)
    return Workload(model=model, args=(x,))


def mlp64(device: str) -> Workload:
    """The 64-layer chain of DESIGN.md's measured facts (eager: ~541 MB extra RSS)."""
    return mlp(device, layers=64, width=512, batch=2048)


class DepthwiseBlock(nn.Module):
    """A ConvNeXt-style block: 7x7 depthwise convolution, GELU, 1x1 convolution (its
    convolution backward asks the CPU allocator for a workspace: tests/test_workspace.py)."""

    def __init__(self, channels: int = 32) -> None:
        super().__init__()
        self.dw = nn.Conv2d(channels, channels, 7, padding=3, groups=channels)
        self.pw = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pw(nn.functional.gelu(self.dw(x)))


def depthwise_block(device: str) -> Workload:
    """DepthwiseBlock(32) on a randn(16, 32, 32, 32) input."""
    torch.manual_seed(0)
    return Workload(model=DepthwiseBlock().to(device),
                    args=(torch.randn(16, 32, 32, 32, device=device),))


def tiny_mlp(device: str) -> Workload:
    """A small MLP for tests: 4 x (Linear(64, 64) + GELU), batch 32."""
    return mlp(device, layers=4, width=64, batch=32)


class BasicBlock(nn.Module):
    """A ResNet basic block (He et al. 2016): conv-BN-ReLU-conv-BN plus the identity, ReLU."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + x)


class ResNet(nn.Module):
    """A stem and three residual blocks with identity skip connections."""

    def __init__(self, channels: int = 8, num_blocks: int = 3, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.Sequential(*[BasicBlock(channels) for _ in range(num_blocks)])
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.relu(self.stem(x)))
        return self.head(x.mean(dim=(2, 3)))


def _pooler_sum(output) -> torch.Tensor:
    return output.pooler_output.sum()


def resnet50(device: str) -> Workload:
    """HF ResNet-50 (default ResNetConfig), random init, batch 32 of 3x64x64.

    The loss is ``pooler_output.sum()`` (the pooled 2048-d features); the
    model has no head, so there are no labels.
    """
    from transformers import ResNetConfig, ResNetModel

    torch.manual_seed(0)
    model = ResNetModel(ResNetConfig()).to(device).train()
    pixels = torch.randn(32, 3, 64, 64, device=device)
    return Workload(model=model, args=(pixels,), loss=_pooler_sum)


def gpt2(device: str) -> Workload:
    """HF GPT-2 with a LM head: 12 layers, full vocabulary, batch 4, sequence 256.

    Dropout stays at GPT2Config's defaults (0.1 for embeddings, attention and
    residuals) and the model is in train mode, so the step draws random masks.
    The loss is the model's own LM loss (``output.loss``).
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=12, use_cache=False)
    model = GPT2LMHeadModel(config).to(device).train()
    # Name the loss explicitly: with loss_type unset, transformers logs a warning
    # inside forward, which is a graph break for torch.compile (fullgraph).
    model.loss_type = "ForCausalLM"
    input_ids = torch.randint(0, config.vocab_size, (4, 256), device=device)
    labels = torch.randint(0, config.vocab_size, (4, 256), device=device)
    return Workload(model=model, kwargs={"input_ids": input_ids, "labels": labels})


def has_llama() -> bool:
    """Whether the installed transformers has LlamaForCausalLM (the `llama` workload)."""
    try:
        from transformers import LlamaForCausalLM  # noqa: F401
    except ImportError:
        return False
    return True


def llama(device: str) -> Workload:
    """A small HF Llama with a LM head: 4 layers, hidden 256, 4 attention heads (no
    grouped-query sharing), MLP 688 (Llama's 8/3 x hidden), vocabulary 8000, batch 4,
    sequence 128. Llama has no dropout; the loss is the model's own LM loss."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8000, hidden_size=256, intermediate_size=688,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=128, use_cache=False)
    model = LlamaForCausalLM(config).to(device).train()
    model.loss_type = "ForCausalLM"  # as in gpt2: no warning (a graph break) in forward
    input_ids = torch.randint(0, config.vocab_size, (4, 128), device=device)
    labels = torch.randint(0, config.vocab_size, (4, 128), device=device)
    return Workload(model=model, kwargs={"input_ids": input_ids, "labels": labels})


class LSTMLoop(nn.Module):
    """An ``nn.LSTMCell`` run in a Python for-loop over the time axis.

    Input (T, B, F); output the stacked hidden states (T, B, H).
    """

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(input_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = x.shape[1]
        h = x.new_zeros(batch, self.cell.hidden_size)
        c = x.new_zeros(batch, self.cell.hidden_size)
        hs = []
        for t in range(x.shape[0]):
            h, c = self.cell(x[t], (h, c))
            hs.append(h)
        return torch.stack(hs)


def lstm(device: str) -> Workload:
    """LSTMCell(256, 256) over T=256 steps, batch 64; loss = MSE of the hidden states
    against a fixed random target (a dense output gradient, as any real loss gives)."""
    torch.manual_seed(0)
    model = LSTMLoop(256, 256).to(device).train()
    x = torch.randn(256, 64, 256, device=device)
    target = torch.randn(256, 64, 256, device=device)
    return Workload(model=model, args=(x,), loss=lambda out: F.mse_loss(out, target))


def lstm_sum(device: str) -> Workload:
    """`lstm` with loss = sum of the hidden states.

    The gradient of `sum()` is a zero-stride expand, free in eager; AOTAutograd
    materializes every output gradient densely (16 MiB here). memopt's plan
    counts it; eager never allocates it. Kept to show that gap honestly.
    """
    torch.manual_seed(0)
    model = LSTMLoop(256, 256).to(device).train()
    x = torch.randn(256, 64, 256, device=device)
    return Workload(model=model, args=(x,))
