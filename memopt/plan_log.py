"""What a memopt module has planned so far: the PlanLog a backend and its twin share.

`memopt.compile` keeps one backend per module and a twin for the steps that find `.grad`
tensors kept from earlier steps (memopt.grads); both write here. The API reads it through
methods (the capture clock, the forward's code, a pending BudgetError), never by field.
"""

from __future__ import annotations

import copy
import re
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import CodeType
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from memopt.passes._torch_compat import recompile_reasons, storage_key
from memopt.passes.allocated import UNMEASURED

from .errors import BudgetError, CaptureError, InputError
from .memory_plan import MemoryPlan

if TYPE_CHECKING:  # pragma: no cover
    from memopt.passes._torch_compat import CompilingFrame
    from .compiled_graph import CompiledGraph
    from .ddp import DDPBuckets
    from .settled import StepCall
    from .steps import Outside


@dataclass
class PlanLog:
    """Plans in capture order and the plan of the graph that ran last."""

    plans: list[MemoryPlan] = field(default_factory=list)
    last: MemoryPlan | None = None
    graphs: dict[bool, int] = field(default_factory=dict)  # captured, by existing_grads
    graph_limit: int = 8  # the most graphs of one kind (dynamo's recompile_limit)
    #: Graph breaks: the forward now running (memopt.settled, its trace memopt.steps),
    #: every graph built, the graphs the last forward ran (in order), the code object of
    #: the model's forward (a graph of it that returns is the whole step), and a
    #: BudgetError a re-plan raised, for the next call.
    call: StepCall | None = None
    graphs_built: list[CompiledGraph] = field(default_factory=list)
    last_runs: tuple[CompiledGraph, ...] = ()
    forward_code: CodeType | None = None
    pending: BudgetError | InputError | None = None  # raised at the next call
    #: the first graph run of the forward that just ended, whose eager backward
    #: memopt.eager_tail may measure once the forward returns
    tail_run: Any = None
    #: the trace of the forward that just ended, whose caller's loss memopt.caller_loss
    #: watches once the forward returns
    loss_run: Any = None
    warned_eager: bool = False
    #: a frame's graph captured for a third input size (count_graph): said once
    warned_sizes: bool = False
    #: a plan saved levels of a parallel scan (passes.scans): said once
    warned_scan: bool = False
    #: every graph built, by what makes two of dynamo's graphs the same step to plan
    #: (memopt.plan_log.graph_key), and how many times dynamo handed over one already built
    by_key: dict[tuple, CompiledGraph] = field(default_factory=dict)
    retraced: int = 0
    #: graphs captured for each code after a graph break (dynamo's resume functions) with
    #: the same inputs, place and modes (all of graph_key but the graph)
    resumed: dict[tuple, int] = field(default_factory=dict)
    #: forwards that ended traced (the others ran a settled graph: memopt.settled)
    traced: int = 0
    step_baselines: dict[tuple[int, ...], int] = field(default_factory=dict)
    #: the last traced step's entry there, where it ran several graphs or runs: what a
    #: refusal names a fraction of (`raise_pending`); None for one graph run once, whose
    #: plan's own baseline is the step's
    last_baseline: int | None = None
    #: a fraction budget's bytes at the largest whole step (one graph) accepted so far: a
    #: later step of a smaller shape, whose own fraction gives fewer bytes, is given these
    #: (docs/budgets.md, "A fraction at several shapes")
    fraction_floor: int = 0
    #: perf_counter when the compiled call began or the last graph was planned: a plan's
    #: capture time (dynamo's and AOTAutograd's tracing) runs from here to partition_fn
    clock: float = 0.0
    #: the gradient buckets of the DDP running the current forward (None: no DDP)
    ddp: DDPBuckets | None = None
    #: a plan was made with something planning measures estimated instead (allocations
    #: untracked while a profiler records on CPU: kernel workspaces, heads' transients;
    #: MemoptBackend plans every graph again at the first step where they can be), and
    #: the count of such estimates (passes.allocated.UNMEASURED) when it last looked
    untracked: bool = False
    unmeasured: int = field(default_factory=lambda: UNMEASURED[0])

    def start_clock(self) -> None:
        """Capture time counts from now (a compiled call begins, or a graph was planned)."""
        self.clock = time.perf_counter()

    def capture_seconds(self) -> float:
        """Seconds since `start_clock` (0 when it never ran)."""
        return max(0.0, time.perf_counter() - self.clock) if self.clock else 0.0

    def set_forward(self, forward: Any) -> None:
        """The model's forward: a graph of its code that returns is the whole step."""
        self.forward_code = getattr(forward, "__func__", forward).__code__

    def raise_pending(self) -> None:
        """Raise the BudgetError a re-plan after graph breaks left for this call (or the
        InputError that refused the step): a copy, since the one kept would gather the
        traceback of the step that raises it, and keep that step's frames (its tensors,
        their autograd graph, a chain's stashed run) alive as long as this log."""
        if self.pending is not None:
            err = self.pending
            # a graph planned again (a caller's loss measured, a second call) names its
            # own baseline, which holds what the step's other runs hold: a byte budget's
            # refusal offered a fraction from 0.687 that was then refused (found from
            # outside, two calls before one backward)
            raise err.with_minimum(err.minimum_bytes, self.last_baseline) \
                if isinstance(err, BudgetError) else copy.copy(err)

    def plan_again(self, graph: CompiledGraph, outside: Outside) -> None:
        """Plan `graph` again with `outside` held around it, for the steps after this
        one: the plan the next step runs is the new one, and a budget it no longer fits
        is left for `raise_pending` (memopt.eager_tail, memopt.caller_loss)."""
        before = graph.plan
        graph.settled = None
        graph.replan(outside, graph.policy, graph.step_baseline)
        if self.last is before:
            self.last = graph.plan
        if not graph.plan.fits and self.pending is None:
            self.pending = graph.budget_error()

    def record(self, plan: MemoryPlan) -> None:
        self.plans.append(plan)
        if UNMEASURED[0] != self.unmeasured:
            self.untracked, self.unmeasured = True, UNMEASURED[0]
        self.start_clock()

    def amend(self, plan: MemoryPlan) -> None:
        """Replace the plan recorded last by `plan` (the same plan, with what compiling it
        found: memopt.compiled_graph's inductor check)."""
        self.plans[-1] = plan

    def count_graph(self, existing_grads: bool, code: Any = None) -> None:
        """One more captured graph of this kind: refuse past the limit, naming the fix and
        what dynamo said made it capture `code` (the frame's) again. A frame the
        forward's eager code calls (`code` is not the model's forward) captured again for
        another input size is warned of at its third capture: the sizes come from that
        eager code (``sizes_from_eager_code``)."""
        count = self.graphs.get(existing_grads, 0) + 1
        reasons = recompile_reasons(code) if count > 1 else []
        nested = code is not None and code is not self.forward_code and reasons \
            and "size mismatch" in reasons[-1]
        if count > self.graph_limit:
            said = f" Dynamo's reason to capture it again: {_first_line(reasons[-1])}." \
                if reasons else ""
            guard = (" (A guard on what the forward read: a Python number it reads, such "
                     "as a step counter, is a constant of each graph; pass it as a tensor.)"
                     if reasons else "")
            fix = sizes_from_eager_code(code) if nested else (
                f"{guard} Pad inputs to a few bucket sizes, or raise that limit (torch._dynamo."
                f"config.patch(recompile_limit=...)) if every shape really needs its own plan.")
            raise CaptureError(
                f"memopt plans each input shape / dtype / train-eval mode separately and this "
                f"module has now been captured more than torch._dynamo.config.recompile_limit "
                f"= {self.graph_limit} times.{said}{fix}")
        if nested and count == 3 and not self.warned_sizes:
            self.warned_sizes = True
            advice = sizes_from_eager_code(code)
            warnings.warn(f"memopt: {_first_line(reasons[-1])}: this module's step was "
                          f"captured and planned for a third input size.{advice}"
                          f" Each new size is captured and planned again (seconds a step), "
                          f"and past torch._dynamo.config.recompile_limit = {self.graph_limit} "
                          f"it is refused.", UserWarning, stacklevel=4)
        self.graphs[existing_grads] = count

    def count_resumed(self, code: CodeType, same: tuple) -> None:
        """One more graph captured for `code`, the rest of a frame after a graph break,
        with inputs, place and modes `same` as others (shapes are captured apart).
        count_graph's limit counts the step's entries only; a Python number the code
        after a break reads (an `.item()` value it computes with) is a constant of each
        graph, so dynamo captures it again whenever the number changes: every step, each
        graph planned again and kept. Past the limit, say so once (not refused: the
        step is right, only slow, and its host memory grows)."""
        count = self.resumed[code, same] = self.resumed.get((code, same), 0) + 1
        if count != self.graph_limit + 1:
            return
        reasons = recompile_reasons(code)
        why = f" (dynamo's reason: {_first_line(reasons[-1])})" if reasons else ""
        warnings.warn(
            f"memopt: dynamo has captured the code after a graph break {count} times"
            f"{why}, more than torch._dynamo.config.recompile_limit = {self.graph_limit}. "
            f"A Python number it reads, such as a value read with .item() and then used in "
            f"arithmetic, is a constant of each graph: when it changes at every step, every "
            f"step captures and plans a new graph and keeps it (planning time at each step, "
            f"host memory growing). Keep the computation on tensors (x / (1 + x.std()) "
            f"instead of x / (1 + x.std().item())).", UserWarning, stacklevel=2)


