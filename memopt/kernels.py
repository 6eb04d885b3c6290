"""Which kernels run memopt's plan: `kernels="aten"` (op by op) or `kernels="inductor"`.

memopt plans the joint forward+backward graph and partitions it (memopt.planner); what
runs the two graphs it returns is a separate choice:

- ``"aten"``: AOTAutograd's boxed GraphModules, one aten kernel per node. memopt's own
  in-place rewrites (Chen et al. 2016, Sec. 3; ``out=`` forms) and storage sharing are
  what runs, so the simulated peak is the step's.
- ``"inductor"``: TorchInductor generates the kernels of both graphs (fused pointwise and
  reduction kernels, its own buffer reuse), as `torch.compile` would, with memopt's
  partition function in place of inductor's min-cut one (inductor's
  ``custom_partitioner_fn`` hook, called after inductor's joint-graph passes). What
  memopt saves and recomputes is memopt's plan; how each graph is computed is
  inductor's.

What the inductor mode changes, and why (passes._inductor_compat.INDUCTOR_SETTINGS):

1. The captured graph is decomposed with inductor's table (plus memopt's loss
   decompositions), so the graph memopt plans is the one inductor compiles.
2. memopt's in-place pass is off: inductor refuses ``out=`` ops, and reuses buffers
   itself. memopt's liveness counts what inductor's kernels allocate instead
   (passes.fusion: values computed inside their readers, in-place writes, the wrapper's
   pool), and once inductor has scheduled the graphs, counts them again in the order its
   kernels run (`scheduled_peak`).
3. ``fallback_random``: random ops run as eager's kernels on eager's generator, in
   program order, so dropout draws eager's masks, and memopt's saved-mask replay
   (passes.twins) recomputes dropout from eager's mask. Without it inductor would
   replace the draws with its own Philox stream inside the partitioner memopt replaces.
4. ``layout_optimization``, ``shape_padding`` and ``comprehensive_padding`` off: they add
   channels-last copies and padded buffers the plan does not hold (a ResNet measured
   1.24x over its budget with channels-last on).
5. AOTAutograd's cache off for memopt's compilations (a hit would skip the partitioner,
   and the plan); inductor's kernel cache stays on, keyed by the graphs it compiles.

memopt's own operators (chains, LM heads, reversible stacks) are registered custom ops
with fake implementations (torch.library), which inductor calls as extern kernels.
"""

from __future__ import annotations

import copy
import enum
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from memopt.allocator import Interval, peak_live_bytes
from memopt.passes._inductor_compat import inductor_compile
from memopt.passes._torch_compat import is_tangent, storage_key
from memopt.passes.fusion import RELAID_OPS, in_schedule_order, relaid_args
from memopt.passes.meta import EXTERN_STRIDES, KERNEL_GROUP, WORKSPACE_BYTES
from memopt.passes.workspace import WorkspaceCache, node_call, workspace_bytes_of

from .budget import format_bytes
from .errors import BudgetError
from .memory_plan import MemoryPlan
from .planner.build import allocation_granularity


class Kernels(str, enum.Enum):
    """What runs a plan's forward and backward graphs (the module docstring)."""

    ATEN = "aten"
    INDUCTOR = "inductor"

    @classmethod
    def parse(cls, value: object) -> Kernels:
        if isinstance(value, Kernels):
            return value
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f'kernels must be "aten" (memopt runs its graphs op by op) or "inductor" '
                f"(TorchInductor generates their kernels), got {value!r}") from None


#: The key inductor's kernel cache gets for memopt's partitioner: the graphs themselves
#: decide the kernels, so one constant per memopt version.
_CACHE_KEY = "memopt-partitioner-1"


@dataclass
class InductorSchedule:
    """What compiling a plan's graphs with inductor showed: its estimate of each graph's
    own peak ("forward", "backward": passes._inductor_compat._schedule_peak), the order its
    kernels run each graph's nodes in (`orders`), and copies of the graphs memopt gave it
    (`graphs`, as planned: inductor's passes change the graphs they compile)."""

    peaks: dict[str, int] = field(default_factory=dict)
    orders: dict[str, list[tuple[str, ...]]] = field(default_factory=dict)
    #: for each entry of `orders`, its generated kernel and the node whose buffer it
    #: writes (passes._inductor_compat._schedule_kernels)
    kernels: dict[str, list[tuple[int, str | None]]] = field(default_factory=dict)
    graphs: tuple[fx.GraphModule, ...] = ()
    #: per graph, the (sizes, strides) of the tensors inductor hands each extern kernel
    #: whose arguments it lays out anew (passes.fusion.RELAID_OPS), by fx node
    layouts: dict[str, dict[str, tuple]] = field(default_factory=dict)


