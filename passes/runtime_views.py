"""Views that hold at runtime when a kernel's output strides differ from its FakeTensor's.

AOTAutograd traces the step on FakeTensors, and a reshape whose input is contiguous there
is recorded as ``aten.view``. Where a kernel's real output strides differ from the ones
its fake (meta) implementation gave, the recorded view does not fit them and the step
fails in its backward with "view size is not compatible with input tensor's size and
stride". Seen on CPU with torch 2.13: ``softplus_backward`` of a gradient that arrives
through a transpose returned strides (256, 1, 8) where its FakeTensor said (256, 32, 1),
and the view after it failed, in memopt's op-by-op graphs as under
``torch.compile(backend="aot_eager")`` (a Mamba-like selective scan, docs/limits.md).

Requires: a forward or backward GraphModule as memopt runs it op by op, after planning.

Ensures: every ``aten.view.default`` node calls ``aten.reshape.default`` with the same
arguments. ``reshape`` returns the same view wherever the strides allow one, which is
wherever the FakeTensors were right, so a step that ran before runs the same kernels and
aliases. Where they do not allow one it copies: the step runs instead of failing. The
planner measures the layouts kernels return (passes.runtime_layouts) and puts such a copy
in the graph, where liveness counts it; a reshape copies here only where that could not be
measured (a profiler recording while planning): one tensor the plan did not count. The
graph is recompiled.
"""

from __future__ import annotations

import torch
from torch import fx

_VIEW = torch.ops.aten.view.default
_RESHAPE = torch.ops.aten.reshape.default


def views_as_reshapes(gm: fx.GraphModule) -> int:
    """Rewrite ``gm``'s views (module docstring); how many were rewritten."""
    count = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is _VIEW:
            node.target = _RESHAPE
            count += 1
    if count:
        gm.recompile()
    return count
