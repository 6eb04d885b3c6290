"""Upsampling run as eager runs it: ATen's own kernels, forward and backward.

Eager ``F.interpolate(x, mode="bilinear")`` (``nn.Upsample``, a segmentation model's
logits brought to the labels' size) runs one ATen kernel, and its backward one more,
``upsample_bilinear2d_backward``, which reads the output's gradient and writes the
input's: no temporary of the output's size. Traced, PyTorch's Python dispatcher
decomposes ``upsample_bilinear2d`` and ``upsample_nearest*d`` at the autograd key into
index arithmetic (``torch/_decomp/decompositions.py``, ``_upsample_linear``), and the
backward AOTAutograd derives from it scatters the gradient through four weighted gathers,
several tensors of the output's size at once. A 1x1 convolution upsampled 4x before a
cross-entropy measured 1.53x eager's peak under memopt with no budget
(``torch.compile(backend="aot_eager")`` 1.79x), and HF SegFormer 1.17x (found from
outside).

This pass replaces each such call in dynamo's graph by ``memopt::upsample``, an op the
tracer does not look into: its forward calls ATen's kernel, its backward
``memopt::upsample_backward``, ATen's backward kernel. It saves nothing (the backward
needs only the sizes), as eager's node saves nothing.

Requires: dynamo's graph (torch-level calls, before AOTAutograd), the call's arguments
Python constants and its output's shape static (``example_value``). Ensures: each call of
``F.interpolate`` in mode ``nearest``, ``linear``, ``bilinear`` or ``trilinear``, without
antialiasing, over a floating input of 3 to 5 dimensions, is replaced by a
``memopt::upsample`` call computing the same values with the same kernels (the scales
passed to the kernel as ``F.interpolate`` passes them); every other call is left as
traced. Used for ``kernels="aten"`` (inductor generates its own upsampling kernels), and
not under autocast: CUDA's autocast runs ATen's upsampling in float32 (its fp32 list),
which this op, with no autocast kernel, would not (a graph captured under autocast, or
entering it, is left as traced).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from memopt.passes._torch_compat import autocast_regions, library_for_op

#: mode -> the ATen op per spatial rank (1, 2, 3), and whether it takes align_corners
_KERNELS = {
    "nearest": ({1: "upsample_nearest1d", 2: "upsample_nearest2d", 3: "upsample_nearest3d"},
                False),
    "linear": ({1: "upsample_linear1d"}, True),
    "bilinear": ({2: "upsample_bilinear2d"}, True),
    "trilinear": ({3: "upsample_trilinear3d"}, True),
}

_FWD_LIB = library_for_op("memopt", "upsample")
_BWD_LIB = library_for_op("memopt", "upsample_backward")
_FWD_LIB.define("upsample(Tensor x, int[] size, str mode, bool align_corners, float[] scales)"
                " -> Tensor", tags=(torch.Tag.pt2_compliant_tag,))
_BWD_LIB.define("upsample_backward(Tensor grad, int[] size, int[] input_size, str mode, "
                "bool align_corners, float[] scales) -> Tensor",
                tags=(torch.Tag.pt2_compliant_tag,))


def _kernel_args(size: list[int], mode: str, align_corners: bool, scales: list[float]
                 ) -> tuple[str, list[Any]]:
    """The ATen op's name and its arguments after the input: the output size, then
    align_corners where the mode takes it, then one scale per spatial dimension (an empty
    `scales`: None each, the kernel's input/output ratio)."""
    names, aligned = _KERNELS[mode]
    per_dim = list(scales) if scales else [None] * len(size)
    return names[len(size)], [list(size), *([align_corners] if aligned else []), *per_dim]


def upsample(x: torch.Tensor, size: list[int], mode: str, align_corners: bool,
             scales: list[float]) -> torch.Tensor:
    name, args = _kernel_args(size, mode, align_corners, scales)
    return getattr(torch.ops.aten, name).default(x, *args)


def upsample_backward(grad: torch.Tensor, size: list[int], input_size: list[int], mode: str,
                      align_corners: bool, scales: list[float]) -> torch.Tensor:
    name, args = _kernel_args(size, mode, align_corners, scales)
    return getattr(torch.ops.aten, f"{name}_backward").default(
        grad.contiguous(memory_format=_format(grad)), args[0], list(input_size), *args[1:])


def _format(t: torch.Tensor) -> torch.memory_format:
    """The layout ATen's upsampling kernels keep: channels-last where the input is."""
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) \
            and not t.is_contiguous():
        return torch.channels_last
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d) \
            and not t.is_contiguous():
        return torch.channels_last_3d
    return torch.contiguous_format


