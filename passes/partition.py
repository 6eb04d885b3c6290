"""Partition the joint forward+backward graph into a forward and a backward graph.

Requires: the joint GraphModule AOTAutograd traced (functional aten ops, FakeTensors
in `node.meta['val']`, primals then tangents as placeholders, the first
`num_fwd_outputs` outputs belonging to the forward).

Ensures: a forward graph that returns its outputs followed by the values it saves
for backward, and a backward graph that takes those saved values and the tangents.

Algorithm:
    Step 1: find the forward region: the primals, every node AOTAutograd tagged as
        forward, every ancestor of a forward output, and the getitems of forward
        multi-output nodes.
    Step 2: the values to save are the forward-region nodes that a node outside the
        region uses (the cut between the two regions). Tuple-valued nodes are
        saved through their getitems; symbolic sizes travel separately.
    Step 3: extract the two GraphModules for that cut. Nothing is recomputed: every
        backward use of a forward value reads a saved value. This is the
        dependency structure of Chen et al. 2016, Sec. 3 before any mirroring.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from torch import fx

from memopt._torch_compat import extract_fwd_bwd, is_sym_node, is_tangent

from .meta import fake_value, is_forward_tagged


@dataclass(frozen=True)
class Cut:
    """The forward values kept for backward, by node name."""

    saved: tuple[str, ...]
    saved_symbols: tuple[str, ...]


def forward_region(joint: fx.GraphModule, num_fwd_outputs: int) -> set[fx.Node]:
    """Step 1: the nodes that belong to the forward graph."""
    output = next(iter(joint.graph.find_nodes(op="output")))
    region: set[fx.Node] = set()
    stack = [a for a in output.args[0][:num_fwd_outputs] if isinstance(a, fx.Node)]
    while stack:
        node = stack.pop()
        if node not in region:
            region.add(node)
            stack.extend(node.all_input_nodes)
    for node in joint.graph.nodes:
        if node.op == "placeholder" and not is_tangent(node):
            region.add(node)
        elif is_forward_tagged(node) and not any(is_tangent(a) for a in node.all_input_nodes):
            region.add(node)
        elif node.target is operator.getitem and node.args[0] in region:
            region.add(node)
    return region


def find_cut(joint: fx.GraphModule, num_fwd_outputs: int) -> Cut:
    """Step 2: the forward values the backward region reads."""
    region = forward_region(joint, num_fwd_outputs)
    saved: list[str] = []
    symbols: list[str] = []
    for node in joint.graph.nodes:
        if node not in region or node.op == "output":
            continue
        if not any(user not in region and user.op != "output" for user in node.users):
            continue
        if is_sym_node(node):
            symbols.append(node.name)
        elif isinstance(fake_value(node), (tuple, list)):
            continue  # its getitems are in the region and are saved one by one
        else:
            saved.append(node.name)
    return Cut(saved=tuple(saved), saved_symbols=tuple(symbols))


def partition(
    joint: fx.GraphModule, num_fwd_outputs: int, cut: Cut
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Step 3: the forward and backward GraphModules for `cut`."""
    by_name = {node.name: node for node in joint.graph.nodes}
    return extract_fwd_bwd(
        joint,
        [by_name[name] for name in cut.saved],
        [by_name[name] for name in cut.saved_symbols],
        num_fwd_outputs,
    )
