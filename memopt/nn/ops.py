"""The reversible sequence as two opaque operators: ``memopt::reversible_fwd`` and
``memopt::reversible_bwd`` (MacKay et al. 2018, Sec. 3 and 5).

RevGRU and RevLSTM always run through them, in eager mode and under memopt.compile
alike. Dynamo and AOTAutograd see one forward op (the outputs, the final state and a
one-element ``handle`` tensor) and one backward op (reading the handle), never the
per-step Python loop, its fixed-point integers or its buffer lists: the buffer's size
depends on the forget values, which a trace cannot branch on. What the forward keeps
for the backward (the information buffers and the final fixed-point state) lives in a
side table keyed by the handle, so memopt's liveness analysis charges it to the
handle's storage (``passes.reversible_stacks``) and frees it after the backward op. A handle
that is never backpropagated releases its entry when it is garbage collected.

The ops compute with the parameters they are given, not with a module's: a registered
*template* stack of cells (on the meta device, one per configuration) is run with
those tensors swapped in (``torch.func.functional_call``), so a copied module, or the
tensors a compiled graph passes, compute exactly what they hold.

Dropout between layers (``StackSpec.dropout``, MacKay et al. 2018 App. E): both ops
take ``seeds``, one int64 per layer boundary, drawn by the module in training mode
(None in eval mode or with p = 0). The forward draws each step's masks from them and
keeps none; the backward draws them again, step by step in reverse
(``dropout.LayerDropout``). Neither op touches the caller's generators.

Backward with ``retain_graph=True``: the first backward consumes the buffers (popping
frees their words as it goes); a second one runs the fixed-point forward again to
rebuild them.
"""

from __future__ import annotations

import sys
import itertools
import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

from memopt.passes.meta import laid_like
from memopt.passes.runtime import RUNTIMES
from memopt.passes._torch_compat import autograd_inside_op
from memopt.budget import format_bytes

from .buffer import BufferSize
from .cells import ReversibleCell
from .dropout import LayerDropout
from .fixed_point import R_Z, to_fixed, to_float
from .sequence import Buffers, regroup, reversible_backward, run_fixed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StackSpec:
    """A stack of reversible cells, by configuration (what the ops need to run one)."""

    cell_type: type[ReversibleCell]
    input_size: int
    hidden_size: int
    num_layers: int
    bias: bool
    max_forget_bits: int | None
    dropout: float = 0.0  # on every layer's output but the last, in training mode

    @property
    def module_type(self) -> str:
        return self.cell_type.__name__.removesuffix("Cell")

    @property
    def n_halves(self) -> int:
        """State tensors per layer: (h1, h2) or (h1, h2, c1, c2)."""
        return self.cell_type.n_halves

    def build(self, device: torch.device | str | None = None,
              dtype: torch.dtype | None = None) -> nn.ModuleList:
        """The cells, layer 0 first (freshly initialized)."""
        return nn.ModuleList(
            self.cell_type(self.input_size if layer == 0 else self.hidden_size,
                           self.hidden_size, self.bias, self.max_forget_bits).to(device, dtype)
            for layer in range(self.num_layers))


_SPECS: dict[int, StackSpec] = {}
_TEMPLATES: dict[int, "_Call"] = {}
_IDS: dict[StackSpec, int] = {}
_STASH: dict[int, "_Kept"] = {}
_HANDLES = itertools.count(1)
_SLOTS = itertools.count(1)
#: The buffers' size after each module's last forward, keyed by the module's slot.
_SIZES: dict[int, BufferSize] = {}


def register(spec: StackSpec) -> int:
    """The id the ops take for this configuration (one per distinct spec)."""
    if spec not in _IDS:
        key = len(_IDS) + 1
        _IDS[spec], _SPECS[key] = key, spec
        _TEMPLATES[key] = _Call(spec.build(device="meta"))
    return _IDS[spec]


def spec_of(stack: int) -> StackSpec:
    return _SPECS[stack]


def new_slot(owner: object) -> int:
    """A slot for ``owner``'s last buffer size, released with the owner."""
    slot = next(_SLOTS)
    weakref.finalize(owner, _SIZES.pop, slot, None)
    return slot


def last_buffer_size(slot: int) -> BufferSize | None:
    return _SIZES.get(slot)


@dataclass
class _Kept:
    """What one forward keeps for its backward: the final fixed-point state of every
    layer and the information buffers (one per state half)."""

    final: list[tuple[Tensor, ...]]
    buffers: list[Buffers]


