"""The peers memopt is measured beside: what a user would do without memopt.

A measurement's ``mode`` names one of them (memopt.measure.measure_step):

* ``"checkpoint_sequential:K"``: an ``nn.Sequential`` run through
  ``torch.utils.checkpoint.checkpoint_sequential`` with K segments;
* ``"hf_checkpointing"``: transformers' ``gradient_checkpointing_enable()``;
* ``"torch_compile"``: ``torch.compile`` (inductor) with its defaults;
* ``"inductor:F"``: ``torch.compile`` (inductor) with functorch's
  ``activation_memory_budget = F``.

None of them is memopt; they are here so that a benchmark measures them the same way.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["PEERS", "PEER_PREFIXES", "CheckpointSequential", "InductorWithBudget", "is_peer",
           "wrap_peer"]

#: Peers whose mode carries a number after the colon.
PEER_PREFIXES = ("checkpoint_sequential:", "inductor:")
#: Peers named by their mode alone.
PEERS = ("hf_checkpointing", "torch_compile")


def is_peer(mode: str) -> bool:
    """Whether ``mode`` names one of the peers above."""
    return mode in PEERS or mode.startswith(PEER_PREFIXES)


class CheckpointSequential(torch.nn.Module):
    """``model`` run through ``checkpoint_sequential`` with ``segments`` segments."""

    def __init__(self, model: torch.nn.Sequential, segments: int) -> None:
        super().__init__()
        self.model, self.segments = model, segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint_sequential

        return checkpoint_sequential(self.model, self.segments, x, use_reentrant=False)


class InductorWithBudget(torch.nn.Module):
    """torch.compile (inductor) with functorch's ``activation_memory_budget``, set only
    while this module runs (where it compiles), through the config's scoped ``patch``."""

    def __init__(self, model: torch.nn.Module, budget: float) -> None:
        super().__init__()
        self.model, self.budget = model, budget
        self.compiled = torch.compile(model)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from ..passes._torch_compat import functorch_config  # noqa: PLC0415

        with functorch_config().patch(activation_memory_budget=self.budget):
            return self.compiled(*args, **kwargs)


def wrap_peer(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    """``model`` as the peer ``mode`` runs it (``is_peer(mode)`` must hold).
    ``hf_checkpointing`` changes ``model`` in place and returns it."""
    if mode.startswith("checkpoint_sequential:"):
        if not isinstance(model, torch.nn.Sequential):
            raise ValueError("checkpoint_sequential needs an nn.Sequential model")
        return CheckpointSequential(model, int(mode.split(":", 1)[1]))
    if mode == "hf_checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model
    if mode == "torch_compile":
        return torch.compile(model)
    if mode.startswith("inductor:"):
        return InductorWithBudget(model, float(mode.split(":", 1)[1]))
    raise ValueError(f"{mode!r} names no peer; peers: {PEERS}, or one starting with "
                     f"{PEER_PREFIXES}")
