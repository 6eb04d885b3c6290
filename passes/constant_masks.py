"""Attention masks that mask nothing, passed as eager passes them: not at all.

transformers 5.17 skips a bidirectional attention mask that masks nothing when it runs
eagerly (it checks the padding mask's values), and under tracing, where it cannot look at
values, builds one from constants instead: `(arange(S)[None, None, :, None] >= 0)
.expand(B, -1, S, S)` when the model is called without `attention_mask` (BERT,
DistilBERT, ViT). That mask is all True, and its last dimension has stride 0, which
SDPA's fused CUDA kernels refuse: the traced graph, memopt's and torch.compile's alike,
runs attention as the decomposed softmax, dropout and matmuls and keeps every layer's
attention probabilities for backward, where eager runs one fused kernel that keeps none.
On an H200 memopt with no budget measured 1.090x eager's peak on the zoo's BERT, 1.165x
on DistilBERT and 1.036x on the ViT (`torch.compile(backend="aot_eager")` 1.218x, 1.160x,
1.036x), and the decomposed attention drew its dropout otherwise than eager's kernel
(docs/benchmarks/cuda.md, the eighth run).

Requires: dynamo's graph (torch-level calls, before AOTAutograd). Ensures: each call of
`F.scaled_dot_product_attention` whose `attn_mask` is computed from constants alone (no
graph input, parameter, buffer or module call, and no random op among what computes it)
and masks nothing (a bool mask all True, a float mask all zero) of a shape that does not
broadcast the attention's batch dimensions, gets `attn_mask=None`, the call eager makes;
the nodes that only fed that mask are removed. The mask is evaluated once, on real
tensors, when the graph is captured: a mask that depends on anything the step can change
is left as traced.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from memopt.passes._torch_compat import real_tensors

#: F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention
SDPA = F.scaled_dot_product_attention
_MASK_AT = 3
#: what must not run at capture (it would draw from the user's generator) or may differ
#: between calls: a mask computed through any of these is left as traced
_VARYING = re.compile(r"rand|bernoulli|normal|uniform|multinomial|poisson|exponential|"
                      r"cauchy|geometric|dropout|empty")


def _mask_node(node: fx.Node) -> fx.Node | None:
    mask = node.kwargs.get("attn_mask", node.args[_MASK_AT] if len(node.args) > _MASK_AT
                           else None)
    return mask if isinstance(mask, fx.Node) else None


def _constant_ancestry(mask: fx.Node) -> list[fx.Node] | None:
    """The nodes `mask` is computed from, in graph order, where every one is a call of a
    function or method on constants (no input, attribute, module call or varying op)."""
    seen: set[fx.Node] = set()
    todo = [mask]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        if node.op not in ("call_function", "call_method"):
            return None
        name = getattr(node.target, "__name__", str(node.target))
        if _VARYING.search(name) or name.endswith("_"):  # random, uninitialized, in place
            return None
        seen.add(node)
        todo.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _evaluate(nodes: list[fx.Node]) -> Any:
    """The last node's value, computing each node from the ones before it."""
    env: dict[fx.Node, Any] = {}
    with real_tensors(), torch.no_grad():
        for node in nodes:
            args = fx.node.map_arg(node.args, env.__getitem__)
            kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
            if node.op == "call_method":
                env[node] = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                env[node] = node.target(*args, **kwargs)
    return env[nodes[-1]]


def _masks_nothing(value: Any, attention: torch.Size | None) -> bool:
    if not isinstance(value, torch.Tensor) or attention is None or value.is_meta:
        return False
    if value.dim() > len(attention) or any(
            m not in (1, a) for m, a in zip(value.shape[::-1], attention[::-1])):
        return False  # it would broadcast the attention's shape: not the same call
    if value.dtype == torch.bool:
        return bool(value.all())
    return value.is_floating_point() and bool((value == 0).all())


def _attention_shape(node: fx.Node) -> torch.Size | None:
    """(..., L, S) of the call's attention weights, from dynamo's example values."""
    query, key = (node.args[i] if len(node.args) > i else None for i in (0, 1))
    values = [getattr(n, "meta", {}).get("example_value") for n in (query, key)]
    if not all(isinstance(v, torch.Tensor) and v.dim() >= 2 for v in values):
        return None
    return torch.Size((*values[0].shape[:-1], values[1].shape[-2]))


def drop_constant_masks(gm: fx.GraphModule) -> int:
    """Give each SDPA call of `gm` whose mask masks nothing `attn_mask=None` (the module
    docstring); return how many."""
    dropped = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not SDPA:
            continue
        mask = _mask_node(node)
        nodes = _constant_ancestry(mask) if mask is not None else None
        if not nodes:
            continue
        try:  # a mask it cannot compute, or read (on the meta device), stays as traced
            if not _masks_nothing(_evaluate(nodes), _attention_shape(node)):
                continue
        except Exception:  # noqa: BLE001
            continue
        if "attn_mask" in node.kwargs:
            node.update_kwarg("attn_mask", None)
        else:
            node.update_arg(_MASK_AT, None)
        for unused in reversed(nodes):  # what fed only this mask
            if not unused.users:
                gm.graph.erase_node(unused)
        dropped += 1
    if dropped:
        gm.recompile()
    return dropped


__all__ = ["drop_constant_masks"]
