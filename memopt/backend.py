"""memopt as a torch.compile backend: AOTAutograd with memopt's partition function.

Dynamo hands the backend an FX graph of torch-level ops and example inputs;
AOTAutograd traces the joint forward+backward graph of aten ops on FakeTensors
and calls `partition_fn`, where memopt's pipeline (memopt.planner) produces
the forward and backward GraphModules and the plan. Both modules then run with
the boxed calling convention, so each saved tensor is freed at its last use in
backward.

    torch.compile(model, backend="memopt")                       # registered name (the
                                                                 # package's entry point)
    torch.compile(model, backend=MemoptBackend(budget="4GB"))   # with options
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import logging
import warnings
from typing import Any, Callable, Sequence

import torch
from torch import fx

from memopt.passes.lm_heads import Attach, chunk_heads
from memopt.passes.cell_loops import chain_loops
from memopt.passes.constant_masks import drop_constant_masks
from memopt.passes.fused_upsample import fuse_upsampling
from memopt.passes.identity_dropouts import remove_identity_dropouts
from memopt.passes.allocated import can_track, when_trackable
from memopt.passes.workspace import SHARED, WorkspaceCache

# The runtimes of memopt's own operators, which the passes reach through
# memopt.passes.runtime: loaded before any graph is planned.
from . import lm_head as _head_runtime  # noqa: F401
from . import nn as _reversible_runtime  # noqa: F401
from .recurrent import modules as _chain_runtime  # noqa: F401

from memopt.passes._torch_compat import (CompilingFrame, autocast_regions, compiling_frame,
                                         last_guard_failure, pytree)
from .budget import Budget, parse_budget
from .compiled_graph import CompiledGraph
from .ddp import DDPBuckets
from . import caller_loss, eager_tail
from .errors import BudgetError, CaptureError, PassError, opaque_backward_error
from .graph_breaks import (ReplanPolicy, earlier_calls, replan_forward, required, step_baseline,
                           step_minimum)
from .run_plans import split_later_runs
from .kernels import Kernels
from .memory_plan import MemoryPlan, StepPlan
from .optimizer import OptimizerBytes, optimizer_bytes, params_of
from .optimizer_step import ChunkedStep
from .plan_log import PlanLog, graph_key, loss_key, resumed
from .allocator.offload import Link
from .planner import Options
from .settled import ModelTensors, StepCall, settle
from .steps import Outside, aliased_output_grad_bytes, repeated_output_grad_bytes, storages

log = logging.getLogger("memopt")


def _chain_loops(gm: fx.GraphModule) -> None:
    """Run the user's unrolled cell loops as recurrent chains (memopt.passes.cell_loops), in
    graphs that record gradients; under autocast each chain's step enters it."""
    if not torch.is_grad_enabled():
        log.debug("memopt loops: an inference graph: loops left unrolled")
        return
    try:
        chain_loops(gm, keep=True, autocast=autocast_regions())
    except Exception as exc:
        raise PassError("recurrent loops", ("capture",), exc) from exc


def _chunk_heads(gm: fx.GraphModule, skip_logits: bool = False,
                 returned_only: bool = False) -> list[Attach]:
    """Run language-model heads chunk by chunk over the tokens (memopt.passes.lm_heads), in
    graphs that record gradients, under autocast too (its casts made explicit); with
    `returned_only` only those whose wide logits the graph returns. Returns where the
    graph now returns logits without a gradient, or (`skip_logits`) without computing them
    (memopt.lm_head.with_attached_logits)."""
    if not torch.is_grad_enabled():
        log.debug("memopt heads: an inference graph: heads left as they are")
        return []
    try:
        return [s.attach for s in chunk_heads(gm, autocast_regions(), skip_logits,
                                              returned_only) if s.attach is not None]
    except Exception as exc:
        raise PassError("language-model heads", ("capture",), exc) from exc


