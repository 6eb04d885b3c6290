"""Mirror plans under a budget B: Chen et al. 2016, Alg. 3, and the search over B of Appendix A.

A mirror plan sets m(v) for every node in topological order: m(v) = 0 keeps v's output
for the backward pass, m(v) = 1 drops it and recomputes it (a mirror node of Alg. 2)
when the gradient needs it. Alg. 3 walks the nodes accumulating output bytes in `temp`
and closes a stage at the first candidate split point (Sec. 4.3: a node whose output
alone separates the graph) where `temp > B`; that node is kept. `x` approximates the
bytes of the kept inter-stage outputs, `y` the largest stage. Small B keeps many
outputs (large x, small y), large B few (small x, large y): Sec. 4.3's O(sqrt(n)) plan
is the balance, which Appendix A finds by a grid search over B scored by the exact
static allocation (the caller's `score`).

Extension beyond the paper: `droppable[v] == False` forces m(v) = 0, for outputs that
must not be recomputed (random ops, in-place-mutated inputs, costly ops; Sec. 4.2 keeps
the costly convolutions). Such a node is stored for the whole backward, so its bytes
count into x, and it is never recomputed, so its bytes do not count into temp. A
non-droppable candidate is a kept split point like any other and closes its stage; a
non-droppable non-candidate does not, since its output alone does not separate the
graph and recomputation of the stage still starts from the previous split.

Pure Python on plain ints: never imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar
from dataclasses import dataclass

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SegmentPlan:
    """The output of Alg. 3 for one budget B."""

    mirror: tuple[bool, ...]  # per node, topological order: True = m(v)=1 (recompute), False = kept
    inter_stage_bytes: int  # x of Alg. 3: bytes of the kept outputs
    max_stage_bytes: int  # y of Alg. 3: the largest accumulated stage when it was closed
    budget: int  # the B it was planned with

    @property
    def num_kept(self) -> int:
        return self.mirror.count(False)


def plan_segments(
    sizes: Sequence[int],
    candidates: Sequence[bool],
    budget: int,
    *,
    droppable: Sequence[bool] | None = None,
) -> SegmentPlan:
    """Chen et al. 2016, Alg. 3 ("Memory Planning with Budget") over nodes in topological order.

    Steps (mirrored by `# Step k:` comments):
    1. temp, x, y <- 0.
    2. For each node v: a non-droppable v (our extension, see the module docstring) is
       kept: x += size(v); if v is a candidate, it closes the stage: y <- max(y, temp),
       temp <- 0.
    3. Otherwise, as in the paper: temp += size(v); if v is a candidate and temp > B,
       keep v (m(v) = 0), x += size(v), y <- max(y, temp), temp <- 0; else m(v) = 1.

    As in the paper, bytes after the last kept candidate do not count into y. With B = 0
    every candidate is kept, except a zero-byte one right after a split (temp = 0 is not
    > 0); with B >= sum(sizes) only the non-droppable nodes are kept. Keeping is monotone:
    a larger B never keeps more nodes.
    """
    n = len(sizes)
    if len(candidates) != n or (droppable is not None and len(droppable) != n):
        raise ValueError(
            f"sizes, candidates and droppable must have one entry per node, got {n}, "
            f"{len(candidates)} and {n if droppable is None else len(droppable)}"
        )
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if any(s < 0 for s in sizes):
        raise ValueError(f"sizes must be >= 0, got {min(sizes)}")

    # Step 1: nothing accumulated yet.
    temp = x = y = 0
    mirror: list[bool] = []
    for v, size in enumerate(sizes):
        if droppable is not None and not droppable[v]:
            # Step 2: forced keep; stored for backward, never recomputed.
            x += size
            if candidates[v]:
                y, temp = max(y, temp), 0
            mirror.append(False)
            continue
        # Step 3: Alg. 3's greedy split.
        temp += size
        if candidates[v] and temp > budget:
            x += size
            y, temp = max(y, temp), 0
            mirror.append(False)
        else:
            mirror.append(True)
    return SegmentPlan(tuple(mirror), x, y, budget)


def split_candidates(
    sizes: Sequence[int],
    droppable: Sequence[bool],
    last_use: Sequence[int],
    *,
    tolerance: float = 0.25,
) -> tuple[bool, ...]:
    """Chen et al. 2016, Sec. 4.3: the candidate split points of Alg. 3, nodes whose
    output alone separates the graph (no value computed before v is read after v).

    `last_use[j]` is the index of the last node reading node j's value (j if none).
    Kept values never break a segment (they are there anyway), and a tiny value (an
    attention mask, a position table) hardly does, so v is a candidate when it is
    droppable and the droppable bytes crossing it (values j < v with
    last_use[j] > v) are at most `tolerance * sizes[v]`. On a chain every droppable
    node is a candidate; on a residual network, the block outputs.
    """
    n = len(sizes)
    if not (len(droppable) == len(last_use) == n):
        raise ValueError(f"sizes, droppable and last_use must have one entry per node, got "
                         f"{n}, {len(droppable)} and {len(last_use)}")
    delta = [0] * (n + 1)  # crossing bytes by a difference array over positions
    for j, (size, drop, end) in enumerate(zip(sizes, droppable, last_use)):
        if drop and end > j + 1:
            delta[j + 1] += size
            delta[end] -= size
    crossing, result = 0, []
    for v in range(n):
        crossing += delta[v]
        result.append(bool(droppable[v]) and crossing <= tolerance * sizes[v])
    return tuple(result)


def _geometric(lo: float, hi: float, points: int) -> tuple[int, ...]:
    """`points` geometrically spaced ints on [lo, hi], sorted, deduplicated, each >= 1.

    When [lo, hi] holds no more than `points` integers, all of them are returned.
    """
    a, b = max(1, math.ceil(lo)), max(1, math.floor(hi))
    if b < a:  # no integer inside: the one nearest to the interval
        return (max(1, round((lo + hi) / 2)),)
    if b - a + 1 <= points:
        return tuple(range(a, b + 1))
    lo, hi = max(lo, 1.0), max(hi, 1.0)
    steps = max(points - 1, 1)
    grid = {round(lo * (hi / lo) ** (i / steps)) for i in range(points)}
    return tuple(sorted(min(max(g, a), b) for g in grid))


def grid_budgets(x: int, y: int, points: int = 6) -> tuple[int, ...]:
    """Chen et al. 2016, Appendix A: `points` budgets on [B0/sqrt(2), sqrt(2)*B0], B0 = sqrt(x*y).

    x and y come from Alg. 3 with B = 0. The grid is geometric, rounded to ints, sorted,
    deduplicated and >= 1, so it may have fewer than `points` values when B0 is small.
    """
    if x < 0 or y < 0:
        raise ValueError(f"x and y must be >= 0, got x={x}, y={y}")
    if points < 1:
        raise ValueError(f"points must be >= 1, got {points}")
    b0 = math.sqrt(x * y)
    return _geometric(b0 / math.sqrt(2), b0 * math.sqrt(2), points)


def search_budgets(
    sizes: Sequence[int],
    candidates: Sequence[bool],
    *,
    droppable: Sequence[bool] | None = None,
    score: Callable[[SegmentPlan], Any],
    points: int = 6,
    refine: bool = True,
) -> tuple[SegmentPlan, tuple[tuple[int, Any], ...]]:
    """Chen et al. 2016, Appendix A: grid search over B, each plan scored exactly by `score`.

    `score` is the exact cost of a plan (e.g. the predicted peak bytes of its static
    allocation, or a tuple); lower is better. Returns the best plan and every
    (B, score) tried, sorted by B. Ties go to fewer mirrored nodes (less
    recomputation), then smaller B. `score` is called once per distinct mirror tuple.

    The budgets tried depend on `sizes`, `candidates` and `droppable` only, never on
    the scores: a caller whose score encodes a memory budget (feasible plans by
    FLOPs, the rest by peak) gets the same plans for every budget, so a smaller
    budget never picks a plan with a higher peak.

    Steps (mirrored by `# Step k:` comments):
    1. Run Alg. 3 with B = 0; B0 = sqrt(x*y) from its x and y.
    2. Score B0 (the paper: "this can already give a good memory plan") and the grid of
       `grid_budgets(x, y, points)` around it.
    3. With `refine` (our extension beyond the paper): also score the extremes B = 0
       (every candidate kept) and B = sum(sizes) (nothing kept but the non-droppable
       nodes), and a grid four times as dense over [B0 / 4, 4 * B0].
    """
    memo: dict[tuple[bool, ...], Any] = {}
    tried: dict[int, tuple[Any, SegmentPlan]] = {}

    def evaluate(budgets: Sequence[int]) -> None:
        for b in budgets:
            if b not in tried:
                plan = plan_segments(sizes, candidates, b, droppable=droppable)
                if plan.mirror not in memo:
                    memo[plan.mirror] = score(plan)
                tried[b] = (memo[plan.mirror], plan)

    # Step 1: the first run with B = 0 sets the grid's center.
    first = plan_segments(sizes, candidates, 0, droppable=droppable)
    b0 = round(math.sqrt(first.inter_stage_bytes * first.max_stage_bytes))
    # Step 2: B0 and the grid around it.
    evaluate(sorted({b0, *grid_budgets(first.inter_stage_bytes, first.max_stage_bytes, points)}))
    if refine:
        # Step 3: the extremes and a wider, denser grid.
        evaluate((0, sum(sizes)))
        evaluate(_geometric(b0 / 4, b0 * 4, 4 * points))
    best = min(tried, key=lambda b: (tried[b][0], tried[b][1].mirror.count(True), b))
    return tried[best][1], tuple((b, tried[b][0]) for b in sorted(tried))


def placement_order(nodes: Iterable[T], inputs: Callable[[T], Iterable[T]],
                    emitted: set[T]) -> list[T]:
    """Chen et al. 2016, Alg. 2's traversal order: `nodes` in order, each preceded by its
    not yet emitted ancestors (a depth-first walk through `inputs`), so that a node no
    one emitted on its own (a mirror node) runs just before its first use:
    V' <- V' + topo(ancestors(v)) - V'. `emitted` holds what counts as done already (the
    graph's inputs) and is updated. Nodes that no walk reaches are left out."""
    order: list[T] = []
    for root in nodes:
        if root in emitted:
            continue
        if all(a in emitted for a in inputs(root)):  # the usual case: nothing to place
            emitted.add(root)
            order.append(root)
            continue
        work = [(root, False)]
        while work:
            node, ready = work.pop()
            if node in emitted:
                continue
            if ready:
                emitted.add(node)
                order.append(node)
                continue
            work.append((node, True))
            work.extend((a, False) for a in inputs(node) if a not in emitted)
    return order
