"""Tests for memopt.allocator.gruslys (Gruslys et al. 2016, Sec. 3.1-3.5, eq. 2-10, Fig. 3).

Everything here is written from the paper, apart from the solver:

- tier 1: the paper's boundary conditions and Fig. 3 as plain numbers;
- tier 2: brute-force oracles (memoized recursions with full scans over y, eq. 2-3, 4-5,
  6-9 and 10), a numpy full-scan table for mid-size chains, the closed form of binomial
  checkpointing for HSM at scale, and a schedule interpreter that replays every action,
  counts forward steps and memory units by its own rules and checks them against m;
- hypothesis over random (t, m, strategy, alpha, beta), and an import check with torch
  blocked;
- the solver's fast paths (convex merge, Monge envelope over a column's hull) against its
  own full scan over y, table against table and on arbitrary non-convex columns.

Units (from the paper's boundary conditions): HSM counts hidden-state slots with h_0
included and the core free (C(t, 1) = t(t + 1) / 2); ISM counts internal-state slots with
the core included and h_0 free; MSM counts hidden-state units, h_0 = 1, a stored internal
state alpha, or beta when its input hidden state is already in memory (eq. 10), core free.
"""

from __future__ import annotations

import functools
import itertools
import math
import subprocess
import sys
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memopt.allocator import gruslys
from memopt.allocator.gruslys import Action, solve

REPO = Path(__file__).resolve().parents[1]
INF = math.inf
MSM_PARAMS = [(2, 2), (2, 1), (3, 3), (3, 2), (5, 5), (5, 4), (4, 1)]  # (alpha, beta)


# Oracles: the paper's recursions, full scans over y ---------------------------------------
#
# Only the base cases the recursions cannot produce are given; the "plentiful memory"
# boundaries (C = 2t - 1, C = t) are *not* put in, so the tests below can check that the
# solver agrees with them and with the recursion at once.


@functools.cache
def hsm_oracle(t: int, m: int) -> float:
    """Eq. 2-3: Q(t, m, y) = y + C(t - y, m - 1) + C(y, m), 1 <= y < t."""
    if m < 1:
        return INF
    if t == 1:
        return 1
    if m == 1:
        return t * (t + 1) // 2
    return min(y + hsm_oracle(t - y, m - 1) + hsm_oracle(y, m) for y in range(1, t))


@functools.cache
def ism_oracle(t: int, m: int) -> float:
    """Eq. 4-5: Q(t, m, y) = y + C(y - 1, m) + C(t - y, m - 1), 1 <= y <= t; C(0, m) = 0."""
    if t == 0:
        return 0
    if m < 1:
        return INF
    if m == 1:
        return t * (t + 1) // 2
    return min(y + ism_oracle(y - 1, m) + ism_oracle(t - y, m - 1) for y in range(1, t + 1))


@functools.cache
def msm_oracle(t: int, m: int, alpha: int, beta: int) -> float:
    """Eq. 6-9 with eq. 10's beta: C = min(min_y Q1, min_y Q2).

    C(0, m) = 0 for every m (storing a segment's last internal state and backpropagating
    it at once is the core: the costs are the same with C(0, m <= 0) = inf, checked by
    hand for t <= 14, m <= 14, alpha <= 5).
    """
    if t == 0:
        return 0
    if m < 1:
        return INF
    if t == 1:
        return 1
    if m == 1:
        return t * (t + 1) // 2
    q1 = min(y + msm_oracle(y, m, alpha, beta) + msm_oracle(t - y, m - 1, alpha, beta)
             for y in range(1, t))
    q2 = min(y + msm_oracle(y - 1, m, alpha, beta)
             + msm_oracle(t - y, m - (beta if y == 1 else alpha), alpha, beta)
             for y in range(1, t + 1))
    return min(q1, q2)


def oracle(strategy: str, t: int, m: int, alpha: int | None = None,
           beta: int | None = None) -> float:
    if strategy == "hsm":
        return hsm_oracle(t, m)
    if strategy == "ism":
        return ism_oracle(t, m)
    return msm_oracle(t, m, alpha, alpha if beta is None else beta)


