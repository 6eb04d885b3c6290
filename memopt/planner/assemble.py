"""The MemoryPlan of a built step, in one constructor call.

From the exact build the planner chose (planner.build.Built): each storage's interval,
Chen et al. 2016's tag sharing (Sec. 3, Fig. 2) and static offsets (allocator.sharing,
allocator.offsets), the saved values and why (SavedReason), the recomputed values, what
each op family chose (planner.families), and the timelines of live bytes by kind for
the picture (allocator.timeline).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from enum import Enum

from torch import fx

from memopt.allocator import Interval, assign_offsets, no_sharing_bytes, peak_live_bytes
from memopt.allocator import share_by_tags
from memopt.allocator.timeline import downsample, live_by_kind
from memopt.passes.liveness import RESIDENT_KINDS, StepSchedule
from memopt.passes.meta import accumulates_into, op_name, source_module, steps_in_backward, \
    tensor_value, \
    user_module
from memopt.passes.simulate import Simulated

from ..memory_plan import (MemoryPlan, SavedTensor, SearchCandidate,
                           SharingGroup, StorageRecord, Timeline)
from .build import Built, as_simulated, intervals, recomputed_nodes
from .families import Sites
from .request import PlanRequest

#: Greedy-by-size offsets (allocator.assign_offsets) cost O(n x the storages live beside
#: each): about 20 s for the 25,000 storages of a ResNet-1000 step. Past this many
#: storages the plan lays each of Chen's tags out as its own block instead.
GREEDY_OFFSETS_LIMIT = 8192


@dataclass(frozen=True)
class Decisions:
    """What the planner decided besides the built graphs: the budget it resolved (and
    what the plan had to fit after headroom), the baseline it resolved a fraction of,
    the budget search's candidates and the op families' choices."""

    budget_bytes: int | None
    fits: int | None
    baseline: Simulated
    search: tuple[SearchCandidate, ...]
    families: tuple[Sites, ...]
    forward_flops: int


def assemble(final: Built, request: PlanRequest, decisions: Decisions, device: str,
             granularity: int, elapsed: float) -> MemoryPlan:
    """Step 1: intervals, peak, lower bound; Step 2: tag sharing and offsets of the
    storages the step allocates (resident ones and other graphs' are not in its arena);
    Step 3: the records; Step 4: the plan, in one call."""
    schedule, gran = final.schedule, granularity
    # Step 1: intervals and peak
    spans = intervals(schedule, gran)
    n_steps = len(schedule.steps)
    peak = peak_live_bytes(spans, n_steps)
    # Step 2: sharing and offsets
    dynamic = [i for i, s in enumerate(schedule.storages)
               if s.kind not in RESIDENT_KINDS and s.kind != "outside"]
    resident = sum(iv.size for iv, s in zip(spans, schedule.storages)
                   if s.kind in RESIDENT_KINDS)
    tags = share_by_tags([spans[i] for i in dynamic])
    if len(dynamic) <= GREEDY_OFFSETS_LIMIT:
        offsets = assign_offsets([spans[i] for i in dynamic], alignment=gran)
        arena, layout, offset_of = offsets.arena_bytes, "greedy by size", dict(
            zip(dynamic, offsets.offsets))
    else:  # each tag's block in turn: a valid static layout, in O(n)
        starts = list(itertools.accumulate((-(-n // gran) * gran for n in tags.tag_sizes),
                                           initial=0))
        arena, layout = starts[-1], "tag blocks"
        offset_of = {i: starts[t] for i, t in zip(dynamic, tags.tag_of)}
    tag_of = dict(zip(dynamic, tags.tag_of))
    # Step 3: records
    storages = tuple(
        StorageRecord(name=s.name, kind=s.kind, nbytes=s.nbytes, start=s.start, end=s.end,
                      nodes=s.nodes, offset=offset_of.get(i), tag=tag_of.get(i))
        for i, s in enumerate(schedule.storages))
    members: dict[int, list[str]] = {}
    for i, tag in tag_of.items():
        members.setdefault(tag, []).append(schedule.storages[i].name)
    sharing = tuple(SharingGroup(tag=t, nbytes=tags.tag_sizes[t], storages=tuple(names))
                    for t, names in sorted(members.items()) if len(names) > 1)
    recomputed = recomputed_nodes(final)
    outside, grads = request.outside, request.grads
    by_field = {f.family.plan_field: f.records() for f in decisions.families}
    # Step 4: the plan
    return MemoryPlan(
        device=device,
        budget_bytes=decisions.budget_bytes,
        baseline_peak_bytes=decisions.baseline.peak_bytes,
        predicted_peak_bytes=peak.peak_bytes,
        lower_bound_bytes=peak_live_bytes(
            [Interval(s.nbytes, s.start, s.end) for s in schedule.storages], n_steps
        ).peak_bytes,
        arena_bytes=resident + arena,
        arena_layout=layout,
        sharing_bytes=resident + tags.total_bytes,
        no_reuse_bytes=no_sharing_bytes(spans),
        resident_bytes=resident,
        peak_step=schedule.steps[peak.peak_step] if schedule.steps else "",
        num_forward_steps=schedule.num_forward_steps,
        num_backward_steps=n_steps - schedule.num_forward_steps,
        storages=storages,
        saved=saved_tensors(final.fw, schedule, final.saved_names, bool(recomputed),
                            final.serves),
        inplace=final.rewrites,
        sharing=sharing,
        plan_seconds=elapsed,
        recomputed=recomputed,
        forward_flops=decisions.forward_flops,
        recompute_flops=sum(r.flops for r in recomputed) + sum(
            f.recompute_flops() for f in decisions.families),
        search=decisions.search,
        chains=by_field.get("chains", ()),
        heads=by_field.get("heads", ()),
        reversible=by_field.get("reversible", ()),
        headroom_bytes=(decisions.budget_bytes - decisions.fits
                        if decisions.fits is not None else 0),
        existing_grad_bytes=sum((grads.resident or {}).values()) if grads is not None else 0,
        outside_forward_bytes=outside.forward,
        outside_backward_bytes=outside.backward,
        outside_after_backward_bytes=outside.after_backward,
        outside_before_backward_bytes=outside.before_backward,
        own_runs_before=outside.repeats,
        baseline_saved_bytes=decisions.baseline.saved_bytes,
        timeline=timeline(as_simulated(final), {"fw": final.fw, "bw": final.bw}, gran),
        baseline_timeline=timeline(decisions.baseline,
                                   {"fw": request.joint, "bw": request.joint}, gran),
        grads_added_in_place=sum(1 for n in final.bw.graph.nodes if accumulates_into(n)),
        steps_in_backward=sum(1 for n in final.bw.graph.nodes if steps_in_backward(n)),
        reserved_bounded=request.options.reserved and decisions.fits is not None,
        fusion_estimate_bytes=schedule.fusion_estimates,
    )


class SavedReason(Enum):
    """Why a value is saved for backward: `SavedTensor.reason` is `reason.text(...)`.

    The planner decides the reason as one of these (memopt.planner.assemble) and renders
    it once; nothing reads the text back."""

    #: a view of a parameter, buffer or input: its storage is resident anyway (0 bytes)
    RESIDENT_VIEW = "a view of graph input {storage}: already resident"
    #: another saved value holds the same storage (0 bytes)
    SHARES_STORAGE = "shares storage with saved {other}"
    #: no recomputation was planned: the budget does not bind
    NOT_BINDING = "read by backward; no recomputation planned (budget not binding)"
    #: the budget search recomputes other values; this one is kept (Chen Alg. 3)
    SEGMENT_BOUNDARY = ("kept: a segment boundary of the Alg. 3 plan, read by backward or "
                        "by recomputation")
    #: the forward computes this value more than once; backward reads this copy for all
    SERVES_EQUALS = "{kept}; saved once for its equals {others} (the same computation)"

    def text(self, **detail: str) -> str:
        return self.value.format(**detail)


def saved_tensors(fw: fx.GraphModule, schedule: StepSchedule, saved_names: frozenset[str],
                  recomputing: bool, serves: dict[str, tuple[str, ...]] | None = None
                  ) -> tuple[SavedTensor, ...]:
    """One record per saved value, in forward order. Bytes are counted once per
    storage: a saved view of a graph input or of another saved value costs 0.
    `recomputing`: the plan recomputes values, so what it keeps is a segment boundary.
    `serves`: saved value -> the equal values backward reads it for (build.Built)."""
    serves = serves or {}
    storage_of = {name: s for s in schedule.storages for name in s.nodes}
    counted: dict[str, str] = {}
    kept = SavedReason.SEGMENT_BOUNDARY if recomputing else SavedReason.NOT_BINDING
    records = []
    for node in fw.graph.nodes:
        val = tensor_value(node)
        if node.name not in saved_names or val is None:
            continue
        module, module_type = user_module(node)
        storage = storage_of.get(f"fw.{node.name}")
        if storage is not None and storage.kind in RESIDENT_KINDS:
            nbytes, reason = 0, SavedReason.RESIDENT_VIEW.text(storage=storage.name)
        elif storage is not None and storage.name in counted:
            nbytes, reason = 0, SavedReason.SHARES_STORAGE.text(other=counted[storage.name])
        else:
            nbytes, reason = val.untyped_storage().nbytes(), kept.text()
            if node.name in serves:
                reason = SavedReason.SERVES_EQUALS.text(
                    kept=reason, others=", ".join(serves[node.name]))
            if storage is not None:
                counted[storage.name] = node.name
        records.append(SavedTensor(
            name=node.name, op="input" if node.op == "placeholder" else op_name(node),
            module=module, module_type=module_type, shape=tuple(int(d) for d in val.shape),
            dtype=str(val.dtype).replace("torch.", ""), nbytes=nbytes, decision="saved",
            reason=reason,
        ))
    return tuple(records)


def timeline(step: Simulated, graphs: dict[str, fx.GraphModule], granularity: int
             ) -> Timeline:
    """The plan's record of `step`'s live bytes by kind (allocator.timeline), its peak
    op and the user's module that op came from (looked up in `graphs` by the step's
    prefix, "fw" or "bw")."""
    profiles = live_by_kind(step.intervals, step.kinds, step.num_steps, granularity)
    steps, columns = downsample(profiles, step.num_steps)
    prefix, _, name = step.peak_step.partition(".")
    gm = graphs.get(prefix)
    node = next((n for n in gm.graph.nodes if n.name == name), None) if gm is not None \
        else None
    module, module_type = source_module(node) if node is not None else ("", "")
    return Timeline(num_steps=step.num_steps, num_forward_steps=step.num_forward_steps,
                    steps=steps, kinds=tuple(columns), live=tuple(columns.values()),
                    peak_step=step.peak_step,
                    peak_module=f"{module} ({module_type})" if module else module_type)
