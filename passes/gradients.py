"""Add each parameter's gradient into its existing `.grad` as soon as it is complete.

Requires: the joint graph of a step (AOTAutograd's convention: its output returns the
`num_fwd_outputs` forward outputs, then one gradient per non-tangent placeholder, in
placeholder order), the primals in `params`, and an `add(grad, parameter)` callable
(memopt.grads.GradSink.add) that adds the gradient into that parameter's `.grad` and
returns None, or returns the gradient when it cannot (see memopt.grads). Run after the
cut is chosen and before partitioning: partition with a cut that saves every primal in
`params` (`save_parameters`). The backward must receive the parameter itself, since the
same graph may run on other parameters in another call, and it must read it: the
partitioner drops saved values the backward never reads (a bias is not needed by its
own backward), which is why the nodes go into the joint graph and not into the
extracted backward.

Ensures: a copy of the joint graph in which, for every primal in `params` whose gradient
is a tensor node g, a node `add(g, primal)` sits right after g and the output returns
it instead of g; and how many such nodes it placed. Liveness then ends g at its last
reader instead of holding it to the end of the step (the step where `.grad` exists:
memopt.grads). The input graph is not changed.

Algorithm:
    Step 1: pair the output's gradients with the primals, by position.
    Step 2: after each parameter gradient's producing node, insert the `add` node
        (marked with ACCUMULATES so that plans can name it), reading the primal.
    Step 3: the output returns the `add` nodes' values in those positions.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import fx

from ._torch_compat import is_tangent

from .meta import ACCUMULATES
from .partition import Cut
from .recompute import copy_graph_module


def save_parameters(cut: Cut, params: frozenset[str]) -> Cut:
    """`cut`, also saving the primals in `params` (resident: saving them costs nothing)."""
    extra = tuple(sorted(params - set(cut.saved)))
    return Cut(saved=cut.saved + extra, saved_symbols=cut.saved_symbols)


def accumulate_in_place(joint: fx.GraphModule, num_fwd_outputs: int, params: frozenset[str],
                        add: Callable[[Any, Any], Any]) -> tuple[fx.GraphModule, int]:
    gm = copy_graph_module(joint)
    output = next(iter(gm.graph.find_nodes(op="output")))
    outs = list(output.args[0])
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    primals = [p for p in placeholders if not is_tangent(p)]
    grads = outs[num_fwd_outputs:]
    # Step 1: one gradient per primal; anything else (effect tokens, RNG offsets
    # appended) is not a layout this pass knows, and the step keeps autograd's path.
    if len(grads) != len(primals):
        return joint, 0
    placed = 0
    for i, (primal, grad) in enumerate(zip(primals, grads)):
        if primal.name not in params or not isinstance(grad, fx.Node):
            continue
        # Step 2: right after the gradient is produced (after the inputs, for a gradient
        # that is a tangent as it came in).
        where = placeholders[-1] if grad.op == "placeholder" else grad
        with gm.graph.inserting_after(where):
            node = gm.graph.call_function(add, (grad, primal))
        node.meta[ACCUMULATES] = primal.name
        node.meta["val"] = None
        outs[num_fwd_outputs + i] = node
        placed += 1
    # Step 3.
    output.args = (tuple(outs),) + tuple(output.args[1:])
    gm.recompile()
    return gm, placed