def numpy_table(strategy: str, t_max: int, m_max: int, alpha: int = 1, beta: int = 1
                ) -> np.ndarray:
    """C[t, m] for t <= t_max, m <= m_max, bottom up, each entry a full scan over y.

    Columns are padded with ``alpha`` columns of m <= 0 (inf for t > 0, 0 for t = 0).
    Returns the array indexed [t, m] (m = 0 is the padding column).
    """
    big = np.int64(1) << 40
    pad = alpha
    C = np.full((t_max + 1, m_max + 1 + pad), big, dtype=np.int64)
    C[0, :] = 0
    ys = np.arange(t_max + 1, dtype=np.int64)
    for mm in range(1, m_max + 1):
        c = mm + pad
        C[1, c] = 1
        for t in range(2, t_max + 1):
            if mm == 1:
                C[t, c] = t * (t + 1) // 2
                continue
            y = ys[1:t + 1]
            if strategy in ("ism", "msm"):
                g = c - (1 if strategy == "ism" else alpha)
                q2 = y + C[y - 1, c] + C[t - y, g]
                if strategy == "msm":
                    q2[0] = 1 + C[0, c] + C[t - 1, c - beta]
                best = q2.min()
            else:
                best = big
            if strategy in ("hsm", "msm"):
                y1 = ys[1:t]
                best = min(best, (y1 + C[y1, c] + C[t - y1, c - 1]).min())
            C[t, c] = best
    return C[:, pad:]


def binomial_hsm(t: int, m: int) -> int:
    """HSM's C(t, m) in closed form (binomial checkpointing, Griewank 1992): with r the
    least integer with binom(m + r, m) >= t, C = t + r t - binom(m + r, m + 1)."""
    r = 0
    while math.comb(m + r, m) < t:
        r += 1
    return t + r * t - math.comb(m + r, m + 1)


# Schedule interpreter --------------------------------------------------------------------


@dataclass
class Replay:
    forward_ops: int = 0
    ops_through_first_backward: int | None = None
    first_pass_stores: list[Action] = field(default_factory=list)
    peak_units: int = 0
    peak_stored_hidden: int = 0
    peak_stored_internal: int = 0


def replay(p) -> Replay:
    """Run ``p.schedule`` on positions alone and check every action is legal.

    Available hidden positions: h_0, stored hidden states, the output hidden state of a
    stored internal state, and the hidden state just produced by the previous advance or
    store_internal (it sits in the core, uncounted). Units, per strategy:
      hsm: 1 (h_0) + stored hidden states;
      ism: stored internal states + 1 during a backward that recomputes (the core);
      msm: 1 (h_0) + stored hidden states + alpha per stored internal state, beta when its
           input hidden state was in memory when it was stored (eq. 10).
    A store_internal immediately followed by its own backward is the core (a forward with
    autograd, backpropagated at once): 1 unit for ism, free for msm.
    """
    t, m, strategy, sched = p.t, p.m, p.strategy, p.schedule
    out = Replay()
    stored_hidden: set[int] = set()
    internal: dict[int, int] = {}          # step -> units it holds
    beta_relies_on: dict[int, int] = {}    # step -> hidden position its beta discount needs
    current: int | None = None             # hidden just produced, in the core
    next_backward = t - 1

    def available(i: int) -> bool:
        return i == 0 or i in stored_hidden or (i - 1) in internal or i == current

    def units(core: int) -> int:
        if strategy == "hsm":
            return 1 + len(stored_hidden)
        if strategy == "ism":
            return len(internal) + core
        return 1 + len(stored_hidden) + sum(internal.values())

    for k, a in enumerate(sched):
        where = f"action {k} {tuple(a)} of {strategy} t={t} m={m}"
        assert isinstance(a, Action), where
        op, i, j = a
        core = 0
        if op == "advance":
            assert 0 <= i < j <= t, where
            assert available(i), f"{where}: hidden {i} not available"
            out.forward_ops += j - i
            current = j
        elif op == "store_hidden":
            assert i == j, where
            assert strategy != "ism", f"{where}: ISM stores internal states only"
            prev = sched[k - 1] if k else None
            assert prev is not None and prev[0] == "advance" and prev[2] == j, \
                f"{where}: not right after an advance ending at {j}"
            assert j not in stored_hidden, f"{where}: already stored"
            stored_hidden.add(j)
        elif op == "store_internal":
            assert j == i + 1 and 0 <= i <= next_backward, where
            assert strategy != "hsm", f"{where}: HSM stores hidden states only"
            assert i not in internal, f"{where}: already stored"
            assert available(i), f"{where}: hidden {i} not available"
            nxt = sched[k + 1] if k + 1 < len(sched) else None
            is_core = nxt is not None and tuple(nxt) == ("backward", i, i + 1)
            if strategy == "ism":
                size = 1
            elif is_core:
                size = 0
            elif i == 0 or (i - 1) in internal:
                size = p.beta
            elif i in stored_hidden:
                size = p.beta
                beta_relies_on[i] = i
            else:
                size = p.alpha
            internal[i] = size
            out.forward_ops += 1
            current = i + 1
        elif op == "backward":
            assert j == i + 1, where
            assert i == next_backward, f"{where}: expected backward of step {next_backward}"
            if i not in internal:
                assert available(i), f"{where}: recompute needs hidden {i}"
                out.forward_ops += 1
                core = 1
            out.peak_units = max(out.peak_units, units(core))   # the state is in use now
            internal.pop(i, None)
            beta_relies_on.pop(i, None)
            next_backward -= 1
            current = None
            if out.ops_through_first_backward is None:
                out.ops_through_first_backward = out.forward_ops
        elif op == "free":
            assert i == j and j in stored_hidden, f"{where}: hidden {j} is not stored"
            leaning = [s for s, h in beta_relies_on.items() if h == j]
            assert not leaning, f"{where}: internal states {leaning} were stored at beta on it"
            stored_hidden.remove(j)
        else:
            raise AssertionError(f"{where}: unknown op {op!r}")
        if out.ops_through_first_backward is None and op.startswith("store"):
            out.first_pass_stores.append(a)
        out.peak_units = max(out.peak_units, units(core))
        out.peak_stored_hidden = max(out.peak_stored_hidden, len(stored_hidden))
        out.peak_stored_internal = max(out.peak_stored_internal, len(internal))
    assert next_backward == -1, f"steps {next_backward}..0 never backpropagated"
    assert not internal, f"internal states {sorted(internal)} never consumed"
    return out


