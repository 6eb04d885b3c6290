"""The caller's loss: what autograd saves between a forward's return and its backward.

memopt plans what runs inside the compiled module. A loss the caller computes from the
outputs (``F.cross_entropy(model(x), y)``) runs after the forward, and its backward runs
first, before any graph's, while everything the forward saved is still held: what that
loss saved, and the gradients its backward makes, are on top of the whole plan at the
backward's start. ``F.cross_entropy`` over (2,048, 1,000) logits keeps its
``log_softmax`` output, the logits' size, and its backward makes two more of that size: a
5-layer MLP with the loss outside measured 1.69x the minimum memopt named (35.5 MB
against 21.0 MB, found from outside).

Before anything is measured, the plan of the forward's last graph assumes a
cross-entropy over its largest output that requires grad (``assumed``: three float32
tensors of its size; nothing where the forward returns a scalar that requires grad, the
loss computed inside): at its first plan where the forward is that one graph, else as
the first forward ends (``with_loss``), where the whole step is checked. Then memopt
measures it, the way ``torch.autograd.graph.saved_tensors_hooks`` lets any library see
what autograd saves:

1. As a traced training forward returns (``watch``), a pair of default hooks is pushed
   on this thread's stack, where it is empty (a caller's own hooks, such as
   ``save_on_cpu``, are left alone, and nothing is measured) and not disabled (inside
   ``torch.func`` transforms). The pack hook records each tensor the caller's code saves
   (its storage and bytes, unless the plan counts it already: the model's tensors, the
   graphs' inputs and outputs; a tensor outside autograd only where it is gone by the
   graph's backward, not the targets the caller holds) and, from its ``grad_fn`` down to
   the compiled graphs' nodes, the most gradients one of those autograd nodes holds at
   once (eager_reads.node_bytes: handed and returned, or what a fused loss's forward
   made). It returns ``t.detach()``, an alias (the version counter shared, so in-place
   checks stay eager's).
2. A pre-hook on the forward's last graph's autograd node (AOTAutograd's
   CompiledFunctionBackward) closes the window as that graph's backward starts: the
   caller's loss is then the saved bytes plus that gradient term
   (``CompiledGraph.caller_loss``; the most any window measured). Each graph is watched
   for its first ``WINDOWS`` windows. Where the plan held as much, or its peak holds the
   rest as it is (with no budget: the peak raised to hold it), the plan says so there
   (``recorded``: nothing planned again; what a plan recomputed to hold an assumption
   above the measurement stays). The unpack hook finds each node of the loss as its
   backward runs (one whose saved tensors are the graphs' outputs, which the pack hook's
   walk does not reach: ``(out ** 2).mean()``).
3. The hooks are popped at the next call of any memopt module on this thread (``stop``),
   or later where a caller's hooks opened since are still above them. They cannot be
   popped as the backward ends: autograd runs the backward with the thread-local state
   captured as it began, and restores the caller's after it.
4. At that call (``charge``), a measurement the plan could not record is held before
   the forward's last graph's backward, planned again (steps.Outside.before_backward;
   with eager code after the graph, the larger of the two gradient terms: ``held``),
   and a budget it no longer fits is refused there, naming the smallest that does.

The same MLP: measured 24,577,032 bytes (three (2,048, 1,000) float32 tensors, the
4-byte total weight twice, ``LOSS_SCALARS``). Assumed from the first step, the first
minimum named, 36,192,325 bytes, holds at every step: 35,645,352 measured, 35,646,376
predicted.

A module compiled again in the process over the same parameters starts from the last
measurement (``known``: the budget a refusal named, passed back, holds from the first
step). While the hooks are pushed (between a training forward and the next call),
``torch.func.grad``, ``vjp`` and ``jacrev`` refuse to run, as they do under any
saved-tensor hooks; ``memopt.compile(..., watch_loss=False)`` turns the watch and the
assumption off. What the loss holds that autograd does not save is seen only in part:
what its forward makes and frees before the backward, but for one more of the largest
temporary it saved that was made outside autograd (``_Watch.bytes``). ``F.mse_loss``'s
scalar, a view of an input-sized buffer, is counted by its node's kind
(``INPUT_SIZED_RESULTS``).
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from memopt.allocator.timeline import other_lowered
from memopt.passes._torch_compat import (current_autograd_node, pop_saved_tensor_hooks,
                                          push_saved_tensor_hooks, pytree,
                                          saved_tensor_hooks_free,
                                          saved_tensor_pack_hook_on_top, sequence_nr,
                                          storage_ref)

from .eager_reads import eager_nodes, gradient_edges, node_bytes, node_kind
from .storages import StorageId, holds_memory, storage_id

if TYPE_CHECKING:  # pragma: no cover
    from .backend import MemoptBackend
    from .compiled_graph import CompiledGraph
    from .memory_plan import MemoryPlan
    from .steps import ForwardTrace, Outside

_LOCAL = threading.local()  # .watch: the _Watch whose hooks are on this thread's stack

#: what graph a caller's loss was measured after (memopt.plan_log.graph_key, but whether
#: `.grad` exists) -> (its bytes, the weak storage reference and data pointer of each of
#: the graph's parameters, its bytes held through the backward): a module compiled again
#: over the same parameters starts from it (``known``)
_KNOWN: dict[tuple, tuple[int, tuple, int]] = {}


#: backward windows watched per graph: the first measures, the second checks it (a
#: caller's loss that grows later, an auxiliary loss switched on mid-training, is not seen)
WINDOWS = 2


def identity(params: Iterable[torch.Tensor]) -> tuple:
    """The parameters' identity, held weakly: a storage reference and a data pointer
    each."""
    return tuple((storage_ref(p.untyped_storage()), p.data_ptr()) for p in params)


def _same(ident: tuple, other: tuple) -> bool:
    return _alive(ident) and len(ident) == len(other) and all(
        ptr == theirs for (_, ptr), (_, theirs) in zip(ident, other))


def _alive(ident: tuple) -> bool:
    """Every parameter of `ident` (``identity``) still exists."""
    return bool(ident) and not any(ref.expired() for ref, _ in ident)


def known(key: tuple, ident: tuple) -> tuple[int, int] | None:
    """The caller's loss measured after a graph of this key over these parameters in this
    process, and what it held through the backward (None: none). The budget a refusal
    named counts them, and a module compiled again with that budget holds them from its
    first step."""
    entry = _KNOWN.get(key)
    return entry[::2] if entry is not None and _same(entry[1], ident) else None


#: Tensors the size of the largest output a loss the caller computes is assumed to hold,
#: before it was measured, each in float32 at least: cross-entropy keeps its log-softmax
#: output and its backward makes two more tensors of that size (a bf16 model's loss
#: upcasts its logits first: 12,288,004 bytes measured over (1,024, 1,000) bf16 logits)
ASSUMED_PER_ELEMENT = 3
#: and bytes besides, for its scalars (the loss, its gradient, a reduction's count)
ASSUMED_SCALARS = 4096
#: losses whose scalar is a view of a buffer the size of their input, held as long as the
#: loss is (through the graphs' backward) and saved by no node (their node's kind:
#: memopt.eager_reads.node_kind): the unpack hook finds it as the node runs, and the graph
#: is planned again with it held over its backward (`taken`; a U-Net with ``F.mse_loss``
#: outside measured one output over its plan, 1.016x its prediction, found from outside)
INPUT_SIZED_RESULTS = ("MseLoss", "SmoothL1Loss", "BinaryCrossEntropy", "SoftMarginLoss")
#: bytes of the loss and of the gradient its backward starts from, counted beside what
#: the loss saves: a CUDA allocator block (512 bytes) each at least
LOSS_SCALARS = 2 * 512


def assumed(returned: Any) -> int:
    """What the plan holds for the caller's loss over the forward's `returned` values
    before it was measured: none where one is a scalar that requires grad (a loss
    computed inside, as transformers' models do with ``labels=``), else
    ``ASSUMED_PER_ELEMENT`` tensors the size of the largest floating one that requires
    grad (a cross-entropy over the logits). A loss that holds less (a sum) leaves that
    much unused in the plan; one that holds more is charged from the next step."""
    tensors = [v for v in pytree.tree_leaves(returned) if isinstance(v, torch.Tensor)
               and v.requires_grad and v.is_floating_point()]
    if not tensors or any(v.numel() == 1 for v in tensors):
        return 0
    return max(ASSUMED_PER_ELEMENT * v.numel() * max(4, v.element_size())
               for v in tensors) + ASSUMED_SCALARS


def assumed_through(returned: Any) -> int:
    """What the plan holds through the graphs' backward for the caller's loss before it
    was measured, under a budget: one tensor the size of the largest floating output that
    requires grad (in float32 at least), the buffer ``F.mse_loss`` and the other
    INPUT_SIZED_RESULTS hold as long as the loss is; none where a returned scalar requires
    grad (a loss inside). Without it, a minimum named at the first step (its loss not yet
    measured) was refused at the second where the loss was one of those: a NeRF with
    ``F.mse_loss`` outside named 18,687,253 bytes and asked 18,689,332 a step later, a
    U-Net 3.4-5.8% more (found from outside, 2026-11-30 and 2026-12-01)."""
    tensors = [v for v in pytree.tree_leaves(returned) if isinstance(v, torch.Tensor)
               and v.requires_grad and v.is_floating_point()]
    if not tensors or any(v.numel() == 1 for v in tensors):
        return 0
    return max(v.numel() * max(4, v.element_size()) for v in tensors)


def room(graph: CompiledGraph, outside: Outside) -> int:
    """Bytes of `outside.backward` held as ``assumed_through``'s room (0: none)."""
    return 0 if graph.loss_measured else min(graph.through_charged, outside.backward)


def without_room(graph: CompiledGraph, outside: Outside) -> Outside | None:
    """`outside` without the room ``assumed_through`` holds for the caller's loss, where
    the graph's plan holds that room unmeasured (None: it holds none). A plan that
    misses its budget with the room is made without it (the loss then charged from
    the next step where it holds such a result); a budget it misses either way names
    the minimum with the room, which holds from the first step whatever the loss. A
    forward with graph breaks is planned without it as a whole
    (``replanned_without_room``), not graph by graph."""
    return _lean(graph, outside) if graph.alone else None


def _lean(graph: CompiledGraph, outside: Outside) -> Outside | None:
    nbytes = graph.through_charged
    if not nbytes or graph.loss_measured:
        return None
    graph.through_charged = 0
    return dataclasses.replace(outside, backward=max(0, outside.backward - nbytes))


def _remember(graph: CompiledGraph) -> None:
    if graph.loss_key is None:
        return
    for key in [k for k, (_, ident, _) in _KNOWN.items() if not _alive(ident)]:
        del _KNOWN[key]  # its model is gone
    _KNOWN[graph.loss_key] = (graph.caller_loss, graph.loss_identity, graph.loss_through)


class _Watch:
    """One window, from a forward's return to its last graph's backward (module
    docstring)."""

    def __init__(self, graph: CompiledGraph, counted: set[StorageId], walked: set[int],
                 nodes: Iterable[Any], outputs: Iterable[tuple[Any, StorageId, int]] = ()
                 ) -> None:
        self.graph = weakref.ref(graph)
        #: the graph's outputs (weak storage reference, id, bytes), which its plan holds
        #: to the step's end: one the caller dropped before the loss's backward is not
        #: held under it (``bytes``)
        self.outputs = list(outputs)
        self.counted, self.walked = counted, walked
        self.read: set[StorageId] = set()  # what the plans count that the loss saved
        self.results: dict[int, int] = {}  # INPUT_SIZED_RESULTS's buffers, by node
        self.saved: dict[StorageId, int] = {}
        #: saved tensors outside autograd: a weak reference to their storage, and bytes
        self.leaves: dict[StorageId, tuple[Any, int]] = {}
        #: the loss's nodes seen: (sequence number, the gradients each holds at once)
        self.costs: list[tuple[int | None, int]] = []
        #: the gradients they send, by where they go: (bytes, the senders' sequence numbers)
        self.edges: dict[tuple[int, int], tuple[int, list]] = {}
        self.open = True
        self.handles = [node.register_prehook(self._closes) for node in nodes]

    def pack(self, t: torch.Tensor) -> Any:
        if self.open and holds_memory(t):
            key = storage_id(t)
            if key in self.counted:  # held by the loss until its node's backward ran
                self.read.add(key)
            elif t.grad_fn is None and not t.requires_grad:  # made by the step, or before?
                self.leaves[key] = (storage_ref(t.untyped_storage()), t.untyped_storage().nbytes())
            else:
                self.saved[key] = t.untyped_storage().nbytes()
            if t.grad_fn is not None:
                self._seen(eager_nodes([t.grad_fn], self.walked))
        return t.detach() if isinstance(t, torch.Tensor) else t

    def unpack(self, t: Any) -> Any:
        """A node of the caller's loss reads what it saved as its backward runs: the
        gradients it holds count (``node_bytes``). The pack hook walks from what is
        saved down, and misses a node whose saved tensors are the graphs' outputs (the
        ``PowBackward`` of ``(out ** 2).mean()``, ``F.mse_loss``'s): it holds its
        handed gradient and the output's at once (a plan 1.12x over its budget without
        this, found from outside)."""
        if self.open:
            node = current_autograd_node()
            if node is not None:
                self._seen(eager_nodes([node], self.walked))
                if node_kind(node) in INPUT_SIZED_RESULTS and isinstance(t, torch.Tensor):
                    self.results[id(node)] = t.numel() * t.element_size()  # its input's
        return t

    def _seen(self, nodes: Iterable[Any]) -> None:
        """Count the loss's autograd nodes `nodes` (each seen once): the gradients each
        holds at once as its backward runs, when it runs (its sequence number: the
        engine runs the higher first), and where it sends its gradients."""
        for node in nodes:
            order = sequence_nr(node)
            self.costs.append((order, node_bytes(node)))
            for key, nbytes in gradient_edges(node):
                self.edges.setdefault(key, (nbytes, []))[1].append(order)

    def flowing(self) -> int:
        """The most gradients one of the loss's nodes holds at once as its backward runs,
        with those waiting beside it in an input's buffer: a tensor the loss read twice
        gets two gradients, and the engine holds the first from the node that sent it to
        the last one that sends into it. ``F.poisson_nll_loss`` computes ``exp(out) - y *
        out``: the multiplication's gradient waits while ``exp``'s backward holds its
        handed gradient and its own beside the saved result, and the step measured one
        output over the minimum named at every step (1.068x; 1.21x on another model,
        found from outside, 2026-11-30). A node whose sequence number is unknown counts
        every waiting gradient."""
        spans = [(None, None, nbytes) if None in orders else (min(orders), max(orders), nbytes)
                 for nbytes, orders in self.edges.values() if len(orders) > 1]
        return max((held + sum(nbytes for first, last, nbytes in spans
                               if order is None or first is None or first <= order < last)
                    for order, held in self.costs), default=0)

    def bytes(self) -> int:
        """What the caller's loss held on top of the plan: its saved tensors and its
        gradients' working set. A saved tensor outside autograd (no ``grad_fn``) counts
        where it is gone as the graph's backward starts: a temporary of the loss (a
        distillation's soft targets, made under no_grad), not what the caller made
        before the step and holds through it (the targets, a loss's weights), which a
        budget does not count (docs/budgets.md, "How it is measured"). Such a temporary
        was made in the loss's forward from another of its size, which autograd did not
        save (the soft targets' ``softmax`` from the scaled logits, a teacher's
        ``exp(log_target)`` in ``kl_div``): the largest counts once more, as the forward's
        temporaries, which no hook sees (two KL divergences measured 1.17x and 1.15x the
        minimum named without it, found from outside). The graph's outputs the caller
        dropped by then (``loss_fn(model(x), y)`` keeps no reference to the logits) come
        off: the plan holds them to the step's end, and the loss's backward runs without
        them (a tied-embedding LM predicted 1.21x what it measured, found from
        outside); but for one the loss saved (``out.square()``'s), which its node holds
        until its backward ran."""
        saved = dict(self.saved)
        made = {key: n for key, (ref, n) in self.leaves.items() if ref.expired()}
        saved.update(made)
        dropped = sum({key: n for ref, key, n in self.outputs
                       if ref.expired() and key not in self.read}.values())
        return max(0, sum(saved.values()) + self.flowing() + LOSS_SCALARS - dropped
                   + max(made.values(), default=0))

    def _closes(self, *_: Any) -> None:
        if not self.open:
            return
        self.open = False
        graph = self.graph()
        if graph is not None:
            graph.caller_loss = max(graph.caller_loss if graph.loss_measured else 0,
                                    self.bytes())
            graph.loss_through = max(graph.loss_through, sum(self.results.values()))
            graph.loss_windows += 1
            graph.loss_measured = True
            _remember(graph)
            recorded(graph)  # where no re-plan is needed: the next call's is (charge)
        self.leaves, self.outputs, self.edges, self.costs = {}, [], {}, []

    def release(self) -> None:
        self.open = False
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def on_top(self) -> bool:
        return saved_tensor_pack_hook_on_top() == self.pack


def watch(trace: ForwardTrace) -> None:
    """Watch what the caller's code saves until the backward of `trace`'s last graph
    starts: what the plans count already (steps.ForwardTrace.counted, read only where
    it is watched) and the autograd nodes of the eager code after that graph (their
    gradients counted already) are left out."""
    stop()
    last = trace.runs[-1]
    graph = last.graph
    nodes = [node for node in (ref() for ref in last.nodes) if node is not None]
    if graph.loss_windows >= WINDOWS or getattr(_LOCAL, "watch", None) is not None \
            or not nodes or not saved_tensor_hooks_free():
        return
    found = _Watch(graph, trace.counted(), trace.head_nodes, nodes, last.outputs)
    push_saved_tensor_hooks(found.pack, found.unpack)
    _LOCAL.watch = found


def stop() -> None:
    """A memopt module's call starts: the caller's code since the last forward is over.
    Its hooks are popped where they are on top (a caller's hooks opened since and still
    open stay above them: popped at a later call)."""
    found = getattr(_LOCAL, "watch", None)
    if found is None:
        return
    found.release()
    if found.on_top():
        pop_saved_tensor_hooks()
        _LOCAL.watch = None


def held(graph: CompiledGraph, loss: int) -> int:
    """Bytes held before `graph`'s backward for a caller's loss of `loss` bytes, on top of
    what the eager code after it holds (steps.ForwardTrace.eager_head): that code's saved
    tensors are held while the loss's backward runs, and its gradients only after it, so
    the larger of the two gradient terms counts (`head_flowing`, the head's)."""
    return max(0, loss - graph.head_flowing)


def graph_outputs(gm: Any) -> list[Any]:
    """The example values of what graph `gm` returns (dynamo's, FakeTensors)."""
    nodes = pytree.tree_leaves([n.args for n in gm.graph.find_nodes(op="output")])
    return [getattr(n, "meta", {}).get("example_value") for n in nodes]


def with_loss(graph: CompiledGraph, base: Outside, head_flowing: int,
              returned: Any = None) -> Outside:
    """The base of a forward's last run (steps.ForwardTrace.end) with the caller's loss
    its graph's plan holds (``charge``) held before its backward; where nothing was
    measured or assumed yet (a forward with graph breaks, whose graphs were planned
    before the last was known), assumed from what the forward `returned`, and under a
    budget with ``assumed_through``'s room held through the backward (where it does not
    fit: ``replanned_without_room``). Without the room, a 2-graph MLP with ``F.mse_loss``
    outside ran its first step 1.066x the minimum named, which the second step refused
    (found 2026-12-01)."""
    graph.head_flowing = head_flowing
    if returned is not None and not graph.loss_measured and not graph.loss_charged \
            and graph.backend.watch_loss:
        graph.loss_charged = assumed(returned)
        if graph.backend.budget is not None:
            graph.through_charged = assumed_through(returned)
    extra = held(graph, graph.loss_charged)
    if not extra and not graph.through_charged:
        return base
    return dataclasses.replace(base, before_backward=base.before_backward + extra,
                               backward=base.backward + graph.through_charged)


def replanned_without_room(graph: CompiledGraph, bases: list[Outside],
                           replan: Callable[[list[Outside]], Any]) -> tuple[Any, Any]:
    """A forward with graph breaks whose graphs missed the budget with the room
    ``with_loss`` holds for the caller's loss in its last run's base (`bases[-1]`,
    `graph`'s), planned again without it (`replan(bases)`: the BudgetError of a graph
    that misses, or None), as ``without_room`` plans one graph: (the bases without the
    room, what `replan` returned), or (None, None) where no room is held."""
    lean = _lean(graph, bases[-1])
    if lean is None:
        return None, None
    lean_bases = [*bases[:-1], lean]
    return lean_bases, replan(lean_bases)


def charge(backend: MemoptBackend) -> None:
    """At a call: where the last forward's last graph's caller's loss was measured above
    what its plan holds, and ``recorded`` could not hold it as the plan is, the graph is
    planned again with it held before its backward, and a budget it no longer fits is
    raised now, naming the smallest that does."""
    log = backend.plan_log
    if not log.last_runs:
        return
    graph = log.last_runs[-1]
    if graph.plan is None or not graph.loss_measured or recorded(graph):
        return
    log.plan_again(graph, taken(graph)[0])
    log.raise_pending()


def recorded(graph: CompiledGraph) -> bool:
    """`graph`'s plan says what its caller's loss measured, without being planned again,
    where it can (True): the plan held more (an assumption, ``assumed``; lowered to the
    measurement where its timeline has a point per step, its predicted peak with it), or
    its peak holds the rest as it is (``within_peak``), or, with no budget, the peak is
    raised to hold it (nothing to recompute: the same plan). False: it must be planned
    again (``charge``)."""
    plan = graph.plan
    if graph.loss_through > graph.through_charged:  # held over the backward: planned again
        return False
    if plan is None or plan.caller_loss_measured_bytes == graph.caller_loss:
        return True
    change = held(graph, graph.caller_loss) - held(graph, graph.loss_charged)
    at_end = _before_backward(plan)
    if change > 0 and not within_peak(plan, change) \
            and not (graph.backend.budget is None and at_end is not None):
        return False
    if change > 0 or at_end is not None:
        graph.loss_charged = graph.caller_loss
    else:  # its timeline cannot say its peak without the assumption: it stays held
        change = 0
    graph.outside = dataclasses.replace(
        graph.outside, before_backward=graph.outside.before_backward + change)
    update: dict[str, Any] = {"caller_loss_bytes": graph.loss_charged,
                              "caller_loss_measured_bytes": graph.caller_loss,
                              "outside_before_backward_bytes":
                              plan.outside_before_backward_bytes + change}
    if change:
        update.update(_timeline_moved(plan, change))
    new = plan.model_copy(update=update)
    unused = graph.through_charged - graph.loss_through
    if unused > 0 and new.timeline is not None \
            and len(new.timeline.steps) == new.timeline.num_steps:
        o = graph.outside
        lowered = dataclasses.replace(o, backward=max(0, o.backward - unused))
        at_end = 0  # held_outside charges it at the forward's last step too, over `forward`
        if o.before_backward:
            at_end = max(0, o.backward - o.forward) - max(0, lowered.backward - o.forward)
        new = new.model_copy(update=_backward_lowered(new, unused, at_end))
        graph.through_charged, graph.outside = graph.loss_through, lowered  # held no more
    log = graph.backend.plan_log
    log.plans[:] = [new if p is plan else p for p in log.plans]
    if log.last is plan:
        log.last = new
    graph.plan = new
    return True


def _timeline_moved(plan: MemoryPlan, change: int) -> dict[str, Any]:
    """`plan`'s timeline and predicted peak with `change` bytes more held before its
    backward (at the forward's last step, as other graphs' bytes)."""
    timeline = plan.timeline
    at = timeline.num_forward_steps - 1
    before = timeline.totals
    after = list(before)
    after[at] += change
    update: dict[str, Any] = {"predicted_peak_bytes":
                              plan.predicted_peak_bytes + max(after) - max(before)}
    if "other_graphs" in timeline.kinds:
        kind = timeline.kinds.index("other_graphs")
        live = [list(column) for column in timeline.live]
        live[kind][at] += change
        update["timeline"] = timeline.model_copy(
            update={"live": tuple(tuple(column) for column in live)})
    return update


def _backward_lowered(plan: MemoryPlan, unused: int, at_end: int) -> dict[str, Any]:
    """`plan`'s outside bytes, timeline and predicted peak with the room it held through
    the backward for the caller's loss (``assumed_through``) that the loss measured
    left unused, `unused` bytes, taken off its backward steps and `at_end` off its
    forward's last step: the plan stays as it is (what it recomputed for the room too),
    its prediction says what it holds."""
    timeline = plan.timeline
    live = other_lowered(timeline.live, timeline.kinds, timeline.steps,
                         timeline.num_forward_steps, unused, at_end)
    if live is None:
        return {}
    lowered = timeline.model_copy(update={"live": live})
    return {"timeline": lowered, "outside_backward_bytes": max(
                0, plan.outside_backward_bytes - unused),
            "predicted_peak_bytes": plan.predicted_peak_bytes
            + max(lowered.totals) - max(timeline.totals)}


def taken(graph: CompiledGraph) -> tuple[Outside, int]:
    """What the rest of the step holds around `graph` with the caller's loss measured
    since it was planned held before its backward (``held``), and what it holds through
    the backward (`loss_through`: INPUT_SIZED_RESULTS's buffers) over it, and how many
    bytes more before it that is; the loss is then the plan's to hold (`loss_charged`,
    `through_charged`)."""
    charged = graph.caller_loss if graph.loss_measured else graph.loss_charged
    extra = held(graph, charged) - held(graph, graph.loss_charged)
    through = graph.loss_through - graph.through_charged  # < 0: the room assumed, unused
    graph.loss_charged = charged
    graph.through_charged = graph.loss_through if graph.loss_measured else graph.through_charged
    return dataclasses.replace(graph.outside, before_backward=graph.outside.before_backward
                               + extra, backward=max(0, graph.outside.backward + through)
                               ), max(0, extra)


def _before_backward(plan: MemoryPlan) -> int | None:
    """Bytes live in `plan` at the forward's last step, where what is held before the
    backward is counted (allocator.lifetimes.held_outside), from its timeline where it
    has one point per step (None: it has not)."""
    timeline = plan.timeline
    if timeline is None or len(timeline.steps) != timeline.num_steps \
            or not timeline.num_forward_steps:
        return None
    return timeline.totals[timeline.num_forward_steps - 1]


def within_peak(plan: MemoryPlan, extra: int) -> bool:
    """`plan`'s predicted peak holds `extra` bytes more before its backward, as it is."""
    at_end = _before_backward(plan)
    return at_end is not None and at_end + extra <= plan.predicted_peak_bytes
