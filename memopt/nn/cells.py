"""Reversible GRU and LSTM cells (MacKay et al. 2018, Sec. 3.1-3.2).

The hidden state is split in two halves updated in turn, each from the other:
RevGRU, eq. 4-5::

    [z1; r1] = sigmoid(W1 [x; h2])     g1 = tanh(U1 [x; r1 * h2])     h1 <- z1 h1 + (1 - z1) g1
    [z2; r2] = sigmoid(W2 [x; h1])     g2 = tanh(U2 [x; r2 * h1])     h2 <- z2 h2 + (1 - z2) g2

RevLSTM, eq. 11-14 (then the same for c2, h2 from h1)::

    [f1, i1, o1, p1] = sigmoid(W1 [x; h2])     g1 = tanh(U1 [x; h2])
    c1 <- f1 c1 + i1 g1                          h1 <- p1 h1 + o1 tanh(c1)

Every update multiplies a state half by a forget value (z, f or p), so given h(t) and
x(t) the halves are undone last first (eq. 6). A cell steps in three ways: ``step``
(fixed point, Alg. 1 through information buffers), ``reverse`` (the exact inverse of
``step``), and ``tracked_step`` (autograd through a step whose result is known: what
the sequence modules differentiate). ``forward`` is one floating-point step, for use as
an ordinary cell. The forget values are capped and quantized by
``fixed_point.quantize_forget`` (Sec. 5.3 and Alg. 1's z*).

State layout: a cell's state is a tuple of halves, (h1, h2) for the RevGRU and
(h1, h2, c1, c2) for the RevLSTM; ``split`` and ``join`` convert from and to
nn.GRUCell's ``h`` and nn.LSTMCell's ``(h, c)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .buffer import InformationBuffer
from .fixed_point import check_forget_cap, quantize_forget, to_fixed
from .stepping import FixedForward, FixedReverse, StepMode, Tracked

State = tuple[Tensor, ...]


class ReversibleCell(nn.Module):
    """What the RevGRU and RevLSTM cells share: argument checks, initialization, the
    state layout and the three ways to step. Subclasses define ``_half``."""

    n_halves: int  # state tensors of size hidden_size / 2

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True,
                 max_forget_bits: int | None = None) -> None:
        super().__init__()
        name = type(self).__name__
        for arg, value in (("input_size", input_size), ("hidden_size", hidden_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: {arg} must be a positive int, got {value!r}")
        if hidden_size % 2:
            raise ValueError(f"{name}: hidden_size must be even (the state is split in two "
                             f"halves, MacKay et al. 2018 eq. 4-5), got {hidden_size}")
        check_forget_cap(max_forget_bits)
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.half_size = hidden_size // 2
        self.bias = bias
        self.max_forget_bits = max_forget_bits

    def reset_parameters(self) -> None:
        """Uniform in +-1/sqrt(hidden_size), as nn.GRU and nn.LSTM."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        for weight in self.parameters():
            nn.init.uniform_(weight, -bound, bound)

    def extra_repr(self) -> str:
        return (f"{self.input_size}, {self.hidden_size}, bias={self.bias}, "
                f"max_forget_bits={self.max_forget_bits}")

    # State layout.

    def split(self, hx: Any) -> State:
        """nn.GRUCell's h / nn.LSTMCell's (h, c) -> the tuple of halves."""
        raise NotImplementedError

    def join(self, halves: Sequence[Tensor]) -> Any:
        """The tuple of halves -> nn.GRUCell's h / nn.LSTMCell's (h, c)."""
        raise NotImplementedError

    @staticmethod
    def output(halves: Sequence[Tensor]) -> Tensor:
        """The output h = [h1; h2] (the first two halves)."""
        return torch.cat([halves[0], halves[1]], dim=-1)

    def fixed_state(self, hx: Any) -> State:
        """The fixed-point state (int64 halves) nearest to a floating-point one."""
        return tuple(to_fixed(half) for half in self.split(hx))

    @staticmethod
    def new_buffers(state: Sequence[Tensor]) -> tuple[InformationBuffer, ...]:
        """One empty information buffer per state half."""
        return tuple(InformationBuffer(half) for half in state)

    # Stepping.

    @torch.no_grad()
    def step(self, x: Tensor, state: Sequence[Tensor],
             buffers: Sequence[InformationBuffer]) -> State:
        """One fixed-point step: h(t-1) -> h(t), pushing onto ``buffers``."""
        return self._run(x, FixedForward(state, buffers, self._dtype()))

    @torch.no_grad()
    def reverse(self, x: Tensor, state: Sequence[Tensor],
                buffers: Sequence[InformationBuffer]) -> State:
        """Undo ``step``: h(t) and x(t) -> h(t-1), bit for bit, popping ``buffers``
        (eq. 6: the second half is undone first, from the first half at time t)."""
        return self._run(x, FixedReverse(state, buffers, self._dtype()), halves=(1, 0))

    def tracked_step(self, x: Tensor, values: Sequence[Tensor],
                     exact: Sequence[Tensor]) -> State:
        """Autograd through ``step``: ``values`` are h(t-1)'s floating-point halves,
        ``exact`` is the fixed-point h(t) that ``step`` produced; returns h(t)'s halves
        with those exact values and the gradient of the floating-point update (every
        rounding straight-through)."""
        return self._run(x, Tracked(values, exact))

    def forward(self, input: Tensor, hx: Any = None) -> Any:
        """One floating-point step of eq. 4-5 / 11-14 with the capped, quantized forget
        values (no fixed point, no buffer): what ``tracked_step`` differentiates.
        ``input`` is (batch, input_size); ``hx`` as nn.GRUCell's / nn.LSTMCell's, zeros
        when None."""
        if hx is None:
            zeros = input.new_zeros(input.shape[0], self.hidden_size)
            hx = zeros if self.n_halves == 2 else (zeros, zeros)
        return self.join(self._run(input, Tracked(self.split(hx))))

    def _run(self, x: Tensor, mode: StepMode, halves: tuple[int, ...] = (0, 1)) -> State:
        """Step the halves in the given order through ``mode``; return the new state."""
        for k in halves:
            self._half(k, x, mode)
            mode.end_half()
        return tuple(mode.state)

    def _half(self, k: int, x: Tensor, state: StepMode) -> None:
        """Update half k (0 or 1) of the state from the other half and x."""
        raise NotImplementedError

    def _dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype


