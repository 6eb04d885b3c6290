"""A stack of reversible cells over a sequence: the reversible backward (MacKay et al.
2018, Sec. 3 and 5) and the autograd reference it must agree with.

Time is the outer loop and layers the inner one, so going backward step t of every
layer is undone before step t - 1 of any: layer l's input at t is layer l - 1's output
at t, reconstructed in the same step. No per-step state is stored for any layer; the
backward keeps the input sequence, the final (and, to check the reversal, the initial)
state and the information buffers. With dropout between layers (``dropout``, nn.GRU's
semantics) a layer's input at t is the layer below's output times that step's mask,
rebuilt from the seeds wherever it is needed (``dropout.LayerDropout``), never stored.

Gradients: each step is differentiated as its floating-point update evaluated at the
exact fixed-point values, with straight-through (identity) gradients for the three
roundings, as the authors' code does: the forget value's quantization to R_Z bits
(so dz*/dz = 1 and d(z h)/dh = z*/2^R_Z), the update's rounding to R_H bits, and the
noise Alg. 1 adds to h* (B mod z*, under 2^-13). ``autograd_sequence`` is that same
fixed-point forward under ordinary autograd, holding every step's graph; the
reversible backward must match its gradients. memopt.nn.ops runs the forward and
``reversible_backward`` as two custom operators.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .buffer import InformationBuffer
from .cells import ReversibleCell, State
from .dropout import LayerDropout, apply
from .fixed_point import straight_through, to_fixed, to_float

Buffers = tuple[InformationBuffer, ...]


def run_fixed(cells: Sequence[ReversibleCell], xs: Tensor, states: Sequence[State],
              dropout: LayerDropout | None = None
              ) -> tuple[Tensor, list[State], list[Buffers]]:
    """The fixed-point forward without autograd: ``xs`` is (T, batch, input_size),
    ``states`` each layer's int64 halves, ``dropout`` the masks between layers (None:
    none). Returns the top layer's outputs (T, batch, hidden_size), the final states and
    the filled buffers."""
    states = list(states)
    buffers = [cell.new_buffers(state) for cell, state in zip(cells, states)]
    out = xs.new_empty(xs.shape[0], xs.shape[1], cells[-1].hidden_size)
    for t in range(xs.shape[0]):
        masks = _masks(dropout, t, xs, cells)
        inp = xs[t]
        for layer, cell in enumerate(cells):
            states[layer] = cell.step(inp, states[layer], buffers[layer])
            inp = apply(masks, layer, to_float(cell.output(states[layer]), xs.dtype))
        out[t] = inp
    return out, states, buffers


def autograd_sequence(cells: Sequence[ReversibleCell], xs: Tensor, init: Sequence[State],
                      dropout: LayerDropout | None = None) -> tuple[Tensor, list[State]]:
    """The reference: ``run_fixed``'s forward under ordinary autograd, every step's
    graph held until backward (the dropout masks with it, as nn.GRU holds them).
    ``init`` is each layer's floating-point halves; returns the outputs and the final
    floating-point halves (values exactly ``run_fixed``'s)."""
    states = [tuple(to_fixed(half) for half in state) for state in init]
    values = [tuple(straight_through(half, to_float(fixed, xs.dtype))
                    for half, fixed in zip(state, fixed_state))
              for state, fixed_state in zip(init, states)]
    buffers = [cell.new_buffers(state) for cell, state in zip(cells, states)]
    outputs = []
    for t in range(xs.shape[0]):
        masks = _masks(dropout, t, xs, cells)
        inp = xs[t]
        for layer, cell in enumerate(cells):
            states[layer] = cell.step(inp, states[layer], buffers[layer])
            values[layer] = cell.tracked_step(inp, values[layer], states[layer])
            inp = apply(masks, layer, cell.output(values[layer]))
        outputs.append(inp)
    if not outputs:
        return xs.new_zeros(0, xs.shape[1], cells[-1].hidden_size), values
    return torch.stack(outputs), values


def _masks(dropout: LayerDropout | None, t: int, xs: Tensor,
           cells: Sequence[ReversibleCell]) -> list[Tensor] | None:
    """Step t's dropout masks (one per layer but the last), or None without dropout."""
    if dropout is None:
        return None
    return dropout.masks(t, xs.new_empty(xs.shape[1], cells[0].hidden_size))


def regroup(cells: Sequence[ReversibleCell], flat: Sequence[Any]) -> list[Any]:
    """A flat list of every layer's halves -> one tuple per layer."""
    groups, start = [], 0
    for cell in cells:
        groups.append(tuple(flat[start:start + cell.n_halves]))
        start += cell.n_halves
    return groups


def reversible_backward(cells: Sequence[ReversibleCell], xs: Tensor, init: Sequence[Tensor],
                        final: Sequence[State], buffers: list[Buffers], grad_out: Tensor,
                        grad_final: Sequence[Tensor], need_x: bool,
                        params: Sequence[Tensor], dropout: LayerDropout | None = None
                        ) -> tuple[list[Tensor], Tensor | None, list[Tensor]]:
    """Backpropagate through ``run_fixed``'s forward without its hidden states (MacKay et
    al. 2018, Sec. 3: reconstruct, then backpropagate one step). ``init``: every layer's
    floating-point initial halves, flat; ``final``: the fixed-point h(T) of each layer;
    ``buffers``: the filled buffers, consumed (popped) here; ``params``: the leaves the
    cells compute with, whose gradients are returned; ``dropout``: the forward's (its
    masks are rebuilt at each step, MacKay et al. 2018 App. E). Returns (dL/d init,
    dL/d xs or None, dL/d params).

    1. Start from h(T) (fixed point) and dL/dh(T).
    2. For t = T..1, reconstruct h(t-1) from h(t) and x(t), top layer first (its input,
       the layer below's output at t times its dropout mask, is still at time t):
       ``cell.reverse``, Alg. 1 undone, popping the buffers (their words are freed as
       they empty). Step t's masks are drawn again from their seeds here.
    3. Recompute step t from h(t-1) under autograd (``cell.tracked_step``, all layers).
    4. Backpropagate dL/dh(t), plus dL/d output(t) on the top layer, through that step:
       dL/dh(t-1) is carried on, dL/dx(t) stored, parameter gradients summed.
    5. Check that the reconstruction ended exactly at h(0) with empty buffers.
    """
    states = list(final)                                             # Step 1
    carried = list(grad_final)
    grad_xs = torch.zeros_like(xs) if need_x else None
    grad_params = [torch.zeros_like(p) for p in params]
    for t in reversed(range(xs.shape[0])):
        masks = _masks(dropout, t, xs, cells)
        previous = _reconstruct(cells, xs[t], states, buffers, masks)  # Step 2
        x_t = xs[t].detach().requires_grad_(need_x)                  # Steps 3-4
        carried, grad_x, grads = _backpropagate_step(cells, x_t, previous, states,
                                                     [*carried, grad_out[t]], params, masks)
        if need_x:
            grad_xs[t] = grad_x
        for total, grad in zip(grad_params, grads):
            total += grad
        states = previous
    _check_reversal(states, init, buffers)                           # Step 5
    return carried, grad_xs, grad_params


def _reconstruct(cells: Sequence[ReversibleCell], x: Tensor, states: Sequence[State],
                 buffers: Sequence[Buffers], masks: list[Tensor] | None) -> list[State]:
    """Backward step 2: every layer's h(t-1) from h(t) and x(t), top layer first, so that
    each layer's input (the output of the layer below at t, dropped with step t's mask)
    is read before it changes."""
    previous = list(states)
    for layer in reversed(range(len(cells))):
        inp = x if layer == 0 else apply(
            masks, layer - 1, to_float(cells[layer - 1].output(states[layer - 1]), x.dtype))
        previous[layer] = cells[layer].reverse(inp, states[layer], buffers[layer])
    return previous


def _backpropagate_step(cells: Sequence[ReversibleCell], x: Tensor, previous: Sequence[State],
                        states: Sequence[State], grad_outputs: Sequence[Tensor],
                        trained: Sequence[Tensor], masks: list[Tensor] | None
                        ) -> tuple[list[Tensor], Tensor | None, list[Tensor]]:
    """Backward steps 3-4: step t from h(t-1) (``previous``) under autograd, every layer
    landing on the known h(t) (``states``), then one vector-Jacobian product with
    ``grad_outputs`` (dL/dh(t) for every half, then dL/d output(t) of the top layer).
    Returns dL/dh(t-1), dL/dx(t) (None unless ``x`` requires grad) and dL/d ``trained``
    through this step."""
    with torch.enable_grad():
        leaves = [to_float(h, x.dtype).requires_grad_() for state in previous for h in state]
        inp, outputs = x, []
        for layer, (cell, values, exact) in enumerate(zip(cells, regroup(cells, leaves),
                                                          states)):
            values = cell.tracked_step(inp, values, exact)
            outputs.extend(values)
            inp = apply(masks, layer, cell.output(values))
    wrt = [*leaves, *([x] if x.requires_grad else []), *trained]
    grads = torch.autograd.grad([*outputs, inp], wrt, grad_outputs, allow_unused=True)
    grads = [torch.zeros_like(w) if g is None else g for g, w in zip(grads, wrt)]
    n_halves = len(leaves)
    grad_x = grads[n_halves] if x.requires_grad else None
    return grads[:n_halves], grad_x, grads[n_halves + x.requires_grad:]


def _check_reversal(states: Sequence[State], init: Sequence[Tensor],
                    buffers: Sequence[Buffers]) -> None:
    """Raise RuntimeError unless the reconstructed h(0) is the forward's, bit for bit,
    and every buffer is empty: otherwise the gradients were taken at wrong states."""
    reconstructed = [h for state in states for h in state]
    exact = all(torch.equal(h, to_fixed(x)) for h, x in zip(reconstructed, init))
    if not exact or not all(b.is_empty() for layer in buffers for b in layer):
        raise RuntimeError(
            "reversible RNN backward: reconstructing the states (MacKay et al. 2018, Alg. 1) "
            "did not return to the initial state exactly; a step computed different gates "
            "going backward than going forward (non-deterministic kernels?), so the "
            "gradients would be wrong")
