"""Reversible RNN stacks in the joint graph: find them and charge what they hold.

A reversible stack is a ``memopt::reversible_fwd`` node (a memopt.nn.RevGRU or RevLSTM,
MacKay et al. 2018) and the ``memopt::reversible_bwd`` node(s) reading its handle. Its
backward reconstructs every hidden state from the final one, so it needs no
hidden-state slots at all: nothing to choose, unlike a Gruslys chain (passes.chain_policy).
What it holds between its forward and backward ops is the information buffers (Alg. 1)
and the final fixed-point state, and the planner counts exactly that, at its bound
(memopt.nn.ops.held_bytes): the buffers' size depends on the forget values the model
has learnt, and a budget must hold for any of them.

Requires: FakeTensors on the joint graph. Ensures: ``apply`` records the bytes
(passes.meta.HELD_BYTES on the forward op's handle, WORKSPACE_BYTES on both ops) that
liveness charges.

Memory model of one stack over T steps (batch B):
    held          = buffer bound (Alg. 1 + Sec. 5.1, see ops.buffer_bound_bytes)
                    + the final fixed-point state (int64 halves)
    forward op    = F: one step's temporaries (gates, Alg. 1's integer arithmetic, the
                    buffers' size report, the step's dropout masks), measured on real
                    tensors at 2 and 4 steps
    backward op   = B: one step recomputed under autograd and backpropagated, the
                    reversal's integers and the parameter gradients of one step,
                    measured the same way, beyond the op's outputs (the gradients)
The input sequence, the initial state, the parameters and the dropout seeds (one int64
per layer boundary; the masks are rebuilt from them, never held) are the ops' inputs,
saved by the partitioner like any other tensor. The seeds come from a random op
(``randint``), which the planner never recomputes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import fx

from ._torch_compat import real_tensors
from .allocated import can_track, maybe_allocation_peak, say_untracked
from .runtime import runtime
from memopt.allocator.units import format_bytes

from .chain_policy import Linear
from .meta import OpBytes, fake_value, handle_readers, record_op_bytes, user_module

log = logging.getLogger("memopt")

#: Positions of the ops' arguments (memopt.nn.ops schemas).
_STACK, _FWD_INIT, _FWD_XS, _FWD_PARAMS, _FWD_SEEDS = 0, 3, 4, 5, 6
_BWD_NEED_X, _BWD_HANDLE = 1, 2


def _ops():
    return runtime("reversible"), torch.ops.memopt.reversible_fwd.default, \
        torch.ops.memopt.reversible_bwd.default


@dataclass(frozen=True)
class ReversibleSite:
    """One reversible stack of the joint graph, and its bytes."""

    fwd: str                    # the reversible_fwd node's name
    bwds: tuple[str, ...]       # the reversible_bwd nodes reading its handle
    name: str                   # the user's module path
    module_type: str            # "RevGRU" / "RevLSTM"
    steps: int                  # T
    batch: int
    layers: int
    max_forget_bits: int | None
    stored_state_bytes: int     # what plain BPTT stores of the hidden states
    buffer_bound_bytes: int     # the information buffers, at most
    held_bytes: int             # buffers' bound + final fixed-point state
    forward_workspace_bytes: int = 0
    workspace_bytes: int = 0
    dropout: float = 0.0        # between layers, when this graph draws seeds (training)
    #: where the forward op returns its handle, which holds what the op keeps for backward
    #: (its last output; -1 for a site made by hand)
    handle: int = -1


def present(joint: fx.GraphModule) -> bool:
    """Whether the graph runs any reversible stack (without importing memopt.nn)."""
    return any(n.op == "call_function" and str(n.target).startswith("memopt.reversible_fwd")
               for n in joint.graph.nodes)


def find_reversible(joint: fx.GraphModule) -> list[ReversibleSite]:
    """Every reversible_fwd node with its backward nodes (none in an inference graph)
    and its bytes; the workspaces are measured on real tensors (``measure_workspaces``)."""
    ops, fwd_op, bwd_op = _ops()
    nodes = list(joint.graph.nodes)
    sites = []
    for node in nodes:
        if node.target is not fwd_op:
            continue
        bwds = tuple(n.name for n in handle_readers(nodes, node, bwd_op, _BWD_HANDLE))
        spec = ops.spec_of(node.args[_STACK])
        xs = fake_value(node.args[_FWD_XS])
        steps, batch = int(xs.shape[0]), int(xs.shape[1])
        forward, backward = measure_workspaces(node, bool(bwds))
        sites.append(ReversibleSite(
            fwd=node.name, bwds=bwds, name=user_module(node)[0] or spec.module_type,
            module_type=spec.module_type, steps=steps, batch=batch, layers=spec.num_layers,
            max_forget_bits=spec.max_forget_bits,
            stored_state_bytes=ops.stored_state_bytes(spec, steps, batch, xs.element_size()),
            buffer_bound_bytes=ops.buffer_bound_bytes(spec, steps, batch),
            held_bytes=ops.held_bytes(spec, steps, batch),
            forward_workspace_bytes=forward(steps), workspace_bytes=backward(steps),
            dropout=spec.dropout if _seeds(node) is not None else 0.0,
            handle=len(fake_value(node)) - 1))
        site = sites[-1]
        log.info("memopt reversible %s (%s): T=%d, no hidden-state slots (BPTT would store "
                 "%s), holds %s (buffers at most %s)", site.name, site.module_type, steps,
                 format_bytes(site.stored_state_bytes), format_bytes(site.held_bytes),
                 format_bytes(site.buffer_bound_bytes))
    return sites


def op_bytes(site: ReversibleSite) -> dict[str, OpBytes]:
    """What the site's ops hold and allocate, by node name."""
    return {site.fwd: OpBytes(((site.handle, site.held_bytes),), site.forward_workspace_bytes),
            **{b: OpBytes((), site.workspace_bytes) for b in site.bwds}}


def apply(graphs: list[fx.GraphModule], site: ReversibleSite) -> None:
    """Record the site's bytes for liveness in ``graphs`` (the joint graph, or a
    partition's forward and backward: node names are kept)."""
    _, fwd_op, bwd_op = _ops()
    nbytes = op_bytes(site)
    for gm in graphs:
        for node in gm.graph.nodes:
            if (node.target is fwd_op and node.name == site.fwd) or (
                    node.target is bwd_op and node.name in site.bwds):
                record_op_bytes(node, nbytes[node.name])


#: Sequence lengths the workspaces are measured at (fewer when T is shorter).
_LENGTHS = (2, 4)


def measure_workspaces(node: fx.Node, backward: bool) -> tuple[Linear, Linear]:
    """(forward op's, backward op's) transient bytes as lines in T: each op run on zeros
    of the real shapes on the real device at two short lengths, under allocation
    tracking. Transient = the op's peak beyond what it returns (and, forward, keeps).
    Where allocations cannot be tracked (another profiler is recording on CPU) they
    are taken as zero, and a warning says the plan may undercount."""
    xs = fake_value(node.args[_FWD_XS])
    tracked = can_track(xs.device)
    if not tracked:
        say_untracked("reversible", " reversible stack %s (a profiler is recording); its "
                      "temporaries are not counted", node.name)
    lengths = sorted({max(1, min(n, int(xs.shape[0]))) for n in _LENGTHS})
    points = []
    with real_tensors():
        for steps in lengths:
            points.append((steps, *_run_ops(node, steps, backward, tracked)))
    if len(points) == 1:
        points.append(points[0])
    (la, fa, ba), (lb, fb, bb) = points[0], points[-1]
    return Linear.through((la, fa), (lb, fb)), Linear.through((la, ba), (lb, bb))


def _seeds(node: fx.Node) -> fx.Node | None:
    """The forward op's dropout seeds (None: no dropout in this graph)."""
    return node.args[_FWD_SEEDS] if len(node.args) > _FWD_SEEDS else None


def _run_ops(node: fx.Node, steps: int, backward: bool, tracked: bool) -> tuple[int, int]:
    """One forward op and one backward op of ``steps`` steps: their transient bytes."""
    def real(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros(t.shape, dtype=t.dtype, device=t.device)

    xs = real(fake_value(node.args[_FWD_XS]).narrow(0, 0, steps))
    init = [real(fake_value(h)) for h in node.args[_FWD_INIT]]
    params = [real(fake_value(p)) for p in node.args[_FWD_PARAMS]]
    seeds = _seeds(node)
    seeds = None if seeds is None else real(fake_value(seeds))  # the masks' bytes, any seeds
    fwd_op = torch.ops.memopt.reversible_fwd.default
    with maybe_allocation_peak(xs.device, tracked) as fwd:
        out = fwd_op(node.args[_STACK], 0, True, init, xs, params, seeds)
    forward = max(0, fwd.peak - fwd.end)
    if not backward:
        return forward, 0
    grads = [torch.zeros_like(t) for t in out[:-1]]  # the backward op's inputs
    with maybe_allocation_peak(xs.device, tracked) as bwd:
        result = torch.ops.memopt.reversible_bwd.default(
            node.args[_STACK], True, out[-1], grads[0], grads[1:], init, xs, params, seeds)
    returned = sum(t.untyped_storage().nbytes() for t in result)
    return forward, max(0, bwd.peak - returned)
