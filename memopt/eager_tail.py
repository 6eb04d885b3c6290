"""The backward of eager code that runs before a forward's first graph, measured.

dynamo compiles what it can of the forward; where it cannot resume inside a call (a graph
break inside an ``nn.Sequential``: dynamo compiles no frame of PyTorch's own modules, so
the rest of the Sequential runs as eager PyTorch), the start of the forward runs eagerly
before the first graph. The backward of that code runs after every compiled graph's
backward, outside every plan: a CNN of three ``BatchNorm2d(momentum=None)`` blocks in a
Sequential (momentum=None reads ``float(num_batches_tracked)``, a graph break) measured
17.1 MB against a 13.1 MB budget memopt had named (found from outside).

memopt does not plan eager code; it holds it beside the graphs (Chen et al. 2016 plan
the graph they see, and the rest of the step is what the plan holds beside it). As the
first forward ends, the trace estimates that backward (steps.ForwardTrace.eager_tail:
the gradients the first graph returns into the code and the most gradients one of its
autograd nodes holds at once), held from the first step (``with_tails``). It then
measures it, at the first traced step under a budget whose first graph reads tensors
eager autograd made (steps.GraphRun.eager_saved, eager_grads):

1. a post-hook on the graph's autograd node (AOTAutograd's CompiledFunctionBackward)
   opens a window of allocation tracking (passes.allocated) when the graph's backward is
   done;
2. it closes when the backward ends (``_Watch``): the peak over what was live when the
   window opened is the eager code's backward (``CompiledGraph.eager_tail``);
3. at the next call (``charge``), where it measured more than the estimate, the graph
   is planned again with those bytes held as its backward ends, on top of what is live
   then (steps.Outside.after_backward), and a budget it no longer fits is refused there,
   naming the smallest that does.

The same CNN: estimated 1,048,896 bytes, measured 1,036,295; the first minimum named
holds from the first step. The code after the last graph, whose backward runs first, is
estimated the same way (steps.ForwardTrace.eager_head) and not measured.
"""

from __future__ import annotations

import dataclasses
import sys
from types import FunctionType, MethodType
from typing import TYPE_CHECKING, Any

import torch

from memopt.passes._torch_compat import inside_backward, queue_backward_callback, storage_ref
from memopt.passes.allocated import AllocationTracker, can_track

from .eager_reads import nodes_below, saved_tensors
from .storages import StorageId, holds_memory, storage_id

if TYPE_CHECKING:  # pragma: no cover
    from .backend import MemoptBackend
    from .compiled_graph import CompiledGraph
    from .steps import GraphRun, Outside


