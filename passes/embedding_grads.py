"""A tied embedding's gradient added into the other gradient of the same weight, in place.

A language model whose head shares the token embedding's weight (GPT-2, BERT, T5) gets
that weight's gradient as a sum in the joint graph,
``add(g_head, embedding_dense_backward(g, ids, V, padding_idx, False))``: the head's
part, made at the start of the backward, and the embedding's, made at its end as a new
(V, d) tensor, with the sum a third. With a vocabulary of 50k that is two tensors of the
size of the embedding more than the gradient itself, at the very end of the step, when
every other gradient is live too. The sum equals ``g_head`` with each token's row of
``g`` added into row ``ids`` (``index_put(g_head, [ids], g, accumulate=True)``, padding
rows left out as the embedding's backward leaves them), which the in-place pass then
runs into ``g_head`` where it dies: no (V, d) tensor is made.

Requires: the joint graph (aten ops, FakeTensors in ``node.meta["val"]``). Run before the
cut is chosen (plan_joint's Step 1).

Ensures: each matched ``add`` is replaced by ``index_put`` (after a ``masked_fill`` of the
padding rows, when there is a padding index) with the same value up to the order of the
floating-point additions; the embedding's backward and its ``add`` are erased. Matches
only ``scale_grad_by_freq=False``, int64 indices, and equal dtypes and shapes.
"""

from __future__ import annotations

import torch
from torch import fx

from ._torch_compat import detect_fake_mode
from .meta import fake_value

aten = torch.ops.aten


def _fake_mode(node: fx.Node):

    return detect_fake_mode([fake_value(node)])


def _embedding_backward(node: object) -> bool:
    return isinstance(node, fx.Node) and node.target is aten.embedding_dense_backward.default \
        and len(node.users) == 1


def add_embedding_grads_in_place(joint: fx.GraphModule) -> int:
    """Replace every ``add(x, embedding_dense_backward(...))`` (either order) that can be
    (see the module docstring); returns how many."""
    graph = joint.graph
    done = 0
    for add in list(graph.nodes):
        if add.target is not aten.add.Tensor or len(add.args) != 2 or add.kwargs:
            continue
        a, b = add.args
        if not _embedding_backward(b):
            a, b = b, a
        if not _embedding_backward(b) or not isinstance(a, fx.Node):
            continue
        g, ids, _num, padding_idx, scale = b.args
        xv, gv, iv, out = fake_value(a), fake_value(g), fake_value(ids), fake_value(add)
        if scale or not all(isinstance(v, torch.Tensor) for v in (xv, gv, iv, out)) \
                or iv.dtype != torch.int64 or xv.dtype != gv.dtype or xv.dtype != out.dtype \
                or tuple(xv.shape) != tuple(out.shape):
            continue
        new: list[fx.Node] = []
        with graph.inserting_before(add), _fake_mode(add):
            values = g
            if padding_idx >= 0:
                pad = graph.call_function(aten.eq.Scalar, (ids, padding_idx))
                pad.meta["val"] = aten.eq.Scalar(iv, padding_idx)
                mask = graph.call_function(aten.unsqueeze.default, (pad, -1))
                mask.meta["val"] = aten.unsqueeze.default(pad.meta["val"], -1)
                values = graph.call_function(aten.masked_fill.Scalar, (g, mask, 0.0))
                values.meta["val"] = aten.masked_fill.Scalar(gv, mask.meta["val"], 0.0)
                new += [pad, mask, values]
            put = graph.call_function(aten.index_put.default, (a, [ids], values, True))
            put.meta["val"] = aten.index_put.default(xv, [iv], fake_value(values), True)
            new.append(put)
        for node in new:  # a backward node, as the embedding's backward was
            for key in ("stack_trace", "nn_module_stack", "fwd_nn_module_stack",
                        "partitioner_tag", "seq_nr"):
                if key in b.meta:
                    node.meta[key] = b.meta[key]
        add.replace_all_uses_with(put)
        graph.erase_node(add)
        graph.erase_node(b)
        done += 1
    if done:
        graph.lint()
        joint.recompile()
    return done
