"""A zoo of small third-party models from `transformers`, for benchmarks and tests that
must hold on code memopt's authors did not write.

Every model is built from a config (no download), with random weights drawn after
``torch.manual_seed(seed)``, so two builds give identical models and inputs. The
configs are small enough that one eager training step takes well under a second on
2 CPU cores and a plan takes seconds, yet large enough that activations, not the
parameters, decide the peak (except ResNet, whose parameters and gradients are about
two thirds of its step).

    from benchmarks.zoo import ZOO, build, allocated_peak
    case = ZOO["convnext"]()                      # or build("convnext", device="cpu")
    case.run_step()                               # forward, loss, backward (eager)

Each builder is also a ``memopt.measure`` workload (a ZooCase has the ``model``,
``args``, ``kwargs`` and ``loss`` of a ``memopt.measure.Workload``):
``measure_step("benchmarks.zoo:convnext", mode="memopt", budget=0.6)``.
``python -m benchmarks.zoo_budgets`` measures the whole zoo at several budgets.

Interface (stable; tests rely on it):

- ``ZooCase(name, model, args, kwargs, loss)``: the model in train mode, its example
  inputs, and ``loss(output) -> scalar Tensor``: the model's own ``.loss`` where the case
  passes labels, else the sum of its main output. ``run_step(module)`` runs one step.
- ``ZOO``: name -> builder ``(device: str = "cpu", seed: int = 0) -> ZooCase``.
- ``CONV``: the names of the convolutional models.
- ``resident_bytes(case)``: bytes of the distinct storages of the parameters, buffers
  and tensor inputs (what lives before a step begins).
- ``allocated_peak(module, case)``: one training step's allocated peak on CPU, gradients
  set to None first, resident bytes included (what a memopt budget counts; compare
  with ``plan.predicted_peak_bytes``). Never call it on compiled code under a
  TorchDispatchMode.

Most HF models are given an explicit ``loss_type``. GPT-2 is not: with it unset
transformers logs a warning inside its loss (``logger.warning_once``), which memopt
traces through (logging is no graph break). ``distilbert_item`` logs a statistic of its
hidden states with ``.item()`` between encoder and head, as training scripts log
metrics: a real graph break, which memopt plans as two graphs under one budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn


@dataclass
class ZooCase:
    """A model, one step's inputs, and the loss of its output."""

    name: str
    model: nn.Module
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    loss: Callable[[Any], torch.Tensor] = None  # type: ignore[assignment]

    def run_step(self, module: Callable[..., Any] | None = None) -> torch.Tensor:
        """Forward, loss and backward through ``module`` (default: the model); the loss.
        The output stays referenced until backward ends (``out = model(**batch);
        out.loss.backward()``), which is what a memopt plan assumes: a loop that drops
        it first (HF Trainer) measures less than the plan by the output's bytes."""
        module = self.model if module is None else module
        out = module(*self.args, **self.kwargs)  # held through backward, as most loops do
        loss = self.loss(out)
        loss.backward()
        return loss.detach()


def _own_loss(output: Any) -> torch.Tensor:
    return output.loss


def _logits_sum(output: Any) -> torch.Tensor:
    return output.logits.sum()


def _train(model: nn.Module, device: str, loss_type: str | None) -> nn.Module:
    if loss_type is not None:
        model.loss_type = loss_type
    return model.to(device).train()


# --------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------


