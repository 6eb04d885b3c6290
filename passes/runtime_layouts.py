"""Outputs whose kernel lays them out, or allocates them, otherwise than their FakeTensor says.

AOTAutograd traces the step on FakeTensors, and where a reshape's input is laid out so
that a view can express it, it records ``aten.view``; otherwise it records a copy
(``clone`` then ``_unsafe_view``), which liveness counts. A few kernels return another
layout than their fake (meta) implementation says. Measured on CPU with torch 2.13:
``_native_batch_norm_legit_functional`` and ``native_batch_norm_backward`` of an input
laid out transposed (strides (1024, 1, 64) for shape (12, 64, 16)) return contiguous
outputs, (1024, 16, 1), where the FakeTensors keep the input's strides; so does
``softplus_backward`` of a gradient that arrives through a transpose. A view recorded
after such an op does not fit the real strides: memopt runs views as reshapes
(passes.runtime_views), which copy there, and the copy was in no plan. HF PatchTST's
step (BatchNorm over its patches, transposed) measured 24,116 bytes over its prediction at
every budget, 3.7% over the minimum memopt named; random models with a BatchNorm over
a transposed input 1.009-1.045x their budgets (found from outside). The same mismatch
let passes.inplace write a softmax gradient into a buffer laid out otherwise
(passes.inplace.laid_out_as_traced guards that since).

Some kernels also allocate a larger storage than their FakeTensor's: CPU's ``col2im``
(nn.Unfold's backward) allocates its output ``empty_like`` its input and resizes it
smaller, a (4, 16, 16, 1) result on 20,480 bytes where the FakeTensor says 4,096; HF
ConvBERT measured 1.036x the minimum memopt named. passes.storage_sizes gives five
ops whose kernels clone ``self``'s storage theirs by rule; this pass measures.

Requires: a joint graph run op by op (not inductor's kernels, whose generated code
allocates the layouts its own lowering chooses), with FakeTensors in
``node.meta['val']``, before the passes that read sizes and aliasing
(passes.storage_sizes first of them); a passes.workspace.WorkspaceCache, whose
measurement of an op also records what the kernel returned (one run per op and layout
per process, which passes.workspace then finds in the cache: the joint graph's ops are
the partitioned graphs' ops).

Ensures: every node whose value's layout or storage size is measured to differ from the
kernel's carries a FakeTensor of the kernel's strides on a storage of the kernel's size
(never smaller than traced); the nodes after it that read it are traced again on the
corrected values; where a view no longer fits, a ``clone`` (contiguous) is inserted
before it, the copy the runtime reshape made, now a value liveness counts. Other nodes
are left as they are, and a graph with nothing measured to differ is not changed.
Outputs a kernel returns as an alias (of an input or another output) are left as traced.
Nothing runs where nothing can be measured (a meta device, a profiler recording:
passes.workspace).

Algorithm, over the nodes in graph order:
    Step 1: a node reading a corrected value is traced again on the corrected values
        (``operator.getitem`` takes its element; an op of the ``memopt`` namespace or a
        node that is not an aten op keeps its value). A view that now fails reads a
        contiguous clone of its input instead.
    Step 2: an aten op that is not a view is measured (passes.workspace's run, cached);
        where the strides it returned differ from its FakeTensors', or its storage is
        larger, its value takes them.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from ._torch_compat import OpOverload
from .meta import fake_value, value_tensors
from .storage_sizes import with_storage_bytes
from .workspace import WorkspaceCache, node_call, workspace_bytes_of

log = logging.getLogger("memopt")
aten = torch.ops.aten


@dataclass(frozen=True)
class LayoutResult:
    """What one call of ``restore_runtime_layouts`` changed."""

    relaid: int    # nodes given the strides their kernel returns (Step 2)
    retraced: int  # nodes traced again on corrected values (Step 1)
    copies: int    # views that read a clone now (Step 1)


def restore_runtime_layouts(gm: fx.GraphModule, cache: WorkspaceCache) -> LayoutResult:
    """Give `gm`'s values the layouts their kernels return (the module docstring)."""
    changed: set[fx.Node] = set()
    relaid = retraced = copies = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if any(arg in changed for arg in node.all_input_nodes):      # Step 1
            copied = _retrace(gm, node)
            if copied is None:
                continue
            copies += copied
            retraced += 1
            changed.add(node)
        if _measurable(node) and _relay(node, cache):                   # Step 2
            relaid += 1
            changed.add(node)
    if copies:
        gm.graph.lint()
        gm.recompile()
    if relaid:
        log.debug("memopt layouts: %d values take their kernel's strides, %d traced again, "
                  "%d views read a copy", relaid, retraced, copies)
    return LayoutResult(relaid=relaid, retraced=retraced, copies=copies)


