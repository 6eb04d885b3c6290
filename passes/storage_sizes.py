"""Outputs whose kernel allocates more storage than their FakeTensor says.

Liveness (passes.liveness), the step simulator (passes.simulate) and the planner count
each value's bytes as its FakeTensor's ``untyped_storage().nbytes()``. For five ops that
is not what the kernel allocates when ``self`` is a non-dense view (a slice of a larger
tensor): ``copy``, ``slice_scatter``, ``select_scatter``, ``diagonal_scatter`` and
``as_strided_scatter`` build their result with ATen's ``clone_preserve_strides(self)``,
which clones ``self``'s whole storage and returns a strided view of the clone. Measured
on CPU (torch 2.13) with ``self`` = ``x[:, :13]`` of an (8, 32, 8, 8) float tensor: the
result's storage is 65,536 B (all of ``x``), the FakeTensor's 60,672 B (the view's extent)
for the three scatters always, and for ``copy`` and ``as_strided_scatter`` whenever
FakeTensorMode's dispatch cache answers: a cache hit rebuilds the output with
``empty_strided``, so the first trace of such an op in a process counts 65,536 B and
every later one 60,672 B. The fuzzer found it (tests/test_fuzz.py): the same model and
budget planned 4,864 B lower after another plan in the same process had traced the same
``copy``, and measured 0.6% over its budget.

Requires: a joint graph with FakeTensors in ``node.meta['val']`` (before partitioning,
so that the simulator, the partitioned graphs and recomputed copies all read the same
values). Ensures: each such node's value has the storage the kernel allocates: ``self``'s
storage (``self.clone()``'s contiguous one where ``self`` overlaps itself, as an
expanded view does), with the same shape, strides and offset. Other nodes, outputs with
symbolic sizes, and graphs run by inductor's kernels (its generated code allocates the
extent, ``empty_strided``) are left as they are.
"""

from __future__ import annotations

import torch
from torch import fx

from ._torch_compat import overlaps_itself
from .meta import tensor_value

aten = torch.ops.aten

#: ops whose CPU and CUDA kernels return a strided view of a clone of self's storage
CLONES_SELFS_STORAGE = frozenset({
    aten.copy.default, aten.slice_scatter.default, aten.select_scatter.default,
    aten.diagonal_scatter.default, aten.as_strided_scatter.default,
})


def kernel_storage_bytes(self_value: torch.Tensor) -> int:
    """Bytes of the storage ``clone_preserve_strides(self)`` allocates."""
    if overlaps_itself(self_value):
        return self_value.numel() * self_value.element_size()
    return self_value.untyped_storage().nbytes()


def with_storage_bytes(value: torch.Tensor, nbytes: int, *,
                       stride: tuple[int, ...] | None = None, offset: int | None = None
                       ) -> torch.Tensor:
    """A FakeTensor like `value` (shape, strides, offset, dtype, device) on a fresh
    storage of `nbytes` bytes; `stride`, `offset`: other strides or offset than
    `value`'s."""
    stride = tuple(value.stride()) if stride is None else stride
    offset = value.storage_offset() if offset is None else offset
    with value.fake_mode, torch.no_grad():
        storage = torch.empty(nbytes, dtype=torch.uint8, device=value.device)
        out = torch.empty(0, dtype=value.dtype, device=value.device)
        out.set_(storage.untyped_storage(), offset, value.shape, stride)
    return out.requires_grad_(value.requires_grad) if value.is_floating_point() else out


def restore_storage_sizes(gm: fx.GraphModule) -> int:
    """Give each node of CLONES_SELFS_STORAGE the storage its kernel allocates (the
    module docstring); return how many values changed."""
    changed = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in CLONES_SELFS_STORAGE \
                or not node.args:
            continue
        value, source = tensor_value(node), node.args[0]
        self_value = tensor_value(source) if isinstance(source, fx.Node) else None
        if value is None or self_value is None or not hasattr(value, "fake_mode"):
            continue
        sizes = (self_value.untyped_storage().nbytes(), value.untyped_storage().nbytes())
        if not all(isinstance(s, int) for s in sizes):
            continue  # symbolic sizes: left as traced
        want = kernel_storage_bytes(self_value)
        if want > sizes[1]:
            node.meta["val"] = with_storage_bytes(value, want)
            changed += 1
    return changed
