"""How one step of a reversible cell reads and writes its state, in three modes.

A cell writes its step once, as two halves (``ReversibleCell._half``), against a small
protocol: ``read(i)`` gives the floating-point value of state component i, and
``update(i, forget, add)`` sets component i <- forget * component i + add (MacKay et
al. 2018, eq. 4-5 and 13-14 all have this form). The modes:

- ``FixedForward``: the fixed-point step, Alg. 1 through an information buffer; no
  autograd.
- ``FixedReverse``: the same step undone. A half's updates are deferred to its end and
  undone last first, so every read inside the half sees the values the forward read
  (a component read after its update is read after the step, as in the forward).
  Called on the halves in reverse order, this reconstructs h(t-1) from h(t) and x(t).
- ``Tracked``: the step in floating point under autograd, with every updated
  component's value replaced by the known fixed-point result (straight-through), or,
  without known results, the plain floating-point update.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from .buffer import InformationBuffer
from .fixed_point import Forget, straight_through, to_fixed, to_float


class StepMode(Protocol):
    """What a cell's half-step reads and writes through; ``state`` is the state so far."""

    state: list[Tensor]

    def read(self, i: int) -> Tensor: ...

    def update(self, i: int, forget: Forget, add: Tensor) -> None: ...

    def end_half(self) -> None: ...


class FixedForward:
    """Forward in fixed point: each update runs Alg. 1 on component i's buffer, then adds
    the update rounded to R_H bits."""

    def __init__(self, state: Sequence[Tensor], buffers: Sequence[InformationBuffer],
                 dtype: torch.dtype) -> None:
        self.state = list(state)
        self.buffers = buffers
        self.dtype = dtype

    def read(self, i: int) -> Tensor:
        return to_float(self.state[i], self.dtype)

    def update(self, i: int, forget: Forget, add: Tensor) -> None:
        self.state[i] = self.buffers[i].multiply(self.state[i], forget.fixed) + to_fixed(add)

    def end_half(self) -> None:
        """Nothing is deferred going forward."""


class FixedReverse(FixedForward):
    """Reverse in fixed point: updates are recorded, then undone at ``end_half``."""

    def __init__(self, state: Sequence[Tensor], buffers: Sequence[InformationBuffer],
                 dtype: torch.dtype) -> None:
        super().__init__(state, buffers, dtype)
        self._pending: list[tuple[int, Tensor, Tensor]] = []

    def update(self, i: int, forget: Forget, add: Tensor) -> None:
        self._pending.append((i, forget.fixed, to_fixed(add)))

    def end_half(self) -> None:
        while self._pending:
            i, z, add = self._pending.pop()
            self.state[i] = self.buffers[i].divide(self.state[i] - add, z)


class Tracked:
    """The step under autograd. With ``exact`` (the fixed-point state after the step),
    each updated value equals ``exact`` bit for bit and has the floating-point update's
    gradient; without it, the floating-point update itself."""

    def __init__(self, values: Sequence[Tensor], exact: Sequence[Tensor] | None = None) -> None:
        self.state = list(values)
        self.exact = exact

    def read(self, i: int) -> Tensor:
        return self.state[i]

    def update(self, i: int, forget: Forget, add: Tensor) -> None:
        value = forget.value * self.state[i] + add
        if self.exact is not None:
            value = straight_through(value, to_float(self.exact[i], value.dtype))
        self.state[i] = value

    def end_half(self) -> None:
        """Nothing is deferred under autograd."""