def check_policy(p, expected_cost: float | None = None) -> Replay:
    """Replay and check everything a policy claims about itself."""
    r = replay(p)
    label = f"{p.strategy} t={p.t} m={p.m} alpha={p.alpha} beta={p.beta}"
    assert r.forward_ops == p.cost, f"{label}: replayed {r.forward_ops} ops, cost {p.cost}"
    assert p.recompute == p.cost - p.t, label
    # The first pass: every step once, no step twice, before or at the first backward.
    assert r.ops_through_first_backward == p.t, (
        f"{label}: {r.ops_through_first_backward} forward ops through the first backward")
    assert p.peak_units <= p.m, f"{label}: reported peak {p.peak_units} > m"
    assert r.peak_units <= p.m, f"{label}: replayed peak {r.peak_units} > m"
    assert p.peak_units == r.peak_units, (
        f"{label}: reported peak {p.peak_units}, replayed {r.peak_units}")
    if expected_cost is not None:
        assert p.cost == expected_cost, f"{label}: cost {p.cost}, expected {expected_cost}"
    return r


def test_interpreter_rejects_broken_schedules():
    """The checker itself must be able to fail: break a good schedule a few ways."""
    p = solve(10, 4, "hsm")
    check_policy(p, 24)
    fields = ("strategy", "t", "m", "alpha", "beta", "cost", "recompute", "schedule",
              "peak_units")
    good = SimpleNamespace(**{f: getattr(p, f) for f in fields})
    check_policy(good, 24)

    def edit(**kw):
        return SimpleNamespace(**{**vars(good), **kw})

    sched = list(good.schedule)
    first_store = next(k for k, a in enumerate(sched) if a.op == "store_hidden")
    first_free = next(k for k, a in enumerate(sched) if a.op == "free")
    backwards = [k for k, a in enumerate(sched) if a.op == "backward"]
    swapped = list(sched)
    swapped[backwards[0]], swapped[backwards[1]] = swapped[backwards[1]], swapped[backwards[0]]
    broken = {
        "store dropped": sched[:first_store] + sched[first_store + 1:],
        "free too early": [sched[first_free]] + sched[:first_free] + sched[first_free + 1:],
        "backwards swapped": swapped,
        "last backward dropped": sched[:-1],
    }
    for why, bad in broken.items():
        with pytest.raises(AssertionError):
            check_policy(edit(schedule=tuple(bad)))
            pytest.fail(why)
    with pytest.raises(AssertionError):
        check_policy(edit(cost=23, recompute=13))
    with pytest.raises(AssertionError):
        check_policy(edit(m=3))   # its peak of 4 no longer fits


# Tier 1: the paper's numbers ---------------------------------------------------------------


