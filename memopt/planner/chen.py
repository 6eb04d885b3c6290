"""Chen et al. 2016's budget search over mirror sets: which forward values to recompute.

    Alg. 3 (budget planning over segments) with Appendix A's grid search over B, Sec. 4.2's
    plan that drops every cheap op, Sec. 4.4's recursion (m(v) = 2 inside the segments),
    and, beyond the paper, the peak-directed path and the exact MILP (Checkmate, Jain et
    al. 2020) as candidates. Every candidate is scored by the step simulator
    (passes.simulate) through a `simulate(Mirror) -> Simulated` callable, so this module
    never builds a graph; the segment solvers themselves are torch-free
    (memopt.allocator.mirror, memopt.allocator.milp).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterator

from torch import fx

from memopt.allocator import SegmentPlan, plan_segments, search_budgets, split_candidates
from memopt.allocator.milp import solve
from memopt.passes.meta import tensor_value
from memopt.passes.oracle import recompute_problem
from memopt.passes.partition import forward_region
from memopt.passes.recompute import (last_uses, mirrorable, node_flops, recompute_sources,
                                     storage_sizes)
from memopt.passes.simulate import Simulated, StepModel

from ..memory_plan import SearchCandidate
from .build import Mirror


def choose_mirror(joint: fx.GraphModule, num_fwd_outputs: int, budget_bytes: int,
                  mutable_inputs: frozenset[str], simulate: Callable[[Mirror], Simulated],
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
    allowed = {n.name for n in mirrorable(joint, num_fwd_outputs, mutable_inputs)}
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


def solve_exactly(model: StepModel, target: int, simulate: Callable[[Mirror], Simulated],
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


