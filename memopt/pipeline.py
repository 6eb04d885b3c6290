"""memopt's pass pipeline over one joint forward+backward graph.

    joint graph -> partition -> liveness (baseline) -> in-place -> liveness
                -> allocator (peak, tag sharing, offsets) -> MemoryPlan

Each stage is a pass in `memopt.passes` or a solver in `memopt.allocator`; this
module only runs them in order and assembles the plan. Errors name the stage.
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import math
import operator
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import fx
from tqdm.auto import tqdm

from memopt.allocator import Interval, assign_offsets, no_sharing_bytes, peak_live_bytes
from memopt.allocator import (SegmentPlan, plan_segments, search_budgets, share_by_tags,
                              split_candidates)
from memopt.passes import chains as chain_pass
from memopt.passes.embedding_grads import add_embedding_grads_in_place
from memopt.passes import heads as head_pass
from memopt.passes import reversible as reversible_pass
from memopt.passes.gradients import accumulate_in_place, save_parameters
from memopt.passes.inplace import InplaceResult, reinplace
from memopt.passes.liveness import StepSchedule, analyze_liveness, timeline_kinds
from memopt.passes.meta import op_name, source_module, tensor_value, user_module
from memopt.passes.partition import find_cut, forward_region, partition, read_concat_views
from memopt.passes.meta import accumulates_into, mirror_level, recomputed_from
from memopt.passes.workspace import measure_workspaces
from memopt.passes.recompute import (add_mirror_nodes, last_uses, mirrorable, node_flops,
                                     recompute_sources, storage_sizes)
from memopt.passes.simulate import Simulated, StepModel
from memopt.passes.oracle import recompute_problem
from memopt.allocator.milp import solve
from memopt.allocator.timeline import downsample, live_by_kind
from memopt.passes._torch_compat import dce_impure_random

from .budget import Budget, format_bytes
from .steps import Outside
from .errors import BudgetError, PassError
from .memory_plan import (ChainRecord, HeadRecord, InplaceRecord, MemoryPlan, RecomputedNode,
                          ReversibleRecord, SavedTensor, SearchCandidate, SharingGroup,
                          StorageRecord, Timeline)

log = logging.getLogger("memopt")

RESIDENT_KINDS = ("parameter", "buffer", "input", "existing_grad")


@dataclass(frozen=True)
class ExistingGrads:
    """The step in which parameters' `.grad` tensors already exist (gradients kept between
    steps, gradient accumulation: memopt.grads). `nbytes` maps each parameter primal to its
    `.grad`'s bytes, resident for the whole step; `add` is the runtime's
    `GradSink.add`, which the backward calls with each new gradient as soon as it is
    complete (passes.gradients)."""

    nbytes: dict[str, int]
    add: Callable[[str, Any], Any]


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

    def liveness(self, fw: fx.GraphModule, bw: fx.GraphModule, saved: frozenset[str],
                 num_user_outputs: int) -> StepSchedule:
        return analyze_liveness(
            fw, bw, saved=saved, num_user_outputs=num_user_outputs,
            primal_kinds=self.primal_kinds,
            existing_grads=self.grads.nbytes if self.grads is not None else None,
            outside_grad_bytes=self.outside_grad_bytes,
            outside_bytes=self.outside.bytes(), outputs_dropped=self.outputs_dropped)


@dataclass(frozen=True)
class Options:
    """Pipeline switches (the defaults are what `memopt.compile` runs)."""

    inplace: bool = True
    #: Forward node names to recompute in backward (m(v) = 1), or "all" for every
    #: mirrorable node; None: decided by the budget search. An expert override.
    mirror: frozenset[str] | str | None = None
    #: Fraction of the budget kept free for what the plan does not model (library
    #: workspaces such as convolution scratch space, allocator rounding beyond 512 B,
    #: fragmentation): the plan's peak must fit in budget * (1 - headroom), for byte
    #: budgets (a fraction is of memopt's own predicted baseline). Calibrated
    #: on CPU: the largest measured excess over the prediction was 5.3% (ResNet-50,
    #: BatchNorm recomputed, convolutions kept); 3% let a 305 MiB budget measure 309.
    headroom: float = 0.06
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


#: Seconds a plan runs before its progress bar shows.
PROGRESS_DELAY = 2.0


def allocation_granularity(device: str) -> int:
    """Bytes the device allocator rounds each block to (CUDA caching allocator: 512)."""
    return 512 if device.startswith("cuda") else 1


def _intervals(schedule: StepSchedule, granularity: int) -> list[Interval]:
    g = granularity
    return [Interval(size=-(-s.nbytes // g) * g, start=s.start, end=s.end)
            for s in schedule.storages]


def _peak_bytes(schedule: StepSchedule, granularity: int) -> int:
    return peak_live_bytes(_intervals(schedule, granularity), len(schedule.steps)).peak_bytes


@contextmanager
def _stage(name: str, done: list[str]) -> Iterator[None]:
    """One pipeline stage: a failure is re-raised as PassError naming it and the stages before."""
    try:
        yield
    except (BudgetError, PassError):
        raise
    except Exception as exc:
        raise PassError(name, tuple(done), exc) from exc
    done.append(name)


@dataclass(frozen=True)
class _Built:
    """One candidate step: its graphs, their schedule and its simulated peak."""

    graph: fx.GraphModule  # the joint graph partitioned (with twins: passes.twins)
    fw: fx.GraphModule
    bw: fx.GraphModule
    saved_names: frozenset[str]
    recomputed: frozenset[str]
    rewrites: tuple[InplaceRecord, ...]
    schedule: StepSchedule
    peak_bytes: int


@dataclass(frozen=True)
class Mirror:
    """Mirror counts (Chen Alg. 2): m(v) >= 1 for the nodes in `names`, m(v) = 2 for
    those also in `twice` (Sec. 4.4's recursion), m(v) = 0 for every other node."""

    names: frozenset[str] = frozenset()
    twice: frozenset[str] = frozenset()


def _build(joint: fx.GraphModule, num_fwd_outputs: int, mirror: Mirror, *,
           inplace: bool, step: StepContext, done: list[str]) -> _Built:
    """Partition (recomputing `mirror`), place recomputation, add gradients into existing
    `.grad` tensors, rewrite in place, analyze."""
    with _stage("partition", done):
        if mirror.names:
            joint = add_mirror_nodes(joint, num_fwd_outputs, mirror.names,
                                     _mutable_inputs(step.primal_kinds), twice=mirror.twice)
        cut = find_cut(joint, num_fwd_outputs)
        if step.grads is not None:  # the backward adds into each parameter's .grad
            with _stage("gradient accumulation", done):
                cut = save_parameters(cut, frozenset(step.grads.nbytes))
                joint, _ = accumulate_in_place(joint, num_fwd_outputs,
                                               frozenset(step.grads.nbytes), step.grads.add)
        fw, bw = partition(joint, num_fwd_outputs, cut)
        recomputed = frozenset(n.name for n in bw.graph.nodes if recomputed_from(n))
        # the extraction drops saved values the backward never reads
        saved_names = frozenset(cut.saved) & {n.name for n in bw.graph.find_nodes(op="placeholder")}
    rewrites: list[InplaceRecord] = []
    if inplace:
        with _stage("in-place", done):
            for graph_name, gm in (("fw", fw), ("bw", bw)):
                result: InplaceResult = reinplace(gm)
                rewrites += [InplaceRecord(graph=graph_name, **r.__dict__) for r in result.rewrites]
    with _stage("kernel workspaces", done):  # measured once per op and shape, then cached
        measure_workspaces([fw, bw])
    with _stage("liveness", done):
        schedule = step.liveness(fw, bw, saved_names, num_fwd_outputs)
    peak = _peak_bytes(schedule, allocation_granularity(_device_of(fw)))
    return _Built(joint, fw, bw, saved_names, recomputed, tuple(rewrites), schedule, peak)


def _mutable_inputs(primal_kinds: dict[str, str]) -> frozenset[str]:
    """Primals the step may mutate (buffers: BatchNorm statistics, counters)."""
    return frozenset(name for name, kind in primal_kinds.items() if kind == "buffer")


def _forward_flops(joint: fx.GraphModule, num_fwd_outputs: int) -> int:
    """The cost of one forward pass, by the FLOP model of the recomputed ops."""
    return sum(node_flops(n) for n in forward_region(joint, num_fwd_outputs)
               if n.op == "call_function")


def _recomputed_nodes(built: _Built) -> tuple[RecomputedNode, ...]:
    """One record per recomputed forward value: the cost of all its mirror nodes, and
    how many times it is recomputed."""
    by_name = {n.name: n for n in built.graph.graph.nodes}
    flops: dict[str, int] = {}
    levels: dict[str, set[str | None]] = {}
    for name in built.recomputed:
        original = recomputed_from(by_name[name])
        flops[original] = flops.get(original, 0) + node_flops(by_name[name])
        levels.setdefault(original, set()).add(mirror_level(by_name[name]))
    records = []
    for node in built.graph.graph.nodes:
        val = tensor_value(node)
        if node.name in flops and val is not None:
            module, module_type = user_module(node)
            records.append(RecomputedNode(
                name=node.name, op=op_name(node), module=module, module_type=module_type,
                shape=tuple(int(d) for d in val.shape), nbytes=val.untyped_storage().nbytes(),
                flops=flops[node.name], times=len(levels[node.name]),
            ))
    return tuple(records)


def _choose_mirror(joint: fx.GraphModule, num_fwd_outputs: int, budget_bytes: int,
                   primal_kinds: dict[str, str], simulate: Callable[[Mirror], Simulated],
                   path: bool = True) -> tuple[Mirror, tuple[SearchCandidate, ...]]:
    """Chen et al. 2016, Alg. 3 with the Appendix A grid over B, each candidate scored
    by the step simulator (passes.simulate: the exact build's schedule, from arrays):
    the feasible plan (peak <= budget) with the least recomputed FLOPs, else the plan
    with the lowest peak.

    Beside Alg. 3's plans, Sec. 4.2's: every cheap op dropped, every costly one kept
    (little recomputation, for budgets just under the peak); and, beyond the paper,
    `peak_path`'s plans (`path`), which drop only the values that set the peak (the
    exact oracle, memopt.oracle, found Alg. 3 recomputing up to 200x the optimum's
    FLOPs there). When no plan fits, Sec. 4.4's recursion: inside the segments of the
    lowest-peak plan of Alg. 3 and Sec. 4.2, Alg. 3 and the same grid again pick
    sub-segment boundaries (m(v) = 1) and nodes recomputed twice (m(v) = 2). The plans
    tried at each level do not depend on the budget, and the second level runs only
    when no first-level plan fits, so lowering the budget never raises the predicted
    peak."""
    forward = forward_region(joint, num_fwd_outputs)
    region = [n for n in joint.graph.nodes if n.op == "call_function" and n in forward]
    allowed = {n.name for n in mirrorable(joint, num_fwd_outputs, _mutable_inputs(primal_kinds))}
    sizes = storage_sizes(region)
    droppable = [n.name in allowed for n in region]
    candidates = split_candidates(sizes, droppable, last_uses(region))
    if not any(candidates):  # no value separates the graph: every droppable node may split
        candidates = tuple(droppable)

    def named(mask: tuple[bool, ...]) -> frozenset[str]:
        return frozenset(n.name for n, m in zip(region, mask) if m)

    def score_of(mirror: Mirror) -> tuple[bool, int, int]:
        """(misses the budget, FLOPs or peak first, the other): lower is better."""
        step = simulate(mirror)
        if step.peak_bytes > budget_bytes:
            return True, step.peak_bytes, step.recompute_flops
        return False, step.recompute_flops, step.peak_bytes

    def scorer(mirror_of):
        return lambda segment_plan: score_of(mirror_of(segment_plan.mirror))

    # Level 1: m(v) in {0, 1}.
    plans: dict[tuple[int, int], tuple[tuple[bool, int, int], Mirror]] = {}
    _, tried = search_budgets(sizes, candidates, droppable=droppable,
                              score=scorer(lambda mask: Mirror(named(mask))))
    for b, s in tried:
        plans[(1, b)] = (s, Mirror(named(plan_segments(sizes, candidates, b,
                                                       droppable=droppable).mirror)))
    # Level 0 (Sec. 4.2): drop every cheap op, keep every costly one (matmul, conv).
    cheap = tuple(d and not _costly(n) for n, d in zip(region, droppable))
    if any(cheap) and named(cheap) not in {m.names for _, m in plans.values()}:
        plans[(0, 0)] = (scorer(lambda mask: Mirror(named(mask)))(
            SegmentPlan(cheap, 0, 0, 0)), Mirror(named(cheap)))
    # Level 4 (beyond the paper): the peak-directed path, for budgets Alg. 3's segments
    # overshoot (a few cheap values dropped where the peak is)
    walks = (peak_path(simulate, region, sizes, allowed, whole_ops=w) for w in (False, True))
    for k, mirror in enumerate(itertools.chain(*walks) if path else (), start=1):
        plans[(4, k)] = (score_of(mirror), mirror)
    if all(s[0] for s, _ in plans.values()):
        # Level 2 (Sec. 4.4): recurse inside the lowest-peak plan's segments.
        # (from Alg. 3's and Sec. 4.2's plans, as the paper: the minimum does not move)
        lowest = min((v for k, v in plans.items() if k[0] in (0, 1)),
                     key=lambda v: peak_of(v[0]))[1]
        inside = [n.name in lowest.names for n in region]
        _, tried2 = search_budgets(
            sizes, candidates, droppable=inside,
            score=scorer(lambda mask: Mirror(lowest.names, named(mask))))
        for b, s in tried2:
            twice = named(plan_segments(sizes, candidates, b, droppable=inside).mirror)
            plans[(2, b)] = (s, Mirror(lowest.names, twice))
    key = min(plans, key=lambda k: (plans[k][0], len(plans[k][1].twice),
                                    len(plans[k][1].names), k))
    return plans[key][1], tuple(
        SearchCandidate(level=level, segment_budget_bytes=b, predicted_peak_bytes=peak_of(s)[0],
                        recompute_flops=peak_of(s)[1], fits=not s[0])
        for (level, b), (s, _) in sorted(plans.items()))


@dataclass(frozen=True)
class _Choice:
    """What the planner chose for one of memopt's own ops (a head, a chain) and why."""

    site: Any     # head_pass.HeadSite or chain_pass.ChainSite
    config: Any   # head_pass.HeadConfig or chain_pass.ChainConfig
    reason: str


def _choose_heads(sites: list[head_pass.HeadSite], joint: fx.GraphModule,
                  num_fwd_outputs: int, target: int | None, step: StepContext, build,
                  costs: dict[str, head_pass.HeadCosts]) -> list[_Choice]:
    """Each language-model head's chunk (passes.heads), chosen before the chains and
    the Chen planner see the rest of the graph.

    Step 1: every head starts as one chunk (eager's log-probabilities kept, nothing
        recomputed).
    Step 2: with no budget, or when that fits, done.
    Step 3: else price each head's chunk sizes (head_pass.configurations) by the exact
        liveness of one build, other heads fixed. Every split recomputes the same one
        matmul of the head, so take the largest chunk that fits; where none fits alone,
        the largest chunk of the lowest peak (the head then no longer sets it), and
        leave the rest of the budget to the chains and the Chen planner.
    """
    whole = {s.fwd: head_pass.configure(s, costs[s.fwd], s.rows) for s in sites}
    if target is None:
        return [_Choice(s, whole[s.fwd], "no budget: one chunk, nothing recomputed")
                for s in sites]
    built = build(Mirror())
    if built.peak_bytes <= target:
        return [_Choice(s, whole[s.fwd], "the budget fits with one chunk: nothing "
                                             "recomputed") for s in sites]
    gran = allocation_granularity(_device_of(built.fw))
    choices = []
    for s in sites:
        priced = []
        for config in head_pass.configurations(s, costs[s.fwd]):
            head_pass.apply([built.fw, built.bw], s, config)
            schedule = step.liveness(built.fw, built.bw, built.saved_names, num_fwd_outputs)
            priced.append((_peak_bytes(schedule, gran), config))
        fitting = [(p, c) for p, c in priced if p <= target]
        if fitting:
            p, best = max(fitting, key=lambda pc: pc[1].chunk)
            reason = (f"the largest of {len(priced)} chunk sizes that fits"
                      if best.chunks > 1 else "the budget fits with one chunk")
        else:
            low = min(p for p, _ in priced)
            p, best = max(((p, c) for p, c in priced if p <= low), key=lambda pc: pc[1].chunk)
            reason = (f"the largest chunk of the lowest peak of {len(priced)} chunk sizes "
                      f"(none fits alone; the rest is recomputed elsewhere)")
        log.debug("memopt head %s: %d chunks of %d tokens, peak %s", s.name, best.chunks,
                  best.chunk, format_bytes(p))
        head_pass.apply([joint, built.fw, built.bw], s, best)
        choices.append(_Choice(s, best, reason))
    return choices


def _head_records(choices: list[_Choice]) -> tuple[HeadRecord, ...]:
    return tuple(HeadRecord(
        module=c.site.name, tokens=c.site.rows, vocab=c.site.vocab, chunk=c.config.chunk,
        chunks=c.config.chunks, held_bytes=c.config.held_bytes,
        forward_workspace_bytes=c.config.forward_workspace_bytes,
        workspace_bytes=c.config.workspace_bytes, recompute_flops=c.config.recompute_flops,
        reason=c.reason) for c in choices)


def _choose_chains(sites: list[chain_pass.ChainSite], joint: fx.GraphModule,
                   num_fwd_outputs: int, target: int | None,
                   step: StepContext, build,
                   costs: dict[str, chain_pass.ChunkCosts]) -> list[_Choice]:
    """Each recurrent chain's policy (Gruslys et al. 2016: BPTT-HSM, ISM or MSM), chosen
    before Chen's planner sees the rest of the graph.

    Step 1: every chain starts as one chunk (t = 1: no recomputation, eager's memory).
    Step 2: with no budget, or when that fits, done.
    Step 3: else, chain by chain, price every (chunk length, strategy, m) of its grid
        (chain_pass.configurations) by the exact simulator on one build (only the
        chain's held and workspace bytes change between configurations: one run per
        distinct bytes), other chains fixed, against a goal: the peak less this chain's
        share of the bytes still over the target (the excess over the chains left, this
        one included), so that the first chain of several (a bidirectional RNN's, a
        stack's) is not split to its lowest peak while the others stay whole.
    Step 4: between the longest grid chunk that fits with every boundary kept (m = t)
        and the next longer grid chunk, bisect for the longest chunk that fits
        (chain_pass.longest_fitting_chunk): its T - L recomputed steps can beat the grid.
        Take the configuration that fits the goal in the least estimated time (chunk
        calls at their measured cost, chain_pass.ChunkCosts; then the fewest recomputed
        steps), else the lowest peak, and leave the rest of the budget to the Chen
        planner.
    Step 5: with several chains, when they fit together, each chooses again (Steps 3-4)
        against the target itself, the others fixed at their choice, among the
        configurations estimated faster than its own.
    """
    one_chunk = {s.fwd: chain_pass.configure(s, costs[s.fwd], s.steps, 1) for s in sites}
    for s in sites:
        chain_pass.apply([joint], s, one_chunk[s.fwd])
    if target is None:
        return [_Choice(s, one_chunk[s.fwd], "no budget: one chunk, nothing recomputed")
                for s in sites]
    built = build(Mirror())
    if built.peak_bytes <= target:
        return [_Choice(s, one_chunk[s.fwd],
                             "the budget fits with one chunk: nothing recomputed") for s in sites]
    gran = allocation_granularity(_device_of(built.fw))
    current = dict(one_chunk)

    def choose(s: chain_pass.ChainSite, goal: int, kept: int | None = None
               ) -> tuple[_Choice, int]:
        """``kept``: the peak with the chain's current configuration, which fits the
        goal: only the configurations estimated faster are priced besides it."""
        peaks: dict[tuple[int, int, int], int] = {}  # other chains as in ``current``
        tried: set[tuple[int, str, int]] = set()

        def key_of(config: chain_pass.ChainConfig) -> tuple[int, int, int]:
            # liveness sees only these bytes: policies that share them share a peak
            return (config.held_bytes, config.forward_workspace_bytes, config.workspace_bytes)

        def peak(config: chain_pass.ChainConfig) -> int:
            tried.add((config.chunk, config.policy.strategy, config.m))
            key = key_of(config)
            if key not in peaks:
                chain_pass.apply([built.fw, built.bw], s, config)
                schedule = step.liveness(built.fw, built.bw, built.saved_names,
                                         num_fwd_outputs)
                peaks[key] = _peak_bytes(schedule, gran)
            return peaks[key]

        grid = chain_pass.configurations(s, costs[s.fwd])
        if kept is not None:
            mine = current[s.fwd]
            peaks[key_of(mine)] = kept
            grid = [mine, *(c for c in grid if c.seconds < mine.seconds)]
        priced = [(peak(c), c) for c in grid]
        fitting = [(p, c) for p, c in priced if p <= goal]
        full = [c.chunk for _, c in fitting
                if c.policy.strategy == "hsm" and c.m == c.t and c.t > 1]
        if full:
            lo = max(full)
            hi = min((c.chunk for c in grid if c.chunk > lo), default=lo + 1)
            refined = chain_pass.longest_fitting_chunk(
                s, costs[s.fwd], lambda c: peak(c) <= goal, lo, hi)
            if refined is not None:
                fitting.append((peak(refined), refined))
        if fitting:
            fitting.sort(key=lambda pc: (pc[1].seconds, pc[1].recompute_steps, pc[1].t, pc[0]))
            for p, c in fitting[:5]:
                log.debug("memopt chain %s: fits: %d x %d, %s m=%d, %d steps recomputed, "
                          "%.1f ms, peak %s", s.name, c.t, c.chunk, c.policy.strategy, c.m,
                          c.recompute_steps, c.seconds * 1e3, format_bytes(p))
            p, best = fitting[0]
            reason = (f"least estimated time of the {len(fitting)} of {len(tried)} "
                      f"policies priced that fit")
            if goal > target:
                reason += f" its share of the excess (a peak of {format_bytes(goal)})"
        else:
            p, best = min(priced, key=lambda pc: (pc[0], pc[1].recompute_steps))
            reason = (f"lowest peak of {len(priced)} policies (none fits alone; the Chen "
                      f"planner recomputes the rest)")
        chain_pass.apply([built.fw, built.bw], s, best)
        current[s.fwd] = best
        return _Choice(s, best, reason), p

    # Step 3: each chain in turn removes its share of what is still over the target
    chosen: dict[str, _Choice] = {}
    now = built.peak_bytes
    for k, s in enumerate(sites):
        goal = max(target, now - (now - target) // (len(sites) - k))
        chosen[s.fwd], now = choose(s, goal)
    # Step 5: with several chains, each chooses again, the others fixed, against the
    # target itself: a chain that took more than its share lets the others split less
    if len(sites) > 1 and now <= target:
        for s in sites:
            chosen[s.fwd], now = choose(s, target, kept=now)
    for s in sites:
        chain_pass.apply([joint, built.fw, built.bw], s, current[s.fwd])
    return [chosen[s.fwd] for s in sites]


def _relax(choices: list[_Choice], faster: Callable[[_Choice], list[Any]],
           apply: Callable[[Any, Any], None], peak: Callable[[], int], target: int
           ) -> list[_Choice]:
    """After the mirror set: give each head or chain the fastest of its configurations
    that still fits ``target`` with the Chen planner's recomputation as chosen.

    Heads and chains choose before the Chen planner (their bytes are part of what it
    plans around); where none fits alone they take their lowest peak, and the mirror set
    then brings the step under the target, often with room to spare: near memopt's
    minimum an LSTM LM's chain kept one boundary state of 128 chunks (16,256 time steps
    recomputed, 8.7x eager's time) where the step had room for a faster policy. Each
    choice in turn tries the configurations ``faster(choice)`` lists, fastest first,
    on the step simulator (``peak()``: the simulated peak with the mirror set fixed, other
    choices as they stand), and keeps the first that fits; none fitting, it keeps its
    own. Gruslys et al. 2016, Sec. 3 prices a policy by its time under a memory bound:
    this is that bound taken from the whole step rather than the chain's share of it.
    """
    relaxed = []
    for c in choices:
        for config in faster(c):
            apply(c.site, config)
            if peak() <= target:
                c = _Choice(c.site, config, c.reason + "; after the Chen planner's mirror "
                            "set, the fastest that still fits")
                break
        else:
            apply(c.site, c.config)
        relaxed.append(c)
    return relaxed


def _faster_chains(costs: dict[str, chain_pass.ChunkCosts]) -> Callable[[_Choice], list]:
    def faster(c: _Choice) -> list[chain_pass.ChainConfig]:
        grid = [g for g in chain_pass.configurations(c.site, costs[c.site.fwd])
                if g.seconds < c.config.seconds]
        return sorted(grid, key=lambda g: (g.seconds, g.recompute_steps, g.held_bytes))
    return faster


def _faster_heads(costs: dict[str, head_pass.HeadCosts]) -> Callable[[_Choice], list]:
    def faster(c: _Choice) -> list[head_pass.HeadConfig]:
        return sorted((g for g in head_pass.configurations(c.site, costs[c.site.fwd])
                       if g.chunk > c.config.chunk), key=lambda g: -g.chunk)
    return faster


def _chain_records(choices: list[_Choice]) -> tuple[ChainRecord, ...]:
    return tuple(ChainRecord(
        module=c.site.name, module_type=c.site.module_type, steps=c.site.steps,
        chunk=c.config.chunk, t=c.config.t, m=c.config.m, strategy=c.config.policy.strategy,
        alpha=c.config.policy.alpha, beta=c.config.policy.beta,
        cost=c.config.policy.cost, recompute_steps=c.config.recompute_steps,
        estimated_seconds=c.config.seconds,
        recompute_flops=c.config.recompute_steps * c.site.step_flops,
        hidden_bytes=c.site.hidden_bytes, internal_bytes=c.config.internal_bytes,
        held_bytes=c.config.held_bytes,
        forward_workspace_bytes=c.config.forward_workspace_bytes,
        workspace_bytes=c.config.workspace_bytes,
        reason=c.reason) for c in choices)


#: The peak-directed path (`peak_path`): (forward nodes up to, steps, the share of the
#: peak's droppable bytes each step drops at least), so that its simulations cost about
#: what Alg. 3's grid does and plan time stays linear in the graph's size; how many
#: values deep a recomputation may reach for sources no longer held.
PATH_TIERS = ((512, 64, 1 / 64), (2048, 16, 1 / 16), (None, 4, 1 / 2))
PATH_DEPTH = 3
#: The path ends once this many steps in a row found no lower peak.
PATH_PATIENCE = 8


def peak_path(simulate: Callable[[Mirror], Simulated], region: list[fx.Node],
              sizes: list[int], allowed: set[str], whole_ops: bool = False
              ) -> Iterator[Mirror]:
    """A greedy path of mirror sets, each adding to the last: at each step, the storages
    live at the simulated peak of the last plan that recomputing frees (every node
    holding one is mirrorable: the value and its views), the most bytes freed per
    recomputed FLOP first (sources no longer held recomputed too, or saved), until they
    hold a share of those storages' bytes (PATH_TIERS, by the graph's size). A step that
    neither lowers the simulated peak nor comes free (recomputing a value read early in
    the backward can even raise it) is undone and its groups are not tried again; the
    path ends after PATH_PATIENCE steps in a row without a lower peak. Each plan it yields has a
    lower peak and more FLOPs than the last. The path depends on the graph only, never on the
    budget, so with Alg. 3's plans it keeps the choice monotone (a lower budget never gets a higher
    peak). Alg. 3 cuts the graph in segments and recomputes each whole; near the unconstrained peak
    that is far more than the few values that set the peak (benchmarks/optimum_gap.py measures both
    against the optimum)."""
    nbytes = {n.name: b for n, b in zip(region, sizes)}
    # `whole_ops`: a getitem priced at all its op's outputs, so that a 32-byte BatchNorm
    # statistic is not the first value dropped (on a residual CNN that path reaches the
    # optimum where the one pricing each output alone recomputes 6x its FLOPs, and the
    # other way round on smaller batches: the search walks both)
    cost = {n.name: sum(map(node_flops, n.args[0].users)) if whole_ops and _of_tuple(n)
            else node_flops(n) for n in region if n.name in allowed}
    # what recomputing each reads: a value no longer held must then be saved
    reads = {n.name: [(a.name, _storage_bytes(a)) for a in recompute_sources(n)
                      if a.op != "placeholder"] for n in region if n.name in allowed}

    def recomputation(group: tuple[str, ...], held: set[str]) -> tuple[int, set[str], int]:
        """(FLOPs, the nodes, bytes newly saved) to recompute `group` from held values:
        a source neither held nor already recomputed (`current`) is recomputed too where
        it may be (up to PATH_DEPTH deep), else saved."""
        nodes, kept, flops = set(group), {}, 0
        work = [(n, 0) for n in group]
        while work:
            name, depth = work.pop()
            flops += cost[name]
            for a, size in reads[name]:
                if a in held or a in nodes or a in current:  # recomputed anyway
                    continue
                if a in cost and depth < PATH_DEPTH:
                    nodes.add(a)
                    work.append((a, depth + 1))
                else:
                    kept[a] = size
        return flops, nodes, sum(kept.values())
    steps, share = next((k, f) for n, k, f in PATH_TIERS if n is None or len(region) <= n)
    current: frozenset[str] = frozenset()
    step = simulate(Mirror(current))
    barred: set[tuple[str, ...]] = set()  # groups whose recomputation did not lower the peak
    since = 0
    for _ in range(steps):
        held = {n for run in step.at_peak for g in run for n in g}
        taken: set[str] = set()
        taking: set[tuple[str, ...]] = set()
        for run in step.at_peak:  # each run of peak steps gets its share
            groups = []
            for g in run:
                if g in barred or not all(n in cost for n in g) or current.issuperset(g):
                    continue
                flops, nodes, kept = recomputation(g, held)
                freed = sum(nbytes.get(n, 0) for n in g) - kept
                if freed > 0:
                    groups.append((freed, flops, tuple(sorted(nodes)), g))
            groups.sort(key=lambda t: (t[1] / t[0], t[2]))
            total, dropped = sum(t[0] for t in groups), 0
            for size, _, nodes, g in groups:
                if dropped >= share * total:
                    break
                taken.update(nodes)
                taking.add(g)
                dropped += size
        if not taken:
            return
        barred |= taking
        trial = simulate(Mirror(current | taken))
        lower = trial.peak_bytes < step.peak_bytes
        if lower or (trial.peak_bytes == step.peak_bytes
                     and trial.recompute_flops <= step.recompute_flops):  # else undone
            current, step = current | taken, trial
            if lower:
                since = 0
                yield Mirror(current)
                continue
        if (since := since + 1) >= PATH_PATIENCE:
            return


def _of_tuple(node: fx.Node) -> bool:
    """`node` picks one output of an op with several (a getitem of a tuple)."""
    return (node.target is operator.getitem and isinstance(node.args[0], fx.Node)
            and isinstance(node.args[0].meta.get("val"), (tuple, list)))


def _storage_bytes(node: fx.Node) -> int:
    val = tensor_value(node)
    return val.untyped_storage().nbytes() if val is not None else 0


def _solve_exactly(model: StepModel, target: int, simulate: Callable[[Mirror], Simulated],
                   chosen: Mirror, search: tuple[SearchCandidate, ...], seconds: float
                   ) -> tuple[Mirror, tuple[SearchCandidate, ...]]:
    """Options.solver == "milp": the least-FLOPs plan of Checkmate's MILP over memopt's
    plan space (memopt.allocator.milp, in-place rewrites not modelled), scored by the
    simulator like every candidate, taken where it fits and recomputes less than
    `chosen`. Where the simulator puts the MILP's plan above the target, it is solved
    once more with the target lowered by the excess."""
    problem, units = recompute_problem(model)
    best = simulate(chosen)
    aim = target
    for _ in range(2):
        solution = solve(problem, aim, time_limit=seconds)
        if not solution.feasible:
            break
        mirror = Mirror(frozenset(model.protos[units[u]].name for u in solution.recomputed))
        step = simulate(mirror)
        search += (SearchCandidate(level=3, segment_budget_bytes=aim,
                                   predicted_peak_bytes=step.peak_bytes,
                                   recompute_flops=step.recompute_flops,
                                   fits=step.peak_bytes <= target),)
        if step.peak_bytes <= target:
            if best.peak_bytes > target or step.recompute_flops < best.recompute_flops:
                return mirror, search
            break
        aim -= step.peak_bytes - target
    return chosen, search


def _costly(node: fx.Node) -> bool:
    """More than a few operations per output element (a matmul or a convolution)."""
    val = tensor_value(node)
    return val is not None and node_flops(node) > 8 * max(1, val.numel())


def peak_of(score: tuple[bool, int, int]) -> tuple[int, int]:
    """(peak, FLOPs) of a `_choose_mirror` score."""
    misses, a, b = score
    return (a, b) if misses else (b, a)


def plan_joint(
    joint: fx.GraphModule,
    num_fwd_outputs: int,
    *,
    primal_kinds: dict[str, str],
    budget: Budget | None,
    options: Options = Options(),
    grads: ExistingGrads | None = None,
    outside_grad_bytes: int = 0,
    outside: Outside = Outside(),
    label: str = "",
    cap: int | None = None,
    step_baseline: int | None = None,
    must_fit: bool = True,
    whole_step: bool = False,
) -> tuple[fx.GraphModule, fx.GraphModule, MemoryPlan]:
    """Run memopt's passes on `joint`; return the forward, backward and the plan.
    `grads`: plan the step in which parameters' `.grad` already exist (ExistingGrads);
    `outside_grad_bytes`, `outside`: see StepContext; `label` names the graph in a
    BudgetError when the step has several. `cap` lowers the peak the search aims at
    below the budget (a graph that must leave room for the graphs after it: 1 asks for
    its lowest-peak plan, with or without a budget); a BudgetError is raised only when
    the budget itself is missed, and only if `must_fit` (else the caller reads
    `plan.fits`). `step_baseline`: the baseline peak of the whole step a fraction budget
    is of, when the step has several graphs (else this graph's). `whole_step`: the graph is
    the whole forward, so what `outside` holds (DDP's gradient buckets, parameters it does
    not take) is held unchanged through its step, and the peak-directed path plans around it.

    Step 1: a tied embedding's gradient added into the weight's other gradient
        (passes.embedding_grads), and minimum dependencies declared
        (passes.partition.read_concat_views).
    Step 2: the baseline: no in-place, no recomputation.
    Step 3: the mirror set: the user's (`options.mirror`), none when the plan without
        recomputation fits the budget, else Chen's Alg. 3 + grid search.
    Step 4: the final graphs and the plan, with the timelines of live bytes by kind of the
        step and of the baseline (allocator.timeline; memopt.plot draws them).
    """
    t0 = time.perf_counter()
    done: list[str] = []
    with _stage("tied embedding gradients", done):
        add_embedding_grads_in_place(joint)
    with _stage("minimum dependencies", done):
        read_concat_views(joint, num_fwd_outputs, find_cut(joint, num_fwd_outputs))

    step = StepContext(primal_kinds, grads, outside_grad_bytes, outside,
                       outputs_dropped=options.drop_outputs and whole_step)

    def build(mirror: Mirror, inplace: bool = options.inplace) -> _Built:
        return _build(joint, num_fwd_outputs, mirror, inplace=inplace, step=step, done=[])

    costs: dict[str, chain_pass.ChunkCosts] = {}
    sites = chain_pass.find_chains(joint)
    if sites:
        with _stage("recurrent chains", done):  # every chain as one chunk, for the baseline
            for site in sites:
                costs[site.fwd] = chain_pass.chunk_costs(joint, site)
                chain_pass.apply([joint], site,
                                 chain_pass.configure(site, costs[site.fwd], site.steps, 1))
    head_costs: dict[str, head_pass.HeadCosts] = {}
    head_sites = head_pass.find_heads(joint)
    if head_sites:
        with _stage("language-model heads", done):  # each as one chunk, for the baseline
            for head in head_sites:
                head_costs[head.fwd] = head_pass.head_costs(joint, head)
                head_pass.apply([joint], head,
                                head_pass.configure(head, head_costs[head.fwd], head.rows))
    reversible: list[reversible_pass.ReversibleSite] = []
    if reversible_pass.present(joint):
        with _stage("reversible stacks", done):  # no slots to choose: charge the buffers
            reversible = reversible_pass.find_reversible(joint)
            for rev in reversible:
                reversible_pass.apply([joint], rev)
    gran = allocation_granularity(_device_of(joint))
    with _stage("step model", done):
        model = StepModel(
            joint, num_fwd_outputs, mutable_inputs=_mutable_inputs(primal_kinds),
            primal_kinds=primal_kinds,
            existing_grads=grads.nbytes if grads is not None else None,
            accumulate=grads.add if grads is not None else None,
            outside_grad_bytes=outside_grad_bytes, outside=outside.bytes(),
            granularity=gran, impure_random=dce_impure_random(),
            outputs_dropped=step.outputs_dropped)

    for sink in _OBSERVERS.get():
        sink(Observed(model=model, joint=joint, num_fwd_outputs=num_fwd_outputs,
                      primal_kinds=primal_kinds, options=options))
    bar = tqdm(desc=f"memopt: planning{f' {label}' if label else ''}", unit=" plans",
               delay=PROGRESS_DELAY, leave=False, disable=None if options.progress else True)

    simulated: dict[tuple[Mirror, bool], Simulated] = {}  # no candidate twice

    def simulate(mirror: Mirror, inplace: bool = options.inplace, kinds: bool = False
                 ) -> Simulated:
        if (mirror, inplace) not in simulated or (kinds and not simulated[mirror, inplace].kinds):
            result = model.simulate(mirror.names, mirror.twice, inplace,
                                    kinds=kinds or _VERIFY.get())
            if _VERIFY.get():
                _verify(result, build(mirror, inplace), mirror)
            bar.update()
            simulated[(mirror, inplace)] = result
        return simulated[(mirror, inplace)]

    with _stage("baseline", done):
        baseline = simulate(Mirror(), inplace=False, kinds=True)  # kinds: its timeline
    baseline_peak = baseline.peak_bytes
    budget_bytes = budget.resolve(step_baseline or baseline_peak) if budget is not None else None
    # Headroom guards byte budgets against what the plan does not model; a fraction is
    # of memopt's own predicted baseline, which leaves that out too (1.0 always fits).
    headroom = options.headroom if budget is not None and budget.nbytes is not None else 0.0
    target = budget_bytes - math.ceil(budget_bytes * headroom) if budget_bytes else None
    fits = target  # what the plan must fit; the search may aim lower (cap)
    if cap is not None:
        target = cap if target is None else min(target, cap)
    heads: list[_Choice] = []
    if head_sites:
        with _stage("language-model head chunks", done):
            heads = _choose_heads(head_sites, joint, num_fwd_outputs, target, step, build,
                                  head_costs)
    chains: list[_Choice] = []
    if sites:
        with _stage("recurrent chain policies", done):
            chains = _choose_chains(sites, joint, num_fwd_outputs, target, step, build, costs)
    mirror = Mirror()
    search: tuple[SearchCandidate, ...] = ()
    if options.mirror == "all":
        mirror = Mirror(frozenset(n.name for n in mirrorable(joint, num_fwd_outputs,
                                                             _mutable_inputs(primal_kinds))))
    elif options.mirror is not None:
        mirror = Mirror(frozenset(options.mirror))
    elif target is not None and simulate(Mirror()).peak_bytes > target:
        with _stage("budget search", done):
            # the peak-directed path only where the step is this one graph: with graph
            # breaks its lean plans measured above their prediction (tests/test_graph_breaks);
            # what a whole step holds outside its graph is a constant (DDP's buckets)
            mirror, search = _choose_mirror(joint, num_fwd_outputs, target, primal_kinds,
                                           simulate, path=cap is None and (whole_step or not (
                                               outside.forward or outside.backward)))
        if options.solver == "milp":
            with _stage("exact solver", done):
                mirror, search = _solve_exactly(model, target, simulate, mirror, search,
                                                options.solver_seconds)
    if target is not None and (heads or chains) and simulate(mirror).peak_bytes <= target:
        with _stage("faster heads and chains within the mirror set", done):
            def peak() -> int:
                return model.simulate(mirror.names, mirror.twice, options.inplace).peak_bytes

            chains = _relax(chains, _faster_chains(costs),
                            lambda site, config: chain_pass.apply([joint], site, config),
                            peak, target)
            heads = _relax(heads, _faster_heads(head_costs),
                           lambda site, config: head_pass.apply([joint], site, config),
                           peak, target)
            simulated.clear()  # the chains' and heads' bytes changed under the same mirror
    expected = simulate(mirror).peak_bytes

    def budget_error(peak: int) -> BudgetError:
        err = BudgetError(
            budget_bytes=budget_bytes, minimum_bytes=math.ceil(peak / (1 - headroom)),
            baseline_bytes=baseline_peak, budget=str(budget), headroom=headroom,
            byte_headroom=options.headroom, step=_step_words(grads, label))
        err.plan_seconds = time.perf_counter() - t0
        return err

    if must_fit and fits is not None and expected > fits:
        bar.close()  # below reach: no graphs to build (the simulated peak is the build's)
        raise budget_error(expected)
    bar.set_postfix_str("building the plan's graphs")
    final = _build(joint, num_fwd_outputs, mirror, inplace=options.inplace, step=step,
                   done=done)
    if final.peak_bytes != expected:  # a disagreement: the exact build decides
        log.warning("memopt: the step simulator predicted a peak of %d bytes, the exact "
                    "build %d (please report this model); planning with exact builds",
                    expected, final.peak_bytes)
        if search:
            with _stage("budget search", done):
                mirror, search = _choose_mirror(
                    joint, num_fwd_outputs, target, primal_kinds,
                    lambda m: _as_simulated(build(m)))
            final = _build(joint, num_fwd_outputs, mirror, inplace=options.inplace,
                           step=step, done=[])
    recomputed = _recomputed_nodes(final)
    chain_records = _chain_records(chains)
    head_records = _head_records(heads)
    # memopt's own ops count one element an output in node_flops: add what they run
    forward_flops = _forward_flops(joint, num_fwd_outputs) + sum(
        c.site.steps * c.site.step_flops for c in chains) + sum(
        c.site.matmul_flops for c in heads)
    device = _device_of(final.fw)
    with _stage("allocator", done):
        plan = _assemble(final.fw, final.schedule, final.saved_names, list(final.rewrites),
                         baseline_peak, budget_bytes, device, gran, time.perf_counter() - t0)
        plan = plan.model_copy(update={
            "recomputed": recomputed, "forward_flops": forward_flops,
            "recompute_flops": sum(r.flops for r in recomputed) + sum(
                c.recompute_flops for c in chain_records) + sum(
                h.recompute_flops for h in head_records),
            "search": search, "chains": chain_records, "heads": head_records,
            "reversible": tuple(ReversibleRecord(
                module=r.name, module_type=r.module_type, steps=r.steps, layers=r.layers,
                max_forget_bits=r.max_forget_bits, stored_state_bytes=r.stored_state_bytes,
                buffer_bound_bytes=r.buffer_bound_bytes, held_bytes=r.held_bytes,
                forward_workspace_bytes=r.forward_workspace_bytes,
                workspace_bytes=r.workspace_bytes, dropout=r.dropout) for r in reversible),
            "headroom_bytes": budget_bytes - fits if fits is not None else 0,
            "existing_grad_bytes": sum(grads.nbytes.values()) if grads is not None else 0,
            "outside_forward_bytes": outside.forward, "outside_backward_bytes": outside.backward,
            "outside_after_backward_bytes": outside.after_backward,
            "baseline_saved_bytes": baseline.saved_bytes,
            "timeline": _timeline(_as_simulated(final), {"fw": final.fw, "bw": final.bw},
                                  gran),
            "baseline_timeline": _timeline(baseline, {"fw": joint, "bw": joint}, gran),
            "grads_added_in_place": sum(1 for n in final.bw.graph.nodes if accumulates_into(n)),
            "saved": tuple(
                r.model_copy(update={"reason": "kept: a segment boundary of the Alg. 3 plan, "
                                               "read by backward or by recomputation"})
                if recomputed and r.reason.startswith("read by backward") else r
                for r in plan.saved),
        })
    bar.close()
    log.info(
        "memopt: peak %s -> %s (lower bound %s, arena %s), %d in-place, %d saved tensors, "
        "%d recomputed, planned in %.2fs", format_bytes(plan.baseline_peak_bytes),
        format_bytes(plan.predicted_peak_bytes), format_bytes(plan.lower_bound_bytes),
        format_bytes(plan.arena_bytes), len(final.rewrites), len(plan.saved),
        len(final.recomputed), plan.plan_seconds,
    )
    if must_fit and fits is not None and plan.predicted_peak_bytes > fits:
        raise budget_error(plan.predicted_peak_bytes)
    return final.fw, final.bw, plan


@dataclass(frozen=True)
class Observed:
    """What `observing()` hands its sink for each graph the pipeline plans: the step
    model the budget search scores candidates on, and what built it (the oracle of
    memopt.oracle plans the same step exactly)."""

    model: StepModel
    joint: fx.GraphModule
    num_fwd_outputs: int
    primal_kinds: dict[str, str]
    options: Options


_OBSERVERS: contextvars.ContextVar[tuple[Callable[[Observed], None], ...]] = \
    contextvars.ContextVar("memopt_observers", default=())


@contextmanager
def observing() -> Iterator[list[Observed]]:
    """Collect an `Observed` record for every graph planned inside the block."""
    seen: list[Observed] = []
    token = _OBSERVERS.set(_OBSERVERS.get() + (seen.append,))
    try:
        yield seen
    finally:
        _OBSERVERS.reset(token)


#: Tests set this (`verifying()`): every candidate the planner simulates is also built
#: exactly, and a disagreement raises.
_VERIFY: contextvars.ContextVar[bool] = contextvars.ContextVar("memopt_verify", default=False)


@contextmanager
def verifying() -> Iterator[None]:
    """Check every simulated candidate against its exact build (slow: tests only)."""
    token = _VERIFY.set(True)
    try:
        yield
    finally:
        _VERIFY.reset(token)


def _as_simulated(built: _Built) -> Simulated:
    schedule = built.schedule
    intervals = tuple((s.nbytes, s.start, s.end) for s in schedule.storages)
    at = peak_live_bytes(_intervals(schedule, allocation_granularity(_device_of(built.fw))),
                         len(schedule.steps)).peak_step
    return Simulated(intervals=intervals, num_steps=len(schedule.steps),
                     peak_bytes=built.peak_bytes,
                     recompute_flops=sum(r.flops for r in _recomputed_nodes(built)),
                     saved_bytes=sum(s.nbytes for s in schedule.storages
                                     if s.kind == "saved"),
                     kinds=timeline_kinds(schedule, built.fw, built.bw),
                     peak_step=schedule.steps[at] if at >= 0 else "",
                     num_forward_steps=schedule.num_forward_steps)


def _timeline(step: Simulated, graphs: dict[str, fx.GraphModule], granularity: int
              ) -> Timeline:
    """The plan's record of `step`'s live bytes by kind (allocator.timeline), its peak
    op and the user's module that op came from (looked up in `graphs` by the step's
    prefix, "fw" or "bw")."""
    profiles = live_by_kind(step.intervals, step.kinds, step.num_steps, granularity)
    steps, columns = downsample(profiles, step.num_steps)
    prefix, _, name = step.peak_step.partition(".")
    node = _node_named(graphs.get(prefix), name)
    module, module_type = source_module(node) if node is not None else ("", "")
    return Timeline(num_steps=step.num_steps, num_forward_steps=step.num_forward_steps,
                    steps=steps, kinds=tuple(columns), live=tuple(columns.values()),
                    peak_step=step.peak_step,
                    peak_module=f"{module} ({module_type})" if module else module_type)


def _node_named(gm: fx.GraphModule | None, name: str) -> fx.Node | None:
    return next((n for n in gm.graph.nodes if n.name == name), None) if gm is not None \
        else None


def _verify(simulated: Simulated, built: _Built, mirror: Mirror) -> None:
    exact = _as_simulated(built)
    if (sorted(zip(simulated.intervals, simulated.kinds))
            != sorted(zip(exact.intervals, exact.kinds))
            or (simulated.num_steps, simulated.peak_bytes, simulated.recompute_flops,
                simulated.saved_bytes) != (exact.num_steps, exact.peak_bytes,
                                           exact.recompute_flops, exact.saved_bytes)):
        raise PassError("step simulator", ("exact build",), AssertionError(
            f"step simulator disagrees with the exact build for {len(mirror.names)} mirrored "
            f"({len(mirror.twice)} twice): peak {simulated.peak_bytes} vs {exact.peak_bytes}, "
            f"steps {simulated.num_steps} vs {exact.num_steps}, flops "
            f"{simulated.recompute_flops} vs {exact.recompute_flops}, saved "
            f"{simulated.saved_bytes} vs {exact.saved_bytes}, intervals by kind differing "
            f"{_differing(simulated, exact)[:4]}"))


def _differing(simulated: Simulated, exact: Simulated) -> list:
    """The (interval, kind) pairs of one side only: where the simulator went wrong."""
    return sorted(set(zip(simulated.intervals, simulated.kinds))
                  ^ set(zip(exact.intervals, exact.kinds)))


def _step_words(grads: ExistingGrads | None, label: str) -> str:
    """How a BudgetError names the step that did not fit."""
    words = [label] if label else []
    if grads is not None:
        words.append("the step that finds .grad kept from earlier steps: gradient "
                     "accumulation, zero_grad(set_to_none=False)")
    return f" ({'; '.join(words)})" if words else ""


def _device_of(gm: fx.GraphModule) -> str:
    for node in gm.graph.nodes:
        val = tensor_value(node)
        if val is not None:
            return str(val.device)
    return "cpu"


#: Greedy-by-size offsets (allocator.assign_offsets) cost O(n x the storages live beside
#: each): about 20 s for the 25,000 storages of a ResNet-1000 step. Past this many
#: storages the plan lays each of Chen's tags out as its own block instead.
GREEDY_OFFSETS_LIMIT = 8192


def _assemble(
    fw: fx.GraphModule,
    schedule: StepSchedule,
    saved_names: frozenset[str],
    rewrites: list[InplaceRecord],
    baseline_peak: int,
    budget_bytes: int | None,
    device: str,
    gran: int,
    elapsed: float,
) -> MemoryPlan:
    intervals = _intervals(schedule, gran)
    n_steps = len(schedule.steps)
    peak = peak_live_bytes(intervals, n_steps)
    # what other graphs hold is no part of this graph's arena (nor of its resident bytes)
    dynamic = [i for i, s in enumerate(schedule.storages)
               if s.kind not in RESIDENT_KINDS and s.kind != "outside"]
    resident = sum(iv.size for iv, s in zip(intervals, schedule.storages)
                   if s.kind in RESIDENT_KINDS)
    tags = share_by_tags([intervals[i] for i in dynamic])
    if len(dynamic) <= GREEDY_OFFSETS_LIMIT:
        offsets = assign_offsets([intervals[i] for i in dynamic], alignment=gran)
        arena, layout, offset_of = offsets.arena_bytes, "greedy by size", dict(
            zip(dynamic, offsets.offsets))
    else:  # each tag's block in turn: a valid static layout, in O(n)
        starts = list(itertools.accumulate((-(-n // gran) * gran for n in tags.tag_sizes),
                                           initial=0))
        arena, layout = starts[-1], "tag blocks"
        offset_of = {i: starts[t] for i, t in zip(dynamic, tags.tag_of)}
    tag_of = dict(zip(dynamic, tags.tag_of))

    storages = tuple(
        StorageRecord(name=s.name, kind=s.kind, nbytes=s.nbytes, start=s.start, end=s.end,
                      nodes=s.nodes, offset=offset_of.get(i), tag=tag_of.get(i))
        for i, s in enumerate(schedule.storages)
    )
    members: dict[int, list[str]] = {}
    for i, tag in tag_of.items():
        members.setdefault(tag, []).append(schedule.storages[i].name)
    sharing = tuple(
        SharingGroup(tag=t, nbytes=tags.tag_sizes[t], storages=tuple(names))
        for t, names in sorted(members.items()) if len(names) > 1
    )
    saved = _saved_tensors(fw, schedule, saved_names)
    return MemoryPlan(
        device=device,
        budget_bytes=budget_bytes,
        baseline_peak_bytes=baseline_peak,
        predicted_peak_bytes=peak.peak_bytes,
        lower_bound_bytes=peak_live_bytes(
            [Interval(s.nbytes, s.start, s.end) for s in schedule.storages], n_steps
        ).peak_bytes,
        arena_bytes=resident + arena,
        arena_layout=layout,
        sharing_bytes=resident + tags.total_bytes,
        no_reuse_bytes=no_sharing_bytes(intervals),
        resident_bytes=resident,
        peak_step=schedule.steps[peak.peak_step] if schedule.steps else "",
        num_forward_steps=schedule.num_forward_steps,
        num_backward_steps=n_steps - schedule.num_forward_steps,
        storages=storages,
        saved=tuple(saved),
        inplace=tuple(rewrites),
        sharing=sharing,
        plan_seconds=elapsed,
    )


def _saved_tensors(
    fw: fx.GraphModule, schedule: StepSchedule, saved_names: frozenset[str]
) -> tuple[SavedTensor, ...]:
    """One record per saved value, in forward order. Bytes are counted once per
    storage: a saved view of a graph input or of another saved value costs 0."""
    storage_of = {name: s for s in schedule.storages for name in s.nodes}
    counted: dict[str, str] = {}
    records = []
    for node in fw.graph.nodes:
        val = tensor_value(node)
        if node.name not in saved_names or val is None:
            continue
        module, module_type = user_module(node)
        storage = storage_of.get(f"fw.{node.name}")
        if storage is not None and storage.kind in RESIDENT_KINDS:
            nbytes, reason = 0, f"a view of graph input {storage.name}: already resident"
        elif storage is not None and storage.name in counted:
            nbytes, reason = 0, f"shares storage with saved {counted[storage.name]}"
        else:
            nbytes = val.untyped_storage().nbytes()
            reason = "read by backward; no recomputation planned (budget not binding)"
            if storage is not None:
                counted[storage.name] = node.name
        records.append(SavedTensor(
            name=node.name, op="input" if node.op == "placeholder" else op_name(node),
            module=module, module_type=module_type, shape=tuple(int(d) for d in val.shape),
            dtype=str(val.dtype).replace("torch.", ""), nbytes=nbytes, decision="saved",
            reason=reason,
        ))
    return tuple(records)
