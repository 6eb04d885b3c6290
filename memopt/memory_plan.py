"""The memory plan: what a training step keeps, when each storage lives, where it sits.

A `MemoryPlan` is data (STYLE.md, section 4): a frozen pydantic model with a JSON
round trip (`plan.to_json()` / `MemoryPlan.from_json(text)`), built once by the
pipeline and read by people (`plan.summary()`) and tests.

A plan read back is validated, so a hand-edited one is refused with
`pydantic.ValidationError` (a ValueError) rather than half-read: every model forbids
unknown keys, every field without a default is required, byte counts, FLOP counts and
step counts are non-negative ints, and `from_json` is strict about types ("12" is not
12). Plans travel as JSON only; nothing here unpickles.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import (
    BaseModel,
    ConfigDict,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveInt,
    model_validator,
)

from .budget import format_bytes

_FROZEN = ConfigDict(frozen=True, extra="forbid")

#: Byte counts, and counts of FLOPs, steps and slots: never negative, also in a plan read
#: back from JSON.
Bytes = NonNegativeInt
Count = NonNegativeInt


class StorageRecord(BaseModel):
    """One storage (views share their base's) over the step schedule."""

    model_config = _FROZEN
    name: str                  # "fw.addmm": graph and node that produced it
    kind: str                  # parameter, buffer, input, activation, saved, output, tangent,
                               # backward, gradient
    nbytes: Bytes
    start: int                 # first live step (-1: before the step begins)
    end: int                   # last live step (inclusive)
    nodes: tuple[str, ...]     # every node whose value lives in it
    offset: Bytes | None = None  # arena offset from the allocator (None for resident storages)
    tag: int | None = None     # Chen's sharing tag


class SavedTensor(BaseModel):
    """A tensor the forward keeps for backward, and why (SavedReason)."""

    model_config = _FROZEN
    name: str
    op: str                    # "aten.addmm"
    module: str                # qualified name in the user's model ("" for the root)
    module_type: str           # "Linear"
    shape: tuple[int, ...]
    dtype: str
    nbytes: Bytes
    decision: str              # "saved" (later: "recomputed")
    reason: str


class InplaceRecord(BaseModel):
    model_config = _FROZEN
    graph: str                 # "fw" or "bw"
    node: str
    op: str
    inplace_op: str
    writes_into: str
    nbytes: Bytes


class SharingGroup(BaseModel):
    """Storages that reuse one block of memory, one after another (Chen's tag)."""

    model_config = _FROZEN
    tag: int
    nbytes: Bytes
    storages: tuple[str, ...]


class RecomputedNode(BaseModel):
    """A forward op dropped after forward and run again in backward (Chen Alg. 2, m(v)=1)."""

    model_config = _FROZEN
    name: str
    op: str
    module: str
    module_type: str
    shape: tuple[int, ...]
    nbytes: Bytes
    flops: Count                   # of all its recomputations
    times: PositiveInt = 1         # m(v): 2 under Sec. 4.4's recursion


class SearchCandidate(BaseModel):
    """One budget B the Alg. 3 search tried, and the simulator's verdict on its plan."""

    model_config = _FROZEN
    level: int = 1                 # 1: Alg. 3, m(v) <= 1; 2: inside level 1's segments
                                   # (Sec. 4.4); 0: Sec. 4.2, every cheap op dropped (B unused);
                                   # 3: the exact MILP's plan (solver="milp"; B: its budget);
                                   # 4: the peak-directed path (B: its step; planner.chen.peak_path)
    segment_budget_bytes: Bytes    # Alg. 3's B
    predicted_peak_bytes: Bytes    # the simulator's peak for the plan Alg. 3 made with B
    recompute_flops: Count         # the forward work it recomputes
    fits: bool                     # peak within the budget (less the headroom)


class ChainRecord(BaseModel):
    """A recurrent chain (nn.LSTM / nn.GRU / nn.RNN, or a marked cell loop) and the
    Gruslys et al. 2016 policy memopt chose for it."""

    model_config = _FROZEN
    module: str
    module_type: str
    steps: Count                   # T: time steps of the sequence
    chunk: Count                   # time steps per chunk (one call of the step)
    t: Count                       # chunks: the chain's length
    m: Count                       # memory units: HSM's hidden-state slots (h_0 included),
                                   # ISM's internal-state slots (the core's included), MSM's
                                   # hidden-state units
    strategy: str                  # "hsm" (Sec. 3.1), "ism" (Sec. 3.2) or "msm" (Sec. 3.3)
    alpha: Count | None = None     # MSM: a stored internal state in hidden-state units
    beta: Count | None = None      # MSM: one whose input state is stored already (eq. 10)
    cost: Count                    # C(t, m): chunk forwards, the first pass included
    recompute_steps: Count         # time steps run again in backward
    estimated_seconds: NonNegativeFloat  # the chain's forward + backward, at measured chunk costs
    recompute_flops: Count
    hidden_bytes: Bytes            # one hidden state
    internal_bytes: Bytes          # one chunk's internal state (its backward graph)
    held_bytes: Bytes              # kept from forward to backward
    forward_workspace_bytes: Bytes  # allocated by the forward op while it runs
    workspace_bytes: Bytes         # allocated by the backward op while it runs
    reason: str


class HeadRecord(BaseModel):
    """A language model's head and loss (a projection to the vocabulary and its
    cross-entropy) and the chunk of tokens memopt runs it in (memopt.lm_head): one chunk
    keeps eager's log-probabilities; more recompute each chunk's logits in backward."""

    model_config = _FROZEN
    module: str
    tokens: Count                  # rows of the logits
    vocab: Count
    chunk: Count                   # tokens computed at once
    chunks: Count
    held_bytes: Bytes              # kept from forward to backward (the log-probabilities)
    forward_workspace_bytes: Bytes  # allocated by the forward op while it runs
    workspace_bytes: Bytes         # allocated by the backward op while it runs
    recompute_flops: Count         # the projection again in backward, when chunked
    reason: str
    #: the whole logits are formed in the forward for a reader besides the loss (a model
    #: returning them); False: never formed (memopt.compile's skip_logits, or no reader)
    returns_logits: bool = False


class ReversibleRecord(BaseModel):
    """A reversible RNN stack (memopt.nn.RevGRU / RevLSTM, MacKay et al. 2018): its
    backward reconstructs the hidden states, so it takes no hidden-state slots; it holds
    its information buffers (counted at their bound) and its final state."""

    model_config = _FROZEN
    module: str
    module_type: str
    steps: Count                   # T: time steps of the sequence
    layers: Count
    max_forget_bits: int | None    # the cap on bits forgotten per unit per step (Sec. 5.3)
    stored_state_bytes: Bytes      # the hidden states plain BPTT would store (not stored)
    buffer_bound_bytes: Bytes      # the information buffers, at most (Alg. 1, Sec. 5.1)
    held_bytes: Bytes              # kept from forward to backward: buffers + final state
    forward_workspace_bytes: Bytes  # allocated by the forward op while it runs
    workspace_bytes: Bytes         # allocated by the backward op while it runs
    dropout: float = 0.0           # between layers in this graph; masks rebuilt, not held


class Timeline(BaseModel):
    """Bytes live over one training step as memopt's liveness counts them for the
    predicted peak (passes.liveness; passes.simulate for the baseline), by kind
    (memopt.allocator.timeline.KINDS: parameters, inputs, gradients, chain_states, saved,
    recomputed, temporaries, workspace, other_graphs). x is the step schedule: every
    forward op, then every backward op. At most allocator.timeline.MAX_POINTS points, each
    the step of its bucket of consecutive steps where the total is highest, so the
    timeline's peak is the plan's."""

    model_config = _FROZEN
    num_steps: Count
    num_forward_steps: Count
    steps: tuple[Count, ...]               # the schedule step of each point, ascending
    kinds: tuple[str, ...]                 # the kinds present, bottom to top
    live: tuple[tuple[Bytes, ...], ...]    # live[k][p]: bytes of kinds[k] at steps[p]
    peak_step: str = ""                    # the op where the peak is first reached ("bw.mm")
    peak_module: str = ""                  # the user's module it came from ("fc1 (Linear)")

    @model_validator(mode="after")
    def _columns_match(self) -> Timeline:
        if len(self.live) != len(self.kinds) or any(len(c) != len(self.steps)
                                                    for c in self.live):
            raise ValueError(f"a timeline needs one column of {len(self.steps)} points per "
                             f"kind ({len(self.kinds)} kinds, {len(self.live)} columns)")
        return self

    @property
    def totals(self) -> tuple[int, ...]:
        """Bytes live at each point, every kind together."""
        return tuple(sum(column) for column in zip(*self.live)) if self.live else \
            (0,) * len(self.steps)

    @property
    def peak_bytes(self) -> int:
        return max(self.totals, default=0)


class GraphBreak(BaseModel):
    """Where dynamo ended a graph before the forward ended, and why (its words)."""

    model_config = _FROZEN
    reason: str
    filename: str
    lineno: int

    def where(self) -> str:
        first = self.reason.strip().splitlines()[0] if self.reason.strip() else "graph break"
        return f"{self.filename}:{self.lineno}: {first}"


class FsdpRecord(BaseModel):
    """The FSDP2 unit (`fully_shard(memopt.compile(model))`) around a compiled step, per rank:
    `world_size` ranks each keep `sharded_bytes` of parameter shards (and `sharded_grad_bytes` of
    gradient shards kept from earlier steps) for the whole step, on top of the `unsharded_bytes` of
    parameters FSDP all-gathers before the forward and frees after the backward, and keep the flat
    all-gather output (`kept_all_gather_bytes`) at least until the forward ends (sometimes longer:
    memopt.fsdp.FsdpUnit). The plan counts the shards and that buffer as held outside its graph for
    the whole step; the all-gathered parameters are the graph's own parameters. Values as the step
    that made the plan began. FSDP's collectives run outside the graph: the all-gather before the
    forward holds about `all_gather_bytes` (shards, the gathered flat buffer and the parameters it
    is copied into), the reduce-scatter after the backward about `reduce_scatter_bytes` (shards,
    gradients, the flat buffer they are copied into and its output shard). memopt reports these two;
    of the reduce-scatter it plans the buffers allocated as the backward ends
    (`outside_after_backward_bytes`)."""

    model_config = _FROZEN
    world_size: Count
    sharded_bytes: Bytes
    sharded_grad_bytes: Bytes = 0
    unsharded_bytes: Bytes
    kept_all_gather_bytes: Bytes = 0
    all_gather_bytes: Bytes
    reduce_scatter_bytes: Bytes

    def summary_line(self) -> str:
        b = format_bytes
        grads = f", + {b(self.sharded_grad_bytes)} of .grad shards" \
            if self.sharded_grad_bytes else ""
        return (f"  FSDP2 shards     {b(self.sharded_bytes):>12}   (1/{self.world_size} of "
                f"{b(self.unsharded_bytes)} of parameters{grads}, held outside the graph, and "
                f"{b(self.kept_all_gather_bytes)} of all-gather output; "
                f"the collectives around it hold about: all-gather {b(self.all_gather_bytes)} "
                f"(not planned), reduce-scatter {b(self.reduce_scatter_bytes)} (its buffers "
                f"planned: see 'after backward'))")


class OffloadRecord(BaseModel):
    """A saved value the plan copies to host memory (memopt.offload): the steps its device
    bytes are freed after, allocated again before and first read at, and its copies'
    times in seconds from the step's start (the link's schedule, allocator.offload)."""

    model_config = _FROZEN
    name: str
    nbytes: Bytes
    freed_after: str
    prefetch_at: str
    first_read: str
    freed_step: Count      # the steps above, as indices of the step's ops (the picture's x)
    prefetch_step: Count
    d2h_start_s: NonNegativeFloat
    d2h_end_s: NonNegativeFloat
    h2d_start_s: NonNegativeFloat
    h2d_end_s: NonNegativeFloat
    wait_s: NonNegativeFloat   # the backward's wait for it at its first read


class LinkRecord(BaseModel):
    """The host link the plan's copies run on, and the step's predicted time with them."""

    model_config = _FROZEN
    d2h_bytes_per_s: NonNegativeFloat
    h2d_bytes_per_s: NonNegativeFloat
    compute_s: NonNegativeFloat   # the ops' own seconds (memopt.passes.offload's roofline)
    wait_s: NonNegativeFloat      # what the backward waits for copies back
    busy_s: NonNegativeFloat      # seconds the link copies
    occupancy: NonNegativeFloat   # busy_s over the step's predicted seconds


class MemoryPlan(BaseModel):
    """The plan of one captured training graph (forward + backward)."""

    model_config = _FROZEN
    device: str
    budget_bytes: Bytes | None
    #: memopt's passes off: same graphs, no in-place, no recompute (what a fraction budget
    #: is of: without the room a first plan holds for the caller's loss, caller_loss)
    baseline_peak_bytes: Bytes
    predicted_peak_bytes: Bytes    # simulated peak of the step as memopt runs it
    lower_bound_bytes: Bytes       # max over the schedule of live bytes (no allocator does better)
    arena_bytes: Bytes             # resident bytes + the offset assignment's arena
    arena_layout: str = "greedy by size"  # or "tag blocks" (past the planner's greedy limit)
    sharing_bytes: Bytes           # resident bytes + Chen's tag-recycling total
    no_reuse_bytes: Bytes          # every storage its own memory (Chen's "no optimization")
    resident_bytes: Bytes          # parameters, buffers, inputs and existing .grad tensors
    peak_step: str
    num_forward_steps: Count
    num_backward_steps: Count
    storages: tuple[StorageRecord, ...]
    saved: tuple[SavedTensor, ...]
    inplace: tuple[InplaceRecord, ...]
    sharing: tuple[SharingGroup, ...]
    plan_seconds: NonNegativeFloat     # memopt's own passes (partition_fn)
    capture_seconds: NonNegativeFloat = 0.0  # dynamo and AOTAutograd tracing before them
    recomputed: tuple[RecomputedNode, ...] = ()
    forward_flops: Count = 0           # one forward pass, by the same cost model
    recompute_flops: Count = 0         # extra forward work the recomputation adds
    search: tuple[SearchCandidate, ...] = ()
    headroom_bytes: Bytes = 0          # of the budget, kept free: the peak fits budget - this
    chains: tuple[ChainRecord, ...] = ()  # recurrent chains and their policies
    heads: tuple[HeadRecord, ...] = ()    # language-model heads and their chunks
    reversible: tuple[ReversibleRecord, ...] = ()  # reversible RNN stacks
    #: The step planned with parameters' .grad already allocated (gradients kept between
    #: steps, gradient accumulation): their bytes, resident for the whole step, and how many
    #: new gradients the backward adds into them in place as each completes (memopt.grads).
    existing_grad_bytes: Bytes = 0
    grads_added_in_place: Count = 0
    #: Graph breaks: this graph's position in the forward (0 for the first or only one),
    #: the break that ends it (None: the forward, or its frame, returns there), and what
    #: the rest of the step holds while its forward and its backward run, which its
    #: predicted peak includes (memopt.steps).
    graph_index: Count = 0
    graph_break: GraphBreak | None = None
    outside_forward_bytes: Bytes = 0
    outside_backward_bytes: Bytes = 0
    #: allocated outside the graph as its backward ends, on top of what is live then
    #: (FSDP2's reduce-scatter of the gradients, memopt.fsdp)
    outside_after_backward_bytes: Bytes = 0
    #: of those, the backward of the eager code that ran before this graph, estimated as
    #: the forward ended or measured at an earlier step (memopt.eager_tail)
    eager_tail_bytes: Bytes = 0
    #: held, on top of the rest, while eager code after this graph runs its backward, just
    #: before this graph's (steps.ForwardTrace.eager_backward, eager_head)
    outside_before_backward_bytes: Bytes = 0
    #: of those, what the caller's loss holds (its saved tensors and its gradients'
    #: working set): assumed from the outputs until measured at an earlier step, then
    #: what was measured (memopt.caller_loss)
    caller_loss_bytes: Bytes = 0
    #: what the caller's loss was measured to hold (None: not yet; caller_loss_bytes is
    #: then assumed from the outputs, memopt.caller_loss.assumed)
    caller_loss_measured_bytes: Bytes | None = None
    #: this graph's own runs before its last one in the forward (a repeated block,
    #: memopt.blocks), each holding `held_bytes`, which its predicted peak counts as held
    #: outside it (beside the outside bytes above)
    own_runs_before: Count = 0
    #: a repeated block whose later runs keep more (memopt.run_plans): the first of the
    #: graph's runs in a forward that this plan serves (0: from the first); the runs
    #: before it run the graph's other plan
    first_run: Count = 0
    baseline_saved_bytes: Bytes = 0    # what the baseline (no memopt passes) keeps for backward
    #: Live bytes over the step by kind, as memopt runs it and in the baseline; None in a
    #: plan written before memopt recorded them (plot() then asks to re-plan).
    timeline: Timeline | None = None
    baseline_timeline: Timeline | None = None
    #: Under DistributedDataParallel (memopt.ddp): the bytes of DDP's gradient buckets on
    #: this rank, and the part of them the predicted peak counts as held for the whole step
    #: (in the outside bytes): all of them, less the kept .grad tensors that are views of
    #: the buckets (gradient_as_bucket_view=True), counted as existing .grad instead.
    ddp_bucket_bytes: Bytes = 0
    ddp_bucket_counted_bytes: Bytes = 0
    fsdp: FsdpRecord | None = None     # the FSDP2 unit around this step, if any
    #: The optimizer the budget counts (`optimizer=`, memopt.optimizer): its class, the
    #: state it holds through the step (in the outside bytes) and what its step()
    #: allocates above that as the backward ends (in `outside_after_backward_bytes`).
    #: "" and 0: no optimizer given, its state and step are outside the budget.
    optimizer: str = ""
    optimizer_state_bytes: Bytes = 0
    optimizer_step_bytes: Bytes = 0
    #: `optimizer.step()` runs in chunks of at most this many bytes of parameters per
    #: group, where the budget needs it (memopt.optimizer_step.ChunkedStep; 0: whole)
    optimizer_step_chunk_bytes: Bytes = 0
    #: How many parameters the optimizer steps inside the backward, each as its gradient
    #: completes, freeing the gradient there (memopt.stepper; 0: none, optimizer.step()
    #: steps them after the backward)
    steps_in_backward: Count = 0
    #: what runs the planned graphs (memopt.kernels): "aten" or "inductor", and why a
    #: graph asked for inductor runs aten
    kernels: str = "aten"
    #: `reserved=True` under a budget: the plan fits the budget in the bytes CUDA's caching
    #: allocator would reserve for the step (`cuda_reserved_bytes`), not only allocated
    reserved_bounded: bool = False
    kernels_note: str = ""
    #: kernels="inductor": how many bytes inductor's schedule of the graphs raises the
    #: step's peak above memopt's model of its fused kernels (memopt.kernels
    #: .schedule_excess; 0: none); the predicted peak includes them
    schedule_excess_bytes: Bytes = 0
    #: kernels="inductor": inductor's own estimate of the forward's and the backward's
    #: peak as memopt's fusion model predicts it on memopt's order (passes.fusion), which
    #: memopt.kernels compares with inductor's estimate of its own order
    fusion_estimate_bytes: tuple[Bytes, Bytes] = (0, 0)
    #: saved values copied to host memory between their forward and backward reads
    #: (memopt.planner.offload_choice), and the link they use; () and None: none
    offloaded: tuple[OffloadRecord, ...] = ()
    link: LinkRecord | None = None

    def to_json(self, *, indent: int | None = None) -> str:
        """The plan as JSON text; `MemoryPlan.from_json` reads it back equal."""
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, text: str | bytes) -> "MemoryPlan":
        """A plan from `to_json`'s text, validated strictly.

        Raises pydantic.ValidationError (a ValueError) for a hand-edited plan that
        does not hold: a missing field, an unknown key, a value of the wrong type (in
        strict mode "12" is not 12 and 1.0 is not 1), a negative byte count.
        """
        return cls.model_validate_json(text, strict=True)

    @property
    def saved_bytes(self) -> int:
        return sum(s.nbytes for s in self.saved if s.decision == "saved")

    def plot(self, path: str | Path) -> Path:
        """Draw the bytes live over the step, as memopt runs it beside the baseline,
        stacked by kind, with the budget and the lower bound, to an image at `path`
        (its suffix picks the format: .png, .svg, .pdf). Needs matplotlib
        (`pip install "memopt[plot]"`); see memopt.plot."""
        from .plot import plot  # matplotlib loads only here

        return plot(self, path)

    def save_report(self, directory: str | Path) -> tuple[Path, Path, Path]:
        """Write memory.png (`plot`), summary.txt (`summary()`) and plan.json (`to_json`)
        into `directory` (created if missing); return their paths."""
        from .plot import save_report

        return save_report(self, directory)

    def cuda_reserved_bytes(self) -> int:
        """The segments PyTorch's CUDA caching allocator would reserve for this plan's step
        as a loop repeats it (memopt.allocator.caching: the allocator's policy, default
        settings, replayed on the plan's storages). A budget counts allocated bytes, but a
        GPU runs out of reserved ones. On an H200 this came within -12% to +12% of the
        measured reserved peak, on 11 plans (docs/benchmarks/cuda.md#reserved-memory)."""
        from .allocator.caching import reserved_for

        return reserved_for((s.nbytes, s.start, s.end) for s in self.storages)

    @property
    def held_bytes(self) -> int:
        """Bytes this graph holds from its forward to its backward besides its outputs
        (its saved storages that are not outputs): what the graphs after it see held."""
        return sum(s.nbytes for s in self.storages if s.kind == "saved")

    @property
    def fits(self) -> bool:
        """The predicted peak is within the budget less its headroom (or no budget)."""
        return self.budget_bytes is None or \
            self.predicted_peak_bytes <= self.budget_bytes - self.headroom_bytes

    def summary(self, max_rows: int = 20) -> str:
        """A readable report: the headline numbers, then the largest saved tensors
        (memopt.plan_summary)."""
        from .plan_summary import plan_summary  # noqa: PLC0415 (it reads this module)

        return plan_summary(self, max_rows)


