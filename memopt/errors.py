"""memopt's typed errors. Callers match on the type and its fields, never on the message.

    MemoptError                      every error memopt raises on purpose
    ├── BudgetFormatError            (also a ValueError) a budget memopt cannot parse
    ├── BudgetError                  a budget below the smallest peak memopt can reach
    ├── InputError                   (also a ValueError) a model or inputs memopt cannot run
    ├── CaptureError                 the forward does not capture as one training graph
    ├── PassError                    a memopt pass failed
    ├── NoTimelineError              (also a ValueError) a plan with no timeline to plot
    └── OptionalDependencyError      (also an ImportError) an extra is not installed

Every one of the first five is raised before the user's model changes: no parameter, buffer,
`.grad` or train/eval flag is touched by a call that raises one.
"""

from __future__ import annotations

from memopt.allocator.units import format_bytes


class MemoptError(Exception):
    """Base class of every error memopt raises on purpose."""


class BudgetFormatError(MemoptError, ValueError):
    """A budget that is not one of the accepted forms (memopt.budget.ACCEPTED).

    Raised by `memopt.parse_budget`, so by `memopt.compile` and `memopt.plan` at once,
    before anything is captured. `value` is what was passed. A ValueError too, so code
    written against the plain ValueError memopt raised before keeps working.
    """

    def __init__(self, value: object, problem: str, accepted: str) -> None:
        self.value = value
        self._parts = (value, problem, accepted)
        super().__init__(f"budget={value!r} {problem}; expected {accepted}")

    def __reduce__(self) -> tuple:  # pickle (multiprocessing) rebuilds from the parts
        return type(self), self._parts


