"""memopt as a torch.compile backend: AOTAutograd with memopt's partition function.

Dynamo hands the backend an FX graph of torch-level ops and example inputs;
AOTAutograd traces the joint forward+backward graph of aten ops on FakeTensors
and calls `partition_fn`, where memopt's pipeline (memopt.pipeline) produces
the forward and backward GraphModules and the plan. Both modules then run with
the boxed calling convention, so each saved tensor is freed at its last use in
backward.

    torch.compile(model, backend="memopt")                       # registered name (the
                                                                 # package's entry point)
    torch.compile(model, backend=MemoptBackend(budget="4GB"))   # with options
"""

from __future__ import annotations

import copy
import importlib.util
import dataclasses
import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from memopt.passes.heads import Attach, chunk_heads
from memopt.passes.loops import chain_loops

# The runtimes of memopt's own operators, which the passes reach through
# memopt.passes.runtime: loaded before any graph is planned.
from . import lm_head as _head_runtime  # noqa: F401
from . import nn as _reversible_runtime  # noqa: F401
from .recurrent import modules as _chain_runtime  # noqa: F401

from memopt.passes._torch_compat import (CompilingFrame, aot_module_simplified, compiling_frame,
                            last_guard_failure, loss_decompositions, make_boxed, storage_key)
from .budget import Budget, format_bytes, parse_budget
from .ddp import DDPBuckets
from .errors import BudgetError, CaptureError, PassError
from .grads import GradSink
from .memory_plan import GraphBreak, MemoryPlan, StepPlan
from .pipeline import ExistingGrads, Options, plan_joint
from .steps import ForwardTrace, Outside

log = logging.getLogger("memopt")


class _PlanOnly(Exception):
    """Raised by the backend in plan-only mode (memopt.plan), carrying the plan out of
    torch.compile (None: the captured graph was an inference graph, with no backward to
    plan)."""

    def __init__(self, plan: MemoryPlan | None) -> None:
        super().__init__("plan ready")
        self.plan = plan


def _primal_kinds(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> dict[str, str]:
    """Names of the joint graph's primals ("primals_1", ...) mapped to parameter/buffer/input.

    AOTAutograd's primals are the GraphModule's own parameters and buffers, then
    the example inputs, in order. With dynamo's inlined nn.Modules the parameters
    arrive as inputs; a parameter is recognised by its type, a buffer by the
    dynamo source name recorded on the placeholder.
    """
    kinds: list[str] = ["parameter"] * len(list(gm.parameters()))
    kinds += ["buffer"] * len(list(gm.buffers()))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, value in enumerate(example_inputs):
        if isinstance(value, torch.nn.Parameter):
            kinds.append("parameter")
            continue
        source = ""
        if i < len(placeholders):
            grapharg = placeholders[i].meta.get("grapharg")
            source = str(getattr(getattr(grapharg, "source", None), "name", ""))
            if callable(getattr(getattr(grapharg, "source", None), "name", None)):
                source = grapharg.source.name()
        kinds.append("buffer" if "_buffers" in source else "input")
    return {f"primals_{i + 1}": kind for i, kind in enumerate(kinds)}


def _cuda_devices() -> list[int]:
    return list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []


def _autocast_on() -> bool:
    return any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))


def _chain_loops(gm: fx.GraphModule) -> None:
    """Run the user's unrolled cell loops as recurrent chains (memopt.passes.loops), in
    graphs that record gradients outside autocast (a chain step would run outside it)."""
    if not torch.is_grad_enabled():
        log.debug("memopt loops: an inference graph: loops left unrolled")
        return
    if _autocast_on():
        log.debug("memopt loops: autocast is on: loops left unrolled")
        return
    try:
        chain_loops(gm, keep=True)
    except Exception as exc:
        raise PassError("recurrent loops", ("capture",), exc) from exc