class StepPlan(BaseModel):
    """The plan of a training step whose forward dynamo split into several graphs (graph
    breaks): one MemoryPlan per graph, in the order the last forward first ran them, and
    `runs`, the order it ran them in (a graph inside a loop runs more than once). Each
    graph's predicted peak counts what the rest of the step holds around it, so the
    step's predicted peak is the largest of them."""

    model_config = _FROZEN
    graphs: tuple[MemoryPlan, ...]
    runs: tuple[Count, ...]

    @property
    def predicted_peak_bytes(self) -> int:
        return max(g.predicted_peak_bytes for g in self.graphs)

    @property
    def budget_bytes(self) -> int | None:
        """The step's budget in bytes. A byte budget is every graph's; a fraction budget
        resolves per graph (memopt.planner: the fraction of its own part, above what the
        other graphs hold), and the step's is the largest."""
        budgets = [g.budget_bytes for g in self.graphs if g.budget_bytes is not None]
        return max(budgets) if budgets else None

    @property
    def baseline_peak_bytes(self) -> int:
        return max(g.baseline_peak_bytes for g in self.graphs)

    @property
    def headroom_bytes(self) -> int:
        return max(g.headroom_bytes for g in self.graphs)

    @property
    def breaks(self) -> tuple[GraphBreak, ...]:
        return tuple(g.graph_break for g in self.graphs if g.graph_break is not None)

    # What a MemoryPlan says of one graph, for the whole step, so that code reading a
    # plan works whether or not dynamo broke the forward (a transformers version's
    # logging call can add a break on one machine and not another).
    @property
    def forward_flops(self) -> int:
        """One forward's work: each graph's, once per run."""
        return sum(self.graphs[i].forward_flops for i in self.runs)

    @property
    def recompute_flops(self) -> int:
        """The step's recomputed forward work: each graph's, once per run."""
        return sum(self.graphs[i].recompute_flops for i in self.runs)

    @property
    def heads(self) -> tuple[HeadRecord, ...]:
        """Every graph's language-model heads."""
        return tuple(h for g in self.graphs for h in g.heads)

    @property
    def kernels(self) -> str:
        """What runs the step's graphs: "inductor" or "aten" where every graph runs
        those kernels, else "aten and inductor" (each graph's `kernels_note` says why it
        runs op by op)."""
        kinds = {g.kernels for g in self.graphs}
        return kinds.pop() if len(kinds) == 1 else "aten and inductor"

    # per-step bytes each graph counts alike (DDP's buckets, the optimizer's state)
    ddp_bucket_bytes = property(lambda s: max(g.ddp_bucket_bytes for g in s.graphs))
    ddp_bucket_counted_bytes = property(lambda s: max(g.ddp_bucket_counted_bytes for g in s.graphs))
    optimizer_state_bytes = property(lambda s: max(g.optimizer_state_bytes for g in s.graphs))

    @property
    def peak_graph(self) -> int:
        """Index into `graphs` of the graph whose plan sets the step's peak."""
        return max(range(len(self.graphs)), key=lambda i: self.graphs[i].predicted_peak_bytes)

    def to_json(self, *, indent: int | None = None) -> str:
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, text: str | bytes) -> "StepPlan":
        return cls.model_validate_json(text, strict=True)

    def plot(self, path: str | Path) -> Path:
        """MemoryPlan.plot for each graph, one row of panels per graph, sharing the y axis
        (each graph's timeline counts what the rest of the step holds around it)."""
        from .plot import plot

        return plot(self, path)

    def save_report(self, directory: str | Path) -> tuple[Path, Path, Path]:
        """MemoryPlan.save_report for the whole step."""
        from .plot import save_report

        return save_report(self, directory)

    def _second(self, i: int) -> str:
        """For a repeated block's second plan (memopt.run_plans): which graph it is."""
        g = self.graphs[i]
        if not g.first_run:
            return ""
        first = next(j for j, h in enumerate(self.graphs)
                     if h.graph_index == g.graph_index and not h.first_run)
        return (f" (graph {first + 1} again, from its run {g.first_run + 1} on: a second "
                f"plan that keeps more, memopt.run_plans)")

    def summary(self, max_rows: int = 10) -> str:
        b = format_bytes
        budget = b(self.budget_bytes) if self.budget_bytes is not None else "none"
        lines = [f"memopt step plan: {len(self.graphs)} graphs (graph breaks), "
                 f"{len(self.runs)} graph runs per forward",
                 f"  predicted peak   {b(self.predicted_peak_bytes):>12}   (budget {budget}; "
                 f"set by graph {self.peak_graph + 1})"]
        for i, g in enumerate(self.graphs):
            where = g.graph_break.where() if g.graph_break is not None else "returns"
            runs = self.runs.count(i)
            lines.append(f"  graph {i + 1}: peak {b(g.predicted_peak_bytes)}, "
                         f"{g.num_forward_steps} + {g.num_backward_steps} ops, "
                         f"{runs} run{'s' if runs > 1 else ''}, {where}{self._second(i)}")
        for i, g in enumerate(self.graphs):
            lines.append("")
            lines.append(f"graph {i + 1}:")
            lines.extend("  " + ln for ln in g.summary(max_rows).splitlines())
        return "\n".join(lines)