class BudgetError(MemoptError):
    """The requested budget is below the smallest peak memopt can reach for this step.

    Fields: `budget_bytes` (the budget, resolved to bytes); `minimum_bytes` (the smallest
    budget memopt accepts for this step, in bytes, the headroom every budget keeps free
    included: memopt.budget.HEADROOM); `baseline_bytes` (memopt's *predicted* peak of the
    same step with no recomputation and no in-place rewrites, what a fraction is of;
    not a measurement of eager PyTorch, whose peak can differ from it by 10-20%); and the
    two ways to pass a budget that fits: `smallest_byte_budget` (an int of bytes, equal to
    `minimum_bytes`) and `smallest_fraction` (a float budget resolving to at least those
    bytes, None when no fraction in (0, 1] fits). `step` names the kind of step that did not fit
    when it is not a first step: a step that finds `.grad` kept from earlier steps holds
    those gradients from its start, so it can need more than the first step did.
    `plan_seconds` and `capture_seconds`: how long the search that found the minimum ran,
    and the tracing before it (as MemoryPlan reports them). `room_free_minimum_bytes`: see
    `with_room_free` (None unless set there).
    """

    plan_seconds: float = 0.0
    capture_seconds: float = 0.0
    #: the refused plan measured a recurrent chain's chunks within the budget asked, so
    #: the minimum it names is planned again (memopt.planner.plan.plan_joint)
    measured_within: bool = False
    #: the smaller minimum a loss computed outside that keeps no input-sized result is
    #: accepted from (`with_room_free`); None where `minimum_bytes` holds no such room
    room_free_minimum_bytes: int | None = None

    def __init__(self, *, budget_bytes: int, minimum_bytes: int, baseline_bytes: int,
                 budget: str = "", headroom: float = 0.0,
                 byte_headroom: float | None = None, step: str = "", note: str = "") -> None:

        self.budget_bytes = budget_bytes
        self.minimum_bytes = minimum_bytes
        self.baseline_bytes = baseline_bytes
        self.headroom = headroom  # kept free of every budget (memopt.budget.HEADROOM)
        self._budget = budget
        self._byte_headroom = byte_headroom  # (unused: one headroom rule for both forms)
        self.step = step  # which kind of step did not fit ("" for a first step)
        self.note = note  # said after the message (`with_room_free`)
        # Both forms keep `headroom` free of the bytes they resolve to (memopt.planner): a
        # fraction fits where it resolves to minimum_bytes or more.
        self.smallest_byte_budget = minimum_bytes
        self.smallest_fraction = _smallest_fraction(minimum_bytes, baseline_bytes)
        asked = f"{budget} = " if budget and not budget.startswith(str(budget_bytes)) else ""
        kept = f", with {headroom:.1%} of it kept free as headroom" if headroom else ""
        how = f"budget={self.smallest_byte_budget} (bytes) or more"
        if self.smallest_fraction is not None:
            how += f", or a fraction budget from {self.smallest_fraction!r} to 1.0,"
        super().__init__(
            f"memory budget {asked}{format_bytes(budget_bytes)} ({budget_bytes} bytes) is below "
            f"the smallest budget memopt accepts for this training step{step}, "
            f"{format_bytes(minimum_bytes)} ({minimum_bytes} bytes{kept}). Pass {how} to "
            f"memopt.compile / memopt.plan, or reduce the batch size or sequence length. "
            f"For scale: memopt's predicted peak for this step with no recomputation and no "
            f"in-place rewrites is {format_bytes(baseline_bytes)} ({baseline_bytes} bytes); "
            f"that is memopt's prediction, not a measurement of eager PyTorch, whose peak "
            f"can differ from it by 10-20%.{note}"
        )

    def with_room_free(self, minimum_bytes: int) -> BudgetError:
        """This error for a first step whose minimum holds room for a loss computed
        outside the module that keeps an input-sized result through the backward
        (memopt.caller_loss.assumed_through), saying the smaller minimum without it,
        `room_free_minimum_bytes`, from which a loss that keeps none is accepted."""
        note = (f" That minimum holds room for a loss computed outside the module that "
                f"keeps a result of its input's size through the backward (F.mse_loss, "
                f"smooth_l1_loss, binary_cross_entropy); for a loss that keeps none "
                f"(cross-entropy) budgets from {minimum_bytes} bytes are accepted.")
        error = BudgetError(budget_bytes=self.budget_bytes, minimum_bytes=self.minimum_bytes,
                            baseline_bytes=self.baseline_bytes, budget=self._budget,
                            headroom=self.headroom, byte_headroom=self._byte_headroom,
                            step=self.step, note=note)
        error.plan_seconds, error.capture_seconds = self.plan_seconds, self.capture_seconds
        error.measured_within = self.measured_within
        error.room_free_minimum_bytes = minimum_bytes
        return error

    def with_minimum(self, minimum_bytes: int, baseline_bytes: int | None = None
                     ) -> BudgetError:
        """This error for the same budget and step, naming another minimum (a forward
        with graph breaks planned again at the one named first:
        memopt.graph_breaks.step_minimum) and, where given, the whole step's baseline in
        place of one graph's."""
        baseline = self.baseline_bytes if baseline_bytes is None else baseline_bytes
        error = BudgetError(budget_bytes=self.budget_bytes, minimum_bytes=minimum_bytes,
                            baseline_bytes=baseline, budget=self._budget,
                            headroom=self.headroom, byte_headroom=self._byte_headroom,
                            step=self.step, note=self.note)
        error.plan_seconds, error.capture_seconds = self.plan_seconds, self.capture_seconds
        error.room_free_minimum_bytes = self.room_free_minimum_bytes
        return error

    def __reduce__(self) -> tuple:  # keyword-only __init__: pickle (multiprocessing) needs this
        return _rebuild_budget_error, (self.budget_bytes, self.minimum_bytes, self.baseline_bytes,
                                       self._budget, self.headroom, self._byte_headroom,
                                       self.step, self.note, self.room_free_minimum_bytes)


def _rebuild_budget_error(budget_bytes: int, minimum_bytes: int, baseline_bytes: int,
                          budget: str, headroom: float, byte_headroom: float | None,
                          step: str, note: str = "", room_free: int | None = None
                          ) -> BudgetError:
    error = BudgetError(budget_bytes=budget_bytes, minimum_bytes=minimum_bytes,
                        baseline_bytes=baseline_bytes, budget=budget, headroom=headroom,
                        byte_headroom=byte_headroom, step=step, note=note)
    error.room_free_minimum_bytes = room_free
    return error


