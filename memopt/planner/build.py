"""The exact build of one candidate step: partition, recomputation, in-place, liveness.

Every plan the search picks is built here once for real (the budget search scores its
candidates on the step simulator, passes.simulate, which must agree with this build:
tests/test_simulate.py). A stage that fails is re-raised as PassError naming it and the
stages before it (STYLE.md, section 8).

    build(request, mirror) -> Built(fw, bw, saved, recomputed, in-place rewrites,
                                    schedule, peak)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
import dataclasses
from dataclasses import dataclass

from torch import fx

from memopt.allocator import Interval, peak_live_bytes
from memopt.passes._torch_compat import data_dependent_errors
from memopt.passes.fusion import relaid_args
from memopt.passes.gradients import accumulate_in_place, save_parameters
from memopt.passes.inplace import InplaceResult, reinplace
from memopt.passes.liveness import StepSchedule, timeline_kinds
from memopt.passes.meta import mirror_level, op_name, recomputed_from, tensor_value, user_module
from memopt.passes.partition import find_cut, partition
from memopt.passes.recompute import add_mirror_nodes, copy_graph_module, node_flops
from memopt.passes.shared_saves import duplicates, saved_pairs, share_saved
from memopt.passes.simulate import Simulated
from memopt.passes.workspace import WorkspaceCache, measure_workspaces

from ..errors import BudgetError, CaptureError, PassError, data_dependent_message
from ..memory_plan import InplaceRecord, RecomputedNode
from .request import StepContext


@dataclass(frozen=True)
class Mirror:
    """Mirror counts (Chen Alg. 2): m(v) >= 1 for the nodes in `names`, m(v) = 2 for
    those also in `twice` (Sec. 4.4's recursion), m(v) = 0 for every other node."""

    names: frozenset[str] = frozenset()
    twice: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Built:
    """One candidate step: its graphs, their schedule and its peak."""

    graph: fx.GraphModule  # the joint graph partitioned (with twins: passes.twins)
    fw: fx.GraphModule
    bw: fx.GraphModule
    saved_names: frozenset[str]
    recomputed: frozenset[str]
    rewrites: tuple[InplaceRecord, ...]
    schedule: StepSchedule
    peak_bytes: int
    #: saved value -> the values equal to it that backward reads it for
    #: (passes.shared_saves): each saved once
    serves: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)


@contextmanager
def stage(name: str, done: list[str]) -> Iterator[None]:
    """One pipeline stage: a failure is re-raised as PassError naming it and the stages before."""
    try:
        yield
    except (BudgetError, PassError):
        raise
    except data_dependent_errors() as exc:
        raise CaptureError(data_dependent_message(exc)) from exc
    except Exception as exc:
        raise PassError(name, tuple(done), exc) from exc
    done.append(name)


def allocation_granularity(device: str) -> int:
    """Bytes the device allocator rounds each block to (CUDA caching allocator: 512)."""
    return 512 if device.startswith("cuda") else 1


def device_of(gm: fx.GraphModule) -> str:
    for node in gm.graph.nodes:
        val = tensor_value(node)
        if val is not None:
            return str(val.device)
    return "cpu"


