"""The node.meta keys memopt reads and writes, each defined once with a typed accessor.

Passes never set attributes on `fx.Node`; what a pass learns about a node goes
under one of these keys, as an immutable value (STYLE.md, section 3).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
import re
from typing import Any

import torch
from torch import fx

from ._torch_compat import OpOverload

#: Name of the input node an in-place rewrite writes into (str). Set by passes.inplace.
INPLACE_OF = "memopt.inplace_of"

#: Name of the forward node a mirror node recomputes (str). Set by passes.recompute.
RECOMPUTES = "memopt.recomputes"
#: Which recomputation of that node it is (str, see `mirror_level`). Set with RECOMPUTES.
MIRROR_LEVEL = "memopt.mirror_level"

#: Bytes an opaque op keeps behind one of its outputs ({output index: bytes}), beyond
#: the tensor itself: a recurrent chain's stored states behind its handle. Set by
#: passes.chain_policy; liveness charges them to that output's storage.
HELD_BYTES = "memopt.held_bytes"
#: Bytes an opaque op allocates and frees while it runs (int): a chain's recomputation
#: slots in backward. Set by passes.chain_policy; liveness adds them at the op's step.
WORKSPACE_BYTES = "memopt.workspace_bytes"
#: Positions of an opaque op's arguments whose storage the op holds until its backward
#: (a tuple of positions, or (position, k) for the k-th tensor of a list argument): a
#: chain's inputs, read by the core chunk's graph and by stored internal states, and the
#: per-step inputs it slices from its params (ChainSpec.sliced). Recomputing such a value in backward frees nothing, so
#: passes.recompute does not mirror it (nor the views it is read through). Set by
#: passes.chain_policy.
KEPT_ARGS = "memopt.kept_args"

#: The strides inductor hands an extern kernel's arguments, by argument position
#: ({position: strides}), where it lays them out anew (passes.fusion.relaid_args). Set on
#: a copy of a compiled graph by memopt.kernels.scheduled_peak.
EXTERN_STRIDES = "memopt.extern_strides"
#: The index of the generated kernel that computes a node in inductor's schedule (int),
#: on a copy of a compiled graph in that schedule's order (passes.fusion.in_schedule_order,
#: for memopt.kernels.scheduled_peak)
KERNEL_GROUP = "memopt.kernel_group"

#: Name of the parameter primal whose existing `.grad` a backward node adds a gradient
#: into (str). Set by passes.gradients.
ACCUMULATES = "memopt.accumulates_into"
#: Name of the parameter primal a backward node steps the optimizer on, freeing its
#: gradient (str). Set by passes.gradients (memopt.stepper).
STEPS_IN_BACKWARD = "memopt.steps_in_backward"

#: Keys written by PyTorch's tracers that memopt reads.
VAL = "val"
NN_MODULE_STACK = "nn_module_stack"
#: On a backward node: the module stack of the forward node it differentiates.
FWD_NN_MODULE_STACK = "fwd_nn_module_stack"
PARTITIONER_TAG = "partitioner_tag"


def fake_value(node: fx.Node) -> Any:
    """The FakeTensor (or tuple of them, or SymInt) traced for `node`, or None."""
    return node.meta.get(VAL)


def value_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of a traced value (a tensor, or nested tuples and lists of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in value_tensors(v)]
    return []


def tensor_value(node: fx.Node) -> torch.Tensor | None:
    """The node's value if it is a single tensor, else None."""
    val = node.meta.get(VAL)
    return val if isinstance(val, torch.Tensor) else None


def handle_readers(nodes: list[fx.Node], fwd: fx.Node, bwd_op: Any, handle_arg: int
                   ) -> list[fx.Node]:
    """The ``bwd_op`` nodes among ``nodes`` whose argument ``handle_arg`` is ``fwd``'s
    last output: the handle of an opaque forward op (a recurrent chain, a reversible
    stack) that its backward op reads."""
    last = len(fake_value(fwd)) - 1
    handles = {u for u in fwd.users if u.args[1] == last}
    return [n for n in nodes if n.target is bwd_op and n.args[handle_arg] in handles]


def held_bytes(node: fx.Node) -> dict[int, int]:
    return node.meta.get(HELD_BYTES, {})


@dataclass(frozen=True)
class OpBytes:
    """What one of memopt's own ops holds behind its outputs (`held`: (output index,
    bytes) pairs) and allocates while it runs (`workspace`), as its configuration sets
    it (passes.chain_policy, passes.lm_heads, passes.reversible_stacks). The step
    simulator takes these as an argument; the exact build reads them from node.meta,
    where `record_op_bytes` writes them."""

    held: tuple[tuple[int, int], ...] = ()
    workspace: int = 0


def record_op_bytes(node: fx.Node, nbytes: OpBytes) -> None:
    if nbytes.held:
        node.meta[HELD_BYTES] = dict(nbytes.held)
    node.meta[WORKSPACE_BYTES] = nbytes.workspace