def _with_params(stack: int, params: Sequence[Tensor], fn: Callable[[nn.ModuleList], Any]):
    """``fn(cells)`` with the template cells' parameters replaced by ``params`` (in the
    order of ``cells.parameters()``), autocast off: the backward must compute every gate
    exactly as the forward did, and runs outside the caller's autocast region."""
    template = _TEMPLATES[stack]
    names = [name for name, _ in template.named_parameters()]
    with torch.autocast(params[0].device.type, enabled=False):
        return torch.func.functional_call(template, dict(zip(names, params, strict=True)),
                                          (fn,), strict=True)


class _Call(nn.Module):
    """Runs ``fn(cells)`` as its forward, so that functional_call can swap parameters."""

    def __init__(self, cells: nn.ModuleList) -> None:
        super().__init__()
        self.cells = cells

    def forward(self, fn: Callable[[nn.ModuleList], Any]) -> Any:
        return fn(self.cells)


def _run_forward(stack: int, init: Sequence[Tensor], xs: Tensor, params: Sequence[Tensor],
                 dropout: LayerDropout | None
                 ) -> tuple[Tensor, list[tuple[Tensor, ...]], list[Buffers]]:
    """The fixed-point forward (``sequence.run_fixed``) from the floating-point halves."""
    def run(cells: nn.ModuleList):
        fixed = [tuple(to_fixed(h) for h in state) for state in regroup(cells, init)]
        return run_fixed(cells, xs, fixed, dropout)
    return _with_params(stack, params, run)


def _report(slot: int, stack: int, xs: Tensor, buffers: list[Buffers]) -> None:
    size = sum((b.size() for layer in buffers for b in layer), BufferSize())
    _SIZES[slot] = size
    logger.debug("%s: %d steps, batch %d: buffer %s, %d bits held, %.0f forgotten (eq. 17)",
                 spec_of(stack).module_type, xs.shape[0], xs.shape[1],
                 format_bytes(size.nbytes), size.bits, size.ideal_bits)


@torch.library.custom_op("memopt::reversible_fwd", mutates_args=())
def reversible_fwd(stack: int, slot: int, keep: bool, init: list[Tensor], xs: Tensor,
                   params: list[Tensor], seeds: Tensor | None) -> list[Tensor]:
    """The fixed-point forward of a reversible stack: ``xs`` (T, batch, input_size),
    ``init`` every layer's floating-point halves, ``seeds`` the dropout seeds (one per
    layer boundary; None: no dropout). Returns [outputs (T, batch, hidden), *every
    layer's final halves, handle]. With ``keep`` (a training graph) the buffers and the
    final state stay in the side table under the handle."""
    dropout = LayerDropout.of(spec_of(stack).dropout, seeds)
    out, final, buffers = _run_forward(stack, init, xs, params, dropout)
    _report(slot, stack, xs, buffers)
    key = next(_HANDLES) if keep else 0
    handle = torch.tensor(key, dtype=torch.int64)
    if keep:
        _STASH[key] = _Kept(final, buffers)
        weakref.finalize(handle, _STASH.pop, key, None)
    final = [to_float(h, xs.dtype) for state in final for h in state]
    return [out, *map(laid_like, final, init), handle]


@reversible_fwd.register_fake
def _(stack, slot, keep, init, xs, params, seeds):
    spec = spec_of(stack)
    return [xs.new_empty(xs.shape[0], xs.shape[1], spec.hidden_size),
            *(torch.empty_like(h) for h in init), torch.empty((), dtype=torch.int64)]


@torch.library.custom_op("memopt::reversible_bwd", mutates_args=())
def reversible_bwd(stack: int, need_x: bool, handle: Tensor, grad_out: Tensor,
                   grad_final: list[Tensor], init: list[Tensor], xs: Tensor,
                   params: list[Tensor], seeds: Tensor | None) -> list[Tensor]:
    """Backpropagate through the stack, reconstructing every hidden state from the final
    one (``sequence.reversible_backward``), every dropout mask from ``seeds``. Returns
    [*grad_init, *grad_params] and grad_xs last if ``need_x``."""
    dropout = LayerDropout.of(spec_of(stack).dropout, seeds)
    kept = _STASH.pop(int(handle), None)
    if kept is None:  # a second backward (retain_graph), or a graph without keep
        _, final, buffers = _run_forward(stack, init, xs, params, dropout)
        kept = _Kept(final, buffers)
    final, buffers = kept.final, kept.buffers
    del kept
    leaves = [p.detach().requires_grad_() for p in params]

    def run(cells: nn.ModuleList):
        with autograd_inside_op():
            return reversible_backward(cells, xs, init, final, buffers, grad_out,
                                       grad_final, need_x, leaves, dropout)
    grad_init, grad_xs, grad_params = _with_params(stack, leaves, run)
    grads = [*map(laid_like, grad_init, init), *map(laid_like, grad_params, params)]
    return grads + ([laid_like(grad_xs, xs)] if need_x else [])


