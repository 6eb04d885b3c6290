"""Save one copy of a value the forward computes twice.

Chen et al. 2016, Sec. 3 shares memory between values whose lifetimes do not overlap;
this pass removes a copy outright where two saved values are the same computation.
Model code often repeats a computation per layer: transformers' Pegasus and Marian
convert the same boolean mask to a float mask in every attention layer, and each
layer's copy is saved for the backward (as eager saves it): a copy per layer, where one
copy could serve every backward reader. With memopt's dropped constant masks and
in-place rewrites elsewhere, those copies left both models at 1.025x eager's peak with
no budget.

Requires: the joint graph as the partition sees it (after passes.recompute's mirror
nodes, if any) and its cut (passes.partition.find_cut).

Ensures: where two values in the cut are the same computation (`duplicates`), the
backward reads the first one, and the second is no longer saved; nothing else changes.
The forward still computes both (the second's forward readers are untouched), so the
forward's values are eager's bit for bit. The simulator does the same on its arrays
(passes.simulate_steps, Step 3), so the planner scores what the build runs.

Why only saved pairs, and only at the cut: merging the two computations before
planning (common-subexpression elimination, as AOTAutograd's default partitioner
does) lets the planner recompute the merged value once for all its readers, which
then lives from the first backward reader to the last: the GPT-2 trainer example's
smallest budget rose 7% that way. Two saved copies A (first) and B live from their
forward steps into the backward; the one copy lives from A's forward step to the
later of their last readers, which is never more bytes at any step than the two held.

Algorithm:
    Step 1 (`duplicates`): walk the forward region in order; a pure aten call (no
        mutation, no random draw, no allocation of undefined contents, not one of
        memopt's own ops) whose target and arguments, with every input node replaced by
        its first equal, match an earlier node's, is that node's duplicate.
    Step 2 (`share_saved`): among the saved values equal to each other, every backward
        reader reads the first one saved.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from ._torch_compat import OpOverload
from .partition import forward_region

#: Ops whose output's contents are undefined: two calls are not the same value.
_UNDEFINED = frozenset({"empty", "empty_like", "empty_strided", "new_empty",
                        "new_empty_strided", "empty_permuted"})


def _mergeable(node: fx.Node) -> bool:
    """Whether two calls of this node's op on equal arguments give equal values."""
    op = node.target
    if op is operator.getitem:
        return True
    if not isinstance(op, OpOverload) or op.namespace not in ("aten", "prims"):
        return False
    return not (op._schema.is_mutable or torch.Tag.nondeterministic_seeded in op.tags
                or op._schema.name.split("::")[-1] in _UNDEFINED)


class _Unhashable(Exception):
    """An argument the key cannot compare by value (a SymInt, a tensor constant...)."""


def _key(value: Any, first: dict[fx.Node, fx.Node]) -> Any:
    """A hashable key for an argument: nodes by their first equal, scalars with their
    type (`1`, `1.0` and `True` differ in type promotion; `0.0` and `-0.0` in sign)."""
    if isinstance(value, fx.Node):
        return ("node", first.get(value, value))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_key(v, first) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _key(v, first)) for k, v in value.items())))
    if isinstance(value, float):
        return ("float", repr(value))
    if value is None or isinstance(value, (bool, int, str, torch.dtype, torch.device,
                                           torch.layout, torch.memory_format)):
        return (type(value).__name__, value)
    raise _Unhashable(type(value).__name__)


def duplicates(joint: fx.GraphModule, num_fwd_outputs: int) -> dict[str, str]:
    """Step 1: each forward node that repeats an earlier one's computation -> the name of
    the first node that computes it."""
    region = forward_region(joint, num_fwd_outputs)
    first: dict[fx.Node, fx.Node] = {}
    seen: dict[Any, fx.Node] = {}
    for node in joint.graph.nodes:
        if node not in region or node.op != "call_function" or not _mergeable(node):
            continue
        try:
            key = (node.target, _key(node.args, first), _key(node.kwargs, first))
        except _Unhashable:
            continue
        earlier = seen.setdefault(key, node)
        if earlier is not node:
            first[node] = earlier
    return {node.name: earlier.name for node, earlier in first.items()}


def saved_pairs(saved: tuple[str, ...] | list, first: dict) -> dict:
    """Step 2's choice: each saved duplicate -> the first value equal to it that is saved
    (`saved` in graph order: the first saved is the earliest computed). Works on names
    (the build) and on node ids (the simulator) alike."""
    chosen: dict = {}  # a computation -> the first of its values saved
    pairs = {}
    for name in saved:
        keep = chosen.setdefault(first.get(name, name), name)
        if keep != name:
            pairs[name] = keep
    return pairs


def share_saved(joint: fx.GraphModule, num_fwd_outputs: int, pairs: dict[str, str]) -> None:
    """Step 2: every backward reader of a saved duplicate reads its chosen equal (the
    caller finds the cut again: the duplicate is no longer in it)."""
    region = forward_region(joint, num_fwd_outputs)
    by_name = {node.name: node for node in joint.graph.nodes}
    for name, earlier in pairs.items():
        node, into = by_name[name], by_name[earlier]
        for user in list(node.users):
            if user not in region and user.op != "output":
                user.replace_input_with(node, into)