def _smallest_fraction(peak: int, baseline: int) -> float | None:
    """The smallest fraction f, in thousandths, with int(f * baseline) >= peak (how a
    fraction budget resolves: memopt.budget.Budget), or None above 1."""
    if baseline <= 0:
        return None
    thousandths = -(-peak * 1000 // baseline)
    while int(thousandths / 1000 * baseline) < peak:  # float rounding
        thousandths += 1
    return thousandths / 1000 if 0 < thousandths <= 1000 else None


class InputError(MemoptError, ValueError):
    """A model or inputs memopt cannot run, and what to change: weights on the meta device
    given to `memopt.compile`, inputs on another device or of another floating dtype than
    the parameters, or a step with nothing for `memopt.plan` to plan. A ValueError too.
    `cause` is the error the call failed with, where one did (its first line is quoted in
    the message; its traceback, deep inside torch, is not shown)."""

    def __init__(self, message: str, *, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.cause = cause


class PassError(MemoptError):
    """A memopt pass failed; names the pass and the passes that ran before it."""

    def __init__(self, stage: str, before: tuple[str, ...], cause: BaseException) -> None:
        self.stage = stage
        self.before = before
        self.cause = cause
        ran = ", ".join(before) if before else "none"
        super().__init__(
            f"memopt pass '{stage}' failed (passes run before it: {ran}): "
            f"{type(cause).__name__}: {cause}"
        )


class CaptureError(MemoptError):
    """The model could not be captured as one training graph."""


class NoTimelineError(MemoptError, ValueError):
    """`plot()` of a plan with no timeline: one written before memopt recorded live bytes
    over the step (MemoryPlan.timeline), or edited by hand. `graph` is the index of the
    graph whose plan lacks it (0 for a plan of one graph)."""

    def __init__(self, graph: int = 0) -> None:
        self.graph = graph
        super().__init__(
            f"this plan{f' (graph {graph + 1})' if graph else ''} has no timeline of live bytes "
            f"to plot: it was written by a memopt that did not record one. Plan the step again "
            f"(memopt.plan(model, *inputs, budget=...), or compiled.memopt_plan after a "
            f"training step) and save it with plan.to_json() or plan.save_report(dir).")

    def __reduce__(self) -> tuple:
        return type(self), (self.graph,)


class OptionalDependencyError(MemoptError, ImportError):
    """A feature needs a package memopt installs only with an extra: `package` (the module
    that failed to import) and `extra` (`pip install "memopt[<extra>]"`)."""

    def __init__(self, package: str, extra: str, feature: str) -> None:
        self.package = package
        self.extra = extra
        self._parts = (package, extra, feature)
        super().__init__(f'{feature} needs {package}, which is not installed: '
                         f'pip install "memopt[{extra}]"', name=package)

    def __reduce__(self) -> tuple:
        return type(self), self._parts


def opaque_backward_error(names: set[str], budget: object) -> InputError:
    """The step runs Python autograd.Functions eagerly whose backward no plan counts
    (memopt.eager_reads.opaque_function): a budget memopt cannot hold is refused, not
    accepted and missed."""
    listed = ", ".join(sorted(names))
    if any(name.endswith("BackwardHookFunction") for name in names):
        return InputError(
            f"a module backward hook (register_full_backward_hook or "
            f"register_full_backward_pre_hook) makes dynamo run that module eagerly between "
            f"memopt's graphs, whose backward no plan counts, so the budget {budget} cannot "
            f"be held. Compile with budget=None, or hook the gradient of the module's "
            f"output tensor instead (tensor.register_hook inside forward: memopt counts "
            f"that step).")
    return InputError(
        f"the forward ran {listed} eagerly between memopt's graphs: a torch.autograd.Function "
        f"dynamo did not trace (a graph break inside its forward), and what its backward "
        f"allocates is in no plan (HF Reformer's reversible layers run again there), so "
        f"the budget {budget} cannot be held. Compile with budget=None, or let dynamo "
        f"trace the Function (remove what breaks the graph inside it: "
        f"TORCH_LOGS=graph_breaks names it).")


def data_dependent_message(err: BaseException) -> str:
    """Why a graph whose sizes depend on tensor values cannot be planned, and what to do
    (a graph captured whole, by memopt.plan or ``fullgraph=True``, with a top-2 MoE's
    ``torch.where`` routing raised a PassError over torch's GuardOnDataDependentSymNode,
    found from outside)."""
    text = str(err).strip()
    first = text.splitlines()[0] if text else type(err).__name__
    return (
        f"memopt cannot plan a graph whose sizes depend on tensor values ({type(err).__name__}: "
        f"{first}): an op such as torch.nonzero, torch.where(mask), boolean-mask indexing "
        f"or .item() makes a size known only when the step runs, and a plan counts every "
        f"tensor's bytes before it. memopt.plan and memopt.compile(..., fullgraph=True) "
        f"need the whole forward as one graph of known sizes; memopt.compile without "
        f"fullgraph lets dynamo break the graph at such an op and plans the graphs around "
        f"it (keep the op out of a for loop, whose break runs the whole loop eagerly), or "
        f"route with fixed capacities (GShard's), whose sizes are known.")
