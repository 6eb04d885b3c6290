"""What a captured graph tells memopt, and the checks its compiled backward runs.

From the capture (memopt.compiled_graph): which primals are parameters, buffers and
inputs (`primal_kinds`); which parameters' gradients the joint graph returns as views
(`view_grads`); the `.grad` sink of a kept-gradient step (`grad_sink`); the plan's record
of DDP's buckets and of the optimizer (`ddp_fields`, `optimizer_fields`); the parallel-scan
warning (`warn_parallel_scan`). At runtime: `checked_backward`, the op-by-op backward
with drop_outputs's watcher, and `refuse_double_backward`.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import fx

from memopt.passes._torch_compat import OpOverload, pytree
from memopt.passes.scans import scan_saved_bytes

from .budget import format_bytes
from .errors import InputError
from .grads import GradSink, parameter_slots
from .pending import compiled_nodes
from .planner import ExistingGrads
from .planner.fusible import returns_view

if TYPE_CHECKING:  # pragma: no cover
    from .ddp import DDPBuckets
    from .dropped import DroppedOutputs
    from .memory_plan import MemoryPlan
    from .optimizer import OptimizerBytes

def refuse_double_backward(out: Any) -> None:
    """A pre-hook on the autograd node of the compiled graph that returned `out`, which
    refuses a backward with create_graph=True through it by name as it starts (grad mode
    is on inside a backward only then): torch raised a bare RuntimeError at the second
    backward, from inside the caller's code (a physics-informed net, found from outside).
    One hook a run."""
    node = next(iter(compiled_nodes(out, levels=2)), None)
    if node is not None:
        node.register_prehook(_no_create_graph)


def _no_create_graph(*_: Any) -> None:
    if torch.is_grad_enabled():
        raise InputError(DOUBLE_BACKWARD)


#: a backward run with create_graph=True through a compiled graph (AOTAutograd's
#: backward cannot be differentiated: torch raises a RuntimeError at the second backward)
DOUBLE_BACKWARD = (
    "a backward with create_graph=True ran through a graph memopt compiled: gradients of "
    "gradients (a gradient penalty, a physics-informed loss, a Hessian-vector product) "
    "are not supported, as under torch.compile, whose AOTAutograd backward cannot itself "
    "be differentiated. Compute the derivatives that need create_graph=True with a module "
    "memopt did not compile (docs/limits.md)")


def checked_backward(run: Callable, dropped: DroppedOutputs | None) -> Callable:
    """The boxed op-by-op backward `run`, checking drop_outputs's freed outputs
    (memopt.dropped)."""
    if dropped is None:
        return run

    def checked(args: list[Any]) -> Any:
        dropped.check(args)
        return run(args)

    checked._boxed_call = True  # type: ignore[attr-defined]
    return checked


def view_grads(joint: fx.GraphModule, num_fwd_outputs: int) -> frozenset[int]:
    """Positions of the primals whose gradient the joint graph returns as a view of another
    tensor (F.linear's weight gradient is `t` of a product): autograd cannot add into
    it in place, since the view's base still holds its storage."""
    output = next(iter(joint.graph.find_nodes(op="output")))
    grads = pytree.tree_leaves(output.args[0])[num_fwd_outputs:]
    return frozenset(i for i, g in enumerate(grads) if isinstance(g, fx.Node)
                     and isinstance(g.target, OpOverload) and returns_view(g.target))


def primal_kinds(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> dict[str, str]:
    """Names of the joint graph's primals ("primals_1", ...) mapped to parameter/buffer/input.

    AOTAutograd's primals are the GraphModule's own parameters and buffers, then
    the example inputs, in order. With dynamo's inlined nn.Modules the parameters
    arrive as inputs; a parameter is recognised by its type, a buffer by the
    dynamo source name recorded on the placeholder.
    """
    kinds: list[str] = ["parameter"] * len(list(gm.parameters()))
    kinds += ["buffer"] * len(list(gm.buffers()))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, value in enumerate(example_inputs):
        if isinstance(value, torch.nn.Parameter):
            kinds.append("parameter")
            continue
        source = ""
        if i < len(placeholders):
            grapharg = placeholders[i].meta.get("grapharg")
            source = str(getattr(getattr(grapharg, "source", None), "name", ""))
            if callable(getattr(getattr(grapharg, "source", None), "name", None)):
                source = grapharg.source.name()
        kinds.append("buffer" if "_buffers" in source else "input")
    return {f"primals_{i + 1}": kind for i, kind in enumerate(kinds)}


def warn_parallel_scan(fw: fx.GraphModule, plan: MemoryPlan) -> bool:
    """Warn where the plan saves levels of a parallel scan for backward (passes.scans);
    returns whether it warned."""
    kept = [(t.name, t.nbytes) for t in plan.saved if t.decision == "saved"]
    nbytes = scan_saved_bytes(fw, kept)
    if not nbytes:
        return False
    warnings.warn(
        f"memopt: this model computes a parallel (associative) scan, and its training graph "
        f"keeps the scan's tree levels for backward: {format_bytes(nbytes)} of the "
        f"{format_bytes(sum(n for _, n in kept))} this step saves. Eager PyTorch runs a "
        f"sequential loop there and keeps less (transformers' Mamba takes the parallel path "
        f"under torch.compile by default: memopt measured a small one at 1.57x eager's peak "
        f"with no budget). Set model.config.use_associative_scan = False (or the model's own "
        f"switch) to train the sequential scan; memopt plans it like eager. memopt does not "
        f"recompute the tree's levels yet (docs/limits.md).", UserWarning, stacklevel=2)
    return True


def ddp_fields(ddp: DDPBuckets | None) -> dict[str, int]:
    """The plan's record of DDP's gradient buckets (their bytes are in its outside bytes,
    through the forward's trace: memopt.steps)."""
    if ddp is None:
        return {}
    return {"ddp_bucket_bytes": ddp.nbytes, "ddp_bucket_counted_bytes": ddp.counted_bytes}


def optimizer_fields(opt: OptimizerBytes | None, chunk: int | None) -> dict[str, object]:
    """The plan's record of the optimizer the budget counts (memopt.optimizer; its bytes
    are in the outside bytes), its step run in chunks of `chunk` bytes where not None."""
    if opt is None:
        return {}
    return {"optimizer": opt.name, "optimizer_state_bytes": opt.state_bytes,
            "optimizer_step_bytes": opt.step_bytes if chunk is None
            else opt.chunked_step_bytes(chunk), "optimizer_step_chunk_bytes": chunk or 0}


def grad_sink(kinds: dict[str, str], inputs: Sequence[Any]) -> tuple[GradSink, ExistingGrads]:
    """The runtime sink and the plan's view of the `.grad` tensors of every parameter that
    requires grad (primal `primals_{i+1}` is `inputs[i]`)."""
    slots = parameter_slots(kinds, inputs)
    sink = GradSink(slots)
    nbytes = {name: inputs[i].numel() * inputs[i].element_size() for name, i in slots.items()}
    return sink, ExistingGrads(nbytes=nbytes, add=sink.add)


def refuse_sparse_values(joint: Any) -> None:
    """A joint graph with a sparse tensor in it (``F.embedding(ids, w, sparse=True)``:
    ``refuse_sparse_gradients`` sees modules only) is refused by name: the step model
    failed over torch's "Cannot access storage of SparseTensorImpl" (a PassError, found
    from outside)."""
    for node in joint.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and value.layout != torch.strided:
            raise InputError(
                f"the training graph makes a {value.layout} tensor ({node.name}: a sparse "
                f"gradient, as F.embedding(..., sparse=True) gives its weight): memopt "
                f"plans dense tensors (a sparse one has no storage to count or share). "
                f"Pass sparse=False (the default), or train it without memopt.")
