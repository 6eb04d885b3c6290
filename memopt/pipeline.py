"""memopt's pass pipeline over one joint forward+backward graph.

    joint graph -> partition -> liveness (baseline) -> in-place -> liveness
                -> allocator (peak, tag sharing, offsets) -> MemoryPlan

Each stage is a pass in `memopt.passes` or a solver in `memopt.allocator`; this
module only runs them in order and assembles the plan. Errors name the stage.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import fx

from memopt.allocator import Interval, assign_offsets, no_sharing_bytes, peak_live_bytes
from memopt.allocator import share_by_tags
from memopt.passes.inplace import InplaceResult, reinplace
from memopt.passes.liveness import StepSchedule, analyze_liveness
from memopt.passes.meta import op_name, tensor_value, user_module
from memopt.passes.partition import find_cut, partition, read_concat_views

from .budget import Budget, format_bytes
from .errors import BudgetError, PassError
from .memory_plan import InplaceRecord, MemoryPlan, SavedTensor, SharingGroup, StorageRecord

log = logging.getLogger("memopt")

RESIDENT_KINDS = ("parameter", "buffer", "input")


@dataclass(frozen=True)
class Options:
    """Pipeline switches (the defaults are what `memopt.compile` runs)."""

    inplace: bool = True


def allocation_granularity(device: str) -> int:
    """Bytes the device allocator rounds each block to (CUDA caching allocator: 512)."""
    return 512 if device.startswith("cuda") else 1


def _intervals(schedule: StepSchedule, granularity: int) -> list[Interval]:
    g = granularity
    return [Interval(size=-(-s.nbytes // g) * g, start=s.start, end=s.end)
            for s in schedule.storages]


def _peak_bytes(schedule: StepSchedule, granularity: int) -> int:
    return peak_live_bytes(_intervals(schedule, granularity), len(schedule.steps)).peak_bytes


@contextmanager
def _stage(name: str, done: list[str]) -> Iterator[None]:
    """One pipeline stage: a failure is re-raised as PassError naming it and the stages before."""
    try:
        yield
    except (BudgetError, PassError):
        raise
    except Exception as exc:
        raise PassError(name, tuple(done), exc) from exc
    done.append(name)


def plan_joint(
    joint: fx.GraphModule,
    num_fwd_outputs: int,
    *,
    primal_kinds: dict[str, str],
    budget: Budget | None,
    options: Options = Options(),
) -> tuple[fx.GraphModule, fx.GraphModule, MemoryPlan]:
    """Run memopt's passes on `joint`; return the forward, backward and the plan."""
    t0 = time.perf_counter()
    done: list[str] = []
    with _stage("partition", done):
        cut = find_cut(joint, num_fwd_outputs)
        if read_concat_views(joint, num_fwd_outputs, cut):
            cut = find_cut(joint, num_fwd_outputs)
        fw, bw = partition(joint, num_fwd_outputs, cut)
        # the extraction drops saved values the backward never reads
        saved_names = frozenset(cut.saved) & {n.name for n in bw.graph.find_nodes(op="placeholder")}
    device = _device_of(fw)
    gran = allocation_granularity(device)
    with _stage("liveness (baseline)", done):
        baseline = analyze_liveness(fw, bw, saved=saved_names, primal_kinds=primal_kinds)
        baseline_peak = _peak_bytes(baseline, gran)
    rewrites: list[InplaceRecord] = []
    if options.inplace:
        with _stage("in-place", done):
            for graph_name, gm in (("fw", fw), ("bw", bw)):
                result: InplaceResult = reinplace(gm)
                rewrites += [InplaceRecord(graph=graph_name, **r.__dict__) for r in result.rewrites]
    with _stage("liveness", done):
        schedule = analyze_liveness(fw, bw, saved=saved_names, primal_kinds=primal_kinds)
    with _stage("allocator", done):
        plan = _assemble(fw, schedule, saved_names, rewrites, baseline_peak, budget, device,
                         gran, time.perf_counter() - t0)
    log.info(
        "memopt: peak %s -> %s (lower bound %s, arena %s), %d in-place, %d saved tensors, "
        "planned in %.2fs", format_bytes(plan.baseline_peak_bytes),
        format_bytes(plan.predicted_peak_bytes), format_bytes(plan.lower_bound_bytes),
        format_bytes(plan.arena_bytes), len(rewrites), len(plan.saved), plan.plan_seconds,
    )
    if plan.budget_bytes is not None and plan.predicted_peak_bytes > plan.budget_bytes:
        raise BudgetError(
            budget_bytes=plan.budget_bytes,
            minimum_bytes=plan.predicted_peak_bytes,
            baseline_bytes=plan.baseline_peak_bytes,
            budget=str(budget),
        )
    return fw, bw, plan


