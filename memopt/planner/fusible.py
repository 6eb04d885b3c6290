"""Recomputation that inductor's kernels make free: the mirror set of a step with no budget
under `kernels="inductor"` (issue 25).

Chen et al. 2016 (Sec. 4.1) note that cheap operators, the activations and normalisations
between the expensive ones, can be recomputed at little cost. With op-by-op kernels a
recomputed operator is one more kernel that reads and writes memory, so with no budget
memopt recomputes nothing. With inductor's fused kernels it is nearly free: a pointwise
value recomputed in the backward is computed inside the backward kernel that reads it,
from inputs the backward reads anyway, and the saved value it replaces no longer has to be
written by the forward, kept, and read back. TorchInductor's own partitioner recomputes
such values by default. That is why its step measured 0.67-0.74x memopt's memory at no
budget and ran faster on GPT-2's backward (docs/kernels.md).

`fusible_mirror` picks those values: a saved, mirrorable (passes.recompute) pointwise node
computable from graph inputs and values saved anyway through pointwise nodes alone, with
the unsaved nodes on the way. Recomputing them saves nothing new, so the saved bytes can
only fall; the planner keeps the set only where its simulated peak is no higher than with
none (planner.plan.PlanRun.fusible).
"""

from __future__ import annotations

import torch
from torch import fx

from memopt.passes._torch_compat import OpOverload
from memopt.passes.recompute import mirrorable


def is_fusible(node: fx.Node) -> bool:
    """A call of an aten operator inductor folds into the kernel that reads it: one tagged
    pointwise (elementwise), or a view (an index computation: its schema returns an
    alias of an input), such as the `view` a saved GELU output is read through."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, OpOverload):
        return False
    return torch.Tag.pointwise in target.tags or returns_view(target)


def returns_view(op: OpOverload) -> bool:
    """Whether the operator returns a view of an input (its schema's one return aliases
    one, without writing it): `t`, `view`, `expand`, ..."""
    returns = op._schema.returns
    return len(returns) == 1 and returns[0].alias_info is not None \
        and not returns[0].alias_info.is_write


def fusible_mirror(joint: fx.GraphModule, num_fwd_outputs: int, saved: frozenset[str],
                   mutable_inputs: frozenset[str] = frozenset()) -> frozenset[str]:
    """The saved pointwise nodes recomputable from what the backward has anyway (`saved`:
    the saved node names of the plan that recomputes nothing), with the unsaved pointwise
    nodes between them and it (a decomposed GELU's `mul`, `erf`, `add`): each, in
    topological order, from graph inputs, saved values, or pointwise nodes so computable."""
    # node -> the unsaved pointwise nodes it is recomputed through (None: not computable)
    through: dict[str, frozenset[str] | None] = {}
    picked: set[str] = set()
    for node in mirrorable(joint, num_fwd_outputs, mutable_inputs):
        if not is_fusible(node):
            continue
        needs: set[str] = set()
        for a in node.all_input_nodes:
            if not isinstance(a.meta.get("val"), torch.Tensor) or a.op == "placeholder" \
                    or a.name in saved:
                continue
            chain = through.get(a.name)
            if chain is None:
                needs = None
                break
            needs |= chain | {a.name}
        if needs is None:
            continue
        through[node.name] = frozenset(needs)
        if node.name in saved:
            picked |= needs | {node.name}
    return frozenset(picked)
