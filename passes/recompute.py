"""Recomputation: drop mirrored forward values and recompute them in backward.

Chen et al. 2016, Alg. 2 ("memory optimized gradient graph construction") on
AOTAutograd's joint graph, for mirror counts m(v) in {0, 1}:

Requires: the joint GraphModule (see passes.partition) and a set of forward node
names to mirror (m(v) = 1). Run instead of `partition.find_cut` when a budget
binds; run `place_recomputation` on the backward graph the extraction returns.

Ensures: forward saves only what backward and the recomputed nodes read; each
recomputed node runs in backward just before its first use (Alg. 2's traversal
order), so a segment's recomputed values are alive only while that segment's
gradients are computed. Never mirrored: random ops (a recomputed dropout would
draw a new mask), mutating ops (BatchNorm statistics would update twice),
multi-output ops and their getitems, graph inputs, and forward outputs (they
stay alive anyway).

Algorithm:
    Step 1: `mirrorable`: the forward nodes that may be recomputed.
    Step 2: `mirror_cut`: the mirrored nodes backward needs (the mirrored
        ancestors of backward reads), then the saved set: every kept forward
        value read by backward or by a recomputed node.
    Step 3: extraction (passes.partition.partition) copies the needed mirrored
        nodes into the backward graph.
    Step 4: `place_recomputation`: reorder the backward graph: walk the original
        backward nodes in order and emit each one's not-yet-emitted recomputed
        ancestors just before it (Alg. 2: V' <- V' + topo(ancestors(g[v])) - V').
"""

from __future__ import annotations

import operator

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch.utils.flop_counter import flop_registry

from memopt._torch_compat import is_sym_node, storage_key

from .meta import fake_value, tensor_value
from .partition import Cut, forward_region


def _forward_outputs(joint: fx.GraphModule, num_fwd_outputs: int) -> set[fx.Node]:
    output = next(iter(joint.graph.find_nodes(op="output")))
    return {a for a in output.args[0][:num_fwd_outputs] if isinstance(a, fx.Node)}


def mirrorable(joint: fx.GraphModule, num_fwd_outputs: int) -> list[fx.Node]:
    """Step 1: forward nodes, in topological order, that may be recomputed in backward."""
    region = forward_region(joint, num_fwd_outputs)
    outputs = _forward_outputs(joint, num_fwd_outputs)
    result = []
    for node in joint.graph.nodes:
        if node not in region or node.op != "call_function" or node in outputs:
            continue
        op = node.target
        if op is operator.getitem or tensor_value(node) is None:
            continue  # tuples are kept whole; symbolic values travel separately
        if isinstance(op, torch._ops.OpOverload) and (
            op._schema.is_mutable or torch.Tag.nondeterministic_seeded in op.tags
        ):
            continue
        result.append(node)
    return result


def mirror_cut(joint: fx.GraphModule, num_fwd_outputs: int, mirrored: frozenset[str]) -> Cut:
    """Step 2: the saved values when the nodes named in `mirrored` are recomputed."""
    region = forward_region(joint, num_fwd_outputs)
    allowed = {n.name for n in mirrorable(joint, num_fwd_outputs)}
    mirror = {n for n in region if n.name in mirrored and n.name in allowed}
    backward = [n for n in joint.graph.nodes
                if n not in region and n.op not in ("output", "placeholder")]
    needed: set[fx.Node] = set()
    stack = [a for b in backward for a in b.all_input_nodes if a in mirror]
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(a for a in node.all_input_nodes if a in mirror)
    readers = set(backward) | needed
    saved, symbols = [], []
    for node in joint.graph.nodes:
        if node not in region or node in needed or node.op == "output":
            continue
        if not any(user in readers for user in node.users):
            continue
        if is_sym_node(node):
            symbols.append(node.name)
        elif not isinstance(fake_value(node), (tuple, list)):
            saved.append(node.name)
    return Cut(saved=tuple(saved), saved_symbols=tuple(symbols))


def place_recomputation(bw: fx.GraphModule, recomputed: frozenset[str]) -> int:
    """Step 4: move each recomputed node just before its first use. Returns how many moved."""
    graph = bw.graph
    nodes = list(graph.nodes)
    emitted = {n for n in nodes if n.op == "placeholder"}
    order: list[fx.Node] = []

    def emit(root: fx.Node) -> None:
        stack = [(root, False)]
        while stack:
            node, ready = stack.pop()
            if node in emitted:
                continue
            if ready:
                emitted.add(node)
                order.append(node)
                continue
            stack.append((node, True))
            stack.extend((a, False) for a in node.all_input_nodes if a not in emitted)

    for node in nodes:
        if node.op in ("placeholder", "output") or node.name in recomputed:
            continue
        emit(node)
    moved = sum(1 for n in order if n.name in recomputed)
    cursor = [n for n in nodes if n.op == "placeholder"][-1]  # backward always has tangents
    for node in order:
        cursor.append(node)
        cursor = node
    dead = [n for n in graph.nodes if n.name in recomputed and n not in emitted]
    for node in reversed(dead):
        if not node.users:
            graph.erase_node(node)
    graph.lint()
    bw.recompile()
    return moved


def node_flops(node: fx.Node) -> int:
    """Cost of recomputing `node` (Chen Sec. 4.2: prefer dropping cheap ops): the
    FLOP formula PyTorch's FlopCounterMode uses for matmuls and convolutions, else
    one operation per output element."""
    out = tensor_value(node)
    fallback = int(out.numel()) if out is not None else 0
    formula = flop_registry.get(getattr(node.target, "overloadpacket", None))
    if formula is None or out is None:
        return fallback

    def shape(a: object) -> object:
        if isinstance(a, fx.Node):
            val = tensor_value(a)
            return val.shape if val is not None else fake_value(a)
        return a

    try:
        args, kwargs = pytree.tree_map(shape, (node.args, node.kwargs))
        return int(formula(*args, **kwargs, out_shape=out.shape))
    except Exception:  # a formula that wants more than shapes: count elements
        return fallback


def storage_sizes(nodes: list[fx.Node]) -> list[int]:
    """Bytes each node's output adds (0 for views of an earlier node's storage)."""
    seen: set[object] = set()
    sizes = []
    for node in nodes:
        for arg in node.all_input_nodes:
            if (a := tensor_value(arg)) is not None:
                seen.add(storage_key(a))
        val = tensor_value(node)
        key = storage_key(val) if val is not None else None
        sizes.append(val.untyped_storage().nbytes() if key is not None and key not in seen else 0)
        seen.add(key)
    return sizes