@reversible_bwd.register_fake
def _(stack, need_x, handle, grad_out, grad_final, init, xs, params, seeds):
    grads = [torch.empty_like(h) for h in init] + [torch.empty_like(p) for p in params]
    return grads + ([torch.empty_like(xs)] if need_x else [])


def _setup_context(ctx, inputs, output) -> None:
    stack, _, _, init, xs, params, seeds = inputs
    ctx.stack, ctx.n = stack, (len(init), len(params))
    ctx.save_for_backward(*init, xs, *params, output[-1], seeds)


def _backward(ctx, grads):
    n_init, n_params = ctx.n
    saved = ctx.saved_tensors
    init, xs = list(saved[:n_init]), saved[n_init]
    params, (handle, seeds) = list(saved[n_init + 1:n_init + 1 + n_params]), saved[-2:]
    grad_out = grads[0] if grads[0] is not None else xs.new_zeros(
        xs.shape[0], xs.shape[1], spec_of(ctx.stack).hidden_size)
    grad_final = [g if g is not None else torch.zeros_like(h)
                  for g, h in zip(grads[1:1 + n_init], init)]
    need_x = bool(ctx.needs_input_grad[4])
    out = torch.ops.memopt.reversible_bwd(ctx.stack, need_x, handle, grad_out, grad_final,
                                          init, xs, params, seeds)
    grad_init, grad_params = out[:n_init], out[n_init:n_init + n_params]
    return (None, None, None, list(grad_init), out[-1] if need_x else None, list(grad_params),
            None)


reversible_fwd.register_autograd(_backward, setup_context=_setup_context)


def buffer_bound_bytes(spec: StackSpec, steps: int, batch: int) -> int:
    """The most bytes the information buffers of one forward can take, whatever the
    forget values (MacKay et al. 2018, Alg. 1 with Sec. 5.1's overflow): what a budget
    must allow for.

    Each state half has a buffer of ``batch x hidden/2`` int64 words per stack level,
    and each step multiplies it once by a forget value z* >= 2^(R_Z - c), where c is the
    cap on bits forgotten (``max_forget_bits``, or R_Z with none). Step 6 of Alg. 1
    gives B' = floor((B 2^R_Z + low) / z*) < (B + 1) 2^c, so after n multiplications
    from a fresh word B + 1 <= 2^(n c); a word is pushed (Sec. 5.1) only once some unit's
    reaches 2^(63 - R_Z), which takes at least n_min = floor((63 - R_Z) / c) + 1
    multiplications. T steps push at most floor((T - 1) / n_min) levels, plus the
    current word: for c = 3, 18 steps a word, 0.44 bytes a unit a step (a float32
    hidden state stored per step is 4 bytes); with no cap (c = 10), 1.33 bytes."""
    c = spec.max_forget_bits or R_Z
    n_min = (63 - R_Z) // c + 1
    levels = (max(steps, 1) - 1) // n_min + 1
    units_per_layer = batch * spec.hidden_size // 2 * spec.n_halves
    return levels * units_per_layer * spec.num_layers * 8


def state_bytes(spec: StackSpec, batch: int) -> int:
    """The final fixed-point state the forward keeps (int64 halves, every layer)."""
    return batch * spec.hidden_size // 2 * spec.n_halves * spec.num_layers * 8


def held_bytes(spec: StackSpec, steps: int, batch: int) -> int:
    """What one forward keeps for its backward at most: the buffers' bound and the final
    fixed-point state."""
    return buffer_bound_bytes(spec, steps, batch) + state_bytes(spec, batch)


def stored_state_bytes(spec: StackSpec, steps: int, batch: int, element_size: int) -> int:
    """What plain BPTT stores of the hidden states alone: every step's state, every
    layer (the slots a reversible stack does not need)."""
    return steps * batch * spec.hidden_size // 2 * spec.n_halves * spec.num_layers * element_size



# passes.chain_policy / passes.reversible_stacks reach this runtime through the registry (imports run
# one way: memopt -> passes -> allocator)
RUNTIMES.reversible = sys.modules[__name__]