def compile_with_inductor(gm: fx.GraphModule, example_inputs: Sequence[Any],
                          partition_fn: Callable[..., Any]) -> tuple[Callable, InductorSchedule]:
    """`gm` (a dynamo graph) compiled by TorchInductor with `partition_fn` (memopt's
    planner) partitioning its joint graph, and what inductor's schedule of the planned
    graphs showed (InductorSchedule, see `schedule_peak`). `gm` itself is left as it was
    (inductor's pre-grad passes change the graph they are given), so that it can be
    planned again."""
    own = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    own.meta.update(gm.meta)
    schedule = InductorSchedule()
    resident: set[str] = set()

    def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        fw, bw = partition_fn(joint, joint_inputs, **kwargs)
        resident.update(views_of_primals(joint, bw))
        schedule.graphs = (_copy(fw), _copy(bw))
        return fw, bw

    compiled = inductor_compile(own, list(example_inputs), partition, _CACHE_KEY,
                                schedule.peaks, resident, schedule.orders, schedule.layouts,
                                RELAID_OPS, schedule.kernels)
    return compiled, schedule


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` with a graph of its own (nodes copied, their meta shallow-copied)."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph)


def scheduled_peak(schedule: InductorSchedule, liveness: Callable[..., Any],
                   granularity: int, workspaces: WorkspaceCache) -> int | None:
    """The step's peak as memopt's liveness of fused kernels (passes.fusion) counts it
    with each graph's nodes in the order inductor's kernels ran them
    (passes.fusion.in_schedule_order), and each extern kernel whose arguments inductor
    laid out anew charged the workspace it takes at those layouts (measured in
    `workspaces`); `liveness(fw, bw)` is the plan's (a StepSchedule). A fused kernel runs
    whole: the buffers it writes are live from its first step, those it reads until its
    last (KernelGroups). None where the schedule was not seen (a graph compiled from
    inductor's cache)."""
    if len(schedule.graphs) != 2 or set(schedule.orders) != {"forward", "backward"}:
        return None
    fw, bw = (_at_inductors_layouts(in_schedule_order(g, schedule.orders[kind]),
                                    schedule.layouts.get(kind, {}), workspaces)
              for g, kind in zip(schedule.graphs, ("forward", "backward")))
    groups = {prefix: KernelGroups.of(schedule, kind, graph) for prefix, kind, graph
              in (("fw", "forward", fw), ("bw", "backward", bw))}
    steps = liveness(fw, bw)
    step_of = {name: k for k, name in enumerate(steps.steps)}
    for group in groups.values():
        group.place(step_of)
    return peak_live_bytes([Interval(-(-s.nbytes // granularity) * granularity,
                                     *_within_kernels(s.start, s.end, steps.steps, groups))
                            for s in steps.storages], len(steps.steps)).peak_bytes


@dataclass
class KernelGroups:
    """Which of inductor's generated kernels computes each node of one graph (a fused
    kernel computes several realized nodes, and inlines others into each): `writes`, the
    kernel whose buffer a node's value is; `reads`, every kernel a node is computed or
    inlined in. Each node's copy is marked with its kernel (the last it is inlined in where
    it writes no buffer: passes.meta.KERNEL_GROUP), so that memopt's model of the
    wrapper's buffer pool gives no node a buffer freed inside its own kernel
    (memopt.allocator.fusion)."""

    prefix: str
    writes: dict[str, int] = field(default_factory=dict)
    reads: dict[str, set[int]] = field(default_factory=dict)
    first: dict[int, int] = field(default_factory=dict)   # kernel: its first step
    last: dict[int, int] = field(default_factory=dict)    # kernel: its last step

    @classmethod
    def of(cls, schedule: InductorSchedule, kind: str, graph: fx.GraphModule) -> KernelGroups:
        found = cls("fw" if kind == "forward" else "bw")
        entries = schedule.kernels.get(kind, [])
        for names, (kernel, origin) in zip(schedule.orders.get(kind, []), entries):
            for name in names:
                found.reads.setdefault(name, set()).add(kernel)
            if origin is not None:
                found.writes[origin] = kernel
        for node in graph.graph.nodes:  # a node inductor inlines: the last kernel it is in
            kernel = found.writes.get(node.name, max(found.reads.get(node.name, ()),
                                                     default=None))
            if kernel is not None:
                node.meta[KERNEL_GROUP] = kernel
        return found

    def place(self, step_of: dict[str, int]) -> None:
        """Each kernel's first and last step: those of the nodes whose buffers it writes."""
        for name, kernel in self.writes.items():
            step = step_of.get(f"{self.prefix}.{name}")
            if step is not None:
                self.first[kernel] = min(self.first.get(kernel, step), step)
                self.last[kernel] = max(self.last.get(kernel, step), step)


def _within_kernels(start: int, end: int, steps: Sequence[str],
                    groups: dict[str, KernelGroups]) -> tuple[int, int]:
    """A storage's first and last step with inductor's kernels run whole: the wrapper
    allocates every buffer a kernel writes before calling it (from the kernel's first
    step), and a buffer a kernel reads, itself or inside a node inlined into it, is
    freed after it (at the kernel's last step)."""
    if 0 <= start < len(steps):
        prefix, _, name = steps[start].partition(".")
        group = groups.get(prefix)
        if group is not None and name in group.writes:
            start = min(start, group.first.get(group.writes[name], start))
    if 0 <= end < len(steps):
        prefix, _, name = steps[end].partition(".")
        group = groups.get(prefix)
        if group is not None:
            end = max([end, *(group.last.get(k, end) for k in group.reads.get(name, ()))])
    return start, end


def inductor_peak(plan: MemoryPlan, schedule: InductorSchedule, request: Any) -> int:
    """The step's peak under inductor's kernels: `scheduled_peak` with the liveness of
    `request` (the plan's PlanRequest), or, where the schedule was not seen or could not
    be replayed, `schedule_peak` (inductor's own estimate bounds it); never below the
    plan's own prediction."""
    def liveness(fw: fx.GraphModule, bw: fx.GraphModule) -> Any:
        saved = frozenset(n.name for n in bw.graph.find_nodes(op="placeholder")
                          if not is_tangent(n))
        return request.step.liveness(fw, bw, saved, request.num_fwd_outputs)

    try:
        peak = scheduled_peak(schedule, liveness, allocation_granularity(plan.device),
                              request.workspaces)
    except Exception as exc:  # noqa: BLE001 (a model of inductor, not the step)
        warnings.warn(f"memopt could not count the plan's buffers in the order inductor's "
                      f"kernels run ({type(exc).__name__}: {exc}); inductor's own estimate "
                      f"of its schedule bounds the prediction instead. Please report this "
                      f"model.", stacklevel=2)
        peak = None
    if peak is None:
        peak = schedule_peak(plan, schedule.peaks)
    return max(peak, plan.predicted_peak_bytes)


def _at_inductors_layouts(gm: fx.GraphModule, layouts: dict[str, tuple],
                          workspaces: WorkspaceCache) -> fx.GraphModule:
    """`gm` (a copy) with each extern kernel in `layouts` given the strides inductor
    handed its tensor arguments (passes.meta.EXTERN_STRIDES) and the workspace it takes
    at them (passes.workspace)."""
    for node in gm.graph.nodes:
        if node.name not in layouts:
            continue
        tensors = [k for k, a in enumerate(node.args) if isinstance(a, fx.Node)]
        strides = {k: stride for k, (_, stride) in zip(tensors, layouts[node.name])}
        node.meta[EXTERN_STRIDES] = strides
        node.meta.pop(WORKSPACE_BYTES, None)
        call = node_call(node, relaid=relaid_args(node), strides=strides)
        if call is not None:
            node.meta[WORKSPACE_BYTES] = workspace_bytes_of([call], workspaces)[0]
    return gm


def op_by_op_or_refuse(refused: BudgetError, aten: Callable[[], Callable]) -> Callable:
    """A budget below the smallest that memopt's plan for inductor's kernels reaches
    (`refused`): the graph compiled to run op by op (`aten()`) where that plan fits, else
    the BudgetError of the two that names the larger minimum. The plan for fused kernels
    counts what memopt's model of inductor's fusion leaves (passes.fusion); inductor's
    schedule can hold more (memopt.kernels.inductor_peak), and a budget it misses runs op
    by op: at the larger minimum one of the two is accepted, at the smaller it may be
    neither (the fuzz slice: a midpoint and a minimum budget refused under inductor above
    the minimum named at budget=1)."""
    try:
        return aten()
    except BudgetError as op_by_op:
        if op_by_op.minimum_bytes > refused.minimum_bytes:
            raise op_by_op from None
        raise refused from None


def refused_note(refused: BudgetError) -> str:
    """The plan's `kernels_note` where `op_by_op_or_refuse` ran the graph op by op."""
    return (f"aten: the budget is below the smallest of memopt's plan for inductor's kernels, "
            f"{format_bytes(refused.minimum_bytes)}; op by op it fits")


def views_of_primals(joint: fx.GraphModule, backward: fx.GraphModule) -> set[str]:
    """The backward's inputs that are views of a primal (a saved `W.t()`): resident
    memory, which freeing at their last use would not give back."""
    def key(node: fx.Node) -> Any:
        value = node.meta.get("val")
        return storage_key(value) if isinstance(value, torch.Tensor) else None

    primals = {key(n) for n in joint.graph.find_nodes(op="placeholder")
               if n.name.startswith("primals")} - {None}
    return {n.name for n in backward.graph.find_nodes(op="placeholder") if key(n) in primals}


#: What memopt's timeline holds that inductor's estimate of a graph does not: the step's
#: resident tensors, the other graphs of the step, and workspaces inside kernels.
_NOT_IN_SCHEDULE = ("parameters", "inputs", "other_graphs", "workspace")


def schedule_peak(plan: MemoryPlan, schedule_peaks: dict[str, int]) -> int:
    """The step's peak with each graph's own buffers as inductor's schedule holds them
    where that is more than the plan counts (at least the plan's predicted peak).

    The plan's timeline gives, at each point of the forward and of the backward, the
    bytes its graph's own buffers hold (live bytes less what inductor's estimate does not
    count: `_NOT_IN_SCHEDULE`). Inductor's estimate of the same graph as it scheduled it
    (after fusion, in its kernels' order: passes._inductor_compat._schedule_peak) counts
    its buffers without its in-place writes and frees; the plan's liveness models those
    (passes.fusion) on the graph's own order, which inductor's fusion can change. The plan
    also knows the same estimate on its own order (`plan.fusion_estimate_bytes`): where
    inductor's is higher, the kernels' order costs the difference, and that graph's points
    are raised by it. (A plan without that estimate compares with its most own bytes.) Inductor's pool lets a freed buffer be held until reused
    only while its estimate stays at or below its own peak, and in-place writes only
    lower what it holds, so the estimate bounds the graph's own bytes."""
    timeline = plan.timeline
    if timeline is None or not schedule_peaks:
        return plan.predicted_peak_bytes
    own = [k for k, kind in enumerate(timeline.kinds) if kind not in _NOT_IN_SCHEDULE]
    planned = {"forward": 0, "backward": 0}
    totals = {"forward": 0, "backward": 0}
    for point, (step, total) in enumerate(zip(timeline.steps, timeline.totals)):
        graph = "forward" if step < timeline.num_forward_steps else "backward"
        held = sum(timeline.live[k][point] for k in own)
        planned[graph] = max(planned[graph], held)
        totals[graph] = max(totals[graph], total)
    if any(plan.fusion_estimate_bytes):  # the same estimate, on memopt's order
        planned = dict(zip(("forward", "backward"), plan.fusion_estimate_bytes))
    raised = [totals[graph] + max(0, schedule_peaks.get(graph, 0) - planned[graph])
              for graph in planned]
    return max(plan.predicted_peak_bytes, *raised)


def schedule_excess(plan: MemoryPlan, schedule_peaks: dict[str, int]) -> int:
    """Bytes by which inductor's schedule of the plan's graphs raises the step's peak
    above the plan's prediction (`schedule_peak`; 0 where it does not)."""
    return schedule_peak(plan, schedule_peaks) - plan.predicted_peak_bytes