def sizes_from_eager_code(code: Any) -> str:
    """The advice for a graph of a frame that the forward's eager code calls, captured
    again because an input's size changed: that code made the size, typically from the
    data (the tokens an MoE routes to each expert with torch.where / nonzero / a boolean
    mask, which dynamo cannot capture, so the frame around it runs eagerly)."""
    name = getattr(code, "co_qualname", None) or getattr(code, "co_name", "?")
    return (f" The graph of {name} is called from code dynamo runs eagerly, which made that "
            f"size: a size that depends on the data changes at every step, and memopt "
            f"plans fixed shapes. A PackedSequence's batch sizes follow the lengths: pad "
            f"to a few fixed lengths (buckets) to reuse their plans. The tokens an MoE "
            f"routes to each expert (torch.where, nonzero or a boolean mask in a loop over "
            f"the experts): give the experts fixed shapes, a capacity per expert (tokens "
            f"over it dropped or padded, as GShard and Switch Transformer do), or every "
            f"token through every expert weighted by the router; see docs/limits.md, "
            f"\"Sizes made by the data\".")


def _first_line(reason: str) -> str:
    """A dynamo guard failure in one line: the guard (``0/0: self.calls == 0``), without
    the source comment, hint and user stack dynamo appends (its hint, to make such an int
    dynamic, does not apply: memopt captures with dynamic=False)."""
    return reason.strip().splitlines()[0].split("#")[0].strip() if reason.strip() else ""


