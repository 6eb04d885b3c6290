"""A cell loop's several per-step inputs and stacked values as the one input and output
of its chain (passes.cell_loops). The per-step inputs (`x[t] + emb[t]`, Mamba's
`dA[:, :, t]`, `dBu[:, :, t]` and `C[:, t]`, integer targets of a per-step loss) are not
copied: the chain takes them whole among its params and each chunk reads its slices in place
(memopt.recurrent.ops.ChainSpec.sliced), its ``xs`` an empty (T, 0) tensor that gives the
chain its length. Several stacked values are laid side by side in one (T, M) output and
split back after the chain, in graph nodes the planner counts.

History: until 2026-11-28 the per-step inputs were packed into one (T, N) copy (integers
cast or bit-cast to the floating dtype). The copy held as much as the inputs themselves
beside them: a gated scan run as one chunk measured 1.72x eager's peak.
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
    """The loop's chain takes several per-step inputs (sliced in place) or stacks several
    values (``Packing``); its time dim is then 0."""
    return len(loop.step_inputs) > 1 or len(loop.outputs) > 1


def slices_inputs(loop: Loop) -> bool:
    """The chain takes the loop's per-step inputs among its params and slices them in
    place (ChainSpec.sliced), its xs an empty tensor: when it has several, or one beside
    several stacked values."""
    return is_packed(loop) and bool(loop.step_inputs)


def time_dim_of(loop: Loop) -> int:
    """The chain's time dim: 0 for several stacked values (packed into one (T, M) output);
    else, where the chain's xs only gives its length (``slices_inputs``, or no per-step
    input), the stacked value's stack dim; else the per-step input's."""
    if len(loop.outputs) > 1:
        return 0
    if slices_inputs(loop) or loop.step_input is None:
        return loop.stack_dim if loop.stack_dim is not None else 0
    return loop.step_input[1]


@dataclass(frozen=True)
class Packing:
    """How a loop's stacked values share the chain's one (T, M) output: each step's values
    flattened and laid side by side (see the module docstring)."""

    outputs: tuple[tuple[int, ...], ...]        # each stacked value's step shape
    out_dtype: torch.dtype | None

    def join_outputs(self, ys: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """One step's stacked values -> the chain output's row (M,)."""
        return torch.cat([y.reshape(-1) for y in ys])


def packing_of(plain: PlainGraph, loop: Loop) -> Packing | str:
    """The packing of ``loop``'s stacked values, or why there is none."""
    first = [plain.nodes[j] for j in loop.ops[0]]
    outs = [example_value(first[o]) for o, _ in loop.outputs]
    if len({y.dtype for y in outs}) > 1:
        return "the stacked per-step values differ in dtype (they are packed into one output)"
    return Packing(tuple(tuple(y.shape) for y in outs), outs[0].dtype if outs else None)


# -- Step 6: the rewrite ------------------------------------------------------------------


def sliced_inputs(graph: fx.Graph, plain: PlainGraph, loop: Loop) -> list[fx.Node]:
    """The per-step inputs the chain slices in place (ChainSpec.sliced), each narrowed to
    the loop's steps where it is longer (a view)."""
    nodes = []
    for base, dim, i0 in loop.step_inputs:
        x = plain.node(base)
        if i0 != 0 or example_value(x).shape[dim] != loop.steps:
            x = graph.call_function(torch.narrow, (x, dim, i0, loop.steps))
        nodes.append(x)
    return nodes


def unpack_outputs(graph: fx.Graph, y: fx.Node, loop: Loop, packing: Packing
                    ) -> list[fx.Node]:
    """Nodes splitting the chain's (T, M) output into the stacked values, time first."""
    widths = [math.prod(shape) for shape in packing.outputs]
    parts = graph.call_function(torch.split, (y, widths, 1))
    return [graph.call_method("reshape", (graph.call_function(operator.getitem, (parts, k)),
                                          loop.steps, *shape))
            for k, shape in enumerate(packing.outputs)]
