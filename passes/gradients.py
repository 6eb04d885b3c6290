"""Add each parameter's gradient into its existing `.grad` as soon as it is complete.

Requires: a backward GraphModule from passes.partition for a cut that saves every
primal in `params` (`save_parameters`: the backward must receive the parameter itself,
since the same graph may run on other parameters in another call), whose output returns
one gradient per primal of the joint graph, in primal order (AOTAutograd's convention),
and an `add(grad, parameter)` callable (memopt.grads.GradSink.add) that adds the gradient
into that parameter's `.grad` and returns None, or returns the gradient when it cannot
(see memopt.grads). Run right after partitioning, before the in-place pass and
liveness: both must see the new readers.

Ensures: for every primal in `params` whose gradient is a tensor node g, a node
`add(g, primal)` placed right after g, and the output returning that node instead of g.
Liveness then ends g at its last reader instead of holding it to the end of the step
(the step where `.grad` exists: memopt.grads). Returns how many nodes it placed.

Algorithm:
    Step 1: pair the output's gradients with the primals, by position.
    Step 2: after each parameter gradient's producing node, insert the `add` node
        (marked with ACCUMULATES so that plans can name it), reading the saved primal.
    Step 3: the output returns the `add` nodes' values in those positions.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from torch import fx

from .meta import ACCUMULATES
from .partition import Cut


def save_parameters(cut: Cut, params: frozenset[str]) -> Cut:
    """`cut`, also saving the primals in `params` (resident: saving them costs nothing)."""
    extra = tuple(sorted(params - set(cut.saved)))
    return Cut(saved=cut.saved + extra, saved_symbols=cut.saved_symbols)


def accumulate_in_place(bw: fx.GraphModule, primals: Sequence[str], params: frozenset[str],
                        add: Callable[[str, Any], Any]) -> int:
    output = next(iter(bw.graph.find_nodes(op="output")))
    grads = list(output.args[0])
    # Step 1: one gradient per primal; anything else (effect tokens, RNG offsets
    # appended) is not a layout this pass knows, and the step keeps autograd's path.
    if len(grads) != len(primals):
        return 0
    placeholders = list(bw.graph.find_nodes(op="placeholder"))
    saved = {p.name: p for p in placeholders}
    placed = 0
    for i, (name, grad) in enumerate(zip(primals, grads)):
        if name not in params or name not in saved or not isinstance(grad, fx.Node):
            continue
        # Step 2: right after the gradient is produced (after the inputs, for a gradient
        # that is a tangent as it came in).
        where = placeholders[-1] if grad.op == "placeholder" else grad
        with bw.graph.inserting_after(where):
            node = bw.graph.call_function(add, (grad, saved[name]))
        node.meta[ACCUMULATES] = name
        node.meta["val"] = None
        grads[i] = node
        placed += 1
    # Step 3.
    output.args = (tuple(grads),) + tuple(output.args[1:])
    bw.recompile()
    return placed