def resumed(frame: CompilingFrame) -> bool:
    """Whether dynamo compiles the rest of a frame after a graph break in it (it names
    that code ``torch_dynamo_resume_in_<function>_at_<line>``)."""
    name = getattr(frame.code, "co_name", "") or ""
    return name.startswith("torch_dynamo_resume_in_")


#: the first argument of memopt's own ops in a graph's code: a chain's or head's id, new at
#: each compile (memopt.caller_loss keys a graph by its code without them)
_MEMOPT_OP_IDS = re.compile(r"(torch\.ops\.memopt\.\w+\()\d+")


def graph_key(gm: fx.GraphModule, example_inputs: Sequence[Any], frame: CompilingFrame,
               position: int, alone: bool, existing_grads: bool) -> tuple:
    """What decides a graph's plan, as a hashable value: its code, every input's type,
    shape, strides, dtype, device, requires_grad and storage (which inputs alias which),
    the module state it holds, where it sits in the step and where it ends, and the
    grad and autocast modes AOTAutograd traces under. Dynamo guards on more (Python
    values the forward reads); two graphs equal here get the same plan."""
    storages: dict[Any, int] = {}

    def describe(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return (type(value).__name__, repr(value))
        where = storages.setdefault(storage_key(value), len(storages))
        return (isinstance(value, torch.nn.Parameter), tuple(value.shape), tuple(value.stride()),
                value.storage_offset(), value.dtype, str(value.device), value.requires_grad,
                where)

    state = tuple((describe(t), t.untyped_storage().data_ptr())
                  for t in [*gm.parameters(), *gm.buffers()])
    inputs = tuple(describe(v) for v in example_inputs)
    modes = (torch.is_grad_enabled(),) + tuple(
        (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda"))
    ends = (frame.graph_break, frame.filename, frame.lineno, frame.reason)
    return (gm.code, state, inputs, ends, position, alone, existing_grads, modes)


def loss_key(key: tuple) -> tuple:
    """A `graph_key` without memopt's op ids and whether `.grad` exists: what a caller's
    loss was measured after (memopt.caller_loss)."""
    return (_MEMOPT_OP_IDS.sub(r"\1", key[0]),) + key[1:6] + key[7:]