def _device_of(gm: fx.GraphModule) -> str:
    for node in gm.graph.nodes:
        val = tensor_value(node)
        if val is not None:
            return str(val.device)
    return "cpu"


def _assemble(
    fw: fx.GraphModule,
    schedule: StepSchedule,
    saved_names: frozenset[str],
    rewrites: list[InplaceRecord],
    baseline_peak: int,
    budget: Budget | None,
    device: str,
    gran: int,
    elapsed: float,
) -> MemoryPlan:
    intervals = _intervals(schedule, gran)
    n_steps = len(schedule.steps)
    peak = peak_live_bytes(intervals, n_steps)
    dynamic = [i for i, s in enumerate(schedule.storages) if s.kind not in RESIDENT_KINDS]
    resident = sum(iv.size for iv, s in zip(intervals, schedule.storages)
                   if s.kind in RESIDENT_KINDS)
    offsets = assign_offsets([intervals[i] for i in dynamic], alignment=gran)
    tags = share_by_tags([intervals[i] for i in dynamic])
    offset_of = dict(zip(dynamic, offsets.offsets))
    tag_of = dict(zip(dynamic, tags.tag_of))

    storages = tuple(
        StorageRecord(name=s.name, kind=s.kind, nbytes=s.nbytes, start=s.start, end=s.end,
                      nodes=s.nodes, offset=offset_of.get(i), tag=tag_of.get(i))
        for i, s in enumerate(schedule.storages)
    )
    members: dict[int, list[str]] = {}
    for i, tag in tag_of.items():
        members.setdefault(tag, []).append(schedule.storages[i].name)
    sharing = tuple(
        SharingGroup(tag=t, nbytes=tags.tag_sizes[t], storages=tuple(names))
        for t, names in sorted(members.items()) if len(names) > 1
    )
    saved = _saved_tensors(fw, schedule, saved_names)
    return MemoryPlan(
        device=device,
        budget_bytes=budget.resolve(baseline_peak) if budget is not None else None,
        baseline_peak_bytes=baseline_peak,
        predicted_peak_bytes=peak.peak_bytes,
        lower_bound_bytes=peak_live_bytes(
            [Interval(s.nbytes, s.start, s.end) for s in schedule.storages], n_steps
        ).peak_bytes,
        arena_bytes=resident + offsets.arena_bytes,
        sharing_bytes=resident + tags.total_bytes,
        no_reuse_bytes=no_sharing_bytes(intervals),
        resident_bytes=resident,
        peak_step=schedule.steps[peak.peak_step] if schedule.steps else "",
        num_forward_steps=schedule.num_forward_steps,
        num_backward_steps=n_steps - schedule.num_forward_steps,
        storages=storages,
        saved=tuple(saved),
        inplace=tuple(rewrites),
        sharing=sharing,
        plan_seconds=elapsed,
    )


def _saved_tensors(
    fw: fx.GraphModule, schedule: StepSchedule, saved_names: frozenset[str]
) -> tuple[SavedTensor, ...]:
    """One record per saved value, in forward order. Bytes are counted once per
    storage: a saved view of a graph input or of another saved value costs 0."""
    storage_of = {name: s for s in schedule.storages for name in s.nodes}
    counted: dict[str, str] = {}
    records = []
    for node in fw.graph.nodes:
        val = tensor_value(node)
        if node.name not in saved_names or val is None:
            continue
        module, module_type = user_module(node)
        storage = storage_of.get(f"fw.{node.name}")
        if storage is not None and storage.kind in RESIDENT_KINDS:
            nbytes, reason = 0, f"a view of graph input {storage.name}: already resident"
        elif storage is not None and storage.name in counted:
            nbytes, reason = 0, f"shares storage with saved {counted[storage.name]}"
        else:
            nbytes = val.untyped_storage().nbytes()
            reason = "read by backward; no recomputation planned (budget not binding)"
            if storage is not None:
                counted[storage.name] = node.name
        records.append(SavedTensor(
            name=node.name, op="input" if node.op == "placeholder" else op_name(node),
            module=module, module_type=module_type, shape=tuple(int(d) for d in val.shape),
            dtype=str(val.dtype).replace("torch.", ""), nbytes=nbytes, decision="saved",
            reason=reason,
        ))
    return tuple(records)
