"""What eager code between a step's graphs reads and saves, from autograd's graph.

A model run with graph breaks or `blocks=True` runs some of its forward eagerly: the frame
that loops over the blocks (dynamo skips a frame with a break inside a loop), with what it
calls from `torch.nn` (a Hugging Face model's token embedding, a final norm). No graph's
plan has that code's parameters or saved tensors as its own, yet the step holds them:

- each parameter it reads gets a gradient in the backward, between the graphs' (the token
  embedding's is the step's last, made after every graph's backward);
- autograd keeps what its ops save (a layer norm's input, a dropout's mask) from the
  moment they run in the forward until their backward, after the later graphs' (what
  eager code after the last graph saves is freed before any graph's backward runs).

`eager_reads(values, walked)` walks the autograd graph of `values` (a graph's inputs, or
the forward's return value) back to the previous graph: it stops at AOTAutograd's
CompiledFunctionBackward, behind which are the graphs' own inputs, and at leaves, and
collects the parameters (AccumulateGrad's variables) and the tensors the eager nodes saved
(their `_saved_*` attributes, a Python Function's `saved_tensors`). memopt.steps charges
them to the graphs that run while they are held.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from memopt.passes._torch_compat import pytree

from .fsdp import local_tensor
from .pending import COMPILED_NODE  # AOTAutograd's node for a compiled graph: walks stop there
from .storages import StorageId, holds_memory, storage_id

#: memopt's own Functions applied outside a graph, whose saved tensors that graph's plan
#: counts (a head's input and weight: memopt.lm_head.attach_logits)
_PLANNED = frozenset({"_AttachLogitsBackward"})


@dataclass
class EagerReads:
    """{storage: bytes} of the parameters eager code read and of the tensors it saved."""

    params: dict[StorageId, int] = field(default_factory=dict)
    saved: dict[StorageId, int] = field(default_factory=dict)
    #: the Python autograd.Functions it ran (`module.QualName`) whose backward allocates
    #: what no plan sees (opaque_function)
    opaque: set[str] = field(default_factory=set)


def made_by_eager_autograd(t: torch.Tensor) -> bool:
    """Whether eager code (not a compiled graph) made `t` with autograd recording: its
    gradient is handed to that code's backward."""
    return t.grad_fn is not None and type(t.grad_fn).__name__ != COMPILED_NODE


def made_by_planned_function(t: torch.Tensor) -> bool:
    """Whether one of memopt's own Functions whose tensors a plan counts made `t`
    (`_PLANNED`: logits attached to a head's graph)."""
    return t.grad_fn is not None and type(t.grad_fn).__name__ in _PLANNED


