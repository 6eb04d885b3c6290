"""Dropouts that are the identity, run as eager runs them: not at all.

A dropout with `p == 0` or `training=False` returns its input itself in ATen (the same
tensor, no copy, no random numbers drawn). AOTAutograd's decomposition of `aten.dropout`
returns `input.clone()` instead, and that clone is saved for backward beside its input:
HF MPT calls `F.dropout(attn_weights, p=0.0, training=True)` after its softmax, and each
attention layer held a second copy of its probabilities (memopt with no budget measured
1.18x eager's peak, `torch.compile(backend="aot_eager")` 1.28x; found from outside).

Requires: dynamo's graph (torch-level calls, before AOTAutograd), its dropout arguments
as Python constants. Ensures: each call of a functional dropout (`F.dropout`,
`dropout1d/2d/3d`, `alpha_dropout`, `feature_alpha_dropout`, `torch.dropout`) whose
probability is 0 or whose training flag is False is removed, its users reading its
input; a probability or flag that is not a constant is left as traced. No random number
is drawn either way, so every other dropout's mask is unchanged.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import fx

#: functional dropouts: (position of p, position of the training flag, its keyword)
DROPOUTS = {
    F.dropout: (1, 2, "training"), F.dropout1d: (1, 2, "training"),
    F.dropout2d: (1, 2, "training"), F.dropout3d: (1, 2, "training"),
    F.alpha_dropout: (1, 2, "training"), F.feature_alpha_dropout: (1, 2, "training"),
    torch.dropout: (1, 2, "train"), torch.dropout_: (1, 2, "train"),
    torch.alpha_dropout: (1, 2, "train"), torch.feature_dropout: (1, 2, "train"),
}



def _argument(node: fx.Node, position: int, name: str) -> object:
    """The call's argument, or the function's default (F.alpha_dropout's `training` is
    False, F.dropout's True); None where it has none."""
    if name in node.kwargs:
        return node.kwargs[name]
    if len(node.args) > position:
        return node.args[position]
    try:
        default = inspect.signature(node.target).parameters[name].default
    except (TypeError, ValueError, KeyError):
        return None
    return None if default is inspect.Parameter.empty else default


def remove_identity_dropouts(gm: fx.GraphModule) -> int:
    """Remove the dropouts of `gm` that return their input (the module docstring);
    return how many."""
    removed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in DROPOUTS:
            continue
        p_at, flag_at, flag = DROPOUTS[node.target]
        p, training = _argument(node, p_at, "p"), _argument(node, flag_at, flag)
        if not isinstance(p, (int, float)) or not isinstance(training, bool) \
                or (p != 0 and training):
            continue
        source = node.args[0] if node.args else node.kwargs.get("input")
        if not isinstance(source, fx.Node):
            continue
        node.replace_all_uses_with(source)
        gm.graph.erase_node(node)
        removed += 1
    if removed:
        gm.recompile()
    return removed
