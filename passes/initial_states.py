"""A loop's initial state made in the dtype its steps carry, where the first step only
promotes it (passes.cell_loops runs this between finding the loops and checking them).

Under bf16 autocast transformers' Mamba starts its scan from ``zeros(..., dtype=bf16)`` (the
activations' dtype), and its first step ``dA[:, :, 0] * h + dBu[:, :, 0]`` promotes it to
the float32 of ``dA``: every later step carries float32. A chain carries one dtype, so the
loop stayed unrolled (Mamba's sequential path under autocast: no chain). Where every op of
the first step that reads the initial state is elementwise (passes.scan_inputs.ELEMENTWISE)
and gives the carried dtype, it computed in that dtype from an exact upcast of the initial
value; casting the initial value once before the loop gives the same values, and the loop
then carries one dtype from its start.

Requires: the torch-level FX graph and the loops found in it (passes.cell_loops, Steps 2-3).
Ensures: the same values; returns whether the graph changed (the loops must then be found
again: op indices moved).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import fx

from memopt.allocator.repeats import Loop

from .loop_packing import example_value
from .scan_inputs import elementwise, made_like

if TYPE_CHECKING:  # pragma: no cover
    from .cell_loops import PlainGraph


def widen_initial_states(gm: fx.GraphModule, plain: PlainGraph, loops: tuple[Loop, ...]) -> bool:
    """Cast each initial state the first step only promotes to the carried dtype (module
    docstring), in place; True where one was cast."""
    changed = False
    for loop in loops:
        first = [plain.nodes[j] for j in loop.ops[0] if j is not None]
        for offset, ref in zip(loop.state, loop.init):
            init = plain.node(ref)
            start, carried = example_value(init), example_value(plain.nodes[loop.ops[0][offset]])
            if not (isinstance(start, torch.Tensor) and isinstance(carried, torch.Tensor)
                    and start.dtype != carried.dtype and carried.is_floating_point()
                    and (start.shape, start.device) == (carried.shape, carried.device)
                    and torch.promote_types(start.dtype, carried.dtype) == carried.dtype):
                continue
            readers = [n for n in first if init in n.all_input_nodes]
            if not readers or not all(elementwise(n) and example_value(n).dtype == carried.dtype
                                      for n in readers):
                continue
            with gm.graph.inserting_before(first[0]):  # after init, which may be an input
                cast = made_like(gm.graph, readers[0], "call_method", "to",
                                 (init, carried.dtype))
            for reader in readers:
                reader.replace_input_with(init, cast)
            changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed
