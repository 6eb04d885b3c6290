"""Add each parameter's gradient into its existing `.grad`, or step the optimizer on it,
as soon as it is complete.

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

With `step_bytes` (the optimizer step inside the backward, memopt.stepper; PyTorch's
tutorial "How to save memory by fusing the optimizer step into the backward pass", and
Lv et al. 2023, LOMO) the node updates the parameter in place, so it must also come after
every node that reads the parameter's storage (its own and its views': a backward matmul
reads the weight, a recomputed view of it too): it sits after the later of g and that
last reader, and allocates `step_bytes[primal]` while it runs (its workspace).

Algorithm:
    Step 1: pair the output's gradients with the primals, by position.
    Step 2: after each parameter gradient's producing node (with `step_bytes`: or the
        parameter's last reader, if later), insert the `add` node (marked with
        ACCUMULATES, or STEPS_IN_BACKWARD, so that plans can name it), reading the primal.
    Step 3: the output returns the `add` nodes' values in those positions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

from torch import fx

from ._torch_compat import is_tangent, storage_key

from .meta import ACCUMULATES, STEPS_IN_BACKWARD, WORKSPACE_BYTES, fake_value, value_tensors
from .partition import Cut
from .recompute import copy_graph_module


def save_parameters(cut: Cut, params: frozenset[str]) -> Cut:
    """`cut`, also saving the primals in `params` (resident: saving them costs nothing)."""
    extra = tuple(sorted(params - set(cut.saved)))
    return Cut(saved=cut.saved + extra, saved_symbols=cut.saved_symbols)


def last_readers(nodes: list[fx.Node]) -> dict[Any, fx.Node]:
    """Each storage (passes._torch_compat.storage_key of a traced value) mapped to the last
    of `nodes` that reads it (reads a node whose value lives in it: views share it)."""
    last: dict[Any, fx.Node] = {}
    for node in nodes:
        if node.op in ("placeholder", "output"):
            continue
        for arg in node.all_input_nodes:
            for t in value_tensors(fake_value(arg)):
                last[storage_key(t)] = node
    return last


def accumulate_in_place(joint: fx.GraphModule, num_fwd_outputs: int, params: frozenset[str],
                        add: Callable[[Any, Any], Any],
                        step_bytes: Mapping[str, int] | None = None
                        ) -> tuple[fx.GraphModule, int]:
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
    nodes = list(gm.graph.nodes)
    position = {n: k for k, n in enumerate(nodes)}
    readers = last_readers(nodes) if step_bytes is not None else {}
    for i, (primal, grad) in enumerate(zip(primals, grads)):
        if primal.name not in params or not isinstance(grad, fx.Node):
            continue
        # Step 2: right after the gradient is produced (after the inputs, for a gradient
        # that is a tangent as it came in), and a step after the parameter's last reader.
        where = placeholders[-1] if grad.op == "placeholder" else grad
        values = value_tensors(fake_value(primal))
        reader = readers.get(storage_key(values[0])) if values and readers else None
        if reader is not None and position[reader] > position[where]:
            where = reader
        with gm.graph.inserting_after(where):
            node = gm.graph.call_function(add, (grad, primal))
        if step_bytes is None:
            node.meta[ACCUMULATES] = primal.name
        else:
            node.meta[STEPS_IN_BACKWARD] = primal.name
            node.meta[WORKSPACE_BYTES] = step_bytes.get(primal.name, 0)
        node.meta["val"] = None
        outs[num_fwd_outputs + i] = node
        placed += 1
    # Step 3.
    output.args = (tuple(outs),) + tuple(output.args[1:])
    gm.recompile()
    return gm, placed
