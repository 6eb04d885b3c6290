"""What one call of the planner is asked: the request, the step around the graph, options.

A `PlanRequest` is built once, at the edge (memopt.backend), and validated there; the
planner's stages only read it. `StepContext` is the part every build of the step needs
for its liveness: what each primal is, the `.grad` tensors kept from earlier steps, and
what the rest of the training step holds around this graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import fx

from memopt.passes.chain_costs import FractionRoom
from memopt.passes.liveness import StepSchedule, analyze_liveness
from memopt.passes.meta import fake_value, value_tensors
from memopt.passes.workspace import WorkspaceCache

from ..budget import Budget
from ..steps import Outside


@dataclass(frozen=True)
class ExistingGrads:
    """The step in which parameters' `.grad` tensors already exist (gradients kept between
    steps, gradient accumulation: memopt.grads). `nbytes` maps each parameter primal to its
    `.grad`'s bytes, resident for the whole step; `add` is the runtime's
    `GradSink.add`, which the backward calls with each new gradient as soon as it is
    complete (passes.gradients)."""

    nbytes: dict[str, int]
    add: Callable[[str, Any], Any]
    #: The optimizer steps each of these parameters inside the backward instead
    #: (memopt.stepper): `add` is the stepper's, no `.grad` is resident, and each step
    #: allocates `step_bytes[primal]` while it runs. None: gradients kept in `.grad`.
    step_bytes: dict[str, int] | None = None

    @property
    def resident(self) -> dict[str, int] | None:
        """The `.grad` bytes held for the whole step, by parameter primal."""
        return self.nbytes if self.step_bytes is None else None


@dataclass(frozen=True)
class StepContext:
    """What a step holds or forms besides its joint graph's values: the kind of every
    primal (parameter / buffer / input), the `.grad` tensors kept from earlier steps, and
    `outside_grad_bytes`, the gradients autograd forms outside the compiled backward
    (outputs that alias each other or an input: memopt.backend). Liveness of any build of
    the step comes from here."""

    primal_kinds: dict[str, str]
    grads: ExistingGrads | None = None
    outside_grad_bytes: int = 0
    #: What the rest of the step holds while this graph's forward and its backward run
    #: (the other graphs of a forward with graph breaks, unused parameters: memopt.steps).
    outside: Outside = Outside()
    #: The caller drops every output but its scalar loss before backward (passes.liveness)
    outputs_dropped: bool = False
    #: TorchInductor's fused kernels run the graphs (kernels="inductor"): liveness counts
    #: the buffers they allocate (passes.fusion)
    fused: bool = False

    @property
    def mutable_inputs(self) -> frozenset[str]:
        """Primals the step may mutate (buffers: BatchNorm statistics, counters)."""
        return frozenset(name for name, kind in self.primal_kinds.items() if kind == "buffer")

    @property
    def existing_grad_bytes(self) -> dict[str, int] | None:
        return self.grads.resident if self.grads is not None else None

    def liveness(self, fw: fx.GraphModule, bw: fx.GraphModule, saved: frozenset[str],
                 num_user_outputs: int) -> StepSchedule:
        return analyze_liveness(
            fw, bw, saved=saved, num_user_outputs=num_user_outputs,
            primal_kinds=self.primal_kinds, existing_grads=self.existing_grad_bytes,
            outside_grad_bytes=self.outside_grad_bytes,
            outside_bytes=self.outside.bytes(), outputs_dropped=self.outputs_dropped,
            fused=self.fused)


@dataclass(frozen=True)
class Options:
    """Pipeline switches (the defaults are what `memopt.compile` runs)."""

    inplace: bool = True
    #: Forward node names to recompute in backward (m(v) = 1), or "all" for every
    #: mirrorable node; None: decided by the budget search. An expert override.
    mirror: frozenset[str] | str | None = None
    #: Fraction of the budget kept free for what the plan does not model (allocations
    #: outside PyTorch's allocator, fragmentation, workspaces that depend on values): the
    #: plan's peak must fit in budget * (1 - headroom), for a byte budget and a fraction
    #: alike. None: memopt.budget.default_headroom of the graph's device, the worst
    #: measured excess of a peak over its prediction there (CPU 1.5%, CUDA 3%).
    headroom: float | None = None
    #: "milp": also solve the exact MILP (memopt.allocator.milp, the `[solver]` extra) and
    #: take its plan where it recomputes less than Alg. 3's; None: Alg. 3 + grid only.
    solver: str | None = None
    #: Seconds HiGHS may spend per solve (its best plan so far is used after that).
    solver_seconds: float = 30.0
    #: A progress bar (tqdm, on stderr) for a budget search that runs longer than
    #: PROGRESS_DELAY seconds, when stderr is a terminal; False: never.
    progress: bool = True
    #: True: the training loop keeps only the scalar loss past the forward and drops the
    #: other outputs before backward (``model(**batch).loss.backward()``, the HF Trainer),
    #: so the plan frees them as the forward ends, unless backward reads them. Only for a
    #: step that is one graph; memopt warns at backward when such an output is still
    #: alive (memopt.backend). False: every output is held until the step ends.
    drop_outputs: bool = False
    #: True (kernels="inductor"): inductor's fused kernels run the graphs. With no budget,
    #: recompute the pointwise values they make free (memopt.planner.fusible) where the
    #: peak does not rise; liveness counts the buffers they allocate (passes.fusion).
    fusible: bool = False
    #: True: the budget bounds the bytes CUDA's caching allocator would reserve for the
    #: step (memopt.allocator.caching's model of its segments), not only the allocated
    #: peak (memopt.planner.plan, Step 6b).
    reserved: bool = False
    #: Offload saved values to host memory where that is faster than recomputing them
    #: (memopt.planner.offload_choice, Step 6c): None where the device has separate host
    #: memory (CUDA) and the graphs run op by op, True always (on CPU the copy is a no-op:
    #: nothing is freed), False never, or a memopt.allocator.offload.Link to plan with
    #: instead of the measured one (memopt.link).
    offload: object = None


def first_fraction(budget: Budget | None, within: Budget | None,
                   aim_within: bool = True) -> float | None:
    """The fraction a plan made without a budget of its own aims at: the module's
    fraction budget `within` where the step's baseline is not known yet (a first plan
    with graph breaks: PlanRequest.measure_within), unless `aim_within` is False (a
    repeated graph's interim plan keeps the least it can instead). None otherwise."""
    if budget is not None or within is None or not aim_within:
        return None
    return within.fraction


@dataclass(frozen=True)
class PlanRequest:
    """One graph to plan (memopt.planner.plan_joint), checked once when it is made.

    `joint` is AOTAutograd's joint graph, its first `num_fwd_outputs` outputs the
    forward's. `step` says what the step holds around it (StepContext). `label` names
    the graph in a BudgetError when the step has several. `lowest_peak`: aim at the
    graph's lowest-peak plan whatever the budget (a graph that must leave room for the
    graphs after it: memopt.graph_breaks); a BudgetError is raised only when the budget
    itself is missed, and only if `must_fit` (else the caller reads `plan.fits`).
    `step_baseline`: the baseline peak of the whole step a fraction budget is of, when
    the step has several graphs (else this graph's). `whole_step`: the graph is the whole
    forward, so what `step.outside` holds (DDP's gradient buckets, parameters it does not
    take) is held unchanged through its step, and the peak-directed path plans around it;
    only then does `options.drop_outputs` apply. `fraction_floor`: the fewest bytes a
    fraction budget allows, the most it gave a whole step of the same module that was
    accepted (memopt.plan_log.PlanLog.fraction_floor), so that a step needing fewer
    bytes than one already accepted is never refused.
    """

    joint: fx.GraphModule
    num_fwd_outputs: int
    budget: Budget | None
    primal_kinds: dict[str, str]
    options: Options = Options()
    grads: ExistingGrads | None = None
    outside_grad_bytes: int = 0
    outside: Outside = Outside()
    label: str = ""
    lowest_peak: bool = False
    step_baseline: int | None = None
    must_fit: bool = True
    whole_step: bool = False
    fraction_floor: int = 0
    #: the kernel workspaces measured so far by the module this graph belongs to
    workspaces: WorkspaceCache = field(default_factory=WorkspaceCache)
    #: bytes of the budget the plan leaves free beyond its headroom: what inductor's
    #: schedule of an earlier plan of this graph held above that plan (memopt.kernels)
    reserve_bytes: int = 0
    #: bytes of `outside.backward` held as room for the caller's loss before it was
    #: measured (memopt.caller_loss.assumed_through): planned for, but not part of the
    #: baseline a fraction budget is of (the same with and without a budget)
    room_bytes: int = 0
    #: the module's budget where this plan is made without one (a forward with graph
    #: breaks plans its first graphs before its step's baseline is known): what a
    #: measurement made while planning may allocate (`measuring_room`)
    measure_within: Budget | None = None
    #: where `measure_within` is a fraction, aim at it (`first_fraction`); False: plan as
    #: with no budget (a repeated graph's later runs in the first forward keep the least
    #: they can: memopt.compiled_graph.CompiledGraph._interim_twin)
    aim_within: bool = True
    step: StepContext = field(init=False)

    @property
    def first_fraction(self) -> float | None:
        """The fraction budget of a first plan made before the step's baseline is known
        (graph breaks: `measure_within`), else None."""
        return first_fraction(self.budget, self.measure_within, self.aim_within)

    def measuring_room(self) -> int | FractionRoom | None:
        """The bytes a measurement run while pricing an op family may allocate: a byte
        budget less the graph's inputs and parameters, live as the first call plans (a
        chain's chunks run on real tensors inside the user's first step: an nn.LSTM over
        12 tokens measured 1.68x its budget at that step, found from outside). A
        fraction's bytes are known only after the baseline: its room is the fraction of an
        estimate of it (passes.chain_costs.FractionRoom). None for no budget."""
        budget = self.budget or self.measure_within
        if budget is None:
            return None
        inputs = sum(t.untyped_storage().nbytes() for n in self.joint.graph.nodes
                     if n.op == "placeholder" and not n.name.startswith("tangents")
                     for t in value_tensors(fake_value(n)))
        if budget.nbytes is None and self.step_baseline is None:
            return FractionRoom(budget.fraction, inputs)
        # a fraction of the whole step's baseline (graph breaks) is known
        return max(0, budget.resolve(self.step_baseline or 0) - inputs)

    def __post_init__(self) -> None:
        if self.num_fwd_outputs < 0:
            raise ValueError(f"num_fwd_outputs must be >= 0, got {self.num_fwd_outputs}")
        if self.outside_grad_bytes < 0:
            raise ValueError(f"outside_grad_bytes must be >= 0, got {self.outside_grad_bytes}")
        if self.step_baseline is not None and self.step_baseline <= 0:
            raise ValueError(f"step_baseline must be positive, got {self.step_baseline}")
        if self.options.headroom is not None and not 0 <= self.options.headroom < 1:
            raise ValueError(f"headroom must be in [0, 1), got {self.options.headroom}")
        unknown = set(self.primal_kinds.values()) - {"parameter", "buffer", "input"}
        if unknown:
            raise ValueError(f"primal kinds must be parameter, buffer or input: {unknown}")
        object.__setattr__(self, "step", StepContext(
            self.primal_kinds, self.grads, self.outside_grad_bytes, self.outside,
            outputs_dropped=self.options.drop_outputs and self.whole_step,
            fused=self.options.fusible))