def _chunk_heads(gm: fx.GraphModule) -> list[Attach]:
    """Run language-model heads chunk by chunk over the tokens (memopt.passes.heads), in
    graphs that record gradients outside autocast (the op would run outside it). Returns
    where the graph now returns logits without a gradient (see `_attach_logits`)."""
    if not torch.is_grad_enabled() or _autocast_on():
        log.debug("memopt heads: an inference graph or autocast: heads left as they are")
        return []
    try:
        return [s.attach for s in chunk_heads(gm) if s.attach is not None]
    except Exception as exc:
        raise PassError("language-model heads", ("capture",), exc) from exc


def _attach_logits(compiled: Callable, attaches: list[Attach]) -> Callable:
    """`compiled` returning what dynamo expects: the graph's extra outputs (each head's
    projection input, memopt.passes.heads) stripped, and each head's logits given their
    gradient through the projection (memopt.lm_head.attach_logits)."""
    from .lm_head import attach_logits  # noqa: PLC0415

    extra = len(attaches)

    def run(*args: Any) -> Any:
        out = list(compiled(*args))
        own = out[:len(out) - extra]
        for a in attaches:
            bias = args[a.bias] if a.bias is not None else None
            own[a.logits] = attach_logits(own[a.logits], out[a.h], args[a.weight], bias)
        return own

    return run


@dataclass
class _PlanLog:
    """Plans in capture order and the plan of the graph that ran last, shared by a
    backend and its `with_existing_grads` twin."""

    plans: list[MemoryPlan] = field(default_factory=list)
    last: MemoryPlan | None = None
    graphs: dict[bool, int] = field(default_factory=dict)  # captured, by existing_grads
    graph_limit: int = 8  # the most graphs of one kind (torch._dynamo.config.recompile_limit)
    #: Graph breaks: the forward now running (memopt.steps), every graph built, the graphs
    #: the last forward ran (in order), the code object of the model's forward (a graph
    #: of it that returns is the whole step), and a BudgetError a re-plan raised, for
    #: the next call.
    trace: ForwardTrace | None = None
    graphs_built: list["_Graph"] = field(default_factory=list)
    last_runs: tuple["_Graph", ...] = ()
    forward_code: Any = None
    pending: BudgetError | None = None
    warned_eager: bool = False
    #: every graph built, by what makes two of dynamo's graphs the same step to plan
    #: (_graph_key), and how many times dynamo handed over one already built
    by_key: dict[tuple, "_Graph"] = field(default_factory=dict)
    retraced: int = 0
    step_baselines: dict[tuple[int, ...], int] = field(default_factory=dict)
    #: perf_counter when the compiled call began or the last graph was planned: a plan's
    #: capture time (dynamo's and AOTAutograd's tracing) runs from here to partition_fn
    clock: float = 0.0
    #: the gradient buckets of the DDP running the current forward (None: no DDP)
    ddp: DDPBuckets | None = None


