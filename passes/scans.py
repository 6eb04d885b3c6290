"""Parallel (associative) scans in a captured graph: run as their sequential loop, and what a
plan saves of those left as they are.

A state-space model's recurrence can be computed as a parallel scan: `torch._higher_order_ops
.associative_scan` builds a log-depth tree over the sequence (Blelloch's up-sweep and
down-sweep; on the CPU, combine_mode="generic", dynamo traces the tree as plain ops). Traced
for training, every level of the tree is kept for backward, where the sequential loop that
eager PyTorch runs keeps one state per step: transformers' Mamba takes the parallel path
under torch.compile by default (`config.use_associative_scan`), and memopt measured it at
1.57x eager's peak with no budget (issue 28).

`sequential_scans` rewrites such a tree, in the torch-level graph dynamo hands a backend,
into the loop eager would run: ``out[0] = x[0]``, ``out[t] = combine(out[t-1], x[t])``, the
combine function's ops copied from the tree's first level (traced under ``torch.vmap``, each
op there already sees one element's shape). passes.cell_loops then runs that loop as a
Gruslys chain (Gruslys et al. 2016), and passes.scan_inputs moves the discretization into
its step. An associative combine gives the same values in either order up to rounding: the
loop's are the ones eager's sequential path computes. A tree the rewrite does not recognize
is left as it is, and memopt warns (memopt.compiled_graph) with the bytes the plan saves of
it.

Requires: fx graphs whose nodes carry dynamo's `stack_trace` (AOTAutograd copies it to the
joint graph's nodes).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Iterable

import torch
from torch import fx

from .loop_packing import example_value
from .scan_inputs import made_like
from .scan_outputs import stages

log = logging.getLogger("memopt")

#: What names torch's associative scan: the higher-order op's target, and the call in the
#: stack trace dynamo records for each node traced inside it (the generic mode: its frames
#: inside torch are left out, the user's call `associative_scan(...)` is the last line).
SCAN_NAME = "associative_scan"


def from_scan(node: fx.Node) -> bool:
    """Whether `node` computes part of an associative scan."""
    target = getattr(node.target, "__name__", "") or str(node.target)
    return SCAN_NAME in target or SCAN_NAME in (node.meta.get("stack_trace") or "")


def scan_nodes(gm: fx.GraphModule) -> list[str]:
    """The names of the nodes of `gm` that compute part of an associative scan."""
    return [n.name for n in gm.graph.nodes if n.op == "call_function" and from_scan(n)]


def scan_saved_bytes(fw: fx.GraphModule, saved: Iterable[tuple[str, int]]) -> int:
    """Of the saved tensors `saved` ((forward node name, bytes) pairs), the bytes of those
    the forward graph `fw` computes inside an associative scan."""
    nodes = {n.name: n for n in fw.graph.nodes}
    return sum(nbytes for name, nbytes in saved
               if name in nodes and from_scan(nodes[name]))


# -- the tree as its sequential loop -------------------------------------------------------

#: Bookkeeping calls torch.vmap leaves in a traced graph (no stack trace of their own).
_VMAP_CALLS = ("_vmap_increment_nesting", "_vmap_decrement_nesting", "lazy_load_decompositions",
               "_add_batch_dim", "_remove_batch_dim")


def _name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target))


def _movedim(node: fx.Node) -> tuple[fx.Node, int, int] | None:
    """(x, source, destination) for ``torch.movedim(x, source, destination)``."""
    if node.op != "call_function" or node.target is not torch.movedim or len(node.args) != 3:
        return None
    x, src, dst = node.args
    value = example_value(x)
    if not (isinstance(x, fx.Node) and isinstance(value, torch.Tensor)
            and type(src) is int and type(dst) is int):
        return None
    return x, src % value.dim(), dst % value.dim()


def _regions(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """Runs of consecutive nodes that compute one associative scan (vmap's bookkeeping,
    which has no stack trace, included)."""
    runs: list[list[fx.Node]] = []
    run: list[fx.Node] = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and from_scan(node):
            run.append(node)
        elif run and node.op == "call_function" and _name(node) in _VMAP_CALLS:
            run.append(node)
        elif run:
            runs.append(run)
            run = []
    return runs + ([run] if run else [])


class _Tree:
    """One traced scan: its inputs ``xs`` along ``dim``, its outputs (the final movedims),
    and the combine function's ops with their 2k inputs (left leaves, then right)."""

    def __init__(self, region: list[fx.Node]) -> None:
        while region and _movedim(region[-1]) is None:
            region = region[:-1]
        starts = [m for m in map(_movedim, region) if m is not None and m[2] == 0]
        names = [_name(n) for n in region]
        self.region, self.ok = region, False
        if "_vmap_increment_nesting" not in names or "_vmap_decrement_nesting" not in names:
            return
        block = region[names.index("_vmap_increment_nesting"):names.index("_vmap_decrement_nesting")]
        self.inputs = [n for n in block if _name(n) == "_add_batch_dim"]
        removes = [n for n in block if _name(n) == "_remove_batch_dim"]
        k = len(removes)
        if k == 0 or len(starts) < k or len(self.inputs) != 2 * k:
            return
        self.xs = [m[0] for m in starts[:k]]
        self.dim = starts[0][1]
        self.ends = region[-k:]
        ends = [_movedim(n) for n in self.ends]
        self.body = [n for n in block[block.index(self.inputs[-1]) + 1:block.index(removes[0])]
                     if _name(n) not in _VMAP_CALLS]
        self.outputs = [r.args[0] for r in removes]
        inside = set(region)
        self.ok = (len({m[1] for m in starts[:k]}) == 1
                   and all(e is not None and e[1:] == (0, self.dim) for e in ends)
                   and all(n in self.ends or set(n.users) <= inside for n in region)
                   and not any("flip" in _name(n) for n in region)
                   and len({tuple(example_value(x).shape) for x in self.xs}) == 1
                   and all(a.args[0] in inside for a in self.inputs))


