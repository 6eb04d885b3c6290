"""The exact recomputation plan under a budget: a Checkmate-style MILP, solved by HiGHS.

Jain et al. 2020 (Checkmate, MLSys) write rematerialization as a mixed-integer program:
per stage of a fixed schedule, which values are recomputed (R), which are kept in memory
(S, here P), which are freed after each op (FREE), and the memory after each op (U), with
the budget as a hard constraint and the recomputed FLOPs as the objective. This module
solves that program over memopt's own plan space (Chen et al. 2016, Alg. 2 with mirror
counts m(v) in {0, 1}): the forward runs once as scheduled; each forward value read by
the backward is either saved from the forward (s = 1) or recomputed once in the backward
(Alg. 2's mirror node), before the first backward op that needs it. It is the oracle
memopt's Alg. 3 + grid search is measured against (benchmarks/optimum_gap.py), not
part of `memopt.compile`.

Stages are the backward ops that read a forward value, in the backward's order; the ops
between them read none, and only the values kept across them (P) change their memory.
Within a stage the recomputations run in forward order before the stage's op (as
Checkmate's do); a value is freed after the last op of the stage that reads it unless
the stage's op reads it or a later stage keeps it.

Requires: a `RecomputeProblem` (plain ints, from memopt.passes.oracle). `highspy` (the
`[solver]` extra) is imported when `solve` runs.

Ensures: `solve(problem, budget)` returns the units to recompute with the least total
cost whose modelled peak is <= budget, or None where no plan fits, with HiGHS's status
and its lower bound on the cost (the proof of optimality when it equals the cost).

Pure Python on plain ints and numpy: never imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RecomputeProblem:
    """One training step as units (forward values, topological order) and stages.

    Per unit i: `sizes[i]` bytes of its own storage (0 for a view: its bytes are its
    `bases[i]`'s), `costs[i]` FLOPs to recompute it, `recomputable[i]`, `sources[i]`
    the units its recomputation reads, `workspace[i]` bytes its recomputation holds
    besides its inputs and output (kernel scratch, a twin's temporaries), and
    `forward_last[i]` the last forward step that touches it.

    `forward_fixed[f]`: bytes live at forward step f that the plan does not change (every
    unit counted up to its last forward use). Per stage s: `reads[s]` the units its op
    reads, `phase_fixed[s]` the other bytes live while recomputations run before it,
    `at_fixed[s]` the other bytes live at its op, `after_fixed[s]` the most other bytes
    live at the steps between it and the next stage. `before_fixed`: the most at the
    backward's steps before the first stage.
    """

    sizes: tuple[int, ...]
    costs: tuple[int, ...]
    recomputable: tuple[bool, ...]
    sources: tuple[tuple[int, ...], ...]
    bases: tuple[int | None, ...]
    workspace: tuple[int, ...]
    forward_last: tuple[int, ...]
    forward_fixed: tuple[int, ...]
    reads: tuple[tuple[int, ...], ...]
    phase_fixed: tuple[int, ...]
    at_fixed: tuple[int, ...]
    after_fixed: tuple[int, ...]
    before_fixed: int = 0

    @property
    def num_units(self) -> int:
        return len(self.sizes)


@dataclass(frozen=True)
class RecomputeSolution:
    """`recomputed` units (each once, in the backward) at `cost` FLOPs; `bound` is HiGHS's
    lower bound on the cost: `optimal` when the solver proved cost == bound."""

    recomputed: frozenset[int]
    saved: frozenset[int]
    cost: int
    bound: float
    optimal: bool
    status: str
    seconds: float
    size: dict[str, int] = field(default_factory=dict)  # variables, rows, nonzeros
    feasible: bool = True  # False: HiGHS proved no plan fits ("Infeasible"), or found
                           # none within the time limit ("Time limit reached")


class _Model:
    """Columns and rows for highspy, built as Python lists."""

    def __init__(self) -> None:
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.cost: list[float] = []
        self.integer: list[int] = []
        self.rows: list[tuple[float, float, dict[int, float]]] = []

    def var(self, cost: float = 0.0, upper: float = 1.0, integer: bool = True) -> int:
        self.lower.append(0.0)
        self.upper.append(upper)
        self.cost.append(cost)
        if integer:
            self.integer.append(len(self.lower) - 1)
        return len(self.lower) - 1

    def row(self, terms: dict[int, float] | Sequence[tuple[int, float]], lower: float,
            upper: float) -> None:
        coef: dict[int, float] = {}
        for j, c in (terms.items() if isinstance(terms, dict) else terms):
            coef[j] = coef.get(j, 0.0) + c
        self.rows.append((lower, upper, {j: c for j, c in coef.items() if c}))


def solve(problem: RecomputeProblem, budget: int, *, time_limit: float = 60.0,
          threads: int | None = None) -> RecomputeSolution:
    """The least-cost recomputation set whose peak is <= `budget` bytes; `feasible` is
    False where HiGHS proves that none exists or finds none within `time_limit` s."""
    import highspy  # the [solver] extra
    import numpy as np

    p = problem
    n, stages = p.num_units, len(p.reads)
    inf = highspy.kHighsInf
    model = _Model()
    views: dict[int, list[int]] = {}
    for i, b in enumerate(p.bases):
        if b is not None:
            views.setdefault(b, []).append(i)

    def root(i: int) -> int:
        return p.bases[i] if p.bases[i] is not None else i

    users: dict[int, list[int]] = {}
    for k in range(n):
        for i in p.sources[k]:
            users.setdefault(i, []).append(k)
    # Where each unit can be needed: the stages reading it, and the stages where a user's
    # recomputation can run. The backward reads a chain's units in reverse, so a unit is
    # recomputed at the first stage that needs it or one of its descendants.
    read_at: dict[int, list[int]] = {}
    for s, units in enumerate(p.reads):
        for i in units:
            read_at.setdefault(i, []).append(s)
    can_run: dict[int, set[int]] = {}
    for k in reversed(range(n)):
        stages_k = set(read_at.get(k, ()))
        for u in users.get(k, ()):
            stages_k |= can_run.get(u, set())
        for v in views.get(k, ()):  # a view's readers keep its base's storage
            stages_k |= can_run.get(v, set())
        can_run[k] = stages_k
    last_need = {i: max(can_run[i]) if can_run[i] else -1 for i in range(n)}
    first_read = {i: min(read_at[i]) if i in read_at else stages for i in range(n)}

    saved = [model.var() for _ in range(n)]
    recompute: dict[tuple[int, int], int] = {}
    recompute_of: dict[int, list[int]] = {}  # unit -> its R columns, for m(v) <= 1
    for i in range(n):
        if p.recomputable[i]:
            for s in sorted(can_run[i]):
                if s <= first_read[i]:
                    recompute[(s, i)] = model.var(cost=float(p.costs[i]))
                    recompute_of.setdefault(i, []).append(recompute[(s, i)])
    # present[s, i]: unit i is in memory when stage s starts (s = 0: saved)
    present: dict[tuple[int, int], int] = {}
    for i in range(n):
        present[(0, i)] = saved[i]
        for s in range(1, last_need[i] + 1):
            present[(s, i)] = model.var()

    def there(s: int, i: int) -> list[tuple[int, float]]:
        """P[s, i] + R[s, i] as terms."""
        return [(v, 1.0) for v in (present.get((s, i)), recompute.get((s, i))) if v is not None]

    for i in range(n):
        # computed once in the backward, or saved: memopt's m(v) in {0, 1}
        model.row([(saved[i], 1.0)] + [(v, 1.0) for v in recompute_of.get(i, ())], -inf, 1.0)
        if not can_run[i]:
            model.row([(saved[i], 1.0)], 0.0, 0.0)
        for s in range(last_need[i]):  # kept only if there before, or made in stage s
            model.row([(present[(s + 1, i)], 1.0)] + [(v, -1.0) for v in
                                                     (present[(s, i)], recompute.get((s, i)))
                                                     if v is not None], -inf, 0.0)
        if p.bases[i] is not None:  # a view keeps its base's storage
            for s in range(last_need[i] + 1):
                model.row([(present[(s, i)], 1.0), (present[(s, p.bases[i])], -1.0)]
                          if (s, p.bases[i]) in present else [(present[(s, i)], 1.0)],
                          -inf, 0.0)
    for s, units in enumerate(p.reads):
        for i in set(units) | {root(i) for i in units}:
            model.row(there(s, i), 1.0, inf)
    for (s, k), r in recompute.items():
        for i in set(p.sources[k]) | {root(i) for i in p.sources[k]}:
            model.row([(r, -1.0)] + there(s, i), 0.0, inf)

    # memory: the forward, with each saved unit kept past its last forward use
    by_set: dict[tuple[int, ...], int] = {}
    for f, fixed in enumerate(p.forward_fixed):
        extended = tuple(i for i in range(n) if p.sizes[i] and p.forward_last[i] < f)
        by_set[extended] = max(by_set.get(extended, 0), fixed)
    for extended, fixed in by_set.items():
        model.row([(saved[i], float(p.sizes[i])) for i in extended], -inf, budget - fixed)
    model.row([(saved[i], float(p.sizes[i])) for i in range(n) if p.sizes[i]], -inf,
              budget - p.before_fixed)

    # memory: each stage, Checkmate's U after each recomputation, then the stage's op
    for s in range(stages):
        reads = set(p.reads[s]) | {root(i) for i in p.reads[s]}
        level: list[tuple[int, float]] = [(present[(s, i)], float(p.sizes[i]))
                                         for i in range(n) if p.sizes[i] and (s, i) in present]
        base = float(p.phase_fixed[s])
        running = None  # the U column of the last recomputation
        for k in range(n):
            r = recompute.get((s, k))
            if r is None:
                continue
            terms = ([(running, 1.0)] if running is not None else list(level))
            terms = terms + [(r, float(p.sizes[k]))]
            start = 0.0 if running is not None else base
            model.row(terms + [(r, float(p.workspace[k]))], -inf, budget - start)
            # U[s, k] = U[s, k-1] + size_k R - sum of what is freed after k
            u = model.var(upper=inf, integer=False)
            freed: list[tuple[int, float]] = []
            for i in set(p.sources[k]) | {root(j) for j in p.sources[k]} | {k}:
                if not p.sizes[i] or i in reads:
                    continue
                free = model.var()
                model.row([(free, 1.0), (r, -1.0)], -inf, 0.0)
                for holder in [i] + views.get(i, []):
                    if (s + 1, holder) in present:
                        model.row([(free, 1.0), (present[(s + 1, holder)], 1.0)], -inf, 1.0)
                    if holder in reads:
                        model.row([(free, 1.0)], 0.0, 0.0)
                    for j in users.get(holder, ()):
                        if j > k and (s, j) in recompute:
                            model.row([(free, 1.0), (recompute[(s, j)], 1.0)], -inf, 1.0)
                freed.append((free, -float(p.sizes[i])))
            model.row([(u, -1.0)] + terms + freed, -start, -start)
            running = u
        after_phase = [(running, 1.0)] if running is not None else level
        start = 0.0 if running is not None else base
        model.row(after_phase, -inf, budget - start - (p.at_fixed[s] - p.phase_fixed[s]))
        model.row([(present[(s + 1, i)], float(p.sizes[i])) for i in range(n)
                   if p.sizes[i] and (s + 1, i) in present], -inf, budget - p.after_fixed[s])

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("mip_rel_gap", 0.0)
    if threads is not None:
        h.setOptionValue("threads", int(threads))
    cols = len(model.lower)
    h.addVars(cols, np.array(model.lower), np.array(model.upper))
    h.changeColsCost(cols, np.arange(cols, dtype=np.int32), np.array(model.cost))
    if model.integer:
        h.changeColsIntegrality(len(model.integer), np.array(model.integer, dtype=np.int32),
                                np.array([highspy.HighsVarType.kInteger] * len(model.integer)))
    starts, index, value = [], [], []
    for _, _, coef in model.rows:
        starts.append(len(index))
        index.extend(coef)
        value.extend(coef.values())
    h.addRows(len(model.rows), np.array([r[0] for r in model.rows]),
              np.array([r[1] for r in model.rows]), len(index),
              np.array(starts, dtype=np.int32), np.array(index, dtype=np.int32),
              np.array(value, dtype=np.float64))
    h.run()
    info = h.getInfo()
    status = h.modelStatusToString(h.getModelStatus())
    size = {"variables": cols, "rows": len(model.rows), "nonzeros": len(index)}
    if info.primal_solution_status != 2:  # proven infeasible, or none found in time
        return RecomputeSolution(recomputed=frozenset(), saved=frozenset(), cost=0,
                                 bound=float(info.mip_dual_bound), optimal=False,
                                 status=status, seconds=float(h.getRunTime()), size=size,
                                 feasible=False)
    x = h.getSolution().col_value
    chosen = frozenset(i for (s, i), v in recompute.items() if x[v] > 0.5)
    return RecomputeSolution(
        recomputed=chosen, saved=frozenset(i for i in range(n) if x[saved[i]] > 0.5),
        cost=sum(p.costs[i] for i in chosen), bound=float(info.mip_dual_bound),
        optimal=status == "Optimal", status=status, seconds=float(h.getRunTime()), size=size)