def bert(device: str = "cpu", seed: int = 0) -> ZooCase:
    """BertForMaskedLM: 4 layers, hidden 256, 4 heads, vocabulary 8000, batch 8 x 128;
    labels on every token; dropout 0.1 (the config's default)."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=8000, hidden_size=256, num_hidden_layers=4,
                        num_attention_heads=4, intermediate_size=1024,
                        max_position_embeddings=128)
    model = _train(BertForMaskedLM(config), device, "ForMaskedLM")
    ids = torch.randint(0, config.vocab_size, (8, 128), device=device)
    labels = torch.randint(0, config.vocab_size, (8, 128), device=device)
    return ZooCase("bert", model, kwargs={"input_ids": ids, "labels": labels}, loss=_own_loss)


def llama(device: str = "cpu", seed: int = 0) -> ZooCase:
    """LlamaForCausalLM: 4 layers, hidden 256, 4 heads (2 key/value heads), SwiGLU 688,
    vocabulary 8000, batch 4 x 128, causal-LM labels."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=8000, hidden_size=256, intermediate_size=688,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, use_cache=False)
    model = _train(LlamaForCausalLM(config), device, "ForCausalLM")
    ids = torch.randint(0, config.vocab_size, (4, 128), device=device)
    return ZooCase("llama", model, kwargs={"input_ids": ids, "labels": ids.clone()},
                   loss=_own_loss)


def gpt2(device: str = "cpu", seed: int = 0) -> ZooCase:
    """GPT2LMHeadModel: 4 layers, hidden 256, 4 heads, vocabulary 8000, batch 4 x 128,
    causal-LM labels; no ``loss_type`` (its loss logs a warning: no graph break)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=8000, n_positions=128, n_embd=256, n_layer=4, n_head=4,
                        use_cache=False)
    model = _train(GPT2LMHeadModel(config), device, None)
    ids = torch.randint(0, config.vocab_size, (4, 128), device=device)
    return ZooCase("gpt2", model, kwargs={"input_ids": ids, "labels": ids.clone()},
                   loss=_own_loss)


def mamba(device: str = "cpu", seed: int = 0, associative: bool = False) -> ZooCase:
    """MambaForCausalLM: 2 layers, hidden 128, state 16, expand 2, vocabulary 8000, batch
    4 x 64, causal-LM labels; its sequential scan (`use_associative_scan = False`: a Python
    loop over the tokens, as eager runs it). ``associative``: transformers 5's default, the
    parallel scan torch.compile traces as a tree (memopt rewrites it into the loop,
    passes/scans.py); eager runs the loop either way."""
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(seed)
    config = MambaConfig(vocab_size=8000, hidden_size=128, state_size=16, num_hidden_layers=2,
                         expand=2, conv_kernel=4, use_cache=False)
    config.use_associative_scan = associative  # transformers 5; 4.x has only the loop on CPU
    model = _train(MambaForCausalLM(config), device, "ForCausalLM")
    ids = torch.randint(0, config.vocab_size, (4, 64), device=device)
    name = "mamba_parallel" if associative else "mamba"
    return ZooCase(name, model, kwargs={"input_ids": ids, "labels": ids.clone()},
                   loss=_own_loss)


def mamba_parallel(device: str = "cpu", seed: int = 0) -> ZooCase:
    """The Mamba above with its parallel (associative) scan, transformers 5's default."""
    return mamba(device, seed, associative=True)


def rwkv(device: str = "cpu", seed: int = 0) -> ZooCase:
    """RwkvForCausalLM: 2 layers, hidden 64, vocabulary 4000, batch 4 x 32, causal-LM
    labels: a linear-attention recurrence, whose time mixing off CUDA is a Python loop over
    the tokens (transformers' `rwkv_linear_attention_cpu`) that carries its state through
    elementwise ops and writes each token's output in place."""
    from transformers import RwkvConfig, RwkvForCausalLM

    torch.manual_seed(seed)
    config = RwkvConfig(vocab_size=4000, hidden_size=64, num_hidden_layers=2,
                        attention_hidden_size=64, intermediate_size=256, context_length=32,
                        use_cache=False)
    model = _train(RwkvForCausalLM(config), device, "ForCausalLM")
    ids = torch.randint(0, config.vocab_size, (4, 32), device=device)
    return ZooCase("rwkv", model, kwargs={"input_ids": ids, "labels": ids.clone()},
                   loss=_own_loss)