class _Watch:
    """One armed measurement, from where the graph's first node finishes its backward to
    the end of the backward.

    On CUDA the allocator's counters start at that node's hook and stop in a callback at
    the backward's end. On CPU the window is a profiler (passes.allocated), which must be
    started and stopped on the thread that calls ``backward()``: the autograd engine runs
    each node with the thread-local state captured when the backward began, and gives the
    caller its own back when it ends. So it starts as the forward ends, is marked at the
    hook (AllocationTracker.mark), and stops at the first Python event on that thread
    after the backward returned (``sys.setprofile``, set by the end-of-backward
    callback, removed at once; not armed where a profile function is set as the forward
    ends). The profiler
    does not report the frees of blocks allocated before it started: the tensors the
    eager nodes saved in the forward. Each eager node drops a marker as its backward
    ends, and a saved storage whose last eager holder has run, and that nothing holds
    once the backward is over, counts as freed at its marker.
    """

    def __init__(self, graph: CompiledGraph, device: torch.device, nodes: list[Any]) -> None:
        self.graph = graph
        self.cpu = device.type == "cpu"
        self.tracker: AllocationTracker | None = AllocationTracker(device, collect=False)
        self.marked = False
        self.previous: Any = None  # the profile function set as the backward ended
        self.handles = [node.register_hook(self._begins) for node in nodes]
        #: CPU: per eager node, the storages it saved; per storage, (weak reference,
        #: bytes, eager nodes holding it); markers (node, 1-byte tensor) as nodes end
        self.node_saved: list[list[StorageId]] = []
        self.saved: dict[StorageId, list] = {}
        self.markers: list[tuple[int, torch.Tensor]] = []
        eager, params = _eager_nodes(nodes)
        #: the new gradients of the parameters it reads: the plan counts them as its own
        #: backward ends (steps.ForwardTrace._eager_grads), before they are made
        self.counted = sum(p.untyped_storage().nbytes() for p in params if p.grad is None)
        if self.cpu:
            for i, node in enumerate(eager):
                keys = []
                for t in saved_tensors(node):
                    if holds_memory(t):
                        key = storage_id(t)
                        entry = self.saved.setdefault(
                            key, [storage_ref(t.untyped_storage()),
                                  t.untyped_storage().nbytes(), 0])
                        entry[2] += key not in keys
                        keys.append(key)
                self.node_saved.append(list(dict.fromkeys(keys)))
                self.handles.append(node.register_hook(
                    lambda *_, i=i: self.markers.append((i, torch.empty(1, dtype=torch.uint8)))
                    if self.marked else None))
            self.tracker.start()

    def _begins(self, *_: Any) -> None:
        if self.marked or self.tracker is None:
            return
        self.marked = True
        if self.cpu:
            self.tracker.mark()
            queue_backward_callback(self._backward_ends)
        else:
            self.tracker.start()
            queue_backward_callback(self.stop)

    def _backward_ends(self) -> None:
        # a profile function set since the forward: chained where it is Python's (and put
        # back); a C profiler's (cProfile) is left alone, and the window to `charge`,
        # unmeasured
        self.previous = sys.getprofile()
        if self.previous is None or isinstance(self.previous, (FunctionType, MethodType)):
            sys.setprofile(self._after_backward)

    def _after_backward(self, frame: Any, event: str, arg: Any) -> None:
        if not inside_backward():
            sys.setprofile(self.previous)
            self.stop()
        if self.previous is not None:
            self.previous(frame, event, arg)

    def _released(self) -> dict[int, int]:
        """{marker address: bytes of saved storages freed as its node ended}."""
        released: dict[int, int] = {}
        for i, marker in self.markers:
            for key in self.node_saved[i]:
                entry = self.saved[key]
                entry[2] -= 1
                if entry[2] == 0 and entry[0].expired():
                    address = marker.data_ptr()
                    released[address] = released.get(address, 0) + entry[1]
        return released

    def stop(self) -> None:
        """End the measurement: after the backward, or at the next call where the
        backward did not run (nothing is recorded then)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        tracker, self.tracker = self.tracker, None
        if tracker is None or not (self.cpu or self.marked):
            return
        seen = tracker.stop(self._released() if self.cpu and self.marked else None)
        self.markers, self.saved = [], {}
        graph = self.graph
        if graph._tail_watch is self:
            graph._tail_watch = None
            if self.marked:
                graph.eager_tail = max(graph.eager_tail or 0, seen.peak - self.counted, 0)


def _eager_nodes(compiled: list[Any]) -> tuple[list[Any], list[torch.Tensor]]:
    """The autograd nodes of eager code below the compiled graphs' nodes ``compiled``
    (down to other compiled graphs), and the parameters whose gradient they make."""
    found, params = [], []
    for node in nodes_below(compiled):
        if type(node).__name__ == "AccumulateGrad":
            params.append(node.variable)
        else:
            found.append(node)
    return found, params


def arm(run: GraphRun, graph: CompiledGraph, budget: Any) -> None:
    """Measure the backward of the eager code before ``run``, the forward's first graph
    run, at this step's backward (see the module docstring): under a budget, where eager
    autograd made what the graph reads, at the first step that can (on CPU: no profiler
    recording as the forward ends), once per graph. A profiler the caller starts between
    that forward's end and its backward's end finds the window's already recording, and
    raises."""
    if budget is None or graph.plan is None or graph._tail_armed \
            or not (run.eager_saved or run.eager_grads):
        return
    nodes = [node for node in (ref() for ref in run.nodes) if node is not None]
    device = torch.device(graph.plan.device)
    if nodes and can_track(device) and (device.type != "cpu" or sys.getprofile() is None):
        graph._tail_watch, graph._tail_armed = _Watch(graph, device, nodes), True


def with_tails(runs: list[CompiledGraph], bases: list[Outside], estimate: int) -> list[Outside]:
    """The forward's bases (steps.ForwardTrace.end) with the backward of the eager code
    before the first run held as its backward ends: the `estimate` the trace made
    (steps.ForwardTrace.eager_tail) or, where more, what was measured, as ``charge``
    planned it (`CompiledGraph.tail_charged`)."""
    if not runs:
        return bases
    first = runs[0]
    first.tail_charged = max(first.tail_charged, estimate)
    if not first.tail_charged:
        return bases
    return [dataclasses.replace(bases[0], after_backward=bases[0].after_backward
                                + first.tail_charged), *bases[1:]]


def charge(backend: MemoptBackend) -> None:
    """At a call: plan again each graph of the last forward whose eager backward was
    measured since it was planned, with it held as its backward ends; a budget it no
    longer fits is raised now, naming the smallest that does."""
    log = backend.plan_log
    for graph in dict.fromkeys(log.last_runs):
        if graph._tail_watch is not None:  # its backward never ended: not measured
            graph._tail_watch.marked = False
            graph._tail_watch.stop()
            graph._tail_watch = graph.eager_tail = None
        extra = (graph.eager_tail or 0) - graph.tail_charged
        if extra <= 0 or graph.plan is None:
            continue
        graph.tail_charged += extra
        log.plan_again(graph, dataclasses.replace(
            graph.outside, after_backward=graph.outside.after_backward + extra))
    log.raise_pending()