@pytest.mark.parametrize("t", [1, 2, 3, 7, 20, 61])
def test_hsm_boundaries(t):
    """Sec. 3.1: C(t, 1) = t(t + 1) / 2 (only h_0), C(t, m) = 2t - 1 for m >= t.

    The paper's m >= t is sufficient, not tight: h_{t-1} need not be stored (step t - 1
    is backpropagated right after the advance that reaches it, as in the C(t, 1) base
    case), so m = t - 1 already gives 2t - 1 (eq. 2 with y = 1 all the way down); with
    m = t - 2 some step must be reached twice.
    """
    check_policy(solve(t, 1, "hsm"), t * (t + 1) // 2)
    for m in (t, t + 1, 2 * t + 5):
        check_policy(solve(t, m, "hsm"), 2 * t - 1)
    if t >= 2:
        check_policy(solve(t, t - 1, "hsm"), 2 * t - 1)
    if t >= 3:
        assert solve(t, t - 2, "hsm").cost > 2 * t - 1


@pytest.mark.parametrize("t", [1, 2, 3, 7, 20, 61])
def test_ism_boundaries(t):
    """Sec. 3.2: C(t, 1) = t(t + 1) / 2 (only the core), C(t, m) = t for m >= t."""
    check_policy(solve(t, 1, "ism"), t * (t + 1) // 2)
    for m in (t, t + 1, 3 * t):
        check_policy(solve(t, m, "ism"), t)
    if t > 1:
        assert solve(t, t - 1, "ism").cost > t


def test_ism_empty_sequence_base_case():
    """C(0, m) = 0 enters eq. 4 as C(y - 1, m) at y = 1: storing the first step's internal
    state costs 1 and leaves nothing on the left, so C(t, m) = 1 + C(t - 1, m - 1) when
    y = 1 is optimal; with m >= t that chain gives exactly t. At t = 1 nothing is left on
    either side: C(1, m) = 1 for every m."""
    for m in range(1, 6):
        check_policy(solve(1, m, "ism"), 1)
        check_policy(solve(1, m, "msm", alpha=3), 1)
    for t in range(2, 9):
        assert solve(t, t, "ism").cost == 1 + solve(t - 1, t - 1, "ism").cost == t


@pytest.mark.parametrize("alpha,beta", MSM_PARAMS)
@pytest.mark.parametrize("t", [1, 2, 5, 13])
def test_msm_boundaries(t, alpha, beta):
    """Sec. 3.3: C(t, 1) = t(t + 1) / 2, C(t, m) = t for m >= alpha t."""
    check_policy(solve(t, 1, "msm", alpha=alpha, beta=beta), t * (t + 1) // 2)
    for m in (alpha * t, alpha * t + 3):
        check_policy(solve(t, m, "msm", alpha=alpha, beta=beta), t)


@pytest.mark.parametrize("alpha,beta", MSM_PARAMS)
@pytest.mark.parametrize("t", [2, 3, 6, 11])
def test_msm_least_memory_for_no_recompute(t, alpha, beta):
    """C(t, m) = t means no step runs twice: steps 0..t-2 must all be stored as internal
    states (step t - 1 runs in the core), each at beta since its input hidden state is h_0
    or the previous stored state's output (eq. 10), plus h_0 itself: m = 1 + (t - 1) beta
    is exactly enough, one unit less is not."""
    least = 1 + (t - 1) * beta
    assert least <= alpha * t
    check_policy(solve(t, least, "msm", alpha=alpha, beta=beta), t)
    assert solve(t, least - 1, "msm", alpha=alpha, beta=beta).cost > t


def test_msm_defaults_beta_to_alpha():
    p = solve(9, 7, "msm", alpha=3)
    assert (p.strategy, p.t, p.m, p.alpha, p.beta) == ("msm", 9, 7, 3, 3)
    assert p.cost == solve(9, 7, "msm", alpha=3, beta=3).cost == msm_oracle(9, 7, 3, 3)


def test_policy_fields():
    p = solve(12, 3, "hsm")
    assert (p.strategy, p.t, p.m) == ("hsm", 12, 3)
    assert isinstance(p.cost, int) and isinstance(p.peak_units, int)
    assert p.recompute == p.cost - 12
    assert isinstance(p.schedule, tuple)
    assert all(isinstance(a, Action) and a == (a.op, a.i, a.j) for a in p.schedule)


def test_fig3a_t4_m4():
    """Fig. 3a: m = 4, t = 4 stores h_1, h_2 (and h_3, or backpropagates step 3 straight
    from the advance that reached it) and recomputes each step once: 2t - 1 = 7 forward
    steps. Cost 7 leaves no other schedule: 3 forward steps before the first backward,
    none between backwards, so every h_i the backward needs is stored on the way."""
    p = solve(4, 4, "hsm")
    check_policy(p, 7)
    body = [tuple(a) for a in p.schedule if a.op != "free"]
    head = [("advance", 0, 1), ("store_hidden", 1, 1),
            ("advance", 1, 2), ("store_hidden", 2, 2), ("advance", 2, 3)]
    tail = [("backward", 3, 4), ("backward", 2, 3), ("backward", 1, 2), ("backward", 0, 1)]
    assert body in (head + [("store_hidden", 3, 3)] + tail, head + tail), body


def test_fig3b_t10_m4():
    """Fig. 3b: m = 4, t = 10. The oracle gives C(10, 4) = 24. The first pass pushes
    hidden states like a stack: each push lands at an argmin of eq. 2 for the segment
    that remains to its right, with one slot fewer."""
    p = solve(10, 4, "hsm")
    assert hsm_oracle(10, 4) == 24
    r = check_policy(p, 24)
    assert r.peak_units <= 4 and r.peak_stored_hidden <= 3
    start, slots = 0, 4
    for a in r.first_pass_stores:
        assert a.op == "store_hidden"
        y, rest = a.j - start, 10 - start
        q = {yy: yy + hsm_oracle(rest - yy, slots - 1) + hsm_oracle(yy, slots)
             for yy in range(1, rest)}
        assert q[y] == min(q.values()) == hsm_oracle(rest, slots), (a, q)
        start, slots = a.j, slots - 1
    assert r.first_pass_stores, "the first pass stored nothing"


# Tier 2: oracles on a grid ----------------------------------------------------------------


def _grid_mismatches(strategy, alpha=None, beta=None, t_max=60, m_max=12):
    bad = []
    for m in range(1, m_max + 1):
        for t in range(1, t_max + 1):
            want = oracle(strategy, t, m, alpha, beta)
            got = solve(t, m, strategy, alpha=alpha, beta=beta).cost
            if got != want:
                bad.append((t, m, got, want))
    return bad


@pytest.mark.parametrize("strategy", ["hsm", "ism"])
def test_costs_match_oracle_grid(strategy):
    bad = _grid_mismatches(strategy)
    assert not bad, f"{strategy} (t, m, solver, oracle), {len(bad)} in all: {bad[:8]}"


@pytest.mark.parametrize("alpha,beta", MSM_PARAMS)
def test_msm_costs_match_oracle_grid(alpha, beta):
    bad = _grid_mismatches("msm", alpha, beta, t_max=50)
    assert not bad, f"msm a={alpha} b={beta} (t, m, solver, oracle) {len(bad)}: {bad[:8]}"


@pytest.mark.parametrize("strategy,alpha,beta",
                         [("hsm", None, None), ("ism", None, None)]
                         + [("msm", a, b) for a, b in MSM_PARAMS])
def test_schedules_replay_on_grid(strategy, alpha, beta):
    """Every schedule on a small grid is legal, costs what it claims, fits in m."""
    for t in range(1, 26):
        for m in range(1, 11):
            check_policy(solve(t, m, strategy, alpha=alpha, beta=beta),
                         oracle(strategy, t, m, alpha, beta))


@pytest.mark.parametrize("strategy,alpha,beta,t_max,m_max", [
    ("hsm", 1, 1, 900, 30),
    ("ism", 1, 1, 900, 30),
    ("msm", 5, 4, 500, 30),
    ("msm", 3, 3, 400, 24),
])
def test_costs_match_numpy_table_mid_scale(strategy, alpha, beta, t_max, m_max):
    """Past the recursion oracle's reach: the full-scan table at a few hundred steps."""
    C = numpy_table(strategy, t_max, m_max, alpha, beta)
    kw = {"alpha": alpha, "beta": beta} if strategy == "msm" else {}
    bad = []
    for m in [1, 2, 3, 4, 5, 7, 9, 12, 17, 23, m_max]:
        for t in [t_max, t_max - 1, t_max // 2 + 1, 97, 40]:
            got = solve(t, m, strategy, **kw).cost
            if got != int(C[t, m]):
                bad.append((t, m, got, int(C[t, m])))
    assert not bad, f"(t, m, solver, full scan): {bad[:8]}"
    check_policy(solve(t_max, m_max // 2, strategy, **kw), int(C[t_max, m_max // 2]))


def test_numpy_table_agrees_with_recursion_oracle():
    """The two oracles are written differently; they must agree where both reach."""
    for strategy, a, b in [("hsm", 1, 1), ("ism", 1, 1), ("msm", 3, 2), ("msm", 2, 2)]:
        C = numpy_table(strategy, 30, 8, a, b)
        for t in range(1, 31):
            for m in range(1, 9):
                assert C[t, m] == oracle(strategy, t, m, a, b), (strategy, t, m)


def test_hsm_matches_binomial_closed_form():
    for t in range(1, 80):
        for m in range(1, 10):
            assert hsm_oracle(t, m) == binomial_hsm(t, m), (t, m)
    for t, m in [(1000, 5), (2048, 11), (3000, 40), (777, 2)]:
        assert solve(t, m, "hsm").cost == binomial_hsm(t, m), (t, m)


# Comparisons between strategies --------------------------------------------------------


@pytest.mark.parametrize("alpha,beta", MSM_PARAMS)
def test_msm_never_worse_than_hsm_at_same_m(alpha, beta):
    """MSM's Q1 is HSM's eq. 2 with the same units, so its search space contains HSM's."""
    for t in range(1, 41):
        for m in range(1, 13):
            assert solve(t, m, "msm", alpha=alpha, beta=beta).cost <= solve(t, m, "hsm").cost


@pytest.mark.parametrize("alpha,beta", MSM_PARAMS)
def test_msm_never_worse_than_ism_at_matching_memory(alpha, beta):
    """ISM's m slots are the core plus m - 1 stored internal states, h_0 free; in MSM the
    core is free and h_0 costs 1, so the same stores fit in alpha (m - 1) + 1 hidden
    units. Eq. 7/10 at m' = alpha (m - 1) + 1 step down to alpha (m - 2) + 1 (or higher,
    beta <= alpha), which is eq. 4 at m - 1; C(t, 1) agrees: MSM(t, alpha (m-1) + 1) <=
    ISM(t, m), and so also at alpha m units (Fig. 5's note)."""
    for t in range(1, 41):
        for m in range(1, 11):
            ism = solve(t, m, "ism").cost
            tight = solve(t, alpha * (m - 1) + 1, "msm", alpha=alpha, beta=beta).cost
            assert tight <= ism, (t, m, tight, ism)
            assert solve(t, alpha * m, "msm", alpha=alpha, beta=beta).cost <= ism


def test_fig6_msm_beats_both():
    """Fig. 6a: alpha = 5, memory for 10 internal states or 50 hidden states."""
    for t in (10, 50, 200, 400):
        msm = solve(t, 50, "msm", alpha=5).cost
        assert msm <= solve(t, 50, "hsm").cost
        assert msm <= solve(t, 10, "ism").cost


def test_monotone_in_memory_and_beta():
    for t in (1, 6, 23, 57):
        for strategy in ("hsm", "ism"):
            costs = [solve(t, m, strategy).cost for m in range(1, 16)]
            assert costs == sorted(costs, reverse=True), (strategy, t, costs)
        for alpha in (2, 4):
            costs = [solve(t, m, "msm", alpha=alpha).cost for m in range(1, 4 * alpha + 8)]
            assert costs == sorted(costs, reverse=True), ("msm", alpha, t, costs)
            for m in (3, 7, 11):
                by_beta = [solve(t, m, "msm", alpha=alpha, beta=b).cost
                           for b in range(1, alpha + 1)]
                assert by_beta == sorted(by_beta), (t, m, alpha, by_beta)


@settings(max_examples=40, deadline=None)
@given(t=st.integers(1, 45), m=st.integers(1, 14), strategy=st.sampled_from(["hsm", "ism",
                                                                              "msm"]),
       alpha=st.integers(2, 6), beta_gap=st.integers(0, 5))
def test_random_policies_replay_and_are_optimal(t, m, strategy, alpha, beta_gap):
    beta = max(1, alpha - beta_gap)
    kw = {"alpha": alpha, "beta": beta} if strategy == "msm" else {}
    check_policy(solve(t, m, strategy, **kw), oracle(strategy, t, m, alpha, beta))


# The fast paths against the full scan ---------------------------------------------------
#
# gruslys._Table(..., reference=True) fills every entry by the full scan over y, the
# recursion exactly as written; the default table takes the convex merge or the Monge
# envelope over the earlier column's hull, with a certificate, falling back to the scan.


def _tables(strategy: str, alpha: int, beta: int, t: int, m: int):
    fast = gruslys._Table(strategy, alpha, beta)
    ref = gruslys._Table(strategy, alpha, beta, reference=True)
    fast.ensure(t, m)
    ref.ensure(t, m)
    return fast, ref


def _choice_value(C, strategy: str, t: int, m: int, choice: int, alpha: int, beta: int):
    """Eq. 2-10 at a table's first choice (y > 0: hidden state y; -y: the y-th step's
    internal state; 0: HSM's C(t, 1) or C(1, m)), on the costs C[m][t] of another table."""
    def c(mm, k):
        return 0 if k == 0 else (INF if mm <= 0 else C[mm][k])
    if choice == 0:
        assert strategy == "hsm" and (m == 1 or t == 1), (t, m)
        return t * (t + 1) // 2
    if choice > 0:
        return choice + c(m, choice) + c(m - 1, t - choice)
    y = -choice
    drop = beta if strategy == "msm" and y == 1 else alpha
    return y + c(m, y - 1) + c(m - drop, t - y)


def _fast_vs_full_scan(strategy, alpha, beta, t_max, m_max):
    """The tables agree and the fast one's choices are optimal; returns the full scan's."""
    fast, ref = _tables(strategy, alpha, beta, t_max, m_max)
    for m in range(1, m_max + 1):
        bad = [(t, fast.cost[m][t], ref.cost[m][t]) for t in range(t_max + 1)
               if fast.cost[m][t] != ref.cost[m][t]]
        assert not bad, f"{strategy} a={alpha} b={beta} m={m} (t, fast, scan): {bad[:8]}"
        for t in range(1, t_max + 1):
            got = _choice_value(ref.cost, strategy, t, m, fast.choice[m][t], alpha, beta)
            assert got == ref.cost[m][t], (strategy, alpha, beta, t, m, fast.choice[m][t])
    return ref.cost


@pytest.mark.parametrize("strategy,alpha,beta",
                         [("hsm", 1, 1), ("ism", 1, 1)] + [("msm", a, b) for a, b in MSM_PARAMS])
def test_fast_table_equals_full_scan(strategy, alpha, beta):
    """Every cost of a 400 x 40 table is the full scan's, every first choice attains it,
    and the policies ``solve`` backtracks replay at the full scan's cost."""
    C = _fast_vs_full_scan(strategy, alpha, beta, 400, 40)
    kw = {"alpha": alpha, "beta": beta} if strategy == "msm" else {}
    for t, m in [(400, 40), (400, 7), (399, 23), (173, 31), (64, 12)]:
        check_policy(solve(t, m, strategy, **kw), C[m][t])


@settings(max_examples=15, deadline=None)
@given(alpha=st.integers(2, 7), beta_gap=st.integers(0, 6), t=st.integers(1, 300),
       m=st.integers(1, 45))
def test_fast_msm_table_equals_full_scan_random(alpha, beta_gap, t, m):
    _fast_vs_full_scan("msm", alpha, max(1, alpha - beta_gap), t, m)


def _exact_hull(g: list[int]) -> list[Fraction]:
    """The lower convex hull at each k: the least chord value over i <= k <= j."""
    n = len(g)
    return [min(Fraction(g[i] * (j - k) + g[j] * (k - i), j - i) if i < j else Fraction(g[k])
                for i in range(k + 1) for j in range(k, n)) for k in range(n)]


@settings(max_examples=60, deadline=None)
@given(g=st.lists(st.integers(-40, 40), min_size=1, max_size=24))
def test_scaled_hull_is_floor_of_exact_hull(g):
    hull = gruslys._Hull(g)
    exact = _exact_hull(g)
    assert hull.scale > (len(g) - 1) ** 2
    assert hull.scaled == [math.floor(h * hull.scale) for h in exact]
    assert hull.tight == all(gk - h < 1 for gk, h in zip(g, exact))
    assert [hull.within_one(k) for k in range(len(g))] == [gk - h < 1 for gk, h in zip(g, exact)]


def _branch_rows(f_col, g, *, shift, y_lo, k_lo, reference):
    br = gruslys._Branch(f_col, g, g_convex=False, g_hull=lambda: gruslys._Hull(g), shift=shift,
                       y_lo=y_lo, k_lo=k_lo, sign=1, reference=reference)
    return [br.at(t, False) for t in range(1, len(g))]


def _column(n: int):
    """n values: anything, or a convex sequence with 0/1 bumps (within about 1 of its
    hull, like MSM's columns)."""
    wild = st.lists(st.integers(0, 50), min_size=n, max_size=n)
    near = st.tuples(st.lists(st.integers(0, 8), min_size=n, max_size=n),
                     st.lists(st.integers(0, 1), min_size=n, max_size=n)).map(
        lambda p: [a + b for a, b in zip(itertools.accumulate(sorted(p[0])), p[1])])
    return wild | near


@settings(max_examples=150, deadline=None)
@given(cols=st.integers(1, 40).flatmap(lambda n: st.tuples(_column(n), _column(n))),
       kind=st.sampled_from([(0, 1, 1), (1, 1, 0), (1, 2, 0)]))
def test_branch_envelope_exact_on_any_columns(cols, kind):
    """Steps 3-5 of the solver on arbitrary columns: g far from convex (the certificate
    fails and the scan takes over) or close to it, f anything. The minimum over y of
    y + f_col[y - shift] + g[t - y] must be the brute force's, at a y that attains it."""
    f_col, g = cols
    shift, y_lo, k_lo = kind
    got = _branch_rows(f_col, g, shift=shift, y_lo=y_lo, k_lo=k_lo, reference=False)
    for t, (c, y) in enumerate(got, start=1):
        vals = {yy: yy + f_col[yy - shift] + g[t - yy] for yy in range(y_lo, t - k_lo + 1)}
        if not vals:
            assert c == gruslys.INF, (t, c)
            continue
        assert c == min(vals.values()) == vals[y], (t, c, y, vals)


def test_branch_falls_back_where_the_hull_is_loose(monkeypatch):
    """A column 2 above its hull at k = 2: a row whose relaxed argmin lands there is
    scanned, and the answers stay exact."""
    g = [0, 1, 5, 3, 4, 5, 6, 7]
    hull = gruslys._Hull(g)
    assert not hull.tight and not hull.within_one(2)
    f_col = [0, 3, 1, 0, 2, 9, 1, 4]
    want = _branch_rows(f_col, g, shift=0, y_lo=1, k_lo=1, reference=True)
    scanned = []
    scan = gruslys._Branch._scan
    monkeypatch.setattr(gruslys._Branch, "_scan",
                        lambda br, t, y_hi: scanned.append(t) or scan(br, t, y_hi))
    got = _branch_rows(f_col, g, shift=0, y_lo=1, k_lo=1, reference=False)
    assert scanned, "no row fell back to the scan"
    assert [c for c, _ in got] == [c for c, _ in want]


# Scale and Sec. 3.5's bounds -------------------------------------------------------------


def test_hsm_at_scale():
    p = solve(10_000, 300, "hsm")
    r = check_policy(p, binomial_hsm(10_000, 300))
    assert r.peak_stored_hidden <= 299


@pytest.mark.slow   # 6-10 s on 2 cores: MSM's table for t = 10^4, m = 300, cold
@pytest.mark.parametrize("alpha,beta", [(5, 4), (2, 1)])
def test_msm_at_scale(alpha, beta):
    gruslys._TABLES.pop(("msm", alpha, beta), None)
    p = solve(10_000, 300, "msm", alpha=alpha, beta=beta)
    check_policy(p)
    assert 10_000 <= p.cost <= binomial_hsm(10_000, 300)
    ism_m = (300 - 1) // alpha + 1      # alpha (ism_m - 1) + 1 <= 300
    assert p.cost <= solve(10_000, ism_m, "ism").cost


@pytest.mark.slow   # ~20 s: the numpy full scan is O(t^2 m)
def test_msm_at_scale_matches_full_scan():
    C = numpy_table("msm", 3000, 100, 5, 4)
    for t, m in [(3000, 100), (3000, 61), (2999, 100), (1777, 88)]:
        assert solve(t, m, "msm", alpha=5, beta=4).cost == C[t, m], (t, m)


@pytest.mark.parametrize("t,m", [(100, 1), (100, 2), (1000, 3), (10_000, 10), (5000, 7),
                                 (10_000, 300), (2, 2)])
def test_hsm_upper_bound_sec35(t, m):
    """Sec. 3.5: C(t, m) <= m t^(1 + 1/m); numerically C(t, m) < 4 t^(1 + 1/m)."""
    c = solve(t, m, "hsm").cost
    assert c <= m * t ** (1 + 1 / m)
    assert c < 4 * t ** (1 + 1 / m)


@pytest.mark.parametrize("m,a", [(10, 2), (30, 2), (12, 3), (300, 2)])
def test_hsm_linear_bound_sec35(m, a):
    """Sec. 3.5: for t < m^a / a!, C(t, m) <= (a + 1) t."""
    t = min(math.ceil(m ** a / math.factorial(a)) - 1, 10_000)
    assert solve(t, m, "hsm").cost <= (a + 1) * t


# Errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("args,kwargs", [
    ((0, 3, "hsm"), {}),
    ((-1, 3, "ism"), {}),
    ((5, 0, "hsm"), {}),
    ((5, -2, "msm"), {"alpha": 3}),
    ((5, 3, "lsm"), {}),
    ((5, 3, "msm"), {}),
    ((5, 3, "msm"), {"alpha": 1}),
    ((5, 3, "msm"), {"alpha": 3, "beta": 4}),
])
def test_invalid_arguments(args, kwargs):
    with pytest.raises(ValueError):
        solve(*args, **kwargs)


# Packaging --------------------------------------------------------------------------------


def test_reexported_as_memopt_recurrent():
    import memopt.recurrent as recurrent

    assert recurrent.solve is gruslys.solve


def test_chain_imports_without_torch():
    path = REPO / "allocator" / "gruslys.py"
    code = (
        "import sys, importlib.util; sys.modules['torch'] = None; "
        f"spec = importlib.util.spec_from_file_location('chain_probe', {str(path)!r}); "
        "mod = importlib.util.module_from_spec(spec); sys.modules['chain_probe'] = mod; "
        "spec.loader.exec_module(mod); "
        "assert mod.solve(10, 4, 'hsm').cost == 24; "
        "assert mod.solve(10, 7, 'msm', alpha=3, beta=2).cost == "
        f"{msm_oracle(10, 7, 3, 2)}; "
        "assert sys.modules['torch'] is None; "
        "assert not [k for k in sys.modules if k.startswith('torch.')]"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_allocator_chain_package_import_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None; "
        f"sys.path.insert(0, {str(REPO)!r}); "
        "import allocator.gruslys; "
        "assert allocator.gruslys.solve(4, 4, 'hsm').cost == 7; "
        "assert sys.modules['torch'] is None"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