class LoggedClassifier(nn.Module):
    """A DistilBERT encoder and a linear head on the first token, which logs the mean
    norm of the hidden states with ``.item()`` between the two (a graph break) and
    returns the cross-entropy loss as ``output.loss``."""

    def __init__(self, config: Any, num_labels: int) -> None:
        super().__init__()
        from transformers import DistilBertModel

        self.encoder = DistilBertModel(config)
        self.head = nn.Linear(config.dim, num_labels)
        self.logged: list[float] = []

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        from transformers.modeling_outputs import SequenceClassifierOutput

        hidden = self.encoder(input_ids=input_ids).last_hidden_state
        self.logged.append(hidden.norm(dim=-1).mean().item())  # the graph break
        logits = self.head(hidden[:, 0])
        loss = nn.functional.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


def distilbert_item(device: str = "cpu", seed: int = 0) -> ZooCase:
    """LoggedClassifier: DistilBERT with 3 layers, dim 256, 4 heads, vocabulary 8000,
    batch 8 x 128, 4 labels, logging ``.item()`` between encoder and head."""
    from transformers import DistilBertConfig

    torch.manual_seed(seed)
    config = DistilBertConfig(vocab_size=8000, dim=256, n_layers=3, n_heads=4,
                              hidden_dim=1024, max_position_embeddings=128)
    model = LoggedClassifier(config, num_labels=4).to(device).train()
    ids = torch.randint(0, config.vocab_size, (8, 128), device=device)
    labels = torch.randint(0, 4, (8,), device=device)
    return ZooCase("distilbert_item", model, kwargs={"input_ids": ids, "labels": labels},
                   loss=_own_loss)


def t5(device: str = "cpu", seed: int = 0) -> ZooCase:
    """T5ForConditionalGeneration: 2 encoder + 2 decoder layers, d_model 256, 4 heads,
    vocabulary 8000, batch 8, source 128 and target 64 tokens, with labels."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    config = T5Config(vocab_size=8000, d_model=256, d_kv=64, d_ff=1024, num_layers=2,
                      num_decoder_layers=2, num_heads=4, use_cache=False,
                      decoder_start_token_id=0, pad_token_id=0)
    model = _train(T5ForConditionalGeneration(config), device, "ForConditionalGeneration")
    ids = torch.randint(0, config.vocab_size, (8, 128), device=device)
    labels = torch.randint(0, config.vocab_size, (8, 64), device=device)
    return ZooCase("t5", model, kwargs={"input_ids": ids, "labels": labels}, loss=_own_loss)


# --------------------------------------------------------------------------
# Vision
# --------------------------------------------------------------------------


def _images(device: str, batch: int, size: int, num_labels: int) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(batch, 3, size, size, device=device),
            "labels": torch.randint(0, num_labels, (batch,), device=device)}


def vit(device: str = "cpu", seed: int = 0) -> ZooCase:
    """ViTForImageClassification: 4 layers, hidden 192, 3 heads, patch 8 on 64x64 images
    (64 patches + CLS), batch 16, 10 labels."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    config = ViTConfig(hidden_size=192, num_hidden_layers=4, num_attention_heads=3,
                       intermediate_size=768, image_size=64, patch_size=8, num_labels=10)
    model = _train(ViTForImageClassification(config), device, "ForImageClassification")
    return ZooCase("vit", model, kwargs=_images(device, 16, 64, 10), loss=_own_loss)


def convnext(device: str = "cpu", seed: int = 0) -> ZooCase:
    """ConvNextForImageClassification: 4 stages, widths 32-256, depths 2-2-4-2 (7x7
    depthwise convolutions, LayerNorm, GELU), 64x64 images, batch 16, 10 labels."""
    from transformers import ConvNextConfig, ConvNextForImageClassification

    torch.manual_seed(seed)
    config = ConvNextConfig(hidden_sizes=[32, 64, 128, 256], depths=[2, 2, 4, 2],
                            image_size=64, num_labels=10)
    model = _train(ConvNextForImageClassification(config), device, "ForImageClassification")
    return ZooCase("convnext", model, kwargs=_images(device, 16, 64, 10), loss=_own_loss)


