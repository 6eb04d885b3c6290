"""Training calls of a memopt module whose backward has not run yet.

memopt plans each training call of a module as one forward and its backward (the step).
Two calls before one backward (a siamese or contrastive loss: `loss(m(x1), m(x2))`) hold
the first call's saved tensors while the second runs, and a second backward through a
graph kept with `retain_graph=True` finds the first backward's gradients in `.grad`: both
hold more than the plan counts (1.4-1.8x a binding budget on small models, found from
outside). memopt cannot plan them as they run, so it says so, once per module, with the
fix: one backward per call, or both calls inside one module's forward (one graph, planned
together).

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
    "call ran. memopt plans each call as one forward and its backward, so the step holds "
    "both calls' saved tensors: more than the plan, possibly above the budget. Run each "
    "call's backward before the next call, or call the model twice inside one module's "
    "forward (one graph, planned as one step).")
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
        self.calls: list[tuple[weakref.ref, list[int]]] = []
        self.warned: set[str] = set()

    def watch(self, out: Any) -> None:
        """A training call returned `out`: watch its compiled graph's backward."""
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
        self.calls.append((weakref.ref(node), ran))

    def check(self) -> None:
        """A training call starts: warn where an earlier call's backward is pending."""
        self.calls = [(ref, ran) for ref, ran in self.calls
                      if ref() is not None and not ran[0]]
        if self.calls:
            self._warn(TWO_CALLS, 7)  # the user's call of the module (memopt.api)

    def _warn(self, message: str, stacklevel: int) -> None:
        if message not in self.warned:
            self.warned.add(message)
            warnings.warn(message, UserWarning, stacklevel=stacklevel)
