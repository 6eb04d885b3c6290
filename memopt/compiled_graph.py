"""One graph dynamo captured and memopt planned, as it runs: CompiledGraph.

What a graph needs to be planned again (its FX graph, FakeTensor inputs, primal kinds),
its plan and compiled function (AOTAutograd with the planner as its partition function,
memopt.planner.plan_joint), and where in the user's code it ends. Also what the capture
tells the planner about the step (memopt.graph_facts): which primals are parameters,
buffers and inputs; the output gradients autograd forms outside the compiled backward;
the `.grad` tensors a kept-gradient step adds into; and, with drop_outputs, the watcher
that warns when the loop still holds an output the plan freed (memopt.dropped).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Sequence

from torch import fx

from memopt.passes._torch_compat import (CompilingFrame, aot_module_simplified,
                                         autocast_regions, in_autocast_regions,
                                         loss_decompositions, make_boxed, random_ops_kept,
                                         rng_kept)
from memopt.passes.dead_draws import with_dead_draws
from memopt.passes.lm_heads import Attach
from memopt.passes.runtime_views import views_as_reshapes

from . import caller_loss
from .budget import Budget, format_bytes
from .errors import BudgetError, InputError
from .kernels import (Kernels, compile_with_inductor, inductor_peak, op_by_op_or_refuse,
                      refused_note)
from .graph_breaks import ReplanPolicy
from .memory_plan import GraphBreak, MemoryPlan
from .planner import PlanRequest, plan_joint
from .planner.request import first_fraction
from .dropped import DroppedOutputs
from .unused_outputs import UnusedOutputGrads
from .graph_facts import (checked_backward, ddp_fields, grad_sink, optimizer_fields,
                          primal_kinds, refuse_double_backward, refuse_sparse_values,
                          view_grads, warn_parallel_scan)
from .optimizer_step import in_parts
from .steps import Outside, aliased_output_grad_bytes, kept_input_positions
from .stepper import Stepping, stepping_for

if TYPE_CHECKING:  # pragma: no cover
    from .backend import MemoptBackend
    from .settled import Settled


class PlanOnly(Exception):
    """Raised by the backend in plan-only mode (memopt.plan), carrying the plan out of
    torch.compile (None: the captured graph was an inference graph, with no backward to
    plan)."""

    def __init__(self, plan: MemoryPlan | None) -> None:
        super().__init__("plan ready")
        self.plan = plan


class CompiledGraph:
    """One graph dynamo captured and memopt planned: what it needs to be planned again
    (its FX graph, FakeTensor inputs, primal kinds), its plan and compiled function, and
    where in the user's code it ends (`frame`). `run` is what dynamo calls; a re-plan
    swaps the function it runs for the steps after."""

    def __init__(self, backend: MemoptBackend, gm: fx.GraphModule,
                 example_inputs: Sequence[Any], frame: CompilingFrame, index: int,
                 alone: bool) -> None:
        self.backend, self.gm, self.frame = backend, gm, frame
        self.index, self.alone = index, alone  # its position in the forward; the only one
        self.kinds = primal_kinds(gm, example_inputs)
        self.attributes = [*gm.parameters(), *gm.buffers()]  # AOTAutograd's first primals
        self.fakes = [n.meta.get("example_value") for n in gm.graph.find_nodes(op="placeholder")]
        #: {device type: dtype} of the autocast regions it was captured in: a re-plan traces
        #: it in them again, wherever it runs (`replan`)
        self.autocast = autocast_regions()
        self.sink, self.grads = None, None
        if backend.existing_grads:
            self.sink, self.grads = grad_sink(self.kinds, [*self.attributes, *example_inputs])
        #: the optimizer stepped inside the backward (memopt.stepper): what planning it
        #: needs, or why it cannot be (""; None: not asked, no optimizer= or a kept-.grad
        #: step); whether the plan in use steps in the backward
        self.stepping: Stepping | str | None = None
        if backend.optimizer is not None and backend.optimizer_source is not None \
                and backend.step_in_backward is not False and not backend.existing_grads:
            self.stepping = stepping_for(
                backend.optimizer_source, backend.optimizer, self.kinds,
                [*self.attributes, *example_inputs], alone=alone,
                ddp=backend.plan_log.ddp is not None,
                kernels_inductor=backend.kernels is Kernels.INDUCTOR,
                asked=backend.step_in_backward is True)
        self.steps_in_backward = False
        self.outside_grads = aliased_output_grad_bytes(gm)
        #: the same for a tensor the forward returns more than once, which only the
        #: returned value shows (memopt.steps.repeated_output_grad_bytes; memopt.backend)
        self.repeated_grads = 0
        self.outside, self.policy, self.step_baseline = Outside(), ReplanPolicy.GREEDY, None
        self.provisional = False  # planned with a guess for the graphs after it
        self._kept: tuple[Any, tuple[int, ...]] = (None, ())  # (plan, its kept inputs)
        #: run several times in a forward: its saved bytes counted 2^weight times as often
        #: as its runs hold them, for the graphs after it (memopt.graph_breaks.required)
        self.weight = 0
        #: a repeated graph with a second plan for its later runs (memopt.run_plans): the
        #: graph whose captured graph it is (itself, but in a twin), the own run from which
        #: the twin runs, and whether this plan stays as it is while the twin is planned
        self.primary: CompiledGraph = self
        self.later: tuple[int, CompiledGraph] | None = None
        self.first_run, self.pinned = 0, False
        #: a twin that runs the later runs of the first forward only (`_interim_twin`)
        self.interim = False
        #: positions among its inputs whose gradient it returns as a view (a weight
        #: F.linear reads transposed): autograd adds another gradient into such a one
        #: out of place (memopt.steps.ForwardTrace._eager_grads)
        self.view_grads: frozenset[int] = frozenset()
        self.plan: MemoryPlan | None = None
        self.compiled: Callable | None = None
        #: what its last traced step counted, for steps without the trace (memopt.settled)
        self.settled: Settled | None = None
        #: the backward of eager code before its first run, measured (memopt.eager_tail;
        #: None: not measured), and the part of it its plan holds as its backward ends
        self.eager_tail: int | None = None
        self.tail_charged = 0
        self._tail_watch: Any = None
        self._tail_armed = False
        #: the caller's loss after its last run, measured (memopt.caller_loss: the most
        #: any step measured), and the part of it its plan holds before its backward
        self.caller_loss = self.loss_charged = 0
        #: what it holds through the backward (caller_loss.INPUT_SIZED_RESULTS), and the
        #: part of it the plan holds
        self.loss_through = self.through_charged = 0
        self.loss_windows = 0  # backward windows memopt.caller_loss watched
        self.loss_measured = False  # caller_loss measured (or known from an earlier module)
        self.head_flowing = 0  # steps.ForwardTrace.eager_head's gradient term, last seen
        #: what memopt.caller_loss remembers its measurement by (set by the backend)
        self.loss_key: tuple | None = None
        self.loss_identity: tuple = ()
        self.attaches: list[Attach] = []  # logits returned without a gradient (_chunk_heads)
        #: drop_outputs=True, the step one graph: the outputs the plan frees as it ends
        self.dropped = DroppedOutputs() if backend.options.drop_outputs and alone else None
        #: what runs its planned graphs (memopt.kernels), and why not what was asked
        self.kernels, self.kernels_note = backend.kernels, ""
        if self.kernels is Kernels.INDUCTOR and self.sink is not None:
            self.kernels = Kernels.ATEN
            self.kernels_note = ("aten: a step into existing .grad adds each gradient "
                                 "from Python (memopt.grads), which inductor cannot call")

    def twin(self, first_run: int) -> CompiledGraph:
        """A second entry for this captured graph that runs its own runs from `first_run`
        on in each forward with a plan of its own (memopt.run_plans), to be planned: this
        graph's plan until then."""
        twin = copy.copy(self)
        twin.settled = twin._tail_watch = None
        twin.outside, twin.policy, twin.weight = Outside(), ReplanPolicy.GREEDY, 0
        twin.provisional = twin.pinned = False
        twin.later, twin.first_run = None, first_run
        return twin

    #: what `compile` sets: the plan in use, as it runs
    _PLANNED = ("plan", "compiled", "outside", "policy", "step_baseline")

    def planned(self) -> dict[str, Any]:
        """The plan in use and what it was made for, for `restore`."""
        return {name: getattr(self, name) for name in self._PLANNED}

    def restore(self, planned: dict[str, Any]) -> None:
        """Run a plan taken by `planned` again (no planning)."""
        for name, value in planned.items():
            setattr(self, name, value)

    def label(self) -> str:
        where = f", {self.frame.where()}" if self.frame.graph_break else ""
        return f"graph {self.index + 1}{where}"

    def graph_break(self) -> GraphBreak | None:
        """The break that ends this graph (None: it returns)."""
        if not self.frame.graph_break:
            return None
        reason = "a block boundary (memopt.compile(..., blocks=True), memopt.blocks)" \
            if self.frame.at_block_boundary else self.frame.reason
        return GraphBreak(reason=reason, filename=self.frame.filename,
                          lineno=self.frame.lineno)

    def compile(self, example_inputs: Sequence[Any], outside: Outside, policy: ReplanPolicy,
                budget: Budget | None, step_baseline: int | None = None,
                must_fit: bool = True, aim_within: bool = True) -> Callable:
        """Plan this graph under `budget` with `outside` held around it, by `policy`
        (ReplanPolicy), a fraction budget of `step_baseline` when given
        (memopt.planner.PlanRequest), and compile it (AOTAutograd with memopt's partition
        function); the callable for dynamo. Raises BudgetError where the plan misses,
        if `must_fit` (else the plan is kept all the same: `plan.fits` says).
        `aim_within` False: a plan made without a budget of its own does not aim at the
        module's fraction budget (PlanRequest.first_fraction), so LEAN recomputes Chen's
        mirror set `all` there too."""
        backend, plans = self.backend, self.backend.plan_log
        options = backend.options
        within = backend.budget if budget is None else None
        aims = first_fraction(budget, within, aim_within) is not None
        if policy == ReplanPolicy.LEAN and not aims:
            # a first plan at a fraction aims at the fraction of the graph's own baseline
            # instead (PlanRequest.first_fraction): Chen's mirror set `all` can peak
            # above keeping everything (a Wav2Vec2's encoder: 2,970,352 bytes against
            # 2,850,272, its first step 1.25x a 0.7 budget; found from outside)
            options = dataclasses.replace(options, mirror="all")
        if self.kernels is not Kernels.INDUCTOR:  # op by op, a recomputed op is one more kernel
            options = dataclasses.replace(options, fusible=False)
        planned: list[MemoryPlan] = []
        reserve = [0]  # bytes inductor's schedule of an earlier plan held above it
        requests: list[PlanRequest] = []  # the last is the plan's
        used = [outside]  # what it was planned with (without the loss's room: partition_fn)
        unused: list[UnusedOutputGrads | None] = [None]  # memopt.unused_outputs
        by_aten = [False]  # compiled op by op (memopt's backward: unused_outputs drops)

        def partition_fn(joint: fx.GraphModule, _joint_inputs: Any, *, num_fwd_outputs: int,
                         **_kw: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
            captured = plans.capture_seconds()
            refuse_sparse_values(joint)
            self.view_grads = view_grads(joint, num_fwd_outputs)
            unused[0] = UnusedOutputGrads.of_joint(joint)
            request = PlanRequest(
                joint, num_fwd_outputs, budget, primal_kinds=self.kinds, options=options,
                grads=self.grads, outside_grad_bytes=self.outside_grads + self.repeated_grads,
                outside=used[0],
                label="" if self.alone else self.label(),
                lowest_peak=policy == ReplanPolicy.LOWEST, step_baseline=step_baseline,
                must_fit=must_fit, whole_step=self.alone, workspaces=backend.workspaces,
                fraction_floor=plans.fraction_floor if self.alone else 0,
                reserve_bytes=reserve[0], room_bytes=caller_loss.room(self, used[0]),
                measure_within=within, aim_within=aim_within)
            requests.append(request)
            try:
                fw, bw, plan = self._plan_joint(request)
            except BudgetError as err:
                err.capture_seconds = captured
                lean = caller_loss.without_room(self, used[0])
                if lean is None:
                    raise
                requests[-1] = request = dataclasses.replace(request, outside=lean,
                                                             room_bytes=0)
                try:  # the caller's loss without its room (caller_loss.without_room)
                    fw, bw, plan = self._plan_joint(request)
                except BudgetError as without:
                    raise err.with_room_free(without.minimum_bytes) from None
                used[0] = lean
            plan = plan.model_copy(update={"graph_index": self.index,
                                           "first_run": self.first_run,
                                           "kernels": self.kernels.value,
                                           "kernels_note": self.kernels_note,
                                           "graph_break": self.graph_break(),
                                           "capture_seconds": captured,
                                           **ddp_fields(plans.ddp),
                                           **optimizer_fields(backend.optimizer,
                                                               self.step_chunk)})
            planned.append(plan)
            plans.record(plan)
            if not plans.warned_scan:
                plans.warned_scan = warn_parallel_scan(fw, plan)
            if self.alone and plan.fits and budget is not None and budget.fraction is not None:
                plans.fraction_floor = max(plans.fraction_floor, plan.budget_bytes)
            if backend.plan_only:  # stop before AOTAutograd builds its runtime wrappers
                raise PlanOnly(plan)
            return fw, bw

        partition_fn = with_dead_draws(partition_fn)  # eager's draws, used or not

        def compile_graph(graph: fx.GraphModule, _inputs: Any) -> Callable:
            views_as_reshapes(graph)  # op by op: views that hold at runtime
            return make_boxed(graph)

        def compile_backward(graph: fx.GraphModule, inputs: Any) -> Callable:
            run = checked_backward(compile_graph(graph, inputs), self.dropped)
            return unused[0].backward(run) if unused[0] is not None else run

        # Planning runs chain steps on real tensors (passes.chain_policy measures what they
        # save): the user's RNG state must not move, or dropout would draw other masks.
        def aten() -> Callable:
            nonlocal options  # the graph runs op by op: nothing is recomputed for free
            options = dataclasses.replace(options, fusible=False)
            by_aten[0] = True
            with random_ops_kept(True):  # unused ones too (passes.dead_draws)
                return aot_module_simplified(
                    self.gm, list(example_inputs), fw_compiler=compile_graph,
                    bw_compiler=compile_backward, inference_compiler=compile_graph,
                    partition_fn=partition_fn, decompositions=loss_decompositions())

        with rng_kept():
            if self.kernels is Kernels.INDUCTOR:
                compiled = self._inductor_or_aten(example_inputs, partition_fn, planned, aten,
                                                  reserve, requests)
            else:
                compiled = aten()
        if unused[0] is not None and by_aten[0] and not self.attaches:  # an input reached
            compiled = unused[0].wrap(compiled, self._drop)  # only through outputs unused
        if self.attaches:
            from .lm_head import with_attached_logits  # noqa: PLC0415
            compiled = with_attached_logits(compiled, self.attaches)
        if not planned:
            return compiled  # an inference graph (no gradients needed): nothing to plan
        if self.tail_charged:  # memopt.eager_tail
            self._amend(planned, eager_tail_bytes=self.tail_charged)
        if self.loss_charged:  # memopt.caller_loss
            self._amend(planned, caller_loss_bytes=self.loss_charged,
                        caller_loss_measured_bytes=self.caller_loss if self.loss_measured
                        else None)
        self.plan, self.compiled, self.outside = planned[-1], compiled, used[0]
        self.policy, self.step_baseline = policy, step_baseline
        return self.run

    def _plan_joint(self, request: PlanRequest) -> tuple[fx.GraphModule, fx.GraphModule,
                                                         MemoryPlan]:
        """plan_joint, with what the optimizer's step costs lowered where the budget needs
        it, cheapest first, each for the same bytes: a plan that misses the budget is made
        again with `optimizer.step()` in chunks (memopt.optimizer_step), then with the
        optimizer stepped inside the backward (memopt.stepper; always where asked:
        step_in_backward=True)."""
        stepping, asked = self.stepping, self.backend.step_in_backward
        if asked and not isinstance(stepping, Stepping):
            raise InputError(f"step_in_backward=True, but the optimizer cannot step inside "
                             f"this backward: {stepping or 'no optimizer= was given'}")
        self.steps_in_backward, self.step_chunk = False, None
        if not asked:
            try:
                return plan_joint(request)
            except BudgetError as err:
                failed = err
            try:
                planned = self._plan_chunked(request, failed)
            except BudgetError as err:
                failed = err  # the leanest chunks' minimum: lower than the whole step's
            else:
                if planned is not None:
                    return planned
            if not isinstance(stepping, Stepping):
                raise failed
            baseline = request.step_baseline or failed.baseline_bytes
        else:
            baseline = request.step_baseline
        outside = request.outside
        if stepping.all_stepped:  # the user's optimizer.step() then allocates nothing
            outside = dataclasses.replace(outside, after_backward=max(
                0, outside.after_backward - self.backend.optimizer.step_bytes))
        try:
            planned = plan_joint(dataclasses.replace(request, grads=stepping.grads,
                                                     outside=outside, step_baseline=baseline))
        except BudgetError as err:  # the smaller of the two minimums is the one accepted
            # (a step charged more in the backward than whole, as inside a profiler: the
            # minimum named was 1.05x a budget that held, found from outside)
            raise failed if not asked and failed.minimum_bytes < err.minimum_bytes else err
        if not self.backend.plan_only:
            stepping.stepper.activate()
        self.steps_in_backward = True
        return planned

    def _plan_chunked(self, request: PlanRequest, err: BudgetError
                      ) -> tuple[fx.GraphModule, fx.GraphModule, MemoryPlan] | None:
        """The plan with `optimizer.step()` run in chunks (memopt.optimizer_step.ChunkedStep)
        after the whole step missed the budget (`err`), or None where chunks would not lower
        the step (no foreach temporaries to cut). The chunk first tried is the largest whose
        step is lower by what the budget lacked; then the smallest (one parameter's). Raises
        the last BudgetError where neither fits."""
        opt = self.backend.optimizer
        if opt is None or self.backend.optimizer_source is None \
                or in_parts(self.backend.optimizer_source) is not None:
            return None
        lean = opt.chunked_step_bytes(opt.largest_param)
        if opt.chunk_for(lean) is None or lean >= opt.step_bytes:
            return None
        baseline = request.step_baseline or err.baseline_bytes
        target = opt.step_bytes - (err.minimum_bytes - err.budget_bytes)
        for chunk in dict.fromkeys(c for c in (opt.chunk_for(target), opt.largest_param) if c):
            saved = opt.step_bytes - opt.chunked_step_bytes(chunk)
            outside = dataclasses.replace(request.outside, after_backward=max(
                0, request.outside.after_backward - saved))
            try:
                planned = plan_joint(dataclasses.replace(request, outside=outside,
                                                         step_baseline=baseline))
            except BudgetError as failed:
                err = failed
                continue
            self.step_chunk = chunk
            if not self.backend.plan_only:
                self.backend.chunk_optimizer_step(chunk)
            return planned
        raise err

    def _inductor_or_aten(self, example_inputs: Sequence[Any], partition_fn: Callable,
                          planned: list[MemoryPlan], aten: Callable[[], Callable],
                          reserve: list[int], requests: list[PlanRequest]) -> Callable:
        """The graphs compiled by inductor, checked against the plan. memopt's liveness of
        fused kernels ran on each graph's own order; inductor's fusion can run the kernels
        in another (memopt.kernels.scheduled_peak), and the plan's predicted peak becomes
        the step's on that order. Where that is over the budget, the graph is planned
        again with the budget less the excess (`reserve`) and compiled again; where it is
        still over, it is planned and compiled once more to run op by op (`aten`), and its
        plan says why. A budget below the plan for inductor's smallest runs op by op where
        that fits (`op_by_op_or_refuse`)."""
        plan = planned[-1] if planned else None
        for attempt in range(2):
            try:
                compiled, schedule = compile_with_inductor(self.gm, example_inputs,
                                                           partition_fn)
            except BudgetError as refused:
                if attempt == 0:  # op by op where that plan fits, else the larger minimum
                    compiled = op_by_op_or_refuse(refused, aten)
                    self._amend(planned, kernels=Kernels.ATEN.value,
                                kernels_note=refused_note(refused))
                    return compiled
                planned.append(plan)  # no plan leaves room for the excess: op by op
                break
            if not planned:
                return compiled
            plan, request = planned[-1], requests[-1]
            peak = inductor_peak(plan, schedule, request)
            budget = plan.budget_bytes
            excess = max(0, peak - plan.predicted_peak_bytes)
            if budget is None or peak <= budget:
                # inductor's schedule is the step's peak: what it leaves of the budget is
                # the headroom kept (less than the plan's where the schedule ends above
                # it), so that `plan.fits` says what was accepted (a re-plan after graph
                # breaks found it missing, and then an AssertionError)
                headroom = plan.headroom_bytes if budget is None \
                    else min(plan.headroom_bytes, budget - peak)
                self._amend(planned, schedule_excess_bytes=excess, predicted_peak_bytes=peak,
                            headroom_bytes=headroom)
                return compiled
            if attempt == 0:  # plan again, leaving the excess free
                reserve[0] += peak - budget
                planned.clear()
        planned.clear()
        reserve[0] = 0  # op by op, the plan's own liveness is the step's
        compiled = aten()
        note = (f"aten: inductor's schedule holds {format_bytes(excess)} more than the plan, "
                f"which would end at {format_bytes(peak)}, over the budget of "
                f"{format_bytes(budget)}")
        self._amend(planned, kernels=Kernels.ATEN.value, kernels_note=note,
                    schedule_excess_bytes=excess)
        return compiled

    def _amend(self, planned: list[MemoryPlan], **update: Any) -> None:
        """The last plan of `planned` with `update`, in the backend's plan log too."""
        planned[-1] = planned[-1].model_copy(update=update)
        self.backend.plan_log.amend(planned[-1])

    def replan(self, outside: Outside, policy: ReplanPolicy, step_baseline: int | None) -> None:
        """Plan and compile again (on FakeTensors) under the backend's budget, for the
        next runs, keeping the plan even where it misses the budget (`plan.fits`); LEAN
        falls back to LOWEST where it misses."""
        budget = self.backend.budget
        self.backend.plan_log.start_clock()  # capture: AOTAutograd's tracing only
        # as captured: a re-plan after the user's step (memopt.measure.allocation_peak
        # closing, outside their torch.autocast) traced a bf16 graph in float32, and its
        # backward raised (`mm` of BFloat16 and float, found from outside)
        with in_autocast_regions(self.autocast):
            self.compile(self.fakes, outside, policy, budget, step_baseline, must_fit=False)
            if not self.plan.fits and policy == ReplanPolicy.GREEDY:
                try:  # as a first plan is made: each chain at its lowest peak where needed
                    self.compile(self.fakes, outside, policy, budget, step_baseline)
                except BudgetError:
                    pass  # the plan that misses is kept: its BudgetError is raised later
            stepping = self.backend.optimizer is not None
            if not self.plan.fits and (policy == ReplanPolicy.LEAN or stepping
                                       or self.kernels is Kernels.INDUCTOR):
                # under inductor GREEDY too: the graph after a break missed without the
                # op-by-op fallback; with optimizer=, without the optimizer's chunks and
                # steps inside the backward, tried only where a plan must fit (_plan_joint):
                # budget_error then found a plan that fits (an AssertionError, found from
                # outside)
                self.compile_lowest(self.fakes, outside, budget, step_baseline,
                                    policy if stepping else ReplanPolicy.LOWEST)
                self.policy = policy  # what was asked: LOWEST is how it fits here
        self.provisional = False

    def compile_lowest(self, example_inputs: Sequence[Any], outside: Outside,
                       budget: Budget | None, step_baseline: int | None = None,
                       first: ReplanPolicy = ReplanPolicy.LOWEST) -> Callable:
        """compile() by the LOWEST policy where that fits the budget (under inductor, op by
        op where inductor's lowest plan misses and aten's fits: _inductor_or_aten; with
        optimizer=, its fallbacks: `first`, then LOWEST), else that lowest plan kept all
        the same (`plan.fits` False): the step's minimum is then named where the forward
        ends (memopt.graph_breaks.step_minimum)."""
        for policy in dict.fromkeys((first, ReplanPolicy.LOWEST)):
            if self.kernels is not Kernels.INDUCTOR and self.backend.optimizer is None:
                break
            try:  # the plan kept is the one tried
                return self.compile(example_inputs, outside, policy, budget, step_baseline)
            except BudgetError:
                pass
        return self.compile(example_inputs, outside, ReplanPolicy.LOWEST, budget,
                            step_baseline, must_fit=False)

    def budget_error(self) -> BudgetError | None:
        """The BudgetError of this graph's plan, which misses the budget; None where its
        lowest-peak plan fits after all, which it then runs (a plan made again as the
        user's allocation_peak closed, measured where the first could not, missed where
        the lowest-peak plan fit: an AssertionError here, a CTC model's BiLSTM, found from
        outside). Traced in the autocast regions it was captured in (``replan``): called
        as the user's allocation_peak closed, outside their torch.autocast, it named a
        bf16 CNN's float32 minimum, 1.91x what the step needed (found from outside)."""
        before = self.plan
        try:
            with in_autocast_regions(self.autocast):
                self.compile(self.fakes, self.outside, ReplanPolicy.LOWEST,
                             self.backend.budget, self.step_baseline)
        except BudgetError as err:
            return err
        if self.backend.plan_log.last is before:
            self.backend.plan_log.last = self.plan
        return None

    def _interim_twin(self, trace: Any, args: Sequence[Any]) -> CompiledGraph:
        """The plan of this graph's later runs in the first forward, made as its second
        run starts: its first plan was made for one run, and each later run holds what the
        runs before it saved, so these keep the least they can (LEAN: Chen's mirror set
        `all`; LOWEST where that misses a byte budget). A loop of 6 layers broken by
        dynamo into one graph run 6 times measured 1.17x a 0.5 budget in its first step
        with every run on the first plan (a Wav2Vec2 with transformers 4.46, found from
        outside). The forward's end plans the step again without it
        (memopt.backend: `interim`)."""
        outside = trace.outside_of(len(trace.runs), [*self.attributes, *args])
        budget = None if self.backend.budget.fraction is not None else self.backend.budget
        twin = self.twin(1)
        try:
            twin.compile(self.fakes, outside, ReplanPolicy.LEAN, budget, aim_within=False)
        except BudgetError:
            twin.compile_lowest(self.fakes, outside, budget)
        twin.provisional = twin.interim = True
        return twin

    def _drop(self, primals: frozenset[int]) -> None:
        """An optimizer stepped inside the backward skips the parameters whose gradients
        memopt.unused_outputs drops in it (eager gives them none)."""
        if self.steps_in_backward:
            self.stepping.stepper.drop(primals)

    def kept_inputs(self) -> tuple[int, ...]:
        """memopt.steps.kept_input_positions of its plan, found once per plan."""
        if self._kept[0] is not self.plan:
            self._kept = (self.plan, kept_input_positions(self.plan))
        return self._kept[1]

    def run(self, *args: Any) -> Any:
        """Run the compiled graph: in the forward's trace (memopt.steps) unless it has
        settled (memopt.settled), its parameters bound for a kept-gradient backward."""
        log = self.backend.plan_log
        call, record, skipped = log.call, None, False
        if self.provisional and self.later is None and self.primary is self \
                and call is not None and self.backend.budget is not None \
                and call.trace().runs_of(self) == 1:
            self.later = (1, self._interim_twin(call.trace(), args))
        if self.later is not None and call is not None \
                and call.trace().runs_of(self) >= self.later[0]:
            return self.later[1].run(*args)  # its later runs: the twin's plan
        log.last = self.plan
        flat = [*self.attributes, *args]
        if call is not None:
            skipped = call.admits(self)
            if not skipped:
                record = call.trace().start_run(self, flat, self.plan.held_bytes,
                                                [flat[i] for i in self.view_grads],
                                                self.kept_inputs())
        if self.sink is not None:
            self.sink.bind(flat)
        elif self.steps_in_backward:
            self.stepping.stepper.bind(flat)
        out = self.compiled(*args)
        refuse_double_backward(out)
        if self.dropped is not None:
            self.dropped.watch(out)
        if self.steps_in_backward:
            self.stepping.stepper.watch(out)
        if record is not None:
            record.record_outputs(out)
        elif skipped:
            call.skipped.append((self, flat, out))
        return out