_FWD_LIB.impl("upsample", upsample, "CompositeExplicitAutograd")
_BWD_LIB.impl("upsample_backward", upsample_backward, "CompositeExplicitAutograd")


@torch.library.register_fake("memopt::upsample", lib=_FWD_LIB)
def _(x, size, mode, align_corners, scales):
    return x.new_empty((*x.shape[:2], *size)).contiguous(memory_format=_format(x))


@torch.library.register_fake("memopt::upsample_backward", lib=_BWD_LIB)
def _(grad, size, input_size, mode, align_corners, scales):
    return grad.new_empty(tuple(input_size)).contiguous(memory_format=_format(grad))


def _setup_context(ctx, inputs, output) -> None:
    x, size, mode, align_corners, scales = inputs
    ctx.args = (list(size), list(x.shape), mode, align_corners, list(scales))


def _backward(ctx, grad):
    size, input_size, mode, align_corners, scales = ctx.args
    return (torch.ops.memopt.upsample_backward(grad, size, input_size, mode, align_corners,
                                               scales), None, None, None, None)


torch.library.register_autograd("memopt::upsample", _backward, setup_context=_setup_context,
                                lib=_FWD_LIB)

_SIGNATURE = inspect.signature(F.interpolate)


def _call(node: fx.Node) -> tuple[fx.Node, list[int], str, bool, list[float]] | None:
    """The input, output size, mode, align_corners and kernel scales of an
    ``F.interpolate`` call this pass replaces (None: left as traced)."""
    try:
        bound = _SIGNATURE.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    a = bound.arguments
    x, out = a["input"], node.meta.get("example_value")
    if not isinstance(x, fx.Node) or not isinstance(out, torch.Tensor) or a["antialias"] \
            or a["mode"] not in _KERNELS or not out.is_floating_point():
        return None
    value = x.meta.get("example_value")
    rank = out.dim() - 2
    if not isinstance(value, torch.Tensor) or rank not in _KERNELS[a["mode"]][0] \
            or not all(isinstance(s, int) for s in (*out.shape, *value.shape)):
        return None
    scale, align = a["scale_factor"], a["align_corners"]
    if isinstance(align, bool) and not _KERNELS[a["mode"]][1]:
        return None  # F.interpolate refuses it: left to raise as traced
    scales: list[float] = []
    if scale is not None and not a["recompute_scale_factor"]:
        if isinstance(scale, (int, float)):
            scales = [float(scale)] * rank
        elif isinstance(scale, (tuple, list)) and all(isinstance(s, (int, float))
                                                      for s in scale):
            scales = [float(s) for s in scale]
        else:
            return None
    return x, list(out.shape[2:]), a["mode"], bool(align), scales


def fuse_upsampling(gm: fx.GraphModule) -> int:
    """Replace the upsampling calls of `gm` by ``memopt::upsample`` (the module
    docstring); return how many."""
    if autocast_regions() or any("autocast" in str(n.target) for n in gm.graph.nodes):
        return 0
    replaced = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not F.interpolate:
            continue
        found = _call(node)
        if found is None:
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(torch.ops.memopt.upsample.default, found)
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        replaced += 1
    if replaced:
        gm.recompile()
    return replaced
