"""No zero gradients for the outputs no loss reads.

A compiled graph is one autograd node with one output per returned tensor. When the loss
reads some of them only (a model returns its hidden states or a key/value cache beside
the loss), autograd's engine makes a dense zero gradient for every other output before it
calls the node's backward, bytes eager never allocates: its own nodes that made those
outputs are simply not reached. HF Moonshine measured 1.019x eager's peak with no budget
from them (its caches and final LayerNorm outputs, 74,244 bytes at the peak), and the
zoo's LSTM returning its summed states 1.11x.

With no budget (memopt.compiled_graph), the node is told not to make them (`skip_zero_grads`, after each forward: autograd
then passes None), and memopt's own backward wrapper (`fill_unused`, op by op only)
hands the graph, for a None, a zero of the tangent's shape that is one element
broadcast (its strides 0): the same values, no bytes. Where a zero may be written or kept
(an in-place rewrite writes into the tangent's storage, memopt's own ops read it, or the
graph returns it) it is a real zero tensor, as autograd would have made. The plan still
counts every tangent whole: what it predicts stays an upper bound of the step. Under a
budget that count would make the planner recompute for bytes the step never holds (the
zoo Mamba's returned logits, unused by the loss it computes inside: 8.2 MB, its plan 14%
above the measurement), so there autograd's zeros stay until the planner learns which
outputs go unused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from memopt.passes._torch_compat import OpOverload, is_tangent, pytree, storage_key
from memopt.passes.meta import inplace_source, tensor_value

#: the name torch gives the autograd node of an AOTAutograd-compiled graph
_NODE = "CompiledFunctionBackward"
#: readers that address a tensor's storage directly: a one-element zero would not do
_LAYOUT = frozenset({"as_strided", "_unsafe_view", "view", "_reshape_alias", "unfold",
                     "set_", "view_as_complex", "view_as_real"})


def skip_zero_grads(out: Any) -> None:
    """Tell the compiled graph's autograd node behind `out` to pass None, not zeros, for
    the outputs no loss reads."""
    for t in pytree.tree_leaves(out):
        node = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
        while node is not None and _NODE not in type(node).__name__:
            # an output AOTAutograd regenerates as a view of another: its view node first
            nexts = [n for n, _ in node.next_functions if n is not None]
            node = nexts[0] if len(nexts) == 1 else None
        if node is not None:
            node.set_materialize_grads(False)
            return


def _writes(node: fx.Node, aliases: Callable[[fx.Node], bool]) -> bool:
    """Whether `node`'s op writes into an argument for which `aliases` holds."""
    schema = node.target._schema
    for position, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.args[position] if position < len(node.args) else node.kwargs.get(arg.name)
        if any(isinstance(v, fx.Node) and aliases(v) for v in pytree.tree_leaves(value)):
            return True
    return False


def _kept_whole(bw: fx.GraphModule, tangent: fx.Node) -> bool:
    """Whether a zero for `tangent` must be a real tensor: something writes into its
    storage, one of memopt's own ops reads it, or the graph returns it (as a gradient)."""
    value = tensor_value(tangent)
    if value is None:
        return True
    key = storage_key(value)

    def aliases(node: fx.Node) -> bool:
        v = tensor_value(node)
        return v is not None and storage_key(v) == key

    by_name = {n.name: n for n in bw.graph.nodes}
    for node in bw.graph.nodes:
        source = inplace_source(node)
        if source is not None and source in by_name and aliases(by_name[source]):
            return True
        reads = [a for a in node.all_input_nodes if aliases(a)]
        if not reads:
            continue
        if node.op == "output":
            return True
        op = node.target
        if isinstance(op, OpOverload) and (op.namespace == "memopt" or _writes(node, aliases)
                                           or op._schema.name.split("::")[-1] in _LAYOUT):
            return True
        if not isinstance(op, OpOverload) and node.op == "call_function" \
                and getattr(op, "__module__", "").startswith("memopt"):
            return True
    return False


def fill_unused(bw: fx.GraphModule, run: Callable[[list[Any]], Any]) -> Callable:
    """`run` (a boxed backward) taking None for a tangent: a zero in its place
    (broadcast from one element where nothing writes or keeps it)."""
    fills: dict[int, Callable[[], torch.Tensor]] = {}
    for k, node in enumerate(bw.graph.find_nodes(op="placeholder")):
        value = tensor_value(node)
        if not is_tangent(node) or value is None:
            continue
        shape, dtype, device = tuple(value.shape), value.dtype, value.device
        if _kept_whole(bw, node):
            fills[k] = lambda s=shape, d=dtype, v=device: torch.zeros(s, dtype=d, device=v)
        else:
            fills[k] = lambda s=shape, d=dtype, v=device: \
                torch.zeros((), dtype=d, device=v).expand(s)
    if not fills:
        return run

    def filled(args: list[Any]) -> Any:
        for k, make in fills.items():
            if k < len(args) and args[k] is None:
                args[k] = make()
        return run(args)

    filled._boxed_call = True  # type: ignore[attr-defined]
    return filled