def workspace_bytes(node: fx.Node) -> int:
    return node.meta.get(WORKSPACE_BYTES, 0)


def preset_workspace_bytes(node: fx.Node) -> int | None:
    """The workspace a pass set on `node` (memopt's own ops: passes.chain_policy), or None
    where none was set and passes.workspace measures it."""
    return node.meta.get(WORKSPACE_BYTES)


def accumulates_into(node: fx.Node) -> str | None:
    """The parameter primal whose `.grad` this node adds a gradient into, if any."""
    return node.meta.get(ACCUMULATES)


def steps_in_backward(node: fx.Node) -> str | None:
    """The parameter primal this node steps the optimizer on (memopt.stepper), if any."""
    return node.meta.get(STEPS_IN_BACKWARD)


def inplace_source(node: fx.Node) -> str | None:
    return node.meta.get(INPLACE_OF)


def set_inplace_source(node: fx.Node, source: fx.Node) -> None:
    node.meta[INPLACE_OF] = source.name


def recomputed_from(node: fx.Node) -> str | None:
    """The forward node `node` recomputes, if it is a mirror node (Chen Alg. 2)."""
    return node.meta.get(RECOMPUTES)


def mirror_level(node: fx.Node) -> str | None:
    """Which recomputation of its forward node a mirror node is ("S": the only one;
    "A", "B": the first and second of a node recomputed twice, Chen Sec. 4.4)."""
    return node.meta.get(MIRROR_LEVEL)


def mark_mirror(node: fx.Node, original: fx.Node, level: str = "S") -> None:
    """Make `node` a backward-region mirror node recomputing `original`."""
    node.meta[RECOMPUTES] = original.name
    node.meta[MIRROR_LEVEL] = level
    node.meta[PARTITIONER_TAG] = "is_backward"


def is_forward_tagged(node: fx.Node) -> bool:
    return node.meta.get(PARTITIONER_TAG) == "is_forward"


_DYNAMO_ROOT = re.compile(r"^L\[['\"][^'\"]+['\"]\]\.?")
_INDEX = re.compile(r"\[(\d+)\]")
_MODULES_ITEM = re.compile(r"\._modules\[['\"]([^'\"]+)['\"]\]")


def _clean_path(path: str) -> str:
    path = _DYNAMO_ROOT.sub("", path)
    path = _MODULES_ITEM.sub(r".\1", path)
    path = _INDEX.sub(r".\1", path)
    return path.strip(".")


def user_module(node: fx.Node) -> tuple[str, str]:
    """(qualified path, class name) of the innermost user module `node` came from.

    Read from `node.meta['nn_module_stack']`, which dynamo and AOTAutograd keep on
    every traced aten node. Returns ("", "") for nodes outside any submodule.
    """
    return _module_of(node.meta.get(NN_MODULE_STACK))


def source_module(node: fx.Node) -> tuple[str, str]:
    """`user_module` of a forward node; of a backward node, that of the forward node it
    differentiates (AOTAutograd's `fwd_nn_module_stack`). ("", "") where neither is known."""
    return user_module(node) if node.meta.get(NN_MODULE_STACK) else \
        _module_of(node.meta.get(FWD_NN_MODULE_STACK))


def _module_of(stack: dict | None) -> tuple[str, str]:
    """(qualified path, class name) of the innermost entry of a module stack."""
    if not stack:
        return "", ""
    path, cls = list(stack.values())[-1]
    name = cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1].strip("'>")
    return _clean_path(str(path)), name


def op_name(node: fx.Node) -> str:
    """A short readable name of the node's operator: "aten.addmm", and for one output
    of a multi-output op, the op and the index ("aten.native_layer_norm[0]")."""
    if node.target is operator.getitem:
        parent, index = node.args[0], node.args[1]
        return f"{op_name(parent)}[{index}]" if isinstance(parent, fx.Node) else "getitem"
    if isinstance(node.target, OpOverload):
        namespace, _, name = node.target._schema.name.rpartition("::")
        return f"{namespace or 'aten'}.{name}"
    return str(getattr(node.target, "__name__", node.target))


def laid_like(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """`t`, an op's real output, with the strides its fake kernel gives it,
    `torch.empty_like(ref)`'s (copied where they differ; strides of size-1 dimensions do
    not count): the graph after a custom op is traced for its fake's layout. A recurrent
    chain's state carried in a transposed view (a GroupNorm over transposed channels
    before a loop of a block) got its gradient back contiguous, and the GroupNorm's
    parameters got wrong gradients (found from outside)."""
    want = torch.empty_like(ref, device="meta").stride()
    if all(a == b for a, b, n in zip(t.stride(), want, t.shape) if n > 1):
        return t
    return torch.empty_like(ref, dtype=t.dtype).copy_(t)
