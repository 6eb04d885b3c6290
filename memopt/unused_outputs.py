"""Gradients eager PyTorch never makes: an input reached only through outputs the loss did
not use.

A model that returns two heads' outputs, of which the loss reads one (``logits, aux =
model(x)``; ``loss(logits).backward()``), leaves the other head's parameters with
``.grad`` None in eager: autograd never reaches their nodes. A compiled graph is one
autograd node for all its outputs, and autograd hands its backward a zero gradient for
an output that got none, so its backward returns a zero gradient for those parameters:
AdamW's weight decay and moments then move them, where eager's left them alone (a
3-step loop differed from eager by 5e-5, found from outside; ``torch.compile`` does the
same).

`UnusedOutputGrads` finds, from the joint graph's AOTAutograd descriptors, which outputs
each input's gradient depends on (a bit per output, propagated through the graph), and a
pre-hook on the graph's autograd node (``register_prehook``, which sees the gradients handed to
the node before autograd fills the missing ones with zeros) finds the inputs whose
gradient depends on no output the loss reached, and the backward returns None for them:
the engine then accumulates nothing, as in eager. Op by op only (`kernels="aten"`):
inductor's backward is its own. It is made only where some input's gradient depends on a strict
subset of two or more outputs; where torch records no descriptors it is off. The memory
plan still counts those gradients (its prediction is then an upper bound by their size).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import fx

from memopt.passes._torch_compat import gradient_of_input, tangent_of_output

_COMPILED_NODE = "CompiledFunctionBackward"


class UnusedOutputGrads:
    """For a compiled graph: each input's gradient's dependence on the graph's outputs
    (``masks``: primal index -> a bit per output index), and the hook that drops the
    gradients that depend only on outputs the loss did not reach (module docstring)."""

    def __init__(self, masks: dict[int, int], primals: int) -> None:
        self.masks, self.primals = masks, primals
        #: the primal indices whose gradients the backward starting now drops (set by
        #: the node's pre-hook, read by `backward`)
        self.dropping: frozenset[int] = frozenset()
        self.on_drop: Callable[[frozenset[int]], None] | None = None

    @classmethod
    def of_joint(cls, joint: fx.GraphModule) -> UnusedOutputGrads | None:
        """From the joint graph before it is partitioned; None where no input's gradient
        depends on a strict subset of the outputs (nothing to drop) or the descriptors
        are missing."""
        bits: dict[fx.Node, int] = {}
        every, primals, unknown = 0, 0, False
        for node in joint.graph.nodes:
            if node.op == "placeholder":
                if str(node.target).startswith("tangents"):
                    index = tangent_of_output(node)
                    if index is None:  # a mutated input's or an alias's: always counted
                        unknown = True
                        bits[node] = -1
                    else:
                        bits[node] = 1 << index
                        every |= bits[node]
                else:
                    primals += 1
                    bits[node] = 0
            elif node.op != "output":
                mask = 0
                for arg in node.all_input_nodes:
                    mask |= bits.get(arg, 0)
                bits[node] = mask
        if bin(every).count("1") < 2 and not unknown:
            return None
        output = next(iter(joint.graph.find_nodes(op="output")))
        descs = output.meta.get("desc")
        values = output.args[0]
        if not isinstance(descs, (list, tuple)) or len(descs) != len(values):
            return None
        masks = {}
        for desc, value in zip(descs, values):
            index = gradient_of_input(desc)
            if index is None or not isinstance(value, fx.Node):
                continue
            mask = bits.get(value, -1)
            if mask > 0 and mask != every:  # a strict subset, none of them unknown
                masks[index] = mask
        return cls(masks, primals) if masks else None

    def wrap(self, compiled: Callable[..., Any],
             on_drop: Callable[[frozenset[int]], None] | None = None) -> Callable[..., Any]:
        """`compiled` (AOTAutograd's runtime: the traced function's outputs, flat), with a
        pre-hook on the autograd node of each call's outputs, which finds the gradients
        to drop as the node's backward starts. `on_drop` is told them then (an empty set
        as the backward ends): an optimizer stepped inside the backward must not step
        them."""
        self.on_drop = on_drop

        def run(*args: Any) -> Any:
            out = compiled(*args)
            self.watch(out)
            return out
        return run

    def backward(self, run: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
        """The boxed backward `run`, returning None for the gradients being dropped. Not
        a post-hook on the node: autograd keeps a node's incoming gradients until its
        post-hooks ran, past where the backward frees them (memopt.pending)."""
        def checked(args: list[Any]) -> Any:
            grads = run(args)
            dropping = self.dropping
            if not dropping:
                return grads
            self.dropping = frozenset()
            if self.on_drop is not None:
                self.on_drop(frozenset())
            grads = list(grads)
            for index in dropping:
                if index < len(grads):
                    grads[index] = None
            return grads

        checked._boxed_call = True  # type: ignore[attr-defined]
        return checked

    def watch(self, outputs: Sequence[Any]) -> None:
        node, positions = None, []
        for index, value in enumerate(outputs if isinstance(outputs, (list, tuple)) else ()):
            fn = getattr(value, "grad_fn", None)
            if fn is None or type(fn).__name__ != _COMPILED_NODE:
                continue
            if node is None:
                node = fn
            if fn is node:
                positions.append((index, value.output_nr))
        if node is None or len(node.next_functions) != self.primals:
            return
        masks = self.masks

        def before(grad_outputs: tuple[Any, ...]) -> None:
            unused = 0
            for index, position in positions:
                if grad_outputs[position] is None:
                    unused |= 1 << index
            self.dropping = frozenset(i for i, mask in masks.items()
                                      if mask & ~unused == 0) if unused else frozenset()
            if self.on_drop is not None and self.dropping:
                self.on_drop(self.dropping)

        node.register_prehook(before)