def _plain(value: Any) -> bool:
    """Whether every tensor of `value` has integer sizes (symbolic shapes are left as
    traced) and a fake mode to trace in."""
    tensors = value_tensors(value)
    return all(hasattr(t, "fake_mode") and all(isinstance(s, int) for s in t.shape)
               for t in tensors)


def _measurable(node: fx.Node) -> bool:
    if not isinstance(node.target, OpOverload) or node.target.is_view \
            or node.target.namespace == "memopt":
        return False
    returned = value_tensors(fake_value(node))
    read = [t for arg in node.all_input_nodes for t in value_tensors(fake_value(arg))]
    return bool(returned) and _plain(returned) and _plain(read)


def _relay(node: fx.Node, cache: WorkspaceCache) -> bool:
    """Step 2 for one node: whether its value changed."""
    call = node_call(node)
    if call is None:
        return False
    workspace_bytes_of([call], cache)
    measured = cache.returned_of.get(call.key)
    value = fake_value(node)
    fakes = value_tensors(value)
    if measured is None or len(measured) != len(fakes):
        return False
    new = [_as_returned(t, got) for t, got in zip(fakes, measured)]
    if all(a is b for a, b in zip(new, fakes)):
        return False
    node.meta["val"] = _rebuild(value, iter(new))
    return True


def _as_returned(fake: torch.Tensor, got: tuple | None) -> torch.Tensor:
    """`fake`, or a FakeTensor of its shape on a fresh storage with the strides the
    kernel returned and its storage's bytes where those differ (`got`: passes.workspace's
    (strides, storage bytes) of that output; None: an alias, left as traced)."""
    if got is None:
        return fake
    stride, nbytes = got
    if tuple(fake.stride()) == stride and fake.untyped_storage().nbytes() >= nbytes:
        return fake
    return with_storage_bytes(fake, max(nbytes, 0), stride=stride, offset=0)


def _rebuild(value: Any, tensors: Any) -> Any:
    """`value` with its tensors replaced, in order, by those of `tensors` (an iterator)."""
    if isinstance(value, torch.Tensor):
        return next(tensors)
    if isinstance(value, (tuple, list)):
        return type(value)(_rebuild(v, tensors) for v in value)
    return value


def _retrace(gm: fx.GraphModule, node: fx.Node) -> int | None:
    """Step 1 for one node: the number of copies inserted (0 or 1), None where it keeps
    its value."""
    if node.target is operator.getitem:
        source, index = node.args
        node.meta["val"] = fake_value(source)[index]
        return 0
    if not isinstance(node.target, OpOverload) or node.target.namespace == "memopt" \
            or not _plain(fake_value(node)):
        return None
    try:
        node.meta["val"] = _traced(node)
        return 0
    except (RuntimeError, ValueError):  # FakeTensor's view raises ValueError
        if not node.target.is_view or not node.args or not isinstance(node.args[0], fx.Node):
            log.debug("memopt layouts: %s could not be traced again; kept as traced", node)
            return None
    source = node.args[0]
    with gm.graph.inserting_before(node):
        clone = gm.graph.call_function(aten.clone.default, (source,),
                                       {"memory_format": torch.contiguous_format})
    clone.meta.update({k: v for k, v in node.meta.items() if k != "val"})
    clone.meta["val"] = _traced(clone)
    node.replace_input_with(source, clone)
    node.meta["val"] = _traced(node)
    return 1


def _traced(node: fx.Node) -> Any:
    """`node`'s op run on its arguments' FakeTensors (its value as traced now)."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), fake_value)
    fakes = value_tensors((args, kwargs))
    old = fake_value(node)
    with fakes[0].fake_mode, torch.no_grad():
        value = node.target(*args, **kwargs)
    grads = iter([t.requires_grad for t in value_tensors(old)])
    for t in value_tensors(value):
        if next(grads, False) and t.is_floating_point():
            t.requires_grad_(True)
    return value