class MemoptBackend:
    """A torch.compile backend that plans every captured training graph.

    `budget` is parsed once here (see memopt.budget for what it counts). Plans
    are kept in `self.plans` in capture order; `self.last_plan` is the plan of
    the graph that ran most recently. `existing_grads=True` plans the step in which
    the parameters' `.grad` tensors already exist (memopt.grads): `memopt.compile`
    runs such a twin for the steps that find gradients kept from earlier ones.
    """

    def __init__(self, budget: object = None, *, inplace: bool = True,
                 mirror: object = None, headroom: float = Options.headroom,
                 plan_only: bool = False, loops: bool = True,
                 existing_grads: bool = False, progress: bool = True,
                 solver: str | None = None, solver_seconds: float = 30.0,
                 drop_outputs: bool = False) -> None:
        self.budget: Budget | None = parse_budget(budget)
        for name, flag in (("loops", loops), ("existing_grads", existing_grads),
                           ("inplace", inplace), ("progress", progress),
                           ("drop_outputs", drop_outputs)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be True or False, got {flag!r}")
        self.loops = loops
        self.existing_grads = existing_grads
        self._log = _PlanLog()
        if mirror is not None and mirror != "all":
            mirror = frozenset(mirror)
        if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) \
                or not 0 <= headroom < 1:
            raise ValueError(f"headroom must be a fraction in [0, 1), got {headroom!r}")
        if solver not in (None, "milp"):
            raise ValueError(f'solver must be None or "milp", got {solver!r}')
        if solver == "milp" and importlib.util.find_spec("highspy") is None:
            raise ImportError('solver="milp" needs HiGHS: pip install "memopt[solver]" '
                              '(or pip install highspy)')
        self.options = Options(inplace=inplace, mirror=mirror, headroom=float(headroom),
                               progress=progress, solver=solver,
                               solver_seconds=float(solver_seconds),
                               drop_outputs=drop_outputs)
        self.plan_only = plan_only

    @property
    def plans(self) -> list[MemoryPlan]:
        return self._log.plans

    @property
    def last_plan(self) -> MemoryPlan | None:
        return self._log.last

    @property
    def graph_limit(self) -> int:
        return self._log.graph_limit

    @graph_limit.setter
    def graph_limit(self, value: int) -> None:
        self._log.graph_limit = value

    def _count_graph(self) -> None:
        """One more captured graph: refuse past the limit, naming the fix."""
        count = self._log.graphs.get(self.existing_grads, 0) + 1
        if count > self.graph_limit:
            raise CaptureError(
                f"memopt plans each input shape / dtype / train-eval mode separately and this "
                f"module has now seen more than torch._dynamo.config.recompile_limit = "
                f"{self.graph_limit} of them. Pad inputs to a few bucket sizes, or raise "
                f"that limit (torch._dynamo.config.patch(recompile_limit=...)) if every "
                f"shape really needs its own plan.")
        self._log.graphs[self.existing_grads] = count

    def with_existing_grads(self) -> "MemoptBackend":
        """A twin with the same budget and options, for the steps whose parameters
        already hold `.grad`; it records its plans in this backend's log."""
        twin = copy.copy(self)
        twin.existing_grads = True
        return twin

    def __repr__(self) -> str:
        return (f"MemoptBackend(budget={self.budget}, options={self.options}"
                f"{'' if self.loops else ', loops=False'}"
                f"{', existing_grads=True' if self.existing_grads else ''})")

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **_: Any) -> Callable:
        trace = self._log.trace
        position = len(trace.runs) if trace is not None else 0
        frame = compiling_frame()
        alone = position == 0 and frame.ends_forward(self._log.forward_code)
        key = _graph_key(gm, example_inputs, frame, position, alone, self.existing_grads)
        seen = self._log.by_key.get(key)
        if seen is not None and seen.plan is not None:  # planned before: keep its plan
            self._retraced(frame)
            return seen.run
        if position == 0:  # a new entry into the step (a graph after a break is no new one)
            self._count_graph()
        graph = _Graph(self, gm, example_inputs, frame, index=position, alone=alone)
        self._log.graphs_built.append(graph)
        self._log.by_key[key] = graph
        if self.loops:
            _chain_loops(gm)
        if self.budget is not None:  # with no budget the head stays eager's (nothing to gain)
            graph.attaches = _chunk_heads(gm)
            if graph.attaches:  # an output more: what autograd sums outside the graph
                graph.outside_grads = _aliased_output_grad_bytes(gm)
        outside = Outside()
        if trace is not None:
            outside = trace.outside_of(position, [*graph.attributes, *example_inputs])
            if alone:  # the whole forward in one graph: nothing is planned after it
                outside = Outside(outside.forward, outside.forward, outside.after_backward)
        if trace is None or alone:
            return graph.compile(example_inputs, outside, GREEDY, self.budget)
        # The forward has graph breaks, and what its other graphs hold is not known
        # before it ends: every graph of this first forward holds as little as it can for
        # the others (LEAN, else LOWEST where LEAN misses the budget). When the forward
        # ends, every graph is planned again with all of them known (forward_ends). A
        # fraction budget is of the whole step's baseline, not known before then either.
        budget = None if self.budget is not None and self.budget.fraction is not None \
            else self.budget
        try:
            compiled = graph.compile(example_inputs, outside, LEAN, budget)
        except BudgetError:
            compiled = graph.compile(example_inputs, outside, LOWEST, budget)
        graph.provisional = True
        return compiled

    def _retraced(self, frame: CompilingFrame) -> None:
        """Dynamo compiled a graph memopt has already planned (same graph, inputs and
        place in the step): a guard on Python state failed, typically a list or dict the
        forward mutates (`self.logged.append(x.item())`) or an `.item()` value a branch
        reads (dynamo specializes the code after the break on it). The plan is reused; the
        time dynamo spends tracing again each call is the user's to remove, so say it
        once."""
        self._log.retraced += 1
        if self._log.retraced == 2:
            reason = last_guard_failure(frame.code) or last_guard_failure(self._log.forward_code)
            warnings.warn(
                "dynamo traces this model's forward again at every call"
                f"{f' (its guard failed: {reason})' if reason else ''}: Python state the "
                "forward reads changes between calls, typically a list or dict it appends "
                "to, or a value it reads with .item() and branches on. memopt reuses its "
                "plan, so memory and gradients are unaffected, but each call pays dynamo's "
                "tracing time: keep such state and branches outside forward.",
                UserWarning, stacklevel=2)

    def forward_begins(self, model: torch.nn.Module, args: tuple, kwargs: dict,
                       ddp: DDPBuckets | None = None, held: Sequence[torch.Tensor] = (),
                       after_backward: int = 0) -> None:
        """A memopt module's forward starts: trace its graphs (memopt.steps) when it
        records gradients. `ddp`: the gradient buckets of the DDP running it (memopt.ddp),
        which the trace counts as held for the whole step; `held`: tensors that are not the
        model's, held for the whole step (FSDP2's shards and all-gather output,
        memopt.fsdp); `after_backward`:
        bytes allocated as the backward ends (FSDP2's reduce-scatter)."""
        self._log.ddp = ddp
        self._log.trace = ForwardTrace.begin(
            model, args, kwargs, ddp.counted_bytes if ddp is not None else 0, held,
            after_backward) \
            if torch.is_grad_enabled() else None

    def forward_aborted(self) -> None:
        self._log.trace = None

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
        if not self._log.warned_eager:
            self._log.warned_eager = True
            warnings.warn(message, UserWarning, stacklevel=4)

    def step_plan(self) -> MemoryPlan | StepPlan | None:
        """The plan of the last training forward: its graph's MemoryPlan, or a StepPlan
        of one per graph when graph breaks split it."""
        runs = self._log.last_runs
        graphs = list(dict.fromkeys(runs))
        if len(graphs) <= 1:
            return self._log.last
        return StepPlan(graphs=tuple(g.plan for g in graphs),
                        runs=tuple(graphs.index(g) for g in runs))

    def forward_ends(self, returned: Any) -> None:
        """The forward of a memopt module returned (memopt.api): with every graph of it
        known, re-plan the graphs whose plans assumed less than the rest of the step
        holds around them (memopt.steps), for the steps after this one. A budget that
        no longer fits is raised at the next call, naming the graph."""
        trace, self._log.trace = self._log.trace, None
        if trace is None:
            return
        if not trace.runs:
            if _needs_grad(returned):
                self._nothing_compiled()
            return
        bases = trace.end(returned)
        runs = [run.graph for run in trace.runs]
        self._log.last_runs = tuple(runs)
        if len(set(map(id, runs))) == 1 and runs[0].policy == GREEDY \
                and runs[0].outside.covers(bases[0]):
            return  # one graph, planned with what it needed: the usual case
        step_baseline = None
        if self.budget is not None and self.budget.fraction is not None:
            # once per sequence of graphs: from the first forward's plans, as it ran
            key = tuple(map(id, runs))
            step_baseline = self._log.step_baselines.setdefault(key, _step_baseline(runs))
        # Policies settled by earlier forwards stay; the first forward's guesses do not.
        policies = {id(g): GREEDY if g.provisional else g.policy for g in runs}
        while True:
            try:
                _replan_jointly(runs, bases, policies, step_baseline)
                return
            except _DoesNotFit as miss:
                # the graphs before the one that misses hold as little as they can for it
                earlier = [g for g in dict.fromkeys(runs[:miss.position])
                           if policies[id(g)] == GREEDY and g is not miss.graph]
                if not earlier:
                    self._log.pending = miss.graph.budget_error()
                    return
                for g in earlier:
                    policies[id(g)] = LEAN


