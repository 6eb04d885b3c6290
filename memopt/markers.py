"""Memoryless stand-ins for tensors memopt did not keep or did not compute.

A stand-in has the shape, dtype and device of the tensor it replaces and no storage, so a
loop that only passes it along (`zero_grad`, a `ModelOutput` built and dropped) runs as
before and costs nothing; any op that would read its values raises an error that names what
memopt did and what to change. Two kinds:

- `memopt.stepper.ConsumedGradient`: the `.grad` of a parameter whose optimizer memopt
  stepped inside the backward (the gradient was freed there);
- `SkippedLogits`: a language model's logits, in training, with `skip_logits=True`: the
  loss was computed chunk by chunk over the tokens without ever forming them
  (memopt.passes.lm_heads; Liger-Kernel's fused linear cross-entropy skips them alike).
"""

from __future__ import annotations

from typing import Any

import torch

from memopt.passes._torch_compat import disabled_torch_function

from .errors import InputError


class Memoryless(torch.Tensor):
    """A tensor's metadata without its memory. Subclasses say what an op on it does
    (`_on_op`: return the op's result or raise)."""

    @staticmethod
    def __new__(cls, shape: Any, dtype: torch.dtype, device: Any) -> "Memoryless":
        return torch.Tensor._make_wrapper_subclass(
            cls, tuple(shape), dtype=dtype, device=torch.device(device), requires_grad=False)

    def __init__(self, *args: Any) -> None:  # the metadata is all in __new__
        super().__init__()

    __torch_function__ = disabled_torch_function

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        return cls._on_op(func, args)

    @classmethod
    def _on_op(cls, func: Any, args: Any) -> Any:
        raise NotImplementedError


class LogitsSkippedError(InputError, RuntimeError):
    """The loop read logits memopt did not compute (`skip_logits=True`)."""


class SkippedLogits(Memoryless):
    """A language model's logits in a training call of a model compiled with
    `skip_logits=True`: their shape, dtype and device, no memory; any op raises
    LogitsSkippedError."""

    @classmethod
    def _on_op(cls, func: Any, args: Any) -> Any:
        raise LogitsSkippedError(
            f"these logits were not computed: the model was compiled with "
            f"skip_logits=True, so in a call that records gradients its language-model "
            f"head computes the loss chunk by chunk without forming the (tokens, "
            f"vocabulary) logits, and returns this placeholder in their place ({func} "
            f"tried to read it). A loop that reads the logits in training (accuracy, "
            f"label smoothing or a loss computed outside the model) must leave "
            f"skip_logits off; evaluation under torch.no_grad() returns real logits.")
