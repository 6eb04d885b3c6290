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
    Step 3: declare minimum dependencies (Chen et al. 2016, Sec. 3, "Guidelines"):
        a saved value that a concatenation (`stack` / `cat` along dim 0) copied
        whole is read in backward as a view of that concatenation whenever the
        concatenation is kept anyway (saved, or a forward output). The inputs of
        `torch.stack(hidden_states)` in a recurrent loop then die in forward.
    Step 4: extract the two GraphModules for that cut. Nothing is recomputed: every
        backward use of a forward value reads a saved value (or a view of one).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from ._torch_compat import extract_fwd_bwd, is_sym_node, is_tangent

from .meta import PARTITIONER_TAG, fake_value, is_forward_tagged, tensor_value


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


_aten = torch.ops.aten
_CONCATS = (_aten.stack.default, _aten.cat.default)


def _concat_pieces(node: fx.Node) -> list[tuple[fx.Node, int, int]] | None:
    """(input, start, length) along dim 0 for a dim-0 stack/cat of contiguous inputs."""
    if node.target not in _CONCATS or not isinstance(node.args[0], (list, tuple)):
        return None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    out = tensor_value(node)
    if dim != 0 or out is None or not out.is_contiguous():
        return None
    pieces, start = [], 0
    for piece in node.args[0]:
        val = tensor_value(piece) if isinstance(piece, fx.Node) else None
        if val is None or not val.is_contiguous() or val.dtype != out.dtype:
            return None
        length = 1 if node.target is _aten.stack.default else int(val.shape[0])
        pieces.append((piece, start, length))
        start += length
    return pieces


def read_concat_views(joint: fx.GraphModule, num_fwd_outputs: int, cut: Cut) -> int:
    """Step 3: redirect backward reads of concatenated saved values to views of the
    concatenation, when the concatenation is kept for backward anyway. Returns how
    many saved values no longer need saving. Call `find_cut` again afterwards."""
    region = forward_region(joint, num_fwd_outputs)
    output = next(iter(joint.graph.find_nodes(op="output")))
    kept = set(cut.saved) | {a.name for a in output.args[0][:num_fwd_outputs]
                             if isinstance(a, fx.Node)}
    saved = set(cut.saved)
    freed = 0
    for concat in list(joint.graph.nodes):
        if concat not in region or concat.name not in kept:
            continue
        pieces = _concat_pieces(concat)
        for piece, start, length in pieces or ():
            readers = [u for u in piece.users if u not in region and u.op != "output"]
            if piece.name not in saved or not readers:
                continue
            with joint.graph.inserting_after(concat):
                if concat.target is _aten.stack.default:
                    view = joint.graph.call_function(_aten.select.int, (concat, 0, start))
                    view.meta["val"] = tensor_value(concat).select(0, start)
                else:
                    view = joint.graph.call_function(
                        _aten.slice.Tensor, (concat, 0, start, start + length))
                    view.meta["val"] = tensor_value(concat)[start:start + length]
            if view.meta["val"].stride() != tensor_value(piece).stride():
                joint.graph.erase_node(view)
                continue
            view.meta[PARTITIONER_TAG] = "is_backward"
            for reader in readers:
                reader.replace_input_with(piece, view)
            freed += 1
    if freed:
        joint.recompile()
    return freed


def partition(
    joint: fx.GraphModule, num_fwd_outputs: int, cut: Cut
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Step 4: the forward and backward GraphModules for `cut`."""
    by_name = {node.name: node for node in joint.graph.nodes}
    return extract_fwd_bwd(
        joint,
        [by_name[name] for name in cut.saved],
        [by_name[name] for name in cut.saved_symbols],
        num_fwd_outputs,
    )
