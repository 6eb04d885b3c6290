"""Offload saved values to host memory: what may go, what each step costs, the rewrite.

Requires: a built step (memopt.planner.build.Built: the forward and backward
GraphModules, their StepSchedule and the names of the values the forward saves).

Ensures:
    candidates(...)   the saved values that may be offloaded, as
                      memopt.allocator.offload.Candidate (interval index = storage index
                      in the schedule): a value that owns its whole storage, dense, saved
                      once, produced by a forward op and read by a backward op.
    step_seconds(...) each scheduled op's seconds by a roofline of its FLOPs
                      (passes.recompute.node_flops) and the bytes it reads and writes,
                      plus a launch cost (ComputeModel).
    rewrite(...)      the graphs with the runtime's calls (memopt.offload): `to_host`
                      after the producing op, its result saved in the value's place;
                      `prefetch` before the plan's prefetch step and `ready` before the
                      first backward read, which then reads what `ready` returns.

The rewrite runs after in-place (passes.inplace) has decided on the graphs with every
saved value live through the backward, so no op writes a value while its copy reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import fx

from memopt.allocator.offload import Candidate, Transfer

from .liveness import StepSchedule
from .meta import fake_value, tensor_value, value_tensors
from .recompute import node_flops


@dataclass(frozen=True)
class ComputeModel:
    """A device's rate: FLOP/s, bytes/s of memory traffic, seconds per op launched."""

    flops_per_s: float
    bytes_per_s: float
    launch_s: float = 5e-6

    def seconds(self, flops: int, nbytes: int) -> float:
        return self.launch_s + max(flops / self.flops_per_s, nbytes / self.bytes_per_s)


def _nodes(fw: fx.GraphModule, bw: fx.GraphModule) -> dict[str, fx.Node]:
    return {f"{p}.{n.name}": n for p, gm in (("fw", fw), ("bw", bw)) for n in gm.graph.nodes}


def candidates(schedule: StepSchedule, fw: fx.GraphModule, bw: fx.GraphModule,
               saved_names: frozenset[str]) -> list[tuple[Candidate, str]]:
    """Each offloadable saved value, with its name (the forward node and the backward
    placeholder share it)."""
    step_of = {name: i for i, name in enumerate(schedule.steps)}
    nodes = _nodes(fw, bw)
    found = []
    for index, s in enumerate(schedule.storages):
        saved = [n for n in s.nodes if n.startswith("bw.") and n[3:] in saved_names]
        if s.kind != "saved" or len(saved) != 1 or s.start < 0:
            continue
        name = saved[0][3:]
        node, placeholder = nodes.get(f"fw.{name}"), nodes.get(f"bw.{name}")
        val = tensor_value(node) if node is not None else None
        if node is None or node.op != "call_function" or placeholder is None or val is None \
                or not val.is_contiguous() or val.storage_offset() != 0 \
                or val.numel() * val.element_size() != val.untyped_storage().nbytes():
            continue
        fw_reads = [step_of[f"fw.{u.name}"] for m in s.nodes if m.startswith("fw.")
                    and m in nodes for u in nodes[m].users if f"fw.{u.name}" in step_of]
        bw_reads = [step_of[f"bw.{u.name}"] for u in placeholder.users
                    if f"bw.{u.name}" in step_of]
        if not bw_reads:
            continue
        fw_last = max([s.start, *fw_reads])
        if fw_last >= min(bw_reads):
            continue
        found.append((Candidate(index=index, nbytes=s.nbytes, start=s.start, fw_last=fw_last,
                                bw_first=min(bw_reads)), name))
    return found


def step_seconds(schedule: StepSchedule, fw: fx.GraphModule, bw: fx.GraphModule,
                 compute: ComputeModel) -> list[float]:
    """Each step's seconds (ComputeModel's roofline of the op's FLOPs and bytes)."""
    nodes = _nodes(fw, bw)
    out = []
    for name in schedule.steps:
        node = nodes[name]
        touched = [t for v in [fake_value(node), *(fake_value(a) for a in node.all_input_nodes)]
                   for t in value_tensors(v)]
        nbytes = sum(t.numel() * t.element_size() for t in touched)
        out.append(compute.seconds(node_flops(node) if node.op == "call_function" else 0,
                                   nbytes))
    return out


def rewrite(fw: fx.GraphModule, bw: fx.GraphModule, schedule: StepSchedule,
            transfers: Sequence[tuple[Transfer, str]], bw_first: dict[str, int],
            runtime: Any) -> None:
    """The runtime's calls for each offloaded value, in place (`runtime`: a module with
    `to_host`, `prefetch` and `ready`, memopt.offload, which lives above the passes)."""
    nodes = _nodes(fw, bw)
    fw_out = next(iter(fw.graph.find_nodes(op="output")))
    for transfer, name in transfers:
        produced = nodes[f"fw.{name}"]
        with fw.graph.inserting_after(produced):
            host = fw.graph.call_function(runtime.to_host, (produced,))
        host.meta.update(produced.meta)
        fw_out.replace_input_with(produced, host)
        placeholder = nodes[f"bw.{name}"]
        users = list(placeholder.users)
        device = str(tensor_value(placeholder).device)
        # (a backward step: allocator.offload issues no copy back before the backward)
        with bw.graph.inserting_before(nodes[schedule.steps[transfer.prefetch_at]]):
            back = bw.graph.call_function(runtime.prefetch, (placeholder, device))
        back.meta.update(placeholder.meta)
        with bw.graph.inserting_before(nodes[schedule.steps[bw_first[name]]]):
            ready = bw.graph.call_function(runtime.ready, (back,))
        ready.meta.update(placeholder.meta)
        for user in users:
            user.replace_input_with(placeholder, ready)
    fw.recompile()
    bw.recompile()