class _Graph:
    """One graph dynamo captured and memopt planned: what it needs to be planned again
    (its FX graph, FakeTensor inputs, primal kinds), its plan and compiled function, and
    where in the user's code it ends (`frame`). `run` is what dynamo calls; a re-plan
    swaps the function it runs for the steps after."""

    def __init__(self, backend: MemoptBackend, gm: fx.GraphModule,
                 example_inputs: Sequence[Any], frame: CompilingFrame, index: int,
                 alone: bool) -> None:
        self.backend, self.gm, self.frame = backend, gm, frame
        self.index, self.alone = index, alone  # its position in the forward; the only one
        self.kinds = _primal_kinds(gm, example_inputs)
        self.attributes = [*gm.parameters(), *gm.buffers()]  # AOTAutograd's first primals
        self.fakes = [n.meta.get("example_value") for n in gm.graph.find_nodes(op="placeholder")]
        self.sink, self.grads = None, None
        if backend.existing_grads:
            self.sink, self.grads = _grad_sink(self.kinds, [*self.attributes, *example_inputs])
        self.outside_grads = _aliased_output_grad_bytes(gm)
        self.outside, self.policy, self.step_baseline = Outside(), GREEDY, None
        self.provisional = False  # planned with a guess for the graphs after it
        self.plan: MemoryPlan | None = None
        self.compiled: Callable | None = None
        self.attaches: list[Attach] = []  # logits returned without a gradient (_chunk_heads)
        #: drop_outputs=True, the step one graph: the outputs the plan frees as it ends
        self.dropped = _DroppedOutputs() if backend.options.drop_outputs and alone else None

    def label(self) -> str:
        where = f", {self.frame.where()}" if self.frame.graph_break else ""
        return f"graph {self.index + 1}{where}"

    def graph_break(self) -> GraphBreak | None:
        """The break that ends this graph (None: it returns)."""
        if not self.frame.graph_break:
            return None
        return GraphBreak(reason=self.frame.reason, filename=self.frame.filename,
                          lineno=self.frame.lineno)

    def compile(self, example_inputs: Sequence[Any], outside: Outside, policy: str,
                budget: Budget | None, step_baseline: int | None = None,
                must_fit: bool = True) -> Callable:
        """Plan this graph under `budget` with `outside` held around it, by `policy`
        (GREEDY, LEAN, LOWEST), a fraction budget of `step_baseline` when given
        (memopt.pipeline.plan_joint), and compile it (AOTAutograd with memopt's partition
        function); the callable for dynamo. Raises BudgetError where the plan misses,
        if `must_fit` (else the plan is kept all the same: `plan.fits` says)."""
        backend = self.backend
        options, cap = backend.options, None
        if policy == LEAN:
            options = dataclasses.replace(options, mirror="all")
        elif policy == LOWEST:
            cap = 1
        planned: list[MemoryPlan] = []

        def partition_fn(joint: fx.GraphModule, _joint_inputs: Any, *, num_fwd_outputs: int,
                         **_kw: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
            captured = time.perf_counter() - backend._log.clock if backend._log.clock else 0.0
            try:
                fw, bw, plan = plan_joint(
                    joint, num_fwd_outputs, primal_kinds=self.kinds, budget=budget,
                    options=options, grads=self.grads, outside_grad_bytes=self.outside_grads,
                    outside=outside, label="" if self.alone else self.label(), cap=cap,
                    step_baseline=step_baseline, must_fit=must_fit, whole_step=self.alone)
            except BudgetError as err:
                err.capture_seconds = max(0.0, captured)
                raise
            plan = plan.model_copy(update={"graph_index": self.index,
                                           "graph_break": self.graph_break(),
                                           "capture_seconds": max(0.0, captured),
                                           **_ddp_fields(backend._log.ddp)})
            backend._log.clock = time.perf_counter()
            planned.append(plan)
            backend._log.plans.append(plan)
            if backend.plan_only:  # stop before AOTAutograd builds its runtime wrappers
                raise _PlanOnly(plan)
            return fw, bw

        def compile_graph(graph: fx.GraphModule, _inputs: Any) -> Callable:
            return make_boxed(graph)

        def compile_backward(graph: fx.GraphModule, _inputs: Any) -> Callable:
            run = make_boxed(graph)
            if self.dropped is None:
                return run

            def checked(args: list[Any]) -> Any:
                self.dropped.check(args)
                return run(args)

            checked._boxed_call = True  # type: ignore[attr-defined]
            return checked

        # Planning runs chain steps on real tensors (passes.chains measures what they
        # save): the user's RNG state must not move, or dropout would draw other masks.
        with torch.random.fork_rng(devices=_cuda_devices()):
            compiled = aot_module_simplified(
                self.gm, list(example_inputs), fw_compiler=compile_graph,
                bw_compiler=compile_backward, inference_compiler=compile_graph,
                partition_fn=partition_fn, decompositions=loss_decompositions(),
            )
        if self.attaches:
            compiled = _attach_logits(compiled, self.attaches)
        if not planned:
            return compiled  # an inference graph (no gradients needed): nothing to plan
        self.plan, self.compiled, self.outside = planned[-1], compiled, outside
        self.policy, self.step_baseline = policy, step_baseline
        return self.run

    def replan(self, outside: Outside, policy: str, step_baseline: int | None) -> None:
        """Plan and compile again (on FakeTensors) under the backend's budget, for the
        next runs, keeping the plan even where it misses the budget (`plan.fits`); LEAN
        falls back to LOWEST where it misses."""
        budget = self.backend.budget
        self.backend._log.clock = time.perf_counter()  # capture: AOTAutograd's tracing only
        self.compile(self.fakes, outside, policy, budget, step_baseline, must_fit=False)
        if policy == LEAN and not self.plan.fits:
            self.compile(self.fakes, outside, LOWEST, budget, step_baseline, must_fit=False)
            self.policy = LEAN  # what was asked: LOWEST is how LEAN fits here
        self.provisional = False

    def budget_error(self) -> BudgetError:
        """The BudgetError of this graph's plan, which misses the budget."""
        try:
            self.compile(self.fakes, self.outside, LOWEST, self.backend.budget,
                         self.step_baseline)
        except BudgetError as err:
            return err
        raise AssertionError(f"{self.label()}: its lowest-peak plan fits after all")

    def run(self, *args: Any) -> Any:
        log = self.backend._log
        log.last = self.plan
        flat = [*self.attributes, *args]
        record = log.trace.start_run(self, flat, self.plan.held_bytes) if log.trace else None
        if self.sink is not None:
            self.sink.bind(flat)
        out = self.compiled(*args)
        if self.dropped is not None:
            self.dropped.watch(out)
        if record is not None:
            record.record_outputs(out)
        return out


class _DroppedOutputs:
    """drop_outputs=True: the forward's non-scalar outputs, watched by storage, so that
    the backward can say when the loop still holds one that the plan freed as the
    forward ended (passes.liveness: its bytes then come on top of the predicted peak)."""

    def __init__(self) -> None:
        #: (weak reference, data pointer, bytes, shape) of each watched output's storage
        self.refs: list[tuple[StorageWeakRef, int, int, tuple[int, ...]]] = []

    def watch(self, out: Any) -> None:
        self.refs = [(StorageWeakRef(t.untyped_storage()), t.untyped_storage().data_ptr(),
                      t.untyped_storage().nbytes(), tuple(t.shape))
                     for t in torch.utils._pytree.tree_leaves(out)
                     if isinstance(t, torch.Tensor) and t.dim() > 0]

    def check(self, backward_inputs: list[Any]) -> None:
        """At the backward's start: outputs still alive that backward does not read
        (Python's warning filter shows the same warning once)."""
        read = {t.untyped_storage().data_ptr() for t in backward_inputs
                if isinstance(t, torch.Tensor)}
        alive = [(n, shape) for ref, ptr, n, shape in self.refs
                 if not ref.expired() and ptr not in read]
        self.refs = []
        if alive:
            shapes = ", ".join(str(list(shape)) for _, shape in alive)
            warnings.warn(
                f"memopt planned this step with drop_outputs=True, but "
                f"{format_bytes(sum(n for n, _ in alive))} of the forward's outputs (shapes "
                f"{shapes}) are still alive as its backward starts: this step can exceed the "
                f"plan's predicted peak by that much. Drop every output but the loss before "
                f"calling backward (loss = model(**batch).loss), or compile without "
                f"drop_outputs.", stacklevel=2)


def _ddp_fields(ddp: DDPBuckets | None) -> dict[str, int]:
    """The plan's record of DDP's gradient buckets (their bytes are in its outside bytes,
    through the forward's trace: memopt.steps)."""
    if ddp is None:
        return {}
    return {"ddp_bucket_bytes": ddp.nbytes, "ddp_bucket_counted_bytes": ddp.counted_bytes}


def _graph_key(gm: fx.GraphModule, example_inputs: Sequence[Any], frame: CompilingFrame,
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


def _needs_grad(value: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.requires_grad
               for t in torch.utils._pytree.tree_leaves(value))


def _step_baseline(runs: list[_Graph]) -> int:
    """The baseline peak of the whole step (no memopt passes in any graph), which a
    fraction budget is of: the largest over the runs of a graph's baseline, with what the
    graphs before it would save unoptimized in place of what their plans save."""
    peak, extra = 0, 0
    for graph in runs:
        peak = max(peak, graph.plan.baseline_peak_bytes + extra)
        extra += graph.plan.baseline_saved_bytes - graph.plan.held_bytes
    return peak


class _DoesNotFit(Exception):
    def __init__(self, graph: "_Graph", position: int) -> None:
        super().__init__(graph.label())
        self.graph, self.position = graph, position


#: Rounds of planning every graph of a forward again, each with the saved bytes the
#: round before gave the others (a graph running more than once in a forward sees graphs
#: that run after its first run).
_ROUNDS = 3


def _replan_jointly(runs: list[_Graph], bases: list[Outside], policies: dict[int, str],
                    step_baseline: int | None) -> None:
    """Plan every graph of a forward again with all of them known (graph breaks): each
    by its policy in `policies`, with what the rest of the step holds around each of its
    runs (`bases`, from memopt.steps, plus the saved bytes of the runs before it as
    planned now), in rounds until the saved bytes settle. Raises _DoesNotFit for the
    first graph whose plan misses the budget, at its last run's position."""
    order = list(dict.fromkeys(runs))
    for _ in range(_ROUNDS):
        before = {id(g): g.plan.held_bytes for g in order}
        for graph in order:
            need = Outside()
            for i, run in enumerate(runs):
                if run is graph:
                    need = need.max(bases[i].plus(sum(r.plan.held_bytes for r in runs[:i])))
            policy = policies[id(graph)]
            if graph.provisional or graph.outside != need or graph.policy != policy \
                    or graph.step_baseline != step_baseline:
                log.info("memopt: planning %s again with the whole forward known (%s): %s "
                         "held around its forward, %s around its backward", graph.label(),
                         policy, format_bytes(need.forward), format_bytes(need.backward))
                graph.replan(need, policy, step_baseline)
        if all(g.plan.held_bytes == before[id(g)] for g in order):
            break
    for graph in order:
        if not graph.plan.fits:
            raise _DoesNotFit(graph, max(i for i, r in enumerate(runs) if r is graph))


#: How a graph of a forward with graph breaks is planned: the least recomputation that
#: fits (Chen's search), recomputing everything it can (it holds the least for the graphs
#: after it: Chen Alg. 2 with m(v) = 1 everywhere), or its lowest peak.
GREEDY, LEAN, LOWEST = "greedy", "lean", "lowest"


def _aliased_output_grad_bytes(gm: fx.GraphModule) -> int:
    """Bytes of the output gradients autograd forms outside the compiled backward.

    AOTAutograd returns one tensor per storage and regenerates outputs that alias another
    output (`return h, h`, a slice of an output, HF's hidden-states tuple holding the last
    hidden state twice) or a graph input as views outside the compiled graph, so the loss's
    gradients for those outputs are summed by autograd before the compiled backward runs
    (and those of an input's view flow to the input outside it). While autograd sums k
    gradients of one storage it holds up to k + 1 storage-sized buffers (the contributions,
    a slice's gradient expanded to its base, the running sum), one of which becomes the
    tangent the plan counts: k more, every one for an input's storage. The fuzzer
    (tests/test_fuzz.py) measured a model returning `{"a": h[:, :1], "b": h}` 1.10x its
    budget when the plan left them out. Dynamo hands memopt the same tensor returned
    twice as one output, so `return h, h` is not seen here (README, "Known limits")."""
    placeholders = {storage_key(v): True for v in
                    (n.meta.get("example_value") for n in gm.graph.find_nodes(op="placeholder"))
                    if isinstance(v, torch.Tensor)}
    output = next(iter(gm.graph.find_nodes(op="output")))
    uses: dict[Any, list[int]] = {}
    for node in torch.utils._pytree.tree_leaves(output.args):
        value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
        if isinstance(value, torch.Tensor) and value.requires_grad:
            storage = value.untyped_storage()
            uses.setdefault(storage_key(value), []).append(storage.nbytes())
    return sum(sizes[0] * len(sizes) for key, sizes in uses.items()
               if len(sizes) > 1 or key in placeholders)


def _grad_sink(kinds: dict[str, str], inputs: Sequence[Any]) -> tuple[GradSink, ExistingGrads]:
    """The runtime sink and the plan's view of the `.grad` tensors of every parameter that
    requires grad (primal `primals_{i+1}` is `inputs[i]`)."""
    slots = {name: i for i, (name, kind) in enumerate(kinds.items())
             if kind == "parameter" and i < len(inputs)
             and isinstance(inputs[i], torch.Tensor) and inputs[i].requires_grad}
    sink = GradSink(slots)
    nbytes = {name: inputs[i].numel() * inputs[i].element_size() for name, i in slots.items()}
    return sink, ExistingGrads(nbytes=nbytes, add=sink.add)


def memopt_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], **options: Any) -> Callable:
    """The registered `backend="memopt"`: `torch.compile(m, backend="memopt",
    options={"budget": "4GB"})` passes its options here."""
    return MemoptBackend(**options)(gm, example_inputs)

