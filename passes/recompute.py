"""Recomputation: drop mirrored forward values and recompute them in backward.

Chen et al. 2016, Alg. 2 ("memory optimized gradient graph construction") on
AOTAutograd's joint graph, for mirror counts m(v) in {0, 1}.

Requires: the joint GraphModule (see passes.partition) and a set of forward node
names to mirror (m(v) = 1).

Ensures: a copy of the joint graph with a mirror node per needed mirrored value:
backward reads the mirror node, which recomputes the value from kept forward values
and other mirror nodes, and runs just before its first use (Alg. 2's traversal
order), so a segment's recomputed values are alive only while that segment's
gradients are computed. `partition.find_cut` on the copy saves only what backward
and the mirror nodes read. Never re-run: random ops (a recomputed dropout would draw
a new mask), mutating ops, and ops reading a buffer the step mutates (BatchNorm
statistics); dropout and training-mode BatchNorm outputs are recomputed by pure
twins instead (passes.twins). Never mirrored: graph inputs and forward outputs
(they stay alive anyway).

Algorithm:
    Step 1: `mirrorable`: the forward nodes that may be recomputed.
    Step 2: the mirrored nodes backward needs: the mirrored ancestors of backward
        reads (through the values each recomputation reads, `recompute_sources`).
    Step 3: one mirror node per needed node: a copy of the node (a multi-output op
        copied once for all its getitems), or a twin; backward reads it.
    Step 4: `place_recomputation`: walk the nodes in order and emit each one's
        not-yet-emitted mirror ancestors just before it
        (Alg. 2: V' <- V' + topo(ancestors(g[v])) - V').
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy
from torch.utils.flop_counter import flop_registry

from memopt.allocator.mirror import placement_order

from ._torch_compat import OpOverload, pytree, storage_key

from .meta import KEPT_ARGS, fake_value, mark_mirror, recomputed_from, tensor_value
from .partition import forward_region
from .twins import emit_twin, is_twinned, twin_sources


def _forward_outputs(joint: fx.GraphModule, num_fwd_outputs: int) -> set[fx.Node]:
    output = next(iter(joint.graph.find_nodes(op="output")))
    return {a for a in output.args[0][:num_fwd_outputs] if isinstance(a, fx.Node)}


def _pure(node: fx.Node, mutable_inputs: frozenset[str]) -> bool:
    """Running `node` again gives the same value: no mutation, no random draw, and no
    read of an input the step may mutate (a buffer: its new value is written back
    after the forward, so a backward recomputation would read the wrong one)."""
    op = node.target
    if isinstance(op, OpOverload) and (
        op._schema.is_mutable or torch.Tag.nondeterministic_seeded in op.tags
        or op.namespace == "memopt"  # a recurrent chain: state behind its handle
    ):
        return False
    return not any(a.op == "placeholder" and a.name in mutable_inputs
                   for a in node.all_input_nodes)


def mirrorable(joint: fx.GraphModule, num_fwd_outputs: int,
               mutable_inputs: frozenset[str] = frozenset()) -> list[fx.Node]:
    """Step 1: forward nodes, in topological order, that may be recomputed in backward.

    A single-tensor node qualifies when it is `_pure`. One output of a multi-output
    op qualifies when the op is pure (the op is then recomputed with it, see
    `add_mirror_nodes`) or when a pure twin computes it (passes.twins: dropout from its
    saved mask, training-mode BatchNorm without its running statistics).
    """
    region = forward_region(joint, num_fwd_outputs)
    outputs = _forward_outputs(joint, num_fwd_outputs)
    kept = kept_by_ops(joint)
    result = []
    for node in joint.graph.nodes:
        if node not in region or node.op != "call_function" or node in outputs or node in kept:
            continue
        if node.target is operator.getitem:
            parent = node.args[0]
            if is_twinned(node) or (isinstance(parent, fx.Node) and parent.op == "call_function"
                                   and _pure(parent, mutable_inputs)):
                result.append(node)
        elif tensor_value(node) is not None and _pure(node, mutable_inputs):
            result.append(node)  # tuples: through their getitems; symbols travel separately
    return result


#: The tags dynamo gives the nodes of a torch.utils.checkpoint region that eager recomputes
_RECOMPUTED_BY_USER = (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)


def user_checkpointed(joint: fx.GraphModule, num_fwd_outputs: int,
                      mutable_inputs: frozenset[str] = frozenset()) -> frozenset[str]:
    """The mirrorable forward nodes the model's own `torch.utils.checkpoint` regions
    recompute in eager (dynamo tags each region's nodes: node.meta "recompute", one
    "ac_graph_id" a region; a selective policy's saved ops are tagged to save), less each
    region's outputs: the forward reads them outside the region, and eager keeps them
    (the next region's saved input, or what the code after it saves). A value read by an
    op of its region that a selective policy saves (a matmul's input) is inside the
    region and recomputed, as eager does: kept, a selective policy over half a model's
    blocks measured 1.108x eager's peak with no budget (found from outside). A plan with no
    budget recomputes these, as eager does (Chen et al. 2016, Sec. 4.1: the user's
    segments), instead of keeping what the model asked to recompute."""
    region = forward_region(joint, num_fwd_outputs)

    def inside(node: fx.Node, graph_id: object) -> bool:  # any policy, that region
        return node.meta.get("recompute") is not None \
            and node.meta.get("ac_graph_id") == graph_id

    names = set()
    for node in mirrorable(joint, num_fwd_outputs, mutable_inputs):
        graph_id = node.meta.get("ac_graph_id")
        if node.meta.get("recompute") in _RECOMPUTED_BY_USER \
                and all(inside(u, graph_id) for u in node.users if u in region):
            names.add(node.name)
    return frozenset(names)


def kept_by_ops(joint: fx.GraphModule) -> set[fx.Node]:
    """Values an opaque op holds until its backward (meta KEPT_ARGS: a recurrent chain's
    inputs), with the nodes that made their storage (the views they are read through, up
    to the op that allocated it). Mirroring one would free nothing: the op's handle still
    holds the forward's storage when the copy is made, which the plan would not count (an
    LSTM LM's embedding, recomputed at memopt's minimum, measured 9% above the plan)."""
    kept: set[fx.Node] = set()
    for node in joint.graph.nodes:
        for index in node.meta.get(KEPT_ARGS, ()):
            # an argument's position, or (position, k): the k-th tensor of a list argument
            value = node.args[index] if isinstance(index, int) else node.args[index[0]][index[1]]
            if not isinstance(value, fx.Node) or tensor_value(value) is None:
                continue
            key = storage_key(tensor_value(value))
            stack = [value]
            while stack:
                v = stack.pop()
                if v in kept:
                    continue
                kept.add(v)
                stack.extend(i for i in v.all_input_nodes if tensor_value(i) is not None
                             and storage_key(tensor_value(i)) == key)
    return kept


def recompute_sources(node: fx.Node) -> list[fx.Node]:
    """The forward values recomputing `node` reads (a getitem: its op's inputs)."""
    if is_twinned(node):
        return twin_sources(node)
    if node.target is operator.getitem:
        return node.args[0].all_input_nodes
    return node.all_input_nodes


def copy_graph_module(joint: fx.GraphModule) -> fx.GraphModule:
    """The same graph, node names and metadata (shared FakeTensors), as a new module."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in joint.graph.nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
    return fx.GraphModule(joint, graph)


def add_mirror_nodes(joint: fx.GraphModule, num_fwd_outputs: int, mirrored: frozenset[str],
                     mutable_inputs: frozenset[str] = frozenset(),
                     twice: frozenset[str] = frozenset()) -> fx.GraphModule:
    """Steps 2-4: a copy of `joint` in which backward reads mirror nodes (Chen Alg. 2)
    for the mirrorable nodes named in `mirrored`; `joint` itself is untouched.

    m(v) = 1 for the names in `mirrored` only; m(v) = 2 for those also in `twice`
    (Chen Sec. 4.4, the recursion): such a node gets two mirror nodes, "A" feeding
    the recomputation of the m(v) = 1 nodes (the sub-segment boundaries) and "B"
    feeding backward, so only one sub-segment's values are alive at a time.
    Partition the result with `partition.find_cut`: the mirror nodes are backward
    nodes, so forward saves only what backward and the mirror nodes read.
    """
    gm = copy_graph_module(joint)
    region = forward_region(gm, num_fwd_outputs)
    mirror = {n for n in mirrorable(gm, num_fwd_outputs, mutable_inputs) if n.name in mirrored}
    backward = [n for n in gm.graph.nodes if n not in region and n.op not in ("output", "placeholder")]

    def level(reader: str, node: fx.Node) -> str:
        """Which mirror node of `node` a reader at `reader`'s level reads."""
        if node.name not in twice:
            return "S"
        return "B" if reader in ("B", "bw") else "A"

    # Step 2: the mirrored ancestors of backward reads, per level.
    needed: set[tuple[fx.Node, str]] = set()
    stack = [(a, level("bw", a)) for b in backward for a in b.all_input_nodes if a in mirror]
    while stack:
        node, lvl = stack.pop()
        if (node, lvl) not in needed:
            needed.add((node, lvl))
            stack.extend((a, level(lvl, a)) for a in recompute_sources(node) if a in mirror)
    # Step 3: one mirror node per needed (node, level), in forward order, reading mirror
    # nodes where they exist; a getitem's op is mirrored once per level, a twin
    # replaces a random or stateful op. They go before the output; Step 4 moves them.
    clones: dict[tuple[fx.Node, str], fx.Node] = {}
    ops: dict[str, dict[fx.Node, fx.Node]] = {"A": {}, "S": {}, "B": {}}
    # a twin apart from the op's own copy: an InstanceNorm's BatchNorm has its normalized
    # output recomputed by its twin and its running statistics (read by its backward) by
    # a copy of the op, whose outputs the twin lacks
    twins: dict[str, dict[fx.Node, fx.Node]] = {"A": {}, "S": {}, "B": {}}
    output = next(iter(gm.graph.find_nodes(op="output")))
    with gm.graph.inserting_before(output):
        for node in [n for n in gm.graph.nodes if n in mirror]:
            for lvl in ("A", "S", "B"):
                if (node, lvl) not in needed:
                    continue

                def env(a: fx.Node, lvl: str = lvl) -> fx.Node:
                    return clones[(a, level(lvl, a))] if a in mirror else a

                if is_twinned(node):
                    clones[(node, lvl)] = emit_twin(gm.graph, node, env, twins[lvl], lvl)
                    continue
                if node.target is operator.getitem:
                    op = node.args[0]
                    if op not in ops[lvl]:
                        ops[lvl][op] = gm.graph.node_copy(op, env)
                        mark_mirror(ops[lvl][op], op, lvl)
                    clone = gm.graph.node_copy(node, lambda a, o=ops[lvl]: o.get(a, a))
                else:
                    clone = gm.graph.node_copy(node, env)
                mark_mirror(clone, node, lvl)
                clones[(node, lvl)] = clone
    for node in backward:
        for arg in node.all_input_nodes:
            if arg in mirror:
                node.replace_input_with(arg, clones[(arg, level("bw", arg))])
    # Step 4: each mirror node just before its first use.
    place_recomputation(gm, frozenset(n.name for n in gm.graph.nodes if recomputed_from(n)))
    return gm


def place_recomputation(gm: fx.GraphModule, recomputed: frozenset[str]) -> int:
    """Step 4: move each recomputed node just before its first use. Returns how many moved."""
    graph = gm.graph
    nodes = list(graph.nodes)
    emitted = {n for n in nodes if n.op == "placeholder"}
    order = placement_order([n for n in nodes if n.op != "output" and n.name not in recomputed],
                            lambda n: n.all_input_nodes, emitted)
    moved = sum(1 for n in order if n.name in recomputed)
    cursor = [n for n in nodes if n.op == "placeholder"][-1]  # a joint graph has tangents
    for node in order:
        cursor.append(node)
        cursor = node
    dead = [n for n in graph.nodes if n.name in recomputed and n not in emitted]
    for node in reversed(dead):
        if not node.users:
            graph.erase_node(node)
    graph.lint()  # no recompile: the graph is partitioned next, not run
    return moved


def node_flops(node: fx.Node) -> int:
    """Cost of recomputing `node` (Chen Sec. 4.2: prefer dropping cheap ops): the
    FLOP formula PyTorch's FlopCounterMode uses for matmuls and convolutions, else
    one operation per output element."""
    out = tensor_value(node)
    inputs = [v for v in map(tensor_value, node.all_input_nodes) if v is not None]
    if out is None or any(storage_key(v) == storage_key(out) for v in inputs):
        return 0  # a view (or a tuple's getitem): no arithmetic
    return arithmetic(node)


def arithmetic(node: fx.Node) -> int:
    """`node_flops` of a node that is not a view (0 without a single tensor value)."""
    out = tensor_value(node)
    if out is None:
        return 0
    fallback = int(out.numel())
    formula = flop_registry.get(getattr(node.target, "overloadpacket", None))
    if formula is None:
        return fallback
    # the registry's formulas take values (FakeTensors will do) and the output as out_val
    args, kwargs = pytree.tree_map(
        lambda a: fake_value(a) if isinstance(a, fx.Node) else a, (node.args, node.kwargs))
    try:
        return int(formula(*args, **kwargs, out_val=out))
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


def last_uses(nodes: list[fx.Node]) -> list[int]:
    """For each node of `nodes` (a topological order), the index of the last node in
    `nodes` reading its storage, directly or through a view (its own index if none)."""
    index = {node: i for i, node in enumerate(nodes)}
    last = list(range(len(nodes)))
    for i in range(len(nodes) - 1, -1, -1):
        node = nodes[i]
        for user in node.users:
            last[i] = max(last[i], index.get(user, i))
        keys = {storage_key(t) for t in pytree.tree_leaves(fake_value(node))
                if isinstance(t, torch.Tensor)}
        for arg in node.all_input_nodes:  # a view or getitem keeps its source alive
            src = tensor_value(arg)
            if arg in index and (src is None or storage_key(src) in keys):
                last[index[arg]] = max(last[index[arg]], last[i])
    return last