def intervals(schedule: StepSchedule, granularity: int) -> list[Interval]:
    """Each storage's live interval, its bytes rounded up to the allocator's blocks."""
    g = granularity
    return [Interval(size=-(-s.nbytes // g) * g, start=s.start, end=s.end)
            for s in schedule.storages]


def peak_bytes(schedule: StepSchedule, granularity: int) -> int:
    return peak_live_bytes(intervals(schedule, granularity), len(schedule.steps)).peak_bytes


def build(joint: fx.GraphModule, num_fwd_outputs: int, mirror: Mirror, *,
          inplace: bool, step: StepContext, workspaces: WorkspaceCache, done: list[str]
          ) -> Built:
    """Partition (recomputing `mirror`), place recomputation, add gradients into existing
    `.grad` tensors, rewrite in place, analyze.

    Step 1: Chen Alg. 2: a mirror node for each value of `mirror` (passes.recompute),
        then the forward/backward cut, one copy saved of values computed twice
        (passes.shared_saves); with kept `.grad` tensors the backward adds into
        them, with the optimizer stepped in the backward it steps on each gradient
        (passes.gradients). The extraction drops saved values backward never reads.
    Step 2: Chen Sec. 3's in-place rewrites in both graphs (passes.inplace).
    Step 3: each op's kernel workspace, measured once per op and shape (passes.workspace).
    Step 4: liveness over the whole step (passes.liveness) and its peak.
    """
    # Step 1: partition
    with stage("partition", done):
        if mirror.names:
            joint = add_mirror_nodes(joint, num_fwd_outputs, mirror.names,
                                     step.mutable_inputs, twice=mirror.twice)
        cut = find_cut(joint, num_fwd_outputs)
        pairs: dict[str, str] = saved_pairs(cut.saved, duplicates(joint, num_fwd_outputs))
        if pairs:
            if not mirror.names:  # the planner's joint graph itself: change a copy
                joint = copy_graph_module(joint)
            share_saved(joint, num_fwd_outputs, pairs)
            cut = find_cut(joint, num_fwd_outputs)
        if step.grads is not None:  # the backward adds into each parameter's .grad
            with stage("gradient accumulation", done):
                cut = save_parameters(cut, frozenset(step.grads.nbytes))
                joint, _ = accumulate_in_place(joint, num_fwd_outputs,
                                               frozenset(step.grads.nbytes), step.grads.add,
                                               step.grads.step_bytes)
        fw, bw = partition(joint, num_fwd_outputs, cut)
        recomputed = frozenset(n.name for n in bw.graph.nodes if recomputed_from(n))
        saved_names = frozenset(cut.saved) & {n.name for n in bw.graph.find_nodes(op="placeholder")}
    # Step 2: in-place
    rewrites: list[InplaceRecord] = []
    if inplace:
        with stage("in-place", done):
            for graph_name, gm in (("fw", fw), ("bw", bw)):
                result: InplaceResult = reinplace(gm)
                rewrites += [InplaceRecord(graph=graph_name, **r.__dict__) for r in result.rewrites]
    # Step 3: workspaces
    with stage("kernel workspaces", done):
        measure_workspaces([fw, bw], workspaces, relaid_args if step.fused else None)
    # Step 4: liveness
    with stage("liveness", done):
        schedule = step.liveness(fw, bw, saved_names, num_fwd_outputs)
    peak = peak_bytes(schedule, allocation_granularity(device_of(fw)))
    serves: dict[str, tuple[str, ...]] = {}
    for duplicate, kept in pairs.items():
        serves[kept] = serves.get(kept, ()) + (duplicate,)
    return Built(joint, fw, bw, saved_names, recomputed, tuple(rewrites), schedule, peak,
                 serves)


def recomputed_nodes(built: Built) -> tuple[RecomputedNode, ...]:
    """One record per recomputed forward value: the cost of all its mirror nodes, and
    how many times it is recomputed."""
    by_name = {n.name: n for n in built.graph.graph.nodes}
    flops: dict[str, int] = {}
    levels: dict[str, set[str | None]] = {}
    for name in built.recomputed:
        original = recomputed_from(by_name[name])
        flops[original] = flops.get(original, 0) + node_flops(by_name[name])
        levels.setdefault(original, set()).add(mirror_level(by_name[name]))
    records = []
    for node in built.graph.graph.nodes:
        val = tensor_value(node)
        if node.name in flops and val is not None:
            module, module_type = user_module(node)
            records.append(RecomputedNode(
                name=node.name, op=op_name(node), module=module, module_type=module_type,
                shape=tuple(int(d) for d in val.shape), nbytes=val.untyped_storage().nbytes(),
                flops=flops[node.name], times=len(levels[node.name]),
            ))
    return tuple(records)


def as_simulated(built: Built) -> Simulated:
    """The exact build in the simulator's terms, to compare with it or stand in for it."""
    schedule = built.schedule
    spans = tuple((s.nbytes, s.start, s.end) for s in schedule.storages)
    at = peak_live_bytes(intervals(schedule, allocation_granularity(device_of(built.fw))),
                         len(schedule.steps)).peak_step
    return Simulated(intervals=spans, num_steps=len(schedule.steps),
                     peak_bytes=built.peak_bytes,
                     recompute_flops=sum(r.flops for r in recomputed_nodes(built)),
                     saved_bytes=sum(s.nbytes for s in schedule.storages
                                     if s.kind == "saved"),
                     kinds=timeline_kinds(schedule, built.fw, built.bw),
                     peak_step=schedule.steps[at] if at >= 0 else "",
                     num_forward_steps=schedule.num_forward_steps)
