"""A loop's per-step inputs computed inside its step: elementwise producers of values the
loop reads one slice at a time are moved to the slices (passes.cell_loops runs this first).

A selective scan discretizes before its loop: ``dA = exp(A[None, :, None, :] * dt[..., None])``
and ``dBu = dt[..., None] * B[:, None] * u[..., None]`` are (batch, inner, T, state) tensors,
``state`` times larger than ``dt``, ``B`` and ``u``, and the loop reads ``dA[:, :, t]`` and
``dBu[:, :, t]`` at step t. Run as a chain, those two are the chain's inputs and must be
held (or recomputed whole) for its backward: on a 2-layer Mamba over 256 tokens they kept the
smallest budget at 0.57x eager's peak. Gu and Dao 2023 (Sec. 3.3.2) never materialize the
expanded tensors: their kernel discretizes inside the scan, per step, from the small inputs.
This pass does the same in the graph: each read ``dA[:, :, t]`` becomes
``exp(A'[None] * dt[..., None][:, :, t])``, where ``A'`` is ``A[None, :, None, :]`` with its
broadcast time dim squeezed once before the loop; ``dA`` and the product under it are then
never computed whole. The loop's step then holds those ops, and the chain's inputs are
``dt``, ``B`` and ``u`` (Gruslys et al. 2016 price one step of it, whatever it contains).

Requires: the torch-level FX graph dynamo hands a backend (FakeTensors in
``node.meta["example_value"]``), no node of which writes in place (aliasing is not tracked
at this level: such a graph is left as it is).

Ensures: the same values. A node is moved only where it is an elementwise op of
``ELEMENTWISE`` (scalars and tensors broadcast to its shape; no ``out=``, no random numbers)
and every user of it reads one integer slice of it along one dim, at least ``min_steps``
of them; each such read becomes the op on its operands' slices (an operand that does not
span that dim is read whole; one of size 1 there is squeezed once). The moved op's operands
are then considered in turn. What is moved costs the same arithmetic, spread over the steps.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch.nn import functional as F

from ._torch_compat import own_fake_mode
from .loop_packing import EXAMPLE_VALUE, example_value

#: Elementwise functions and tensor methods whose value at a slice is the function of
#: its operands' slices (broadcasting included).
ELEMENTWISE_FUNCTIONS = frozenset({
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.exp, torch.log, torch.sqrt,
    torch.rsqrt, torch.abs, torch.sigmoid, torch.tanh, torch.square,
    F.softplus, F.silu, F.sigmoid, F.tanh,
})
ELEMENTWISE_METHODS = frozenset({
    "add", "sub", "mul", "div", "neg", "exp", "log", "sqrt", "rsqrt", "abs", "sigmoid",
    "tanh", "square", "float", "to",
})
#: Keyword arguments that would make an op write or change device.
_NO_KWARGS = frozenset({"out", "inplace", "device", "copy", "memory_format"})

Index = Callable[[fx.Node], "tuple[fx.Node, int, int] | None"]


def sink_into_steps(gm: fx.GraphModule, index: Index, writes: Callable[[fx.Node], bool],
                    min_steps: int) -> int:
    """Move elementwise producers of per-step inputs into the reads (module docstring), in
    place; ``index(node)`` is (base, dim, i) for a read of ``base`` at i along dim, and
    ``writes(node)`` says a node writes in place. Returns how many nodes were moved."""
    def candidates() -> list[tuple[fx.Node, tuple]]:
        found = ((n, _reads(n, index, min_steps)) for n in reversed(list(gm.graph.nodes)))
        return [(n, r) for n, r in found if r is not None and elementwise(n)]

    todo = candidates()
    if not todo or any(writes(n) for n in gm.graph.nodes):  # the costly check only then
        return 0
    moved = 0
    while todo:
        for node, found in todo:
            _sink(gm, node, *found)
            moved += 1
        todo = candidates()  # the moved ops' operands, now read per step
    gm.graph.lint()
    gm.recompile()
    return moved


def _reads(node: fx.Node, index: Index, min_steps: int
           ) -> tuple[int, list[tuple[fx.Node, int]]] | None:
    """(dim, [(read, i)]) when every user of ``node`` reads one slice of it along one dim."""
    found = [index(u) for u in node.users]
    if len(found) < min_steps or any(f is None or f[0] is not node for f in found):
        return None
    if len({f[1] for f in found}) != 1:
        return None
    return found[0][1], [(u, f[2]) for u, f in zip(node.users, found)]


def elementwise(node: fx.Node) -> bool:
    """``node`` is an op of ELEMENTWISE over tensors that broadcast to its shape."""
    if node.op == "call_function":
        known = node.target in ELEMENTWISE_FUNCTIONS
    elif node.op == "call_method":
        known = node.target in ELEMENTWISE_METHODS and (
            node.target != "to" or (all(isinstance(a, torch.dtype) for a in node.args[1:])
                                    and set(node.kwargs) <= {"dtype"}))
    else:
        return False
    out = example_value(node)
    if not known or not isinstance(out, torch.Tensor) or _NO_KWARGS & set(node.kwargs):
        return False
    shapes = []
    for arg in (*node.args, *node.kwargs.values()):
        value = example_value(arg) if isinstance(arg, fx.Node) else arg
        if isinstance(value, torch.Tensor):
            if value.device != out.device:
                return False
            shapes.append(value.shape)
        elif isinstance(arg, fx.Node) or not isinstance(value, (int, float, bool, torch.dtype)):
            return False
    try:
        return bool(shapes) and tuple(torch.broadcast_shapes(*shapes)) == tuple(out.shape)
    except RuntimeError:
        return False


def _sink(gm: fx.GraphModule, node: fx.Node, dim: int, reads: list[tuple[fx.Node, int]]
          ) -> None:
    """Replace each read ``node[..., i, ...]`` (along ``dim``) by ``node``'s op on its
    operands' slices (new nodes are ``node``'s: its module and stack trace)."""
    squeezed: dict[fx.Node, fx.Node] = {}
    rank = example_value(node).dim()

    def make(op: str, target: Any, args: tuple) -> fx.Node:
        if target != "squeeze":
            return made_like(gm.graph, node, op, target, args)
        if args[0] not in squeezed:  # once, before the loop
            with gm.graph.inserting_before(node):
                squeezed[args[0]] = made_like(gm.graph, node, op, target, args)
        return squeezed[args[0]]

    for read, i in reads:
        with gm.graph.inserting_before(read):
            args, kwargs = fx.node.map_arg(
                (node.args, node.kwargs), lambda a, i=i: operand_at(make, a, rank, dim, i))
            step = made_like(gm.graph, node, node.op, node.target, args, kwargs)
        read.replace_all_uses_with(step)
        gm.graph.erase_node(read)
    gm.graph.erase_node(node)


def operand_at(make: Callable[..., fx.Node], arg: Any, rank: int, dim: int, i: int) -> Any:
    """``arg``'s part in element i along ``dim`` of a broadcast (or batched matmul) result
    of rank ``rank``: itself where it does not span that dim (broadcasting aligns trailing
    dims), squeezed there where its size is 1, else read at i; new nodes by
    ``make(op, target, args)``."""
    value = example_value(arg)
    if not isinstance(value, torch.Tensor):
        return arg
    at = dim - (rank - value.dim())
    if at < 0:
        return arg
    if value.shape[at] == 1:
        return make("call_method", "squeeze", (arg, at))
    return make("call_function", operator.getitem, (arg, (slice(None),) * at + (i,)))


def made_like(graph: fx.Graph, like: fx.Node, op: str, target: Any, args: tuple,
              kwargs: dict | None = None, *, trace: bool = True) -> fx.Node:
    """A node at the graph's insertion point with ``like``'s meta (without its stack trace
    unless ``trace``) and its own FakeTensor value."""
    made = graph.create_node(op, target, args, kwargs or {})
    made.meta = {k: v for k, v in like.meta.items() if trace or k != "stack_trace"}
    made.meta[EXAMPLE_VALUE] = evaluate(made)
    return made


def evaluate(node: fx.Node) -> Any:
    """``node``'s FakeTensor value, computed from its inputs' under their own fake mode (the
    tracing context's may be another)."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), example_value)
    values = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
    with own_fake_mode(values) or contextlib.nullcontext():
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        return node.target(*args, **kwargs)

