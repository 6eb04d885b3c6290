"""Pure twins: recompute the output of a random or stateful op without re-running it.

Chen et al. 2016, Sec. 4.2 drops cheap ops and keeps what must not (or should not)
run twice. Two ops hold most of a transformer's or a CNN's activations and may not
run twice as they are:

- `native_dropout(x, p, train)` draws a new mask each call. Its output equals
  `x * mask * (1 / (1 - p))`, the CPU and CUDA kernels' own arithmetic. The twin
  keeps the mask (one byte per element) and recomputes the output from it:
  eager's mask, eager's values, a quarter of the bytes kept.
- `_native_batch_norm_legit_functional(x, w, b, running_mean, running_var, True, ...)`
  also returns updated running statistics, and it reads the running-stat buffers,
  which the step mutates after the forward. In training mode the normalized output
  depends on the batch statistics only, so the twin is
  `_native_batch_norm_legit.no_stats(x, w, b, True, ...)`: no buffer read, no
  statistics update (they stay the forward's, applied once).

`is_twinned` names the outputs a twin can compute, `twin_sources` what a
twin reads, and `emit_twin` adds the twin's nodes to a graph (used by
passes.recompute when it builds mirror nodes).
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from torch import fx

from ._torch_compat import pytree
from .meta import NN_MODULE_STACK, fake_value, mark_mirror

_aten = torch.ops.aten
_DROPOUT = _aten.native_dropout.default
_BATCH_NORM = _aten._native_batch_norm_legit_functional.default


def _has_twin(op: fx.Node, index: int) -> bool:
    if op.target is _DROPOUT:
        p, train = op.args[1], op.args[2] if len(op.args) > 2 else op.kwargs.get("train")
        # the twin reads the mask; a dropout that needs no backward (its input does not
        # require grad) has no mask in the graph, and its output is kept, not recomputed
        return (index == 0 and bool(train) and isinstance(p, float) and 0.0 < p < 1.0
                and _mask_of(op) is not None)
    if op.target is _BATCH_NORM:
        return index < 3 and op.args[5] is True
    return False


def is_twinned(node: fx.Node) -> bool:
    """`node` is an output of a random or stateful op that a pure twin recomputes."""
    return (node.target is operator.getitem and isinstance(node.args[0], fx.Node)
            and _has_twin(node.args[0], node.args[1]))


def _mask_of(dropout: fx.Node) -> fx.Node | None:
    """The mask's getitem: there whenever backward reads the mask (native_dropout_backward),
    absent when the dropout needs no gradient."""
    return next((u for u in dropout.users if u.target is operator.getitem and u.args[1] == 1),
                None)


def twin_sources(item: fx.Node) -> list[fx.Node]:
    """The forward values the twin of `item` reads."""
    op = item.args[0]
    if op.target is _DROPOUT:
        return [op.args[0], _mask_of(op)]
    return [a for a in op.args[:3] if isinstance(a, fx.Node)]


def _traced(graph: fx.Graph, target: Callable, args: tuple, original: fx.Node,
            level: str) -> fx.Node:
    """A mirror node of `original` calling `target`, its value traced on FakeTensors."""
    node = graph.call_function(target, args)
    values = pytree.tree_map(lambda a: fake_value(a) if isinstance(a, fx.Node) else a, args)
    mode = next(v.fake_mode for v in pytree.tree_leaves(values) if isinstance(v, torch.Tensor))
    with mode:
        node.meta["val"] = target(*values)
    mark_mirror(node, original, level)
    if NN_MODULE_STACK in original.meta:
        node.meta[NN_MODULE_STACK] = original.meta[NN_MODULE_STACK]
    return node


def emit_twin(graph: fx.Graph, item: fx.Node, env: Callable[[fx.Node], fx.Node],
              shared: dict[fx.Node, fx.Node], level: str = "S") -> fx.Node:
    """Add the twin of `item` to `graph` (at its insertion point); return its value.

    `env` maps each of `twin_sources(item)` to the node to read; `shared` caches
    one BatchNorm twin per op, so its outputs come from one call; `level` marks the
    nodes (see meta.mirror_level)."""
    op = item.args[0]
    if op.target is _DROPOUT:
        x, mask = (env(a) for a in twin_sources(item))
        kept = _traced(graph, _aten.mul.Tensor, (x, mask), item, level)
        return _traced(graph, _aten.mul.Tensor, (kept, 1.0 / (1.0 - op.args[1])), item, level)
    if op not in shared:
        x, w, b, _mean, _var, training, momentum, eps = op.args
        args = (env(x), env(w) if w is not None else None, env(b) if b is not None else None,
                training, momentum, eps)
        shared[op] = _traced(graph, _aten._native_batch_norm_legit.no_stats, args, op, level)
    return _traced(graph, operator.getitem, (shared[op], item.args[1]), item, level)
