"""The plain data the step simulator works on (passes.simulate): what a node computes,
as arrays, and one candidate's simulated step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import fx

@dataclass(frozen=True)
class Simulated:
    """One candidate's step: its storages as (bytes, first step, last step) with
    first = -1 for what lives before the step, the number of steps, its peak (each
    storage rounded up to the allocator's granularity), and its recomputed FLOPs."""

    intervals: tuple[tuple[int, int, int], ...]
    num_steps: int
    peak_bytes: int
    recompute_flops: int
    saved_bytes: int  # the storages of kind "saved" (passes.liveness.KINDS)
    #: per run of consecutive steps where the peak is reached (at most PEAK_RUNS, the last
    #: one stretched over the rest), the forward storages live throughout it, each as the
    #: mirrorable nodes that hold it (the value and its views; memopt.planner's
    #: peak-directed path)
    at_peak: tuple[frozenset[tuple[str, ...]], ...] = ()
    #: per interval, its kind in a timeline of the step (allocator.timeline.KINDS), where
    #: asked for (StepModel.simulate's `kinds`)
    kinds: tuple[str, ...] = ()
    #: the step where the peak is first reached, as passes.liveness names steps
    #: ("fw.addmm", "bw.mm_3"), and the number of forward steps
    peak_step: str = ""
    num_forward_steps: int = 0


@dataclass
class Proto:
    """What a node computes, shared by the joint node and its mirror copies (Step 1)."""

    name: str
    kind: str                      # "primal", "tangent", "call", "get_attr", "output"
    raw: tuple[Any, ...]           # storage identity of each tensor of its value
    nbytes: tuple[int, ...]        # each one's storage bytes
    single: Any                    # raw storage of a single-tensor value, else None
    tuple_valued: bool
    symbolic: bool
    impure: bool
    in_forward: bool               # AOTAutograd's extraction: must be / cannot be
    in_backward: bool
    opaque_output: bool            # never written in place (passes.inplace)
    flops: int                     # passes.recompute.node_flops, were it not a view
    opaque: bool                   # memopt's own op: bytes behind its outputs (HELD_BYTES)
    node: fx.Node                  # for the workspace key of a variant
    inplace_target: Any = None     # passes.inplace Step 2's variants, static checks passed
    out_variant: tuple[Any, str] | None = None
    arg_ok: tuple[bool, ...] = ()  # per top-level node argument: may it be overwritten
    workspace: dict | None = None  # variant -> bytes, filled on first use