class MemoptBackend:
    """A torch.compile backend that plans every captured training graph.

    `budget` is parsed once here (see memopt.budget for what it counts). Plans
    are kept in `self.plans` in capture order; `self.last_plan` is the plan of
    the graph that ran most recently. `existing_grads=True` plans the step in which
    the parameters' `.grad` tensors already exist (memopt.grads): `memopt.compile`
    runs such a twin for the steps that find gradients kept from earlier ones.
    """

    def __init__(self, budget: object = None, *, inplace: bool = True,
                 mirror: object = None, headroom: float | None = None,
                 plan_only: bool = False, loops: bool = True,
                 existing_grads: bool = False, progress: bool = True,
                 solver: str | None = None, solver_seconds: float = 30.0,
                 drop_outputs: bool = False, workspaces: WorkspaceCache | None = None,
                 kernels: str = "aten", step_in_backward: bool | None = None,
                 skip_logits: bool = False, reserved: bool = False,
                 offload: object = None, watch_loss: bool = True) -> None:
        # one cell, shared with the twin with_existing_grads makes: a budget set on one
        # (graph_breaks' search for a step's minimum) is the other's too
        self._budget: list[Budget | None] = [parse_budget(budget)]
        #: what runs the planned graphs (memopt.kernels)
        self.kernels = Kernels.parse(kernels)
        if self.kernels is Kernels.INDUCTOR and drop_outputs:
            raise ValueError('drop_outputs=True is not available with kernels="inductor" yet '
                             '(its backward check wraps the op-by-op graph): use '
                             'kernels="aten"')
        for name, flag in (("loops", loops), ("existing_grads", existing_grads),
                           ("inplace", inplace), ("progress", progress),
                           ("drop_outputs", drop_outputs), ("skip_logits", skip_logits),
                           ("reserved", reserved), ("watch_loss", watch_loss)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be True or False, got {flag!r}")
        self.loops = loops
        #: watch what the caller's loss saves between forward and backward
        #: (memopt.caller_loss)
        self.watch_loss = watch_loss
        #: training calls do not compute the logits their language-model heads only
        #: return (memopt.markers.SkippedLogits)
        self.skip_logits = skip_logits
        self.existing_grads = existing_grads
        self.plan_log = PlanLog()
        #: the measured kernel workspaces its plans read (passes.workspace): the process's
        #: shared cache unless `workspaces` is given (a test that needs a fresh one)
        self.workspaces = workspaces if workspaces is not None else SHARED
        if mirror is not None and mirror != "all":
            mirror = frozenset(mirror)
        if headroom is not None and (isinstance(headroom, bool)
                                     or not isinstance(headroom, (int, float))
                                     or not 0 <= headroom < 1):
            raise ValueError(f"headroom must be None (the device's default) or a fraction in "
                             f"[0, 1), got {headroom!r}")
        if solver not in (None, "milp"):
            raise ValueError(f'solver must be None or "milp", got {solver!r}')
        if solver == "milp" and importlib.util.find_spec("highspy") is None:
            raise ImportError('solver="milp" needs HiGHS: pip install "memopt[solver]" '
                              '(or pip install highspy)')
        if offload is not None and not isinstance(offload, (bool, Link)):
            raise ValueError(f"offload must be None (on where the device has its own memory), "
                             f"True, False or a memopt.Link, got {offload!r}")
        if offload not in (None, False) and self.kernels is Kernels.INDUCTOR:
            raise ValueError('offload is not available with kernels="inductor" yet (its copies '
                             'run between op-by-op graph nodes): use kernels="aten"')
        # Under inductor, buffer reuse and in-place updates are inductor's (memopt.kernels)
        inplace = inplace and self.kernels is Kernels.ATEN
        self.options = Options(inplace=inplace, mirror=mirror,
                               headroom=None if headroom is None else float(headroom),
                               progress=progress, solver=solver,
                               solver_seconds=float(solver_seconds),
                               drop_outputs=drop_outputs,
                               fusible=self.kernels is Kernels.INDUCTOR, reserved=reserved,
                               offload=offload)
        self.plan_only = plan_only
        #: the optimizer's state and step bytes the budget counts (memopt.optimizer; set by
        #: memopt.compile / memopt.plan from `optimizer=`), None: not counted
        self.optimizer: OptimizerBytes | None = None
        self.optimizer_source: torch.optim.Optimizer | None = None
        if step_in_backward not in (None, True, False):
            raise ValueError(f"step_in_backward must be None (where the budget needs it), "
                             f"True or False, got {step_in_backward!r}")
        #: the optimizer stepped inside the backward (memopt.stepper): None where the
        #: budget needs it, True always, False never
        self.step_in_backward = step_in_backward
        #: optimizer.step() run in chunks, where a plan needs it (memopt.optimizer_step)
        self.chunked_step: ChunkedStep | None = None

    def chunk_optimizer_step(self, chunk_bytes: int) -> None:
        """A plan needs the user's optimizer.step() in chunks of at most `chunk_bytes` of
        parameters (the smallest any plan asked for is kept)."""
        if self.chunked_step is None or self.chunked_step.optimizer is not self.optimizer_source:
            if self.chunked_step is not None:  # another optimizer counted since
                self.chunked_step.remove()
            self.chunked_step = ChunkedStep(self.optimizer_source, chunk_bytes)
        else:
            self.chunked_step.narrow(chunk_bytes)

    @property
    def budget(self) -> Budget | None:
        """The budget the graphs are planned under (memopt.budget), None: no budget."""
        return self._budget[0]

    @budget.setter
    def budget(self, value: Budget | None) -> None:
        self._budget[0] = value

    @property
    def plans(self) -> list[MemoryPlan]:
        return self.plan_log.plans

    @property
    def last_plan(self) -> MemoryPlan | None:
        return self.plan_log.last

    @property
    def graph_limit(self) -> int:
        return self.plan_log.graph_limit

    @graph_limit.setter
    def graph_limit(self, value: int) -> None:
        self.plan_log.graph_limit = value

    def with_existing_grads(self) -> "MemoptBackend":
        """A twin with the same budget and options, for the steps whose parameters
        already hold `.grad`; it records its plans in this backend's log, and a budget
        set on either is both's."""
        twin = copy.copy(self)
        twin.existing_grads = True
        return twin

    def __repr__(self) -> str:
        return (f"MemoptBackend(budget={self.budget}, options={self.options}"
                f"{'' if self.loops else ', loops=False'}"
                f"{', kernels=inductor' if self.kernels is Kernels.INDUCTOR else ''}"
                f"{', existing_grads=True' if self.existing_grads else ''})")

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **_: Any) -> Callable:
        call = self.plan_log.call
        position = call.position() if call is not None else 0
        frame = compiling_frame()
        alone = position == 0 and frame.ends_forward(self.plan_log.forward_code)
        key = graph_key(gm, example_inputs, frame, position, alone, self.existing_grads)
        seen = self.plan_log.by_key.get(key)
        if seen is not None and seen.plan is not None:  # planned before: keep its plan
            self._retraced(frame)
            return seen.run
        if position == 0 and not resumed(frame):
            # a new entry into the step: a graph after a break, or after eager code that
            # began the forward, is no new one (it may be captured for each shape of what
            # that code made: a PackedSequence's rows after an RNN's eager call)
            self.plan_log.count_graph(self.existing_grads, frame.code)
        elif resumed(frame):
            self.plan_log.count_resumed(frame.code, key[1:])
        remove_identity_dropouts(gm)  # as eager: no copy saved beside the input
        drop_constant_masks(gm)  # as eager: SDPA's fused kernel, no attention matrix
        if self.kernels is Kernels.ATEN:
            fuse_upsampling(gm)  # as eager: ATen's upsampling kernels, forward and backward
        graph = CompiledGraph(self, gm, example_inputs, frame, index=position, alone=alone)
        graph.loss_key = loss_key(key)
        graph.loss_identity = caller_loss.identity(
            v for v in [*gm.parameters(), *example_inputs] if isinstance(v, torch.nn.Parameter))
        measured = caller_loss.known(graph.loss_key, graph.loss_identity)
        graph.caller_loss = graph.loss_charged = measured[0] if measured else 0
        graph.loss_through = graph.through_charged = measured[1] if measured else 0
        graph.loss_measured = measured is not None
        if measured is None and alone and self.watch_loss:
            returned = caller_loss.graph_outputs(gm)
            graph.loss_charged = caller_loss.assumed(returned)
            if self.budget is not None:
                graph.through_charged = caller_loss.assumed_through(returned)
        self.plan_log.graphs_built.append(graph)
        self.plan_log.by_key[key] = graph
        if self.loops:
            _chain_loops(gm)
        # with no budget too, where the graph returns the logits: the head is one chunk
        # that recomputes nothing, and the logits leave the graph without the (tokens, V)
        # zero gradient autograd would make for them at every backward (the zoo Llama:
        # 1.023x eager's peak with the head left as traced, 0.851x with it)
        no_budget = self.budget is None and not self.skip_logits
        graph.attaches = _chunk_heads(gm, self.skip_logits, returned_only=no_budget)
        if graph.attaches:  # an output more: what autograd sums outside the graph
            graph.outside_grads = aliased_output_grad_bytes(gm)
        opt = self.optimizer  # memopt.plan: no trace, the optimizer's bytes alone
        outside = Outside(opt.state_bytes, opt.state_bytes, opt.step_bytes) if opt else Outside()
        trace = call.trace() if call is not None else None
        if trace is not None:
            outside = trace.outside_of(position, [*graph.attributes, *example_inputs])
            if alone:  # the whole forward in one graph: nothing is planned after it
                outside = dataclasses.replace(outside, backward=outside.forward)
                outside = caller_loss.with_loss(graph, outside, 0)  # known: memopt.caller_loss
        if trace is None or alone:
            return graph.compile(example_inputs, outside, ReplanPolicy.GREEDY, self.budget)
        # The forward has graph breaks, and what its other graphs hold is not known
        # before it ends: every graph of this first forward holds as little as it can for
        # the others (LEAN, else LOWEST where LEAN misses the budget). When the forward
        # ends, every graph is planned again with all of them known (forward_ends). A
        # fraction budget is of the whole step's baseline, not known before then either.
        budget = None if self.budget is not None and self.budget.fraction is not None \
            else self.budget
        # A graph that misses a byte budget even at its lowest peak runs that plan: the
        # smallest budget of the whole step counts the graphs after it, and forward_ends
        # raises it before the backward runs (graph_breaks.step_minimum).
        try:
            compiled = graph.compile(example_inputs, outside, ReplanPolicy.LEAN, budget)
        except BudgetError:
            compiled = graph.compile_lowest(example_inputs, outside, budget)
        graph.provisional = True
        return compiled

    def _retraced(self, frame: CompilingFrame) -> None:
        """Dynamo compiled a graph memopt has already planned (same graph, inputs and
        place in the step): a guard on Python state failed, typically a list or dict the
        forward mutates (`self.logged.append(x.item())`) or an `.item()` value a branch
        reads (dynamo specializes the code after the break on it). The plan is reused; the
        time dynamo spends tracing again each call is the user's to remove, so say it
        once."""
        self.plan_log.retraced += 1
        if self.plan_log.retraced == 2:
            reason = (last_guard_failure(frame.code)
                      or last_guard_failure(self.plan_log.forward_code))
            warnings.warn(
                "dynamo traces this model's forward again at every call"
                f"{f' (its guard failed: {reason})' if reason else ''}: Python state the "
                "forward reads changes between calls, typically a list or dict it appends "
                "to, or a value it reads with .item() and branches on. memopt reuses its "
                "plan, so gradients are unaffected, but each call pays dynamo's tracing "
                "time, and the memory that tracing holds during the call (kilobytes) is in "
                "no plan: keep such state and branches outside forward.",
                UserWarning, stacklevel=2)

    def forward_begins(self, tensors: ModelTensors, grads: list[int] | None, args: tuple,
                       kwargs: dict, ddp: DDPBuckets | None = None,
                       held: Sequence[torch.Tensor] = (), after_backward: int = 0,
                       shards: Any = None, pending: tuple[int, list] = (0, [])) -> None:
        """A memopt module's forward starts: when it records gradients (`grads`, the
        parameters' `ModelTensors.grad_state()`, is not None), trace its graphs
        (memopt.steps), or let a settled graph run without the trace (memopt.settled).
        `ddp`: the gradient buckets of the DDP running it (memopt.ddp), which the trace
        counts as held for the whole step; `held`: tensors that are not the model's, held
        for the whole step (FSDP2's shards and all-gather output, memopt.fsdp);
        `after_backward`: bytes allocated as the backward ends (FSDP2's reduce-scatter);
        `shards`: FSDP2 on the repeated blocks and the root (memopt.fsdp_blocks);
        `pending`: how many earlier calls' backward has not run, and their inputs and
        outputs still alive (memopt.pending.PendingBackwards.check): planned in
        `forward_ends` (graph_breaks.earlier_calls)."""
        self.plan_log.ddp, self.plan_log.tail_run, self.plan_log.loss_run = ddp, None, None
        if grads is None:
            self.plan_log.call = None
            return
        eager_tail.charge(self)  # the eager backward the last step measured
        caller_loss.charge(self)  # the caller's loss the last step measured
        for graph in self.plan_log.last_runs:  # consumed gradients left: accumulation
            if graph.steps_in_backward:
                graph.stepping.stepper.check_forward()
        opt = self.optimizer
        call = StepCall(tensors, grads, args, kwargs,
                        ddp.counted_bytes if ddp is not None else 0, tuple(held), after_backward,
                        opt.state_bytes if opt else 0, opt.step_bytes if opt else 0, shards)
        if pending[0]:  # planned as earlier runs (forward_ends): traced from the start
            model = storages([*tensors.params, *tensors.buffers, args, kwargs])
            flowing = [t for t in pending[1] if t.requires_grad and t.grad_fn is not None]
            call.pending_calls = pending[0]
            call.pending_bytes = tuple(sum(n for s, n in storages(ts).items() if s not in model)
                                       for ts in (pending[1], flowing))
            call.trace()
        if not any(graph.settled is not None for graph in self.plan_log.last_runs):
            call.trace()  # no graph of the last forward may skip it: traced from the start
        self.plan_log.call = call

    def forward_returned(self) -> None:
        """The forward returned to the caller, nothing refused: measure the backward of
        the eager code before its first graph there (memopt.eager_tail)."""
        run, self.plan_log.tail_run = self.plan_log.tail_run, None
        if run is not None:
            eager_tail.arm(run, run.graph, self.budget)
        trace, self.plan_log.loss_run = self.plan_log.loss_run, None
        if trace is not None and self.watch_loss:
            caller_loss.watch(trace)

    def forward_aborted(self) -> None:
        self.plan_log.call = self.plan_log.loss_run = None

    def _nothing_compiled(self) -> None:
        """A training forward ran without any compiled graph: dynamo skipped its frame
        (a graph break inside a loop makes it run the whole frame eagerly), so memopt
        planned nothing. Under a budget that is an error; without one, a warning."""
        message = (
            "dynamo compiled no graph of this forward (a graph break inside a for/while "
            "loop makes it run the whole frame eagerly), so memopt planned nothing: the "
            "step ran as eager PyTorch does. Move the break (.item(), print, a branch on a "
            "tensor's value) out of the loop, or pass fullgraph=True to memopt.compile to "
            "see where it is.")
        if self.budget is not None:
            raise CaptureError(f"{message} The budget {self.budget} cannot be held.")
        if not self.plan_log.warned_eager:
            self.plan_log.warned_eager = True
            warnings.warn(message, UserWarning, stacklevel=4)

    def step_plan(self) -> MemoryPlan | StepPlan | None:
        """The plan of the last training forward: its graph's MemoryPlan, or a StepPlan
        of one per graph when graph breaks split it or its one graph ran several times
        (a repeated block whose loop dynamo runs eagerly, memopt.blocks)."""
        runs = self.plan_log.last_runs
        graphs = list(dict.fromkeys(runs))
        if len(runs) <= 1:
            return self.plan_log.last
        return StepPlan(graphs=tuple(g.plan for g in graphs),
                        runs=tuple(graphs.index(g) for g in runs))

    def _count_repeated_outputs(self, returned: Any, last: CompiledGraph) -> None:
        """A forward that returns a tensor more than once: autograd sums the returns'
        gradients outside the compiled backward (memopt.steps.repeated_output_grad_bytes),
        which the graph that returned it (the forward's last) had not counted. It is
        planned and compiled again with them, for the steps after this one; a budget it
        no longer fits is raised at the next call."""
        repeated = repeated_output_grad_bytes(returned)
        if repeated <= last.repeated_grads or last.plan is None:
            return
        last.repeated_grads = repeated
        last.replan(last.outside, last.policy, last.step_baseline)
        self.plan_log.last = last.plan  # what the next steps run
        if not last.plan.fits:
            self.plan_log.pending = last.budget_error()

    def _plan_again_measured(self) -> None:
        """Plans made while a profiler recorded on CPU counted no kernel workspace and
        estimated the heads' transients (passes.workspace, passes.lm_heads): at the first
        step where allocations can be tracked, every graph is planned again, measured,
        for the steps after it (a profiled first step planned 695 KB where the step
        measured 1,014 KB, and every later step ran that plan over its budget). Where a
        profiler still records (a loop that measures every step with
        memopt.measure.allocation_peak), as that measurement closes."""
        graphs = [g for g in self.plan_log.graphs_built if g.plan is not None]  # planned
        if not graphs:
            return
        if not can_track(graphs[0].plan.device):  # once the user's measurement closes
            when_trackable(self._plan_again_measured)
            return
        if not self.plan_log.untracked:
            return
        self.plan_log.untracked = False
        state, step = self._count_optimizer_again(graphs)
        for graph in graphs:
            graph.settled, before = None, graph.plan
            outside, _ = caller_loss.taken(graph)  # measured since: memopt.caller_loss
            outside = dataclasses.replace(
                outside, forward=outside.forward + state, backward=outside.backward + state,
                after_backward=max(0, outside.after_backward + step))
            graph.replan(outside, graph.policy, graph.step_baseline)
            if self.plan_log.last is before:  # the plan the next step runs
                self.plan_log.last = graph.plan
            if not graph.plan.fits and self.plan_log.pending is None:
                self.plan_log.pending = graph.budget_error()

    def _count_optimizer_again(self, graphs: list[CompiledGraph]) -> tuple[int, int]:
        """An optimizer counted while a profiler recorded charged its step its state's
        bytes, 2 per byte of a parameter stepped alone (memopt.optimizer): counted again,
        measured (an Adam with maximize=True, stepped in the backward, needs 3: its plans
        measured 1.07x the minimum named at every step, found from outside); so is one
        that gained parameters (`optimizer_grew`). Returns how many bytes more its state
        and its step hold."""
        old, source = self.optimizer, self.optimizer_source
        if old is None or source is None or not old.recount:
            return 0, 0
        self.optimizer = new = optimizer_bytes(source, graphs[0].plan.device)
        for graph in graphs:  # the per-parameter step bytes of a step in the backward
            grads = getattr(graph.stepping, "grads", None)
            if grads is not None and grads.step_bytes is not None:
                grads.step_bytes.update({n: new.alone_bytes(b) for n, b in grads.nbytes.items()})
        return new.state_bytes - old.state_bytes, new.step_bytes - old.step_bytes

    def optimizer_grew(self) -> None:
        """A training call begins: where the optimizer steps more parameters than when
        it was counted (`add_param_group`), count it again and plan every graph again as
        this forward ends, for the steps after it (memopt.optimizer.params_of)."""
        opt, source = self.optimizer, self.optimizer_source
        if opt is not None and source is not None and params_of(source) != opt.counted_params:
            self.optimizer = dataclasses.replace(opt, recount=True)
            self.plan_log.untracked = True

    def forward_ends(self, returned: Any) -> None:
        """The forward of a memopt module returned (memopt.api): with every graph of it
        known, re-plan the graphs whose plans assumed less than the rest of the step
        holds around them (memopt.steps), for the steps after this one. A budget that
        no longer fits is raised at the next call, naming the graph."""
        call, self.plan_log.call = self.plan_log.call, None
        if call is None:
            return
        if self.plan_log.untracked:
            self._plan_again_measured()
        if call.traced is None:  # at most a settled graph ran: nothing to plan again
            if call.skipped:
                self.plan_log.last_runs = tuple(graph for graph, _, _ in call.skipped)
            elif _needs_grad(returned):
                self._nothing_compiled()
            return
        trace = call.traced
        if not trace.runs:
            if _needs_grad(returned):
                self._nothing_compiled()
            return
        self.plan_log.traced += 1
        bases = eager_tail.with_tails([run.graph for run in trace.runs], trace.end(returned),
                                      trace.eager_tail())
        bases[-1] = caller_loss.with_loss(trace.runs[-1].graph, bases[-1], trace.head_flowing,
                                          returned)
        self.plan_log.tail_run = trace.runs[0]  # armed once the forward returns
        self.plan_log.loss_run = trace  # watched once the forward returns
        if trace.opaque and self.budget is not None:
            self.plan_log.pending = opaque_backward_error(trace.opaque, self.budget)
            self.plan_log.raise_pending()
        as_ran = [run.graph for run in trace.runs]
        self.plan_log.last_baseline = None  # set below where the step is several runs
        # the later runs of a repeated graph ran an interim plan (CompiledGraph._interim_twin):
        # the step is planned again with the graph itself there, split where that pays
        runs = [run.primary if run.interim else run for run in as_ran]
        for run in as_ran:
            if run.interim:
                run.primary.later = None
        self.plan_log.last_runs = tuple(runs)
        self._count_repeated_outputs(returned, runs[-1])
        if call.pending_calls:  # the earlier calls' runs before this call's: memopt.pending
            runs, bases = earlier_calls(runs, bases, call.pending_calls, *call.pending_bytes,
                                        sum(trace.grads.values()))
            as_ran = as_ran * (call.pending_calls + 1)
        if len(set(map(id, runs))) == 1 and runs[0].policy == ReplanPolicy.GREEDY \
                and runs[0].outside.covers(required(runs[0], runs, bases)):
            # one graph, planned with what it needed: the usual case; the whole forward
            # alone, it may skip the trace while nothing it counted changes
            runs[0].settled = settle(call, trace.runs[0], bases[0]) \
                if len(runs) == 1 and runs[0].alone else None
            return
        baseline = None
        if self.budget is not None:
            # once per sequence of graphs: from the first forward's plans, as it ran. What
            # a fraction is of; a refusal of a byte budget names its fraction of it too
            key = tuple(id(run.primary) for run in runs)
            known = self.plan_log.step_baselines.get(key)
            if known is None:
                known = self.plan_log.step_baselines[key] = step_baseline(as_ran)
            self.plan_log.last_baseline = known
            baseline = known if self.budget.fraction is not None else None
        # The first forward's graphs were planned before the rest of the step was known,
        # and its backward runs those plans: where the whole step misses the budget, the
        # step is refused here, before the backward runs over it.
        first = any(g.provisional for g in runs)
        planned = list(runs)
        missed = replan_forward(runs, bases, baseline,
                                refine=None if call.pending_calls else split_later_runs)
        if not call.pending_calls:
            self.plan_log.last_runs = tuple(runs)  # as the next forwards run them
        lean = None  # the bases without the room for the caller's loss, where that fits
        if missed is not None and not call.pending_calls:
            lean, missed_lean = caller_loss.replanned_without_room(runs[-1], bases, lambda b: (
                replan_forward(runs, b, baseline, refine=split_later_runs)))
            if lean is not None and missed_lean is None:
                self.plan_log.last_runs, missed = tuple(runs), None
        if missed is not None:
            base = baseline if baseline is not None else step_baseline(as_ran)
            self.plan_log.pending = step_minimum(
                missed, lambda nbytes: self._misses_at(planned, bases, nbytes), base)
            if lean is not None:  # the minimum holds the room; a loss keeping none: this
                self.plan_log.pending = self.plan_log.pending.with_room_free(step_minimum(
                    missed_lean, lambda nbytes: self._misses_at(planned, lean, nbytes),
                    base).minimum_bytes)
            if first:
                self.plan_log.raise_pending()

    def _misses_at(self, runs: list[CompiledGraph], bases: list[Outside],
                   nbytes: int) -> BudgetError | None:
        """Plan a forward's graphs again as its first forward is planned, under a byte
        budget of `nbytes` in place of this backend's: the BudgetError of a graph that
        misses it, or None (graph_breaks.step_minimum)."""
        # every graph's backend is this one or its twin (with_existing_grads), which
        # share the budget: re-planned at the refused budget, a twin named a minimum
        # that missed again (7,736,668 bytes, then 8,801,213: found from outside)
        kept = self.budget
        try:
            self.budget = Budget(nbytes=nbytes)
            for graph in runs:
                graph.provisional, graph.weight = True, 0
            return replan_forward(list(runs), bases, None, refine=split_later_runs)
        finally:
            self.budget = kept


def _needs_grad(value: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.requires_grad
               for t in pytree.tree_leaves(value))


def memopt_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], **options: Any) -> Callable:
    """The registered `backend="memopt"`: `torch.compile(m, backend="memopt",
    options={"budget": "4GB"})` passes its options here."""
    return MemoptBackend(**options)(gm, example_inputs)

