"""Dropout between the layers of a reversible stack, its masks rebuilt instead of stored
(MacKay et al. 2018, Sec. 6.1 and App. E: a dropout mask is a function of the random
seed that drew it, so the backward regenerates it and no storage is needed).

nn.GRU / nn.LSTM's ``dropout``: in training mode the output of every layer but the
last is multiplied by a mask of 0 and 1 / (1 - p) entries (each kept with probability
1 - p) before it enters the next layer; the top layer's outputs are returned undropped.

Where the masks come from: the module draws one int64 seed per layer boundary from the
caller's default generator of the input's device (``draw_seeds``: one ``torch.randint``
call, the only draw a forward makes). The mask of boundary l at step t is drawn by a
private ``torch.Generator`` seeded with a mix of seed l and t (``LayerDropout.masks``),
so any step's masks can be rebuilt in any order: the forward draws them at t = 0..T-1,
the reversible backward again at t = T-1..0, one step at a time, and the autograd
reference at t = 0..T-1. What the backward keeps for them is the seeds (8 bytes a
layer boundary); the caller's generators are never touched again, so after the
backward the caller's RNG state is the one the forward left.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

#: Seeds are drawn in [0, 2^62): any step's mix below stays a valid (non-negative) seed.
_SEED_HIGH = 1 << 62
_GOLDEN = 0x9E3779B97F4A7C15  # the splitmix64 increment: steps' seeds far apart
_MASK63 = (1 << 63) - 1


def draw_seeds(boundaries: int, device: torch.device) -> Tensor:
    """One seed per layer boundary, drawn from the caller's generator of ``device``
    (advancing it as one ``torch.randint`` call does)."""
    return torch.randint(0, _SEED_HIGH, (boundaries,), dtype=torch.int64, device=device)


@dataclass(frozen=True)
class LayerDropout:
    """Dropout with probability ``p`` on the outputs of every layer but the last, one
    seed per layer boundary (see the module docstring)."""

    p: float
    seeds: tuple[int, ...]

    @classmethod
    def of(cls, p: float, seeds: Tensor | None) -> LayerDropout | None:
        """The dropout a stack's op runs with: None without seeds (eval mode, p = 0)."""
        if seeds is None or p == 0.0:
            return None
        return cls(p, tuple(int(s) for s in seeds.tolist()))

    def masks(self, t: int, like: Tensor) -> list[Tensor]:
        """Step t's masks, one per layer boundary, shaped, typed and placed like ``like``
        (a layer's output at one step): entries 0 or 1 / (1 - p), the same every time
        they are asked for."""
        scale = 0.0 if self.p >= 1.0 else 1.0 / (1.0 - self.p)
        generator = torch.Generator(device=like.device)
        masks = []
        for seed in self.seeds:
            generator.manual_seed((seed + (t + 1) * _GOLDEN) & _MASK63)
            keep = torch.empty_like(like).bernoulli_(1.0 - self.p, generator=generator)
            masks.append(keep.mul_(scale))
        return masks


def apply(masks: Sequence[Tensor] | None, layer: int, output: Tensor) -> Tensor:
    """``output`` of ``layer`` as the next layer reads it: dropped unless there are no
    masks or it is the top layer's (which has none)."""
    if masks is None or layer >= len(masks):
        return output
    return output * masks[layer]
