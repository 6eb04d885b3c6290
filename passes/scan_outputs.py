"""Ops after a rewritten parallel scan that work one scan element at a time, moved into its
loop (passes.scans runs this while it writes the loop).

transformers' Mamba reads its parallel scan's states once after the scan:
``torch.matmul(all_states.transpose(1, 2).to(dtype), C.unsqueeze(-1))``, a matmul batched
over the sequence. Written after the loop, that matmul keeps every state (batch x inner x T
x state) for its backward; the sequential path does the same matmul inside its loop, one
step's state at a time, and keeps none of them whole (on the zoo's Mamba over 64 tokens the
difference was 1.12x eager's peak against 1.00x). So while the scan's loop is written, each
op of this chain of single users whose value at one element depends only on that element
(``Stage``) is applied to each step's value inside the step, and only its last result is
stacked after the loop: the chain that passes.cell_loops builds then carries the state and
stacks the matmul's small output, as the sequential path's chain does.

Requires: the torch-level FX graph dynamo hands a backend (FakeTensors in
``node.meta["example_value"]``). Ensures: the same values; an operand a stage reads (``C``
above) that the graph computes after the scan is moved before it, with what it depends on,
when it does not depend on the scan itself (otherwise the chain of stages stops there).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from .loop_packing import example_value
from .scan_inputs import operand_at

#: Ops whose value at one element is the same op on that element: method names, and
#: functions.
_SAME_OP_METHODS = frozenset({"to", "float", "contiguous"})
_TRANSPOSES = frozenset({"transpose", "swapaxes"})

New = Callable[..., fx.Node]


@dataclass(frozen=True)
class Stage:
    """One op of the chain after the scan: ``node`` reads the stacked value (time along
    ``dim_in``) as its first argument; its value has time along ``dim_out``."""

    node: fx.Node
    dim_in: int
    dim_out: int

    def step(self, new: New, value: fx.Node, t: int) -> fx.Node:
        """``node``'s op on one element's value (made with ``new(op, target, args)``)."""
        node, args = self.node, self.node.args
        if node.target in _TRANSPOSES or node.target is torch.transpose:
            order = _per_step_order(example_value(node.args[0]).dim(), self.dim_in,
                                    *args[1:3])
            if order == sorted(order):
                return value
            return new("call_method", "permute", (value, *order))
        if node.target is torch.matmul:
            other = operand_at(new, args[1], example_value(args[0]).dim(), self.dim_in, t)
            return new("call_function", torch.matmul, (value, other))
        return new(node.op, node.target, (value, *args[1:]), dict(node.kwargs))


def stages(end: fx.Node, dim: int, region: list[fx.Node]) -> list[Stage]:
    """The chain of single users of ``end`` (a scan's stacked output, time along ``dim``)
    that can run per element; operands the graph makes later are moved before the scan's
    ``region`` (its nodes, in order), where they do not depend on it."""
    found: list[Stage] = []
    node = end
    order = {n: i for i, n in enumerate(end.graph.nodes)}
    fence = (region[0], set(region))
    while len(node.users) == 1:
        user = next(iter(node.users))
        out = _dim_after(user, node, dim, order, fence)
        if out is None:
            break
        found.append(Stage(user, dim, out))
        node, dim = user, out
    return found


def _dim_after(user: fx.Node, value: fx.Node, dim: int, order: dict[fx.Node, float],
               fence: tuple[fx.Node, set[fx.Node]]) -> int | None:
    """The time dim of ``user``'s value, if it runs per element of ``value`` along dim."""
    args = user.args
    if user.op not in ("call_method", "call_function") or not args or args[0] is not value:
        return None
    if (user.target in _TRANSPOSES and user.op == "call_method") or user.target is torch.transpose:
        if len(args) != 3 or user.kwargs or not all(type(a) is int for a in args[1:]):
            return None
        rank = example_value(value).dim()
        a, b = (x % rank for x in args[1:3])
        return b if dim == a else a if dim == b else dim
    if user.op == "call_method" and user.target in _SAME_OP_METHODS:
        if all(isinstance(a, (torch.dtype, torch.memory_format)) for a in args[1:]) \
                and set(user.kwargs) <= {"dtype"}:
            return dim
        return None
    if user.target is torch.matmul and len(args) == 2 and not user.kwargs:
        left, right = example_value(value), example_value(args[1])
        if not (isinstance(right, torch.Tensor) and right.dim() >= 2
                and dim < left.dim() - 2 and _hoist(args[1], order, fence)):
            return None
        return dim + max(0, right.dim() - left.dim())
    return None


def _per_step_order(rank: int, dim: int, a: int, b: int) -> list[int]:
    """The permutation of one element's dims that ``transpose(a, b)`` of the stacked value
    makes, the time dim left out."""
    a, b = a % rank, b % rank
    perm = list(range(rank))
    perm[a], perm[b] = perm[b], perm[a]
    kept = [p for p in perm if p != dim]
    return [p - (p > dim) for p in kept]


def _hoist(node: Any, order: dict[fx.Node, float], fence: tuple[fx.Node, set[fx.Node]]
           ) -> bool:
    """Move ``node`` and what it depends on before the scan (``fence``: its first node and
    all of them) where the graph makes them after it; False where one of them is the
    scan's, depends on it, or is not a plain op."""
    before, region = fence
    if not isinstance(node, fx.Node) or order[node] < order[before]:
        return True
    if (node in region or node.op not in ("call_function", "call_method")
            or str(node.target).endswith("_")):
        return False
    inputs: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), inputs.append)
    if not all(_hoist(n, order, fence) for n in inputs):
        return False
    before.prepend(node)
    order[node] = order[before] - 0.5
    return True