def sequential_scans(gm: fx.GraphModule, min_steps: int) -> int:
    """Rewrite every recognized associative-scan tree of ``gm`` (traced inline, the
    generic combine mode) into its sequential loop, in place (module docstring). A scan
    over fewer than ``min_steps`` elements is left as it is. Returns how many were
    rewritten."""
    done = 0
    for region in _regions(gm):
        tree = _Tree(region)
        steps = example_value(tree.xs[0]).shape[tree.dim] if tree.ok else 0
        if steps < min_steps:
            if region:
                log.debug("memopt scans: the parallel scan at %s left as a tree (%s)",
                          region[0].name, "fewer steps" if tree.ok else "not recognized")
            continue
        _unroll(gm, tree, steps)
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
        log.info("memopt scans: %d parallel scan(s) run as their sequential loop", done)
    return done


def _unroll(gm: fx.GraphModule, tree: _Tree, steps: int) -> None:
    graph = gm.graph
    dim = tree.dim
    made: list[fx.Node] = []

    def new(op: str, target: object, args: tuple, kwargs: dict | None = None,
            like: fx.Node = tree.ends[0]) -> fx.Node:
        # no longer part of a tree: without the scan's stack trace (from_scan)
        node = made_like(graph, like, op, target, args, kwargs, trace=False)
        made.append(node)
        return node

    def read(x: fx.Node, t: int) -> fx.Node:
        return new("call_function", operator.getitem, (x, (slice(None),) * dim + (t,)))

    # ops after the scan that run per element (Mamba's matmul with C) move into the steps
    after = {j: stages(end, dim, tree.region) for j, end in enumerate(tree.ends) if end.users}

    def staged(j: int, value: fx.Node, t: int) -> fx.Node:
        for stage in after[j]:
            value = stage.step(new, value, t)
        return value

    with graph.inserting_before(tree.region[0]):
        # the first state a copy (an op, as the later states are: a loop starts at step 1)
        state = [new("call_method", "clone", (read(x, 0),)) for x in tree.xs]
        outs = {j: [staged(j, state[j], 0)] for j in after}
        for t in range(1, steps):
            env = dict(zip(tree.inputs, [*state, *(read(x, t) for x in tree.xs)]))
            for node in tree.body:
                env[node] = new(node.op, node.target,
                                *fx.node.map_arg((node.args, node.kwargs), lambda a: env.get(a, a)),
                                like=node)
            state = [env[o] for o in tree.outputs]
            for j in after:
                outs[j].append(staged(j, state[j], t))
        for j, chain in after.items():
            last, out_dim = (chain[-1].node, chain[-1].dim_out) if chain else (tree.ends[j], dim)
            first = new("call_method", "unsqueeze", (outs[j][0], out_dim))
            rest = new("call_function", torch.stack, (outs[j][1:], out_dim))
            last.replace_all_uses_with(new("call_function", torch.cat, ([first, rest], out_dim)))
            for stage in reversed(chain):
                graph.erase_node(stage.node)
    for node in reversed(tree.region):
        graph.erase_node(node)
    for node in reversed(made):  # a combine output nothing reads (Mamba's product of dA)
        if not node.users:
            graph.erase_node(node)