def resnet(device: str = "cpu", seed: int = 0) -> ZooCase:
    """ResNetForImageClassification: basic blocks, widths 32-256, depths 2-2-2-2 (a
    ResNet-18 shape at a quarter width, BatchNorm in train mode), 64x64 images, batch
    16, 10 labels."""
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(seed)
    config = ResNetConfig(embedding_size=32, hidden_sizes=[32, 64, 128, 256],
                          depths=[2, 2, 2, 2], layer_type="basic", num_labels=10)
    model = _train(ResNetForImageClassification(config), device, "ForImageClassification")
    return ZooCase("resnet", model, kwargs=_images(device, 16, 64, 10), loss=_own_loss)


def efficientnet(device: str = "cpu", seed: int = 0) -> ZooCase:
    """EfficientNetForImageClassification at width 0.5, depth 0.5 (MBConv blocks:
    depthwise convolutions, squeeze-excitation, BatchNorm in train mode, swish,
    dropout), 64x64 images, batch 16, 10 labels."""
    from transformers import EfficientNetConfig, EfficientNetForImageClassification

    torch.manual_seed(seed)
    config = EfficientNetConfig(image_size=64, width_coefficient=0.5, depth_coefficient=0.5,
                                hidden_dim=640, num_labels=10)
    model = _train(EfficientNetForImageClassification(config), device,
                   "ForImageClassification")
    return ZooCase("efficientnet", model, kwargs=_images(device, 16, 64, 10), loss=_own_loss)


ZOO: dict[str, Callable[..., ZooCase]] = {
    "bert": bert,
    "gpt2": gpt2,
    "llama": llama,
    "mamba": mamba,
    "mamba_parallel": mamba_parallel,
    "rwkv": rwkv,
    "t5": t5,
    "distilbert_item": distilbert_item,
    "vit": vit,
    "convnext": convnext,
    "resnet": resnet,
    "efficientnet": efficientnet,
}

#: The convolutional models of the zoo.
CONV: tuple[str, ...] = ("convnext", "resnet", "efficientnet")


def build(name: str, device: str = "cpu", seed: int = 0) -> ZooCase:
    """``ZOO[name](device, seed)``, with a KeyError naming the zoo's models."""
    if name not in ZOO:
        raise KeyError(f"no zoo model {name!r}; the zoo has {sorted(ZOO)}")
    return ZOO[name](device, seed)


# --------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def resident_bytes(case: ZooCase) -> int:
    """Bytes of the distinct storages of the parameters, buffers and tensor inputs."""
    seen: dict[int, int] = {}
    for t in (*case.model.parameters(), *case.model.buffers(), *_tensors(case.args),
              *_tensors(case.kwargs)):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def allocated_peak(module: Callable[..., Any], case: ZooCase) -> int:
    """One training step of ``module`` (the case's model, or a memopt module compiled
    from it) on the case's inputs: the most bytes PyTorch's allocator handed out at once
    during forward, loss and backward, plus ``resident_bytes(case)``. Gradients are set
    to None first (as after ``zero_grad(set_to_none=True)``); in-process, on the model's
    device (memopt.measure.allocation_peak: the profiler's allocation events on CPU, the
    rise of ``max_memory_allocated`` on CUDA). Run one warm-up step first for a compiled
    module: its first call compiles and plans."""
    from memopt.measure import allocation_peak  # noqa: PLC0415

    for p in case.model.parameters():
        p.grad = None
    device = next(case.model.parameters()).device
    with allocation_peak(str(device)) as seen:
        case.run_step(module)
    return seen.peak + resident_bytes(case)
