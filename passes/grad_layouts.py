"""Gradients autograd copies into their parameter's layout as it accumulates them.

AccumulateGrad stores a parameter's first gradient as `.grad` only where its strides
obey the gradient layout contract (those of the parameter, for a dense parameter);
otherwise it allocates a tensor laid out like the parameter and copies the gradient into
it, while the graph's gradient is still alive. A Conv2d over a channels-last input (a
transposed sequence reshaped into an image) gets a channels-last weight gradient from
`convolution_backward` (strides (288, 1, 96, 32) for a contiguous (16, 32, 3, 3) weight):
a random model (the outside fuzzer's seed 160) measured 420,160 bytes against a
prediction of 405,820 and its named minimum of 412,000 (1.0198x).

Requires: a joint graph run op by op, after passes.runtime_layouts (the gradients'
values laid out as their kernels return them), the primals' kinds, and which parameters
already have a `.grad` (memopt adds into those in place: no copy).

Ensures: `accumulate_copy_bytes` returns the bytes of the largest parameter whose
gradient the joint graph returns laid out otherwise (autograd accumulates one gradient at
a time, so one copy is alive at once beside the graph's gradients), 0 if none. The graph
is not changed; the planner charges it as the graph's backward ends
(steps.Outside.after_backward).
"""

from __future__ import annotations

import torch
from torch import fx

from .meta import tensor_value


def accumulate_copy_bytes(joint: fx.GraphModule, num_fwd_outputs: int,
                          primal_kinds: dict[str, str], kept: frozenset[str] = frozenset()
                          ) -> int:
    """The largest parameter whose returned gradient autograd copies (module docstring);
    `kept`: the parameter primals whose `.grad` is kept (added into in place)."""
    primals = [n for n in joint.graph.nodes if n.op == "placeholder"
               and n.name in primal_kinds]
    output = next(n for n in joint.graph.nodes if n.op == "output")
    grads = list(output.args[0])[num_fwd_outputs:]
    largest = 0
    for primal, grad in zip(primals, grads):
        if primal_kinds.get(primal.name) != "parameter" or primal.name in kept \
                or not isinstance(grad, fx.Node):
            continue
        param, value = tensor_value(primal), tensor_value(grad)
        if param is None or value is None or value.layout != torch.strided \
                or not param.is_contiguous() or value.stride() == param.stride():
            continue
        if value.is_contiguous():  # the contract holds for a contiguous gradient
            continue
        largest = max(largest, param.untyped_storage().nbytes())
    return largest
