"""A cell loop's per-step inputs and outputs packed into the one input and output of its
chain (passes.cell_loops): several per-step tensors (`x[t] + emb[t]`, integer targets of
a per-step loss) laid side by side in one floating tensor the chain slices per step, and
the chain's output split back, in graph nodes the planner counts.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from memopt.allocator.repeats import Loop

if TYPE_CHECKING:  # pragma: no cover
    from .cell_loops import PlainGraph

EXAMPLE_VALUE = "example_value"


def example_value(node: Any) -> Any:
    """The FakeTensor dynamo recorded for `node` (None for anything but a node)."""
    return node.meta.get(EXAMPLE_VALUE) if isinstance(node, fx.Node) else None


def is_packed(loop: Loop) -> bool:
    """The loop's per-step inputs or stacked values are packed into one (``Packing``)."""
    return len(loop.step_inputs) > 1 or len(loop.outputs) > 1


def time_dim_of(loop: Loop) -> int:
    """The chain's time dim: 0 when packed, else the per-step input's, else the stacked
    output's."""
    if is_packed(loop):
        return 0
    if loop.step_input is not None:
        return loop.step_input[1]
    return loop.stack_dim if loop.stack_dim is not None else 0


#: Integers of up to this many bits are exactly representable in the floating dtype.
EXACT_INT_BITS = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}


@dataclass(frozen=True)
class Piece:
    """One per-step input inside the packed ``xs``: its step's shape and dtype, and how
    it is stored in the packed dtype: "same", "cast" (exact widening) or "bits"
    (bit-cast: ``ratio`` packed elements per element)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    how: str
    width: int        # packed elements a step


@dataclass(frozen=True)
class Packing:
    """How a loop's per-step inputs share one (T, N) ``xs`` and its stacked values one
    (T, M) output (see the module docstring)."""

    dtype: torch.dtype                          # the packed xs's
    inputs: tuple[Piece, ...]                  # in loop.step_inputs order
    outputs: tuple[tuple[int, ...], ...]        # each stacked value's step shape
    out_dtype: torch.dtype | None

    def split_inputs(self, x: torch.Tensor) -> list[torch.Tensor]:
        """One step's row (N,) -> the step's inputs, as the unrolled graph read them."""
        pieces, at = [], 0
        for piece in self.inputs:
            part = x.narrow(0, at, piece.width)
            at += piece.width
            if piece.how == "bits":  # a fresh copy: view(dtype) needs an aligned storage
                part = part.clone().view(piece.dtype)
            elif piece.how == "cast":
                part = part.to(piece.dtype)
            pieces.append(part.reshape(piece.shape))
        return pieces

    def join_outputs(self, ys: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """One step's stacked values -> the chain output's row (M,)."""
        return torch.cat([y.reshape(-1) for y in ys])


def packing_of(plain: PlainGraph, loop: Loop) -> Packing | str:
    """The packing of ``loop``'s per-step inputs and stacked values, or why there is none."""
    inputs = [example_value(plain.node(base)) for base, _, _ in loop.step_inputs]
    first = [plain.nodes[j] for j in loop.ops[0]]
    floats = [x.dtype for x in inputs if x.is_floating_point()]
    if not floats:  # integer inputs only: the carried state's floating dtype
        floats = [next(example_value(first[o]).dtype for o in loop.state
                       if example_value(first[o]).is_floating_point())]
    dtype = max(floats, key=lambda d: torch.empty((), dtype=d).element_size())
    size = torch.empty((), dtype=dtype).element_size()
    pieces = []
    for x, (_, dim, _) in zip(inputs, loop.step_inputs):
        shape = tuple(x.shape[:dim]) + tuple(x.shape[dim + 1:])
        numel = 1
        for n in shape:
            numel *= n
        itemsize = x.element_size()
        int_bits = 1 if x.dtype == torch.bool else 8 * itemsize
        if x.dtype == dtype:
            how, width = "same", numel
        elif x.is_floating_point() and itemsize < size:
            how, width = "cast", numel  # widening: exact, and differentiable
        elif (not x.is_floating_point() and not x.is_complex()
              and int_bits <= EXACT_INT_BITS.get(dtype, 0)):
            how, width = "cast", numel  # every integer of the dtype is a float of P
        elif not x.is_floating_point() and not x.is_complex() and itemsize % size == 0:
            how, width = "bits", numel * (itemsize // size)
        else:
            return (f"a per-step input of dtype {x.dtype} cannot be packed exactly with "
                    f"the others ({dtype})")
        pieces.append(Piece(shape, x.dtype, how, width))
    outs = [example_value(first[o]) for o, _ in loop.outputs]
    if len({y.dtype for y in outs}) > 1:
        return "the stacked per-step values differ in dtype (they are packed into one output)"
    return Packing(dtype, tuple(pieces), tuple(tuple(y.shape) for y in outs),
                    outs[0].dtype if outs else None)


# -- Step 5: the cell and its step function ---------------------------------------------


def pack_inputs(graph: fx.Graph, plain: PlainGraph, loop: Loop, packing: Packing) -> fx.Node:
    """Nodes building the packed (T, N) xs from the per-step inputs (``Packing``)."""
    blocks = []
    for (base, dim, i0), piece in zip(loop.step_inputs, packing.inputs):
        x = plain.node(base)
        if i0 != 0 or example_value(x).shape[dim] != loop.steps:
            x = graph.call_function(torch.narrow, (x, dim, i0, loop.steps))
        if dim != 0:
            x = graph.call_function(torch.movedim, (x, dim, 0))
        x = graph.call_method("reshape", (x, loop.steps, -1))
        if piece.how == "bits":
            x = graph.call_method("view", (graph.call_method("contiguous", (x,)),
                                           packing.dtype))
        elif piece.how == "cast":
            x = graph.call_method("to", (x, packing.dtype))
        blocks.append(x)
    return graph.call_function(torch.cat, (blocks, 1))


def unpack_outputs(graph: fx.Graph, y: fx.Node, loop: Loop, packing: Packing
                    ) -> list[fx.Node]:
    """Nodes splitting the chain's (T, M) output into the stacked values, time first."""
    widths = [math.prod(shape) for shape in packing.outputs]
    parts = graph.call_function(torch.split, (y, widths, 1))
    return [graph.call_method("reshape", (graph.call_function(operator.getitem, (parts, k)),
                                          loop.steps, *shape))
            for k, shape in enumerate(packing.outputs)]
