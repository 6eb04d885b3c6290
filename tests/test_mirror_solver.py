"""Tests for memopt.allocator.mirror (Chen et al. 2016, Alg. 3 and Appendix A's search over B).

Tiers (STYLE.md section 7): table-driven Alg. 3 cases computed by hand; an oracle for
the uniform-chain optimum written here, apart from the solver; hypothesis properties
over random chains; and an import check with torch blocked.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memopt.allocator import (SegmentPlan, grid_budgets, plan_segments, search_budgets,
                              split_candidates)

REPO = Path(__file__).resolve().parents[1]
T, F = True, False


# Tier 1: Alg. 3 by hand ----------------------------------------------------------------

ALG3_CASES = [
    # (sizes, candidates, droppable, B, mirror, x, y)
    pytest.param(
        [1] * 10, [T] * 10, None, 3,
        (T, T, T, F, T, T, T, F, T, T), 2, 4,
        id="unit-chain-B3-every-4th",
    ),
    pytest.param([1] * 10, [T] * 10, None, 0, (F,) * 10, 10, 1, id="B0-keeps-every-candidate"),
    pytest.param([1] * 10, [T] * 10, None, 10**9, (T,) * 10, 0, 0, id="huge-B-keeps-nothing"),
    pytest.param(
        [5, 1, 1, 5, 2, 2], [T, F, T, T, F, T], None, 6,
        (T, T, F, T, T, F), 1 + 2, 9,
        id="non-candidate-crossing-B-not-kept",
    ),
    pytest.param(
        [5, 1, 1, 5, 2, 2], [T, F, T, T, F, T], None, 0,
        (F, T, F, F, T, F), 13, 5,
        id="B0-non-candidates-mirrored",
    ),
    pytest.param(
        # node 1 is forced kept: x += 4, and it adds nothing to temp.
        [2, 4, 2, 2, 2], [T, F, T, T, T], [T, F, T, T, T], 3,
        (T, F, F, T, F), 4 + 2 + 2, 4,
        id="non-droppable-non-candidate-kept-outside-temp",
    ),
    pytest.param(
        # node 1 is a forced-kept candidate: it closes the stage (y = temp before it = 2).
        [2, 4, 2, 2, 2], [T, T, T, T, T], [T, F, T, T, T], 100,
        (T, F, T, T, T), 4, 2,
        id="non-droppable-candidate-closes-stage",
    ),
    pytest.param([], [], None, 0, (), 0, 0, id="empty"),
]


@pytest.mark.parametrize("sizes,cands,drop,budget,mirror,x,y", ALG3_CASES)
def test_alg3_by_hand(sizes, cands, drop, budget, mirror, x, y):
    plan = plan_segments(sizes, cands, budget, droppable=drop)
    assert plan == SegmentPlan(mirror, x, y, budget)


def test_zero_byte_candidate_after_a_split_is_not_kept_at_B0():
    assert plan_segments([1, 0, 1], [T, T, T], 0).mirror == (F, T, F)


@pytest.mark.parametrize(
    "args,kwargs",
    [
        (([1, 2], [T], 0), {}),
        (([1, 2], [T, T], 0), {"droppable": [T]}),
        (([1, 2], [T, T], -1), {}),
        (([1, -2], [T, T], 0), {}),
    ],
    ids=["candidates-length", "droppable-length", "negative-budget", "negative-size"],
)
def test_plan_segments_rejects_bad_input(args, kwargs):
    with pytest.raises(ValueError):
        plan_segments(*args, **kwargs)


# Appendix A grid ----------------------------------------------------------------------


def test_grid_budgets_known_center():
    grid = grid_budgets(16, 4)  # B0 = sqrt(64) = 8
    assert len(grid) == 6
    assert list(grid) == sorted(set(grid))
    assert all(8 / math.sqrt(2) <= b <= 8 * math.sqrt(2) for b in grid)


@pytest.mark.parametrize("x,y,points", [(10**8, 10**6, 6), (400, 4, 6), (10**6, 10**6, 11)])
def test_grid_budgets_geometric_and_in_range(x, y, points):
    b0 = math.sqrt(x * y)
    grid = grid_budgets(x, y, points)
    assert len(grid) == points
    ideal = [b0 * 2 ** (i / (points - 1) - 0.5) for i in range(points)]
    assert all(abs(b - g) <= 1 for b, g in zip(grid, ideal))
    assert b0 / math.sqrt(2) <= grid[0] and grid[-1] <= b0 * math.sqrt(2)


@pytest.mark.parametrize("x,y", [(0, 0), (0, 5), (1, 1), (2, 1)])
def test_grid_budgets_degenerate_is_positive_and_nonempty(x, y):
    grid = grid_budgets(x, y)
    assert grid and all(b >= 1 for b in grid) and list(grid) == sorted(set(grid))


def test_grid_budgets_rejects_bad_input():
    with pytest.raises(ValueError):
        grid_budgets(-1, 4)
    with pytest.raises(ValueError):
        grid_budgets(4, 4, points=0)


# Appendix A search --------------------------------------------------------------------


def chain_cost(plan: SegmentPlan, size: int) -> int:
    """Stored outputs plus the longest run of recomputed nodes, in bytes (Sec. 4.3, Eq. 1)."""
    longest = run = 0
    for m in plan.mirror:
        run = run + 1 if m else 0
        longest = max(longest, run)
    return size * (plan.mirror.count(False) + longest)


def uniform_chain_optimum(n: int, size: int) -> int:
    """Over all plans: k kept nodes leave n - k recomputed in k + 1 runs, best split evenly."""
    return size * min(k + math.ceil((n - k) / (k + 1)) for k in range(n + 1))


@pytest.mark.parametrize("refine", [False, True])
def test_search_finds_sqrt_n_plan_on_uniform_chain(refine):
    n, size = 100, 4
    best, tried = search_budgets(
        [size] * n, [T] * n, score=lambda p: chain_cost(p, size), refine=refine
    )
    optimum = uniform_chain_optimum(n, size)
    assert optimum == size * 19  # about 2 sqrt(n)
    assert chain_cost(best, size) <= 1.1 * optimum
    assert 8 <= best.num_kept <= 12
    assert (best.budget, chain_cost(best, size)) in tried
    assert [b for b, _ in tried] == sorted({b for b, _ in tried})


def test_refine_tries_extremes_and_never_does_worse():
    sizes = [3, 9, 1, 4, 4, 8, 2, 2, 7, 5, 1, 6, 3, 3, 9]
    cands = [T, F, T, T, F, T, T, T, F, T, T, F, T, T, T]

    def score(p: SegmentPlan) -> int:
        return p.inter_stage_bytes + 2 * p.max_stage_bytes

    coarse, coarse_tried = search_budgets(sizes, cands, score=score, refine=False)
    fine, fine_tried = search_budgets(sizes, cands, score=score, refine=True)
    budgets = {b for b, _ in fine_tried}
    assert {0, sum(sizes)} <= budgets
    assert {b for b, _ in coarse_tried} <= budgets
    assert score(fine) <= score(coarse)


def test_search_score_called_once_per_distinct_plan():
    sizes = [10] * 30  # bytes move in steps of 10, so nearby budgets give the same plan
    calls: list[tuple[bool, ...]] = []

    def score(p: SegmentPlan) -> int:
        calls.append(p.mirror)
        return chain_cost(p, 10)

    _, tried = search_budgets(sizes, [T] * 30, score=score)
    distinct = {plan_segments(sizes, [T] * 30, b).mirror for b, _ in tried}
    assert len(calls) == len(set(calls)) == len(distinct)
    assert len(tried) > len(distinct)  # some budgets gave the same plan and were not rescored


def test_search_ties_go_to_fewer_mirrored_nodes():
    best, tried = search_budgets([2] * 12, [T] * 12, score=lambda p: 0)
    assert best.num_kept == 12 and best.budget == 0
    assert all(s == 0 for _, s in tried)


def test_search_tries_the_same_budgets_whatever_the_scores():
    sizes, cands = [3, 9, 1, 4, 4, 8, 2, 2, 7, 5, 1, 6, 3, 3, 9], [T] * 15
    _, by_peak = search_budgets(sizes, cands, score=lambda p: p.max_stage_bytes)
    _, by_kept = search_budgets(sizes, cands, score=lambda p: -p.num_kept)
    assert [b for b, _ in by_peak] == [b for b, _ in by_kept]


def test_search_keeps_non_droppable_in_every_plan():
    drop = [T, F, T, T, T, F, T, T]
    seen: list[SegmentPlan] = []

    def score(p: SegmentPlan) -> int:
        seen.append(p)
        return p.inter_stage_bytes + p.max_stage_bytes

    search_budgets([4] * 8, [T] * 8, droppable=drop, score=score)
    assert seen and all(not p.mirror[1] and not p.mirror[5] for p in seen)


# Split candidates (Sec. 4.3): values that alone separate the graph ---------------------


def test_every_node_of_a_chain_is_a_split_candidate():
    n = 6
    assert split_candidates([4] * n, [T] * n, [i + 1 for i in range(n - 1)] + [n - 1]) == (T,) * n


def test_residual_blocks_split_only_at_block_outputs():
    # two blocks x -> b -> c -> add(x, c): nodes 0-3 and 3-6, then an output 7. The
    # block input is read by the add, so it crosses b and c; the adds separate.
    last_use = [3, 2, 3, 6, 5, 6, 7, 7]
    assert split_candidates([4] * 8, [T] * 8, last_use) == (T, F, F, T, F, F, T, T)


def test_kept_and_tiny_crossing_values_do_not_break_a_split():
    # node 0 is read by node 4: it crosses 1..3 (big droppable: no candidates there)
    assert split_candidates([8, 8, 8, 8, 8], [T] * 5, [4, 2, 3, 4, 4])[1:4] == (F, F, F)
    # kept (non-droppable): no effect on the others
    assert split_candidates([8, 8, 8, 8, 8], [F, T, T, T, T], [4, 2, 3, 4, 4]) == (F, T, T, T, T)
    # tiny (a mask): within the tolerance
    assert split_candidates([1, 8, 8, 8, 8], [T] * 5, [4, 2, 3, 4, 4]) == (T,) * 5


def test_split_candidates_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="one entry per node"):
        split_candidates([1, 2], [T], [0, 1])


# Tier 2: properties over random chains -------------------------------------------------

chains = st.integers(min_value=0, max_value=40).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, 50), min_size=n, max_size=n),
        st.lists(st.booleans(), min_size=n, max_size=n),
        st.lists(st.booleans(), min_size=n, max_size=n),
    )
)


@settings(max_examples=100, deadline=None)
@given(chains, st.integers(0, 400), st.integers(0, 400), st.booleans())
def test_alg3_properties(chain, b1, b2, use_droppable):
    sizes, cands, drop = chain
    drop_arg = drop if use_droppable else None
    drop = drop if use_droppable else [T] * len(sizes)
    lo, hi = sorted((b1, b2))
    p_lo = plan_segments(sizes, cands, lo, droppable=drop_arg)
    p_hi = plan_segments(sizes, cands, hi, droppable=drop_arg)
    for plan in (p_lo, p_hi):
        assert len(plan.mirror) == len(sizes)
        for v, mirrored in enumerate(plan.mirror):
            if not drop[v]:
                assert not mirrored  # non-droppable: always kept
            elif not cands[v]:
                assert mirrored  # droppable non-candidate: always recomputed
        kept = [v for v, m in enumerate(plan.mirror) if not m]
        assert plan.inter_stage_bytes == sum(sizes[v] for v in kept)
        assert plan.max_stage_bytes <= sum(s for s, d in zip(sizes, drop) if d)
    assert p_hi.num_kept <= p_lo.num_kept  # a larger B never keeps more
    huge = plan_segments(sizes, cands, sum(sizes), droppable=drop_arg)
    assert huge.mirror == tuple(bool(d) for d in drop)


@settings(max_examples=50, deadline=None)
@given(chains)
def test_search_best_is_min_over_tried(chain):
    sizes, cands, drop = chain

    def score(p: SegmentPlan) -> int:
        return p.inter_stage_bytes + p.max_stage_bytes

    best, tried = search_budgets(sizes, cands, droppable=drop, score=score)
    assert score(best) == min(s for _, s in tried)
    assert (best.budget, score(best)) in tried


# Layering ------------------------------------------------------------------------------


def test_mirror_solver_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None; "
        f"sys.path.insert(0, {str(REPO)!r}); "
        "import allocator, allocator.mirror; "
        "assert allocator.plan_segments([1] * 4, [True] * 4, 1).mirror == "
        "(True, False, True, False); "
        "assert sys.modules['torch'] is None"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
