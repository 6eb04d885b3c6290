"""RevGRU and RevLSTM: multi-layer reversible RNNs with nn.GRU / nn.LSTM's interface
(MacKay et al. 2018), trained without storing hidden states.

    rnn = memopt.nn.RevGRU(input_size=32, hidden_size=256, num_layers=2, max_forget_bits=3)
    output, h_n = rnn(x)          # x: (T, batch, 32), or (batch, T, 32) with batch_first
    rnn.buffer_size               # the information buffer the backward holds (BufferSize)

Supported as in nn.GRU / nn.LSTM: input_size, hidden_size, num_layers, bias,
batch_first, dropout, device, dtype, unbatched input (T, input_size), an optional
initial state (h_0, or (h_0, c_0) for the RevLSTM, shaped (num_layers, batch,
hidden_size)), and the return value (output, h_n) / (output, (h_n, c_n)).

``dropout`` (0 <= p <= 1): in training mode, every layer's output but the last is
multiplied by a mask of 0 and 1 / (1 - p) before the next layer reads it, as in
nn.GRU; in eval mode nothing is dropped. The masks are not stored: the forward draws
one seed per layer boundary from the caller's default generator of the input's device
(one ``torch.randint`` call, the forward's only draw) and the backward rebuilds each
step's masks from them (MacKay et al. 2018, App. E; memopt.nn.dropout). The backward
draws nothing from the caller's generators, so after a training step their state is
the one the forward left, eagerly and under memopt.compile alike. The masks differ
from the ones nn.GRU would draw from the same state.

Not supported, refused with ValueError: bidirectional=True (a reversible RNN runs
forward in time; run a second module on the flipped sequence), proj_size > 0
(RevLSTM), PackedSequence input, odd hidden_size (the state is split in two halves),
dropout outside [0, 1]. Under autocast the module runs in its parameters' dtype (the input is cast
to it). Double backward (``create_graph=True``) is not supported: the backward op has no
derivative, and differentiating through it raises RuntimeError naming it. Added:
``max_forget_bits`` (None, or 1..10: at most this many bits forgotten per unit per step,
Sec. 5.3; the paper uses 2, 3, 5). The cells and the state
differ from nn.GRU's (eq. 4-5, 11-14: each half sees only the other half), so weights do
not transfer from nn.GRU / nn.LSTM.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from .buffer import BufferSize
from .cells import ReversibleCell, RevGRUCell, RevLSTMCell, State
from . import ops
from .dropout import LayerDropout, draw_seeds
from .sequence import autograd_sequence, regroup


class ReversibleRNN(nn.Module):
    """What RevGRU and RevLSTM share; see the module docstring."""

    cell_type: type[ReversibleCell]

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None, *,
                 max_forget_bits: int | None = None) -> None:
        super().__init__()
        name = type(self).__name__
        if bidirectional:
            raise ValueError(f"{name}: bidirectional=True is not supported (a reversible RNN "
                             f"runs forward in time); run a second {name} on the flipped "
                             f"sequence")
        if (isinstance(dropout, bool) or not isinstance(dropout, (int, float))
                or not 0 <= dropout <= 1):
            raise ValueError(f"{name}: dropout must be a number in [0, 1] (the probability "
                             f"of zeroing a layer's output element), got {dropout!r}")
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"{name}: num_layers must be a positive int, got {num_layers!r}")
        if dropout > 0 and num_layers == 1:
            warnings.warn(f"{name}: dropout applies to every layer's output but the last, "
                          f"so dropout={dropout} with num_layers=1 drops nothing",
                          stacklevel=2)
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"{name}: dtype must be a floating-point type, got {dtype}")
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.bias, self.batch_first, self.max_forget_bits = bias, batch_first, max_forget_bits
        self.dropout = float(dropout)
        spec = ops.StackSpec(self.cell_type, input_size, hidden_size, num_layers, bias,
                             max_forget_bits, self.dropout)
        self.cells = spec.build(device, dtype)
        self._stack = ops.register(spec)
        self._slot = ops.new_slot(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # a copy (copy.deepcopy, pickle) reports its own buffer size
        super().__setstate__(state)
        self._slot = ops.new_slot(self)

    @property
    def buffer_size(self) -> BufferSize | None:
        """The information buffers' size after the last forward (what its backward
        holds), None before the first."""
        return ops.last_buffer_size(self._slot)

    def extra_repr(self) -> str:
        return (f"{self.input_size}, {self.hidden_size}, num_layers={self.num_layers}, "
                f"bias={self.bias}, batch_first={self.batch_first}, "
                f"dropout={self.dropout}, max_forget_bits={self.max_forget_bits}")

    def forward(self, input: Tensor, hx: Any = None) -> tuple[Tensor, Any]:
        """As nn.GRU / nn.LSTM's forward; the backward reconstructs the hidden states
        from the final one and the information buffer (``self.buffer_size``), and the
        dropout masks from their seeds."""
        xs, init, unbatched = self._prepare(input, hx)
        flat = [half for state in init for half in state]
        out, *final = torch.ops.memopt.reversible_fwd(
            self._stack, self._slot, torch.is_grad_enabled(), flat, xs,
            list(self.cells.parameters()), self._seeds(xs))[:-1]
        return self._finish(out, regroup(self.cells, final), unbatched)

    def autograd_forward(self, input: Tensor, hx: Any = None) -> tuple[Tensor, Any]:
        """The same forward under ordinary autograd, every step's graph held (the
        reference the reversible backward is checked against, and its memory baseline).
        It draws the same seeds from the same generator state, hence the same masks."""
        xs, init, unbatched = self._prepare(input, hx)
        dropout = LayerDropout.of(self.dropout, self._seeds(xs))
        out, final = autograd_sequence(self.cells, xs, init, dropout)
        return self._finish(out, final, unbatched)

    def _seeds(self, xs: Tensor) -> Tensor | None:
        """The dropout seeds of this forward (one per layer boundary), drawn from the
        caller's generator of the input's device; None when nothing is dropped."""
        if not (self.training and self.dropout > 0 and self.num_layers > 1):
            return None
        return draw_seeds(self.num_layers - 1, xs.device)

    def _prepare(self, input: Tensor, hx: Any) -> tuple[Tensor, list[State], bool]:
        """Check the arguments; return the input as (T, batch, input_size), each layer's
        initial halves, and whether the input was unbatched."""
        name = type(self).__name__
        if isinstance(input, PackedSequence):
            raise ValueError(  # noqa: TRY004 - unsupported like bidirectional: one error type
                f"{name}: PackedSequence input is not supported; pad the batch")
        if not isinstance(input, Tensor) or input.dim() not in (2, 3):
            raise ValueError(f"{name}: input must be a 2-D (unbatched) or 3-D tensor, got "
                             f"{getattr(input, 'shape', type(input).__name__)}")
        if input.shape[-1] != self.input_size:
            raise ValueError(f"{name}: input.size(-1) must be input_size={self.input_size}, "
                             f"got {input.shape[-1]}")
        dtype = next(self.parameters()).dtype
        if input.dtype != dtype:
            if not torch.is_autocast_enabled(input.device.type):
                raise ValueError(f"{name}: input dtype {input.dtype} differs from the "
                                 f"parameters' {dtype}")
            # autocast: the stack runs in its parameters' dtype (its fixed-point state is
            # exact whatever the float type; the gates are computed in that dtype)
            input = input.to(dtype)
        unbatched = input.dim() == 2
        if unbatched:
            xs = input.unsqueeze(1)
        else:
            xs = input.transpose(0, 1) if self.batch_first else input
        expected = (self.num_layers, xs.shape[1], self.hidden_size)
        parts = self._state_parts(hx, xs, expected, unbatched)
        init = []
        for layer, cell in enumerate(self.cells):
            layer_hx = tuple(part[layer] for part in parts)
            init.append(cell.split(layer_hx[0] if len(parts) == 1 else layer_hx))
        return xs, init, unbatched

    def _state_parts(self, hx: Any, xs: Tensor, expected: tuple[int, ...],
                     unbatched: bool) -> tuple[Tensor, ...]:
        """hx (h_0, or (h_0, c_0)) as a tuple of (num_layers, batch, hidden) tensors."""
        n_parts = self.cell_type.n_halves // 2
        if hx is None:
            return tuple(xs.new_zeros(expected) for _ in range(n_parts))
        parts = (hx,) if n_parts == 1 else hx
        shape = expected[::2] if unbatched else expected
        if (not isinstance(parts, tuple) or len(parts) != n_parts
                or any(not isinstance(p, Tensor) or tuple(p.shape) != shape for p in parts)):
            what = "hx" if n_parts == 1 else "hx = (h_0, c_0), each"
            raise ValueError(f"{type(self).__name__}: {what} must be a tensor of shape "
                             f"{shape}, got {_describe(hx)}")
        return tuple(p.unsqueeze(1) for p in parts) if unbatched else parts

    def _finish(self, out: Tensor, final: list[State], unbatched: bool) -> tuple[Tensor, Any]:
        """The (T, batch, hidden) outputs and final halves -> nn.GRU's return value."""
        joined = [cell.join(state) for cell, state in zip(self.cells, final)]
        if isinstance(joined[0], tuple):
            h_n: Any = tuple(torch.stack(part) for part in zip(*joined))
        else:
            h_n = torch.stack(joined)
        if unbatched:
            out = out.squeeze(1)
            h_n = tuple(p.squeeze(1) for p in h_n) if isinstance(h_n, tuple) else h_n.squeeze(1)
        elif self.batch_first:
            out = out.transpose(0, 1)
        return out, h_n


def _describe(hx: Any) -> str:
    if isinstance(hx, Tensor):
        return f"shape {tuple(hx.shape)}"
    if isinstance(hx, tuple):
        return f"a tuple of {len(hx)}: " + ", ".join(_describe(p) for p in hx)
    return type(hx).__name__


class RevGRU(ReversibleRNN):
    """Multi-layer reversible GRU (MacKay et al. 2018, eq. 4-5, Alg. 1), nn.GRU's
    interface; see the module docstring for what is and is not supported."""

    cell_type = RevGRUCell


class RevLSTM(ReversibleRNN):
    """Multi-layer reversible LSTM (MacKay et al. 2018, eq. 11-14, Alg. 1), nn.LSTM's
    interface; see the module docstring for what is and is not supported."""

    cell_type = RevLSTMCell

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 proj_size: int = 0, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, *, max_forget_bits: int | None = None) -> None:
        if proj_size:
            raise ValueError(f"RevLSTM: proj_size is not supported, got proj_size={proj_size!r}")
        super().__init__(input_size, hidden_size, num_layers, bias, batch_first, dropout,
                         bidirectional, device, dtype, max_forget_bits=max_forget_bits)
