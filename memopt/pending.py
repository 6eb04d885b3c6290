"""Training calls of a memopt module whose backward has not run yet.

memopt plans each training call of a module as one forward and its backward (the step).
Two calls before one backward (a siamese or contrastive loss: `loss(m(x1), m(x2))`) hold
the first call's saved tensors while the second runs, and a second backward through a
graph kept with `retain_graph=True` finds the first backward's gradients in `.grad`: both
hold more than the plan counts (1.4-1.8x a binding budget on small models, found from
outside). For two calls, the later call's graphs are planned again as runs after the
earlier calls' (memopt.backend.forward_ends: a graph that runs several times before one
backward, as a repeated block's, each earlier run holding what its plan saves), with the
earlier calls' inputs and outputs still alive held around them (``check``), from the
next step on (a contrastive loop: 1.29x the minimum named at every step before, found
from outside). The first such step is not held, and memopt says so once per module,
with the other fix: both calls inside one module's forward (one graph, planned
together). A second backward through a retained graph is not planned: a warning names
it.

A call is watched through the autograd node of its compiled graph
(`CompiledFunctionBackward`, AOTAutograd's): a pre-hook on it says when its backward ran, a
weak reference when the graph was dropped without one. One hook and one weak reference a
call, whatever the model's size.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch

from memopt.passes._torch_compat import pytree

#: the name of AOTAutograd's autograd node for a compiled graph
COMPILED_NODE = "CompiledFunctionBackward"

TWO_CALLS = (
    "memopt: a training call of this module started before the backward of an earlier "
    "call ran (two calls before one backward: a siamese or contrastive loss). memopt "
    "plans this call again, holding what the earlier call saved, for the steps after "
    "this one; this step holds more than its plan, possibly above the budget. Calling the "
    "model twice inside one module's forward plans both calls as one step from the first.")
SECOND_BACKWARD = (
    "memopt: a second backward ran through a graph kept with retain_graph=True. It adds "
    "into the .grad the first backward made, which the plan does not hold: the step can "
    "exceed the plan, and the budget. Sum the losses and run one backward instead.")


def compiled_nodes(out: Any, levels: int = 3) -> list[Any]:
    """The autograd nodes of compiled graphs behind `out`'s tensors, nearest first: those
    up to `levels` nodes below them (a view, memopt's attached logits), not below another
    compiled graph's node."""
    found, seen = [], set()
    nodes = [t.grad_fn for t in pytree.tree_leaves(out)
             if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    for _ in range(levels):
        below = []
        for node in nodes:
            if id(node) in seen:
                continue
            seen.add(id(node))
            if type(node).__name__ == COMPILED_NODE:
                found.append(node)
            else:
                below.extend(f for f, _ in node.next_functions if f is not None)
        nodes = below
    return found


def _compiled_node(out: Any) -> Any:
    """The autograd node of the last compiled graph among `out`'s tensors, or None."""
    return next(iter(compiled_nodes(out)), None)


class PendingBackwards:
    """The calls of one module whose backward has not run (see the module docstring)."""

    def __init__(self) -> None:
        #: per call: a weak reference to its graph's node, whether its backward ran, and
        #: weak references to the tensors it returned and was called with
        self.calls: list[tuple[weakref.ref, list[int], list[weakref.ref]]] = []
        self.warned: set[str] = set()

    def watch(self, out: Any, inputs: Any = ()) -> None:
        """A training call of `inputs` (its arguments) returned `out`: watch its compiled
        graph's backward."""
        node = _compiled_node(out)
        if node is None:
            return
        ran = [0]

        def backward_ran(*_: Any) -> None:
            ran[0] += 1
            if ran[0] == 2:  # inside autograd's engine: no user frame to point at
                self._warn(SECOND_BACKWARD, 2)

        # a pre-hook: a post-hook makes autograd keep the node's incoming gradients until
        # it returns (its arguments), past where the backward frees them (the fuzz slice
        # measured 8-15% over its budgets with one)
        node.register_prehook(backward_ran)
        held = [weakref.ref(t) for t in pytree.tree_leaves((out, inputs))
                if isinstance(t, torch.Tensor)]
        self.calls.append((weakref.ref(node), ran, held))

    def check(self) -> tuple[int, list[torch.Tensor]]:
        """A training call starts: how many earlier calls' backward is pending, and the
        tensors they returned or were called with that are still alive (the model's and
        this call's are not counted again: memopt.backend), with a warning the first
        time."""
        self.calls = [call for call in self.calls if call[0]() is not None and not call[1][0]]
        outputs = [t for _, _, refs in self.calls for t in (r() for r in refs) if t is not None]
        if self.calls:
            self._warn(TWO_CALLS, 7)  # the user's call of the module (memopt.api)
        return len(self.calls), outputs

    def _warn(self, message: str, stacklevel: int) -> None:
        if message not in self.warned:
            self.warned.add(message)
            warnings.warn(message, UserWarning, stacklevel=stacklevel)