def eager_reads(values: Any, walked: set[int]) -> EagerReads:
    """What eager code read and saved to make `values` (module docstring). `walked` (node
    ids, one forward's) makes each node walked once."""
    found = EagerReads()

    def add(into: dict, t: Any) -> None:
        t = local_tensor(t)
        if holds_memory(t):
            into[storage_id(t)] = t.untyped_storage().nbytes()

    roots = [t.grad_fn for t in pytree.tree_leaves(values)
             if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    for node in eager_nodes(roots, walked):
        kind = type(node).__name__
        if kind == "AccumulateGrad":
            add(found.params, node.variable)
        elif kind not in _PLANNED:
            for t in saved_tensors(node):
                add(found.saved, t)
            opaque = opaque_function(node)
            if opaque is not None:
                found.opaque.add(opaque)
    return found


def eager_nodes(roots: Iterable[Any], walked: set[int]) -> Iterator[Any]:
    """The autograd nodes of eager code from `roots` down, each once (`walked`: node ids
    already seen): not the compiled graphs' nodes, nor below them; a parameter's
    AccumulateGrad is the end of its path."""
    stack = list(roots)
    while stack:
        node = stack.pop()
        if id(node) in walked:
            continue
        walked.add(id(node))
        kind = type(node).__name__
        if kind == COMPILED_NODE:
            continue
        yield node
        if kind != "AccumulateGrad":
            stack.extend(f for f, _ in node.next_functions if f is not None)


def nodes_below(compiled: list[Any]) -> Iterator[Any]:
    """The autograd nodes of eager code below the compiled graphs' nodes `compiled`
    (their inputs' makers, down to other compiled graphs): `eager_nodes` from there."""
    roots = [f for node in compiled for f, _ in node.next_functions if f is not None]
    return eager_nodes(roots, {id(node) for node in compiled})


#: the modules whose autograd.Functions run between graphs with a backward memopt counts:
#: its own (heads, chains), DDP's and FSDP's (their buckets and gathers: memopt.ddp,
#: memopt.fsdp)
_KNOWN_FUNCTIONS = ("memopt.", "torch.distributed.", "torch.nn.parallel.")


def opaque_function(node: Any) -> str | None:
    """The name (`module.QualName`) of the Python autograd.Function behind autograd node
    `node`, where what its backward allocates is in no plan: one that dynamo did not
    trace (a graph break inside it) and that is not memopt's, DDP's or FSDP's. HF
    Reformer's reversible layers are one: their backward runs the layers again eagerly,
    and the step measured 1.53x and 1.74x the budgets memopt accepted (found from
    outside). None for any other node."""
    forward = getattr(node, "_forward_cls", None)
    if not isinstance(node, torch.autograd.function.BackwardCFunction) or forward is None:
        return None
    name = f"{forward.__module__}.{forward.__qualname__}"
    return None if name.startswith(_KNOWN_FUNCTIONS) else name


def saved_tensors(node: Any) -> list[torch.Tensor]:
    """The tensors an autograd node saved for its backward (none once it ran)."""
    values = []
    for name in dir(node):
        if name.startswith("_saved_") or name == "saved_tensors":
            try:
                values.append(getattr(node, name))
            except RuntimeError:  # freed (its backward ran), or not a tensor to unpack
                continue
    return [t for t in pytree.tree_leaves(values) if isinstance(t, torch.Tensor)]


def _metadata_bytes(metadata: Any) -> int:
    """Bytes of the gradient an autograd input metadata describes (0 where unknown)."""
    try:
        if metadata.is_nested_tensor:
            return 0
        numel = 1
        for size in metadata.shape:
            numel *= int(size)
        return numel * metadata.dtype.itemsize
    except (AttributeError, RuntimeError, TypeError):
        return 0


#: autograd nodes of views, whose backward hands its gradient on as a view: AOTAutograd
#: makes an output that aliases another outside the graph, so such a node ends many
#: steps that have no eager code at all
_VIEWS = ("View", "AsStrided", "Alias", "Squeeze", "Unsqueeze", "Permute", "Transpose",
          "Expand", "Slice", "Select", "Unbind", "Split", "TBackward", "Unfold", "Diagonal")


#: temporaries an eager autograd node's backward makes beyond the gradients it is handed
#: and returns, in units of its largest gradient, by node kind (measured on CPU by
#: ``python -m benchmarks.backward_temporaries``, torch 2.13: the formulas are ATen's, the
#: same on CUDA). ``(out ** 2).mean()`` after a plan: ``PowBackward0`` computes
#: ``grad * (2 * out.pow(1))``, three tensors of ``out``'s size at once with its handed
#: gradient, and the plan ran 1.12x over its budget counting handed and returned only
#: (found from outside). Every kind here is measured there; a kind not here is counted as
#: making none (the activations', the matmuls', cross-entropy's, ``mse_loss``'s: measured;
#: others, such as ``cdist``'s, not).
BACKWARD_TEMPORARIES = {
    "Acos": 5.0, "Erf": 4.0, "Erfc": 4.0, "Asin": 4.0, "Div": 3.0,
    "Pow": 2.0, "Rsqrt": 2.0, "Reciprocal": 2.0, "Tan": 2.0, "Cos": 2.0, "Atan": 2.0,
    "Logsumexp": 2.0, "Cumsum": 2.0, "SoftMarginLoss": 2.0,
    "Maximum": 1.5, "Minimum": 1.5, "Amax": 1.5, "Amin": 1.5,
    "LinalgVectorNorm": 1.0, "Std": 1.0, "Var": 1.0, "Sqrt": 1.0, "Sin": 1.0,
    "Sinh": 1.0, "Cosh": 1.0, "Log2": 1.0, "Log10": 1.0, "Log1P": 1.0, "Abs": 1.0,
    "Prod": 1.5, "BinaryCrossEntropy": 1.5, "Clamp": 0.5, "ClampMin": 0.25, "ClampMax": 0.25,
}


#: temporaries an eager autograd node's op makes in its forward and frees before it returns,
#: beyond its output, in units of its largest input, by node kind (measured on CPU by
#: ``python -m benchmarks.backward_temporaries``, its forward column, torch 2.13). A fused
#: loss returns a scalar and saves its inputs only: its backward holds one input-sized
#: gradient, while its forward held more on top of the whole plan at the forward's end.
#: ``F.binary_cross_entropy_with_logits`` over an MLP's (1,024, 500) outputs computed
#: outside the module measured 1.28x its prediction with no budget, found from outside.
FORWARD_TEMPORARIES = {
    "BinaryCrossEntropyWithLogits": 2.0, "MseLoss": 1.0, "SmoothL1Loss": 1.0,
    "HuberLoss": 1.0, "Logsumexp": 1.0,
}


#: kinds whose temporaries (``BACKWARD_TEMPORARIES``) come from one input's gradient
#: formula only, by that input's position: ``a / b``'s are ``b``'s (``-grad * a / b**2``),
#: while ``a``'s is ``grad / b``, the gradient it returns. Over a constant or a scalar
#: ``b`` (a contrastive loss's ``logits / temperature``) the node makes none: counted, a
#: (1,024, 1,024) similarity matrix's division named three matrices more (12 MiB) than
#: its backward held and a budget 1.2x eager's peak was refused (found from outside).
TEMPORARIES_OF_INPUT = {"Div": 1}


def forward_bytes(node: Any) -> int:
    """Bytes eager autograd node `node`'s op held at once in its forward beyond its inputs:
    its outputs (autograd's input metadata) and the temporaries of ``FORWARD_TEMPORARIES``;
    0 for a kind not there (its backward holds as much: ``gradient_bytes``)."""
    per_input = FORWARD_TEMPORARIES.get(node_kind(node), 0)
    if not per_input:
        return 0
    try:
        outputs = sum(_metadata_bytes(m) for m in node._input_metadata)
        inputs = [_metadata_bytes(nxt._input_metadata[index])
                  for nxt, index in node.next_functions if nxt is not None]
    except (AttributeError, IndexError, RuntimeError):
        return 0
    return outputs + int(per_input * max(inputs, default=0))


def node_kind(node: Any) -> str:
    """The op of an autograd node's class name: ``PowBackward0`` -> ``Pow``."""
    name = type(node).__name__
    return name[:name.find("Backward")] if "Backward" in name else name


def gradient_bytes(node: Any) -> int:
    """Bytes live at once as eager autograd node `node` runs its backward: the gradients
    it is handed (one per output of its forward, autograd's input metadata) and those it
    returns, but for parameters (an AccumulateGrad's: counted as the parameters'
    gradients are), and the temporaries its formula makes (``BACKWARD_TEMPORARIES``);
    0 for a view's (`_VIEWS`)."""
    kind = type(node).__name__
    if kind == "AccumulateGrad" or any(view in kind for view in _VIEWS):
        return 0
    try:
        handed = [_metadata_bytes(m) for m in node._input_metadata]
        returned = [(_metadata_bytes(nxt._input_metadata[index]),
                     type(nxt).__name__ != "AccumulateGrad")
                    for nxt, index in node.next_functions if nxt is not None]
    except (AttributeError, IndexError, RuntimeError):
        return 0
    largest = max([*handed, *(size for size, _ in returned)], default=0)
    return sum(handed) + sum(size for size, counted in returned if counted) \
        + int(_temporaries(node) * largest)


def _temporaries(node: Any) -> float:
    """``BACKWARD_TEMPORARIES`` of `node`'s kind, where the input whose gradient formula
    makes them needs a gradient (``TEMPORARIES_OF_INPUT``)."""
    kind = node_kind(node)
    position = TEMPORARIES_OF_INPUT.get(kind)
    if position is not None:
        edges = node.next_functions
        if position >= len(edges) or edges[position][0] is None:
            return 0.0
    return BACKWARD_TEMPORARIES.get(kind, 0)


def gradient_edges(node: Any) -> list[tuple[tuple[int, int], int]]:
    """Where eager autograd node `node`'s backward sends its gradients, but into a
    parameter's AccumulateGrad: ((id of the next node, its input), bytes of that
    gradient) each. Two nodes that send into the same input are two branches over one
    tensor (``exp(out) - y * out``): the engine holds the first branch's gradient in that
    input's buffer while the other branch runs (``memopt.caller_loss``)."""
    try:
        return [((id(nxt), index), _metadata_bytes(nxt._input_metadata[index]))
                for nxt, index in node.next_functions
                if nxt is not None and type(nxt).__name__ != "AccumulateGrad"]
    except (AttributeError, IndexError, RuntimeError):
        return []


def node_bytes(node: Any) -> int:
    """The most eager autograd node `node`'s op holds at once beyond its inputs, in its
    forward (``forward_bytes``) or its backward (``gradient_bytes``)."""
    return max(gradient_bytes(node), forward_bytes(node))