class RevGRUCell(ReversibleCell):
    """Reversible GRU cell, MacKay et al. 2018 eq. 4-5 (see the module docstring).

    Parameters per half k: ``gates[k]`` = W_k (in + hidden/2 -> hidden: z_k and r_k) and
    ``candidate[k]`` = U_k (in + hidden/2 -> hidden/2). ``max_forget_bits``: at most this
    many bits forgotten per unit per step (Sec. 5.3; the paper uses 2, 3, 5), None for
    no cap beyond R_Z = 10. The update's (1 - z) uses the quantized z too (the authors'
    code uses the unquantized one there), so h's two weights still sum to exactly 1.
    """

    n_halves = 2

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True,
                 max_forget_bits: int | None = None) -> None:
        super().__init__(input_size, hidden_size, bias, max_forget_bits)
        width = input_size + self.half_size
        self.gates = nn.ModuleList(nn.Linear(width, hidden_size, bias) for _ in range(2))
        self.candidate = nn.ModuleList(nn.Linear(width, self.half_size, bias) for _ in range(2))
        self.reset_parameters()

    def split(self, hx: Tensor) -> State:
        return tuple(hx.split(self.half_size, dim=-1))

    def join(self, halves: Sequence[Tensor]) -> Tensor:
        return self.output(halves)

    def _half(self, k: int, x: Tensor, state: StepMode) -> None:
        """Eq. 4 (k = 0) or eq. 5 (k = 1)."""
        other = state.read(1 - k)
        z, r = torch.sigmoid(self.gates[k](torch.cat([x, other], dim=-1))).chunk(2, dim=-1)
        g = torch.tanh(self.candidate[k](torch.cat([x, r * other], dim=-1)))
        z = quantize_forget(z, self.max_forget_bits)
        state.update(k, z, (1 - z.value) * g)


class RevLSTMCell(ReversibleCell):
    """Reversible LSTM cell, MacKay et al. 2018 eq. 11-14 (see the module docstring).

    Parameters per half k: ``gates[k]`` = [W_k; U_k] (in + hidden/2 -> 5 hidden/2: the
    f, i, o, p gates and the candidate g). Both forget values, f (cell) and p (hidden),
    are capped and quantized (Sec. 5.3, footnote 8). ``max_forget_bits`` as RevGRUCell.
    """

    n_halves = 4

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True,
                 max_forget_bits: int | None = None) -> None:
        super().__init__(input_size, hidden_size, bias, max_forget_bits)
        width = input_size + self.half_size
        self.gates = nn.ModuleList(
            nn.Linear(width, 5 * self.half_size, bias) for _ in range(2))
        self.reset_parameters()

    def split(self, hx: tuple[Tensor, Tensor]) -> State:
        h, c = hx
        return (*h.split(self.half_size, dim=-1), *c.split(self.half_size, dim=-1))

    def join(self, halves: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        return self.output(halves), torch.cat([halves[2], halves[3]], dim=-1)

    def _half(self, k: int, x: Tensor, state: StepMode) -> None:
        """Eq. 11-14 for half k: c_k (state index 2 + k), then h_k (index k)."""
        gates = self.gates[k](torch.cat([x, state.read(1 - k)], dim=-1))
        f, i, o, p, g = gates.chunk(5, dim=-1)
        # Eq. 13: c_k <- f c_k + i g.
        f = quantize_forget(torch.sigmoid(f), self.max_forget_bits)
        state.update(2 + k, f, torch.sigmoid(i) * torch.tanh(g))
        # Eq. 14: h_k <- p h_k + o tanh(c_k), with the c_k just updated.
        p = quantize_forget(torch.sigmoid(p), self.max_forget_bits)
        state.update(k, p, torch.sigmoid(o) * torch.tanh(state.read(2 + k)))
