"""Optimal checkpointing of a chain: Gruslys et al. 2016's dynamic programs.

A recurrent chain is t steps, step i mapping hidden state i to hidden state i + 1
(h_0 is the chain's input). Backpropagation runs the steps backward in reverse
order; each needs the step's *internal state* (everything autograd saved in its
forward). With room for m memory units, which states to keep and which to
recompute is the policy; its cost C(t, m) is the total number of forward steps run
(the first forward pass included). The three strategies of the paper:

- ``"hsm"`` (Sec. 3.1, eq. 2-3): keep hidden states only. m counts hidden-state
  slots, the segment's initial state included; one "core" holding the internal
  state being backpropagated is free.
      Q(t, m, y) = y + C(t - y, m - 1) + C(y, m),   1 <= y < t
      C(t, 1) = t(t + 1) / 2,  C(t, m) = 2t - 1 for m >= t,  C(1, m) = 1.
- ``"ism"`` (Sec. 3.2, eq. 4-5): keep internal states only. m counts internal-state
  slots, the core included; h_0 is free.
      Q(t, m, y) = y + C(y - 1, m) + C(t - y, m - 1),   1 <= y <= t
      C(0, m) = 0,  C(t, 1) = t(t + 1) / 2,  C(t, m) = t for m >= t.
- ``"msm"`` (Sec. 3.3-3.4, eq. 6-10): either, in hidden-state units: a hidden state
  costs 1, an internal state ``alpha``, or ``beta`` when its input hidden state is
  already stored (the segment's first step, eq. 10). The core is free.
      Q1(t, m, y) = y + C(y, m) + C(t - y, m - 1),                 1 <= y < t
      Q2(t, m, y) = y + C(y - 1, m) + C(t - y, m - [y>1] alpha - [y=1] beta),  1 <= y <= t
      C(t, 1) = t(t + 1) / 2,  C(t, m) = t for m >= alpha t,  C(0, m) = 0,
      C(t, m) = inf for m <= 0 < t.

Algorithm (phase 1 fills the table, phase 2 backtracks it into a schedule, as in
rotor / rockmate). Column C(., m) is filled for t = 1, 2, .. in order:

1. Each branch of the minimum (eq. 2; eq. 4; eq. 6-9's Q1 and Q2) is, at row t, the
   minimum over y of f(y) + g(t - y): f(y) = y + C(y, m) or y + C(y - 1, m) is this
   column's own prefix, known online; g(k) = C(k, m - 1) or C(k, m - alpha) is an
   earlier, complete column. Eq. 10 and the base cases are single entries. Each row
   of a branch is answered exactly by the first of steps 2-5 that applies.
2. Convex merge, when g and f so far are convex (HSM, ISM: binomial checkpointing's
   costs are convex in t): t's argmin follows from t - 1's by advancing whichever of
   y or k has the smaller next increment. O(1) a row.
3. Monge envelope, otherwise. MSM's columns are not convex (Gruslys et al. 2016,
   eq. 6-10: mixing units of 1, beta and alpha makes the increments of C(., m) climb
   from one integer to the next unevenly, second differences of -1 on the way), but
   measured, they lie within 1 of their lower convex hull h. With h for g, A[t][y] =
   f(y) + h(t - y) is a Monge matrix whatever f is, so a later y that beats an earlier
   one at row t beats it at every later row: a stack of candidates, each with the row
   it takes over from, gives every row's argmin online (the least-weight subsequence
   technique: Hirschberg and Larmore 1987, Galil and Giancarlo 1989). A candidate
   costs O(1) if dropped, O(log t) if kept (a binary search for its row).
   h's values are fractions with denominators <= t, kept as floor(S h) with
   S > t^2: integers that compare exactly as the fractions do.
4. Certificate: h <= g, so L(t) = min_y f(y) + h(t - y) bounds the branch from below;
   at its argmin y, g(t - y) - h(t - y) < 1 makes f(y) + g(t - y) < L(t) + 1 the
   branch's (integer) minimum. Free when g - h < 1 on the whole column.
5. Otherwise the full scan over y, O(t): the fallback, and every row of a reference
   table (``_Table(..., reference=True)``, what the tests compare the rest with).

The table for (t, m) costs O(t m) for HSM and ISM, O(t m log t) at worst for MSM
while step 4 certifies every row (a few % of the candidates are kept); step 5 costs
O(t) a row (O(t^2 m) if it were every row), but no MSM column needed it: every
column for t <= 10^4, m <= 300 and the tests' seven (alpha, beta) is within 1 of
its hull. Measured on 2 cores: t = 10^4, m = 300 in about 2 s for HSM and ISM,
6-9 s for MSM (was O(t^2 m): t = 2000, m = 100 in 33 s). ``solve`` keeps one table
per (strategy, alpha, beta) and extends it, so every m <= the largest solved is
free after the first call; a longer t rebuilds it at twice the length.

Schedule actions (``Action(op, i, j)``), steps 0..t-1, hidden positions 0..t:

- ``("advance", i, j)``: run steps i..j-1 without autograd from available hidden i.
- ``("store_hidden", j, j)``: keep hidden j (just produced by an advance).
- ``("store_internal", i, i + 1)``: run step i with autograd and keep it; its
  output hidden i + 1 becomes available.
- ``("backward", i, i + 1)``: backpropagate step i, from its stored internal state,
  or by recomputing it (one forward step) from available hidden i.
- ``("free", j, j)``: release stored hidden j.

The first actions up to the first backward compute every step exactly once: a
training framework's forward pass. This module never imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from itertools import groupby
from operator import add, sub
from typing import NamedTuple

STRATEGIES = ("hsm", "ism", "msm")
INF = 1 << 62


class Action(NamedTuple):
    op: str
    i: int
    j: int


@dataclass(frozen=True)
class Policy:
    """An optimal policy for a chain of ``t`` steps in ``m`` memory units."""

    strategy: str
    t: int
    m: int
    alpha: int | None
    beta: int | None
    cost: int                       # C(t, m): forward steps, the first pass included
    schedule: tuple[Action, ...] = field(repr=False)
    peak_units: int                 # the most memory units in use (the strategy's units)
    internal_units: dict[int, int] = field(repr=False, compare=False, default_factory=dict)

    @property
    def recompute(self) -> int:
        """Forward steps run again in backward: C(t, m) - t."""
        return self.cost - self.t

    def peak_bytes(self, hidden_bytes: int, internal_bytes: int) -> int:
        """The most bytes the policy's stores hold at once, h_0 and the core excluded
        (both exist without any policy): hidden states at ``hidden_bytes`` each,
        stored internal states at ``internal_bytes`` each."""
        live = peak = 0
        stored: dict[int, int] = {}
        sched = self.schedule
        for n, (op, i, _) in enumerate(sched):
            if op == "store_hidden":
                live += hidden_bytes
            elif op == "free":
                live -= hidden_bytes
            elif op == "store_internal" and not (n + 1 < len(sched) and sched[n + 1] == (
                    "backward", i, i + 1)):  # else it is the core, backpropagated at once
                stored[i] = internal_bytes
                live += internal_bytes
            elif op == "backward":
                live -= stored.pop(i, 0)
            peak = max(peak, live)
        return peak

    def describe(self) -> str:
        extra = f", alpha={self.alpha}, beta={self.beta}" if self.strategy == "msm" else ""
        return (f"BPTT-{self.strategy.upper()} t={self.t} m={self.m}{extra}: "
                f"{self.cost} forward steps ({self.recompute} recomputed, "
                f"{self.cost / self.t:.2f} per step), peak {self.peak_units} units")


def _check(t: int, m: int, strategy: str, alpha: int | None, beta: int | None
           ) -> tuple[int, int]:
    for name, v in (("t", t), ("m", m)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if strategy != "msm":
        return 1, 1
    if isinstance(alpha, bool) or not isinstance(alpha, int) or alpha < 2:
        raise ValueError(f"msm needs alpha, an int >= 2 (an internal state's size in hidden "
                         f"states), got {alpha!r}")
    beta = alpha if beta is None else beta
    if isinstance(beta, bool) or not isinstance(beta, int) or not 1 <= beta <= alpha:
        raise ValueError(f"beta must be an int in [1, alpha={alpha}], got {beta!r}")
    return alpha, beta


class _Table:
    """C(t, m) and the first choice D(t, m) for one strategy, columns m = 1.. grown
    on demand. ``cost[m][t]``; ``choice[m][t]`` is y > 0 (store hidden state y), -y
    (store the internal state of step y - 1, i.e. the y-th step), or 0 (HSM's m = 1
    base case: recompute from the segment start for every step). ``reference``: fill
    every entry by the full scan over y (the slow oracle the fast path is tested on)."""

    def __init__(self, strategy: str, alpha: int, beta: int, *, reference: bool = False
                 ) -> None:
        self.strategy, self.alpha, self.beta = strategy, alpha, beta
        self.reference = reference
        self.t = 0
        self._reset()

    def _reset(self) -> None:
        self.cost: list[list[int]] = [[0] + [INF] * self.t]  # column 0: C(t > 0, 0) = inf
        self.choice: list[list[int]] = [[0] * (self.t + 1)]
        self.convex: list[bool] = [True]
        self.hulls: dict[int, _Hull] = {}

    def column(self, m: int) -> list[int]:
        """C(., m); C(0, m) = 0 and C(t > 0, m <= 0) = inf."""
        if m <= 0:
            return self.cost[0]
        return self.cost[m]

    def hull(self, m: int) -> _Hull:
        """Column m's convex hull (m >= 1, filled), built on first use."""
        if m not in self.hulls:
            self.hulls[m] = _Hull(self.cost[m])
        return self.hulls[m]

    def ensure(self, t: int, m: int) -> None:
        if t > self.t:  # longer chains: rebuild every column to the new length
            self.t = max(t, 2 * self.t)
            self._reset()
        while len(self.cost) <= m:
            self._fill(len(self.cost))

    def _branch(self, m: int, kind: str) -> _Branch:
        """Column m's branch that stores hidden state y (eq. 2, eq. 6's Q1) or the y-th
        step's internal state (eq. 4, eq. 7's Q2; y > 1 for MSM, whose y = 1 is eq. 10)."""
        if kind == "hidden":
            drop, kw = 1, {"shift": 0, "y_lo": 1, "k_lo": 1, "sign": 1}
        else:  # alpha is 1 for ISM
            drop = self.alpha
            kw = {"shift": 1, "y_lo": 2 if self.strategy == "msm" else 1, "k_lo": 0, "sign": -1}
        g = m - drop
        if g <= 0:
            return _Branch(self.cost[m], None, g_convex=True, g_hull=None,
                           reference=self.reference, **kw)
        return _Branch(self.cost[m], self.cost[g], g_convex=self.convex[g],
                       g_hull=partial(self.hull, g), reference=self.reference, **kw)

    def _fill(self, m: int) -> None:
        T = self.t
        cost = [0] * (T + 1)
        choice = [0] * (T + 1)
        self.cost.append(cost)
        self.choice.append(choice)
        if self.strategy == "hsm" and m == 1:
            for t in range(1, T + 1):
                cost[t] = t * (t + 1) // 2
            self.convex.append(True)
            return
        # Step 1: the branches; each answers its rows by steps 2-5 (_Branch).
        kinds = {"hsm": ("hidden",), "ism": ("internal",), "msm": ("hidden", "internal")}
        branches = [self._branch(m, kind) for kind in kinds[self.strategy]]
        first_internal = self.column(m - self.beta) if self.strategy == "msm" else None
        convex = True
        for t in range(1, T + 1):
            best, arg = INF, 0
            if t == 1 and self.strategy == "hsm":
                best = 1  # one step: recompute it in the core and backpropagate
            if first_internal is not None:  # eq. 10: y = 1, an internal state costing beta
                best, arg = 1 + first_internal[t - 1], -1
            for br in branches:
                c, y = br.at(t, convex)
                if c < best:
                    best, arg = c, y
            cost[t] = best
            choice[t] = arg
            if convex and t >= 2 and best - cost[t - 1] < cost[t - 1] - cost[t - 2]:
                convex = False  # the merge no longer applies to this column's f
        self.convex.append(convex)


class _Hull:
    """The lower convex hull h of a finite column g(0..T), kept as floor(S h(k)) with
    S = ``scale``, a power of two > T^2, and whether g - h < 1 everywhere (``tight``).

    Each h(k) is a fraction whose denominator is a hull segment's length (<= T), so
    two sums f(y) + h(k) with f integer are equal or differ by >= 1 / T^2 > 1 / S: their
    scaled floors compare as they do, exactly."""

    def __init__(self, g: list[int]) -> None:
        self.g = g
        self.scale = scale = 1 << (2 * (len(g) - 1).bit_length())
        self.scaled = _scaled_hull(g, scale)
        self.tight = all(gk * scale - hk < scale for gk, hk in zip(g, self.scaled))

    def within_one(self, k: int) -> bool:
        """g(k) - h(k) < 1 (S h(k) > S (g(k) - 1), and a positive gap is >= 1 / T)."""
        return self.g[k] * self.scale - self.scaled[k] < self.scale


def _scaled_hull(g: list[int], scale: int) -> list[int]:
    """floor(scale * h(k)), k = 0..len(g) - 1, h the lower convex hull of g: a stack of
    segments (rise, run) with increasing slopes, fed runs of equal increments."""
    rises: list[int] = []
    runs: list[int] = []
    for d, same in groupby(map(sub, g[1:], g[:-1])):
        run = sum(1 for _ in same)
        rise = d * run
        while rises and rises[-1] * run >= rise * runs[-1]:  # not a convex turn: merge
            rise += rises.pop()
            run += runs.pop()
        rises.append(rise)
        runs.append(run)
    out: list[int] = []
    base = g[0] * scale
    for rise, run in zip(rises, runs):
        step, frac = divmod(rise * scale, run)
        if frac == 0:
            out.extend(range(base, base + step * run, step) if step else [base] * run)
        else:
            out.extend([base + rise * scale * j // run for j in range(run)])
        base += rise * scale
    out.append(base)
    return out


class _Branch:
    """One branch of the minimum: min over y of f(y) + g(t - y), y_lo <= y, k_lo <= t - y,
    with f(y) = y + f_col[y - shift] (this column, filled row by row: ``at`` is asked
    rows t = 1, 2, .. in order, each once f_col holds the rows before t) and g an
    earlier, complete column (None: column m - drop <= 0, where only g(0) = 0 is
    finite). ``g_hull()`` builds g's hull (steps 3-4). ``sign``: -1 marks the y an
    internal state. Each row is answered by the first of the module docstring's steps
    2-5 that applies; a ``reference`` branch always scans."""

    def __init__(self, f_col: list[int], g_col: list[int] | None, *, g_convex: bool,
                 g_hull: Callable[[], _Hull] | None, shift: int, y_lo: int, k_lo: int,
                 sign: int, reference: bool) -> None:
        self.f_col, self.g_col, self.g_convex, self.g_hull = f_col, g_col, g_convex, g_hull
        self.shift, self.y_lo, self.k_lo, self.sign = shift, y_lo, k_lo, sign
        self.reference = reference
        self.y = None  # the merge's current y (for the last t reached)
        self.fs: list[int] = [INF] * y_lo  # f(y) for y = 0.. (y < y_lo unused)
        self.hull: _Hull | None = None
        self.envelope: _Envelope | None = None

    def at(self, t: int, f_convex: bool) -> tuple[int, int]:
        """(the minimum, sign * its y) at row t; ``f_convex``: f is convex so far."""
        y_hi = t - self.k_lo
        if y_hi < self.y_lo:
            return INF, 0
        f_hi = y_hi + self.f_col[y_hi - self.shift]  # f(y_hi) just became known
        if self.g_col is None:  # only k = 0
            return (f_hi, self.sign * t) if self.k_lo == 0 else (INF, 0)
        self.fs.append(f_hi)
        if self.reference:
            c, y = self._scan(t, y_hi)
        elif f_convex and self.g_convex:
            c, y = self._merge(t, y_hi)
        else:
            c, y = self._monge(t, y_hi)
        return c, self.sign * y

    def _scan(self, t: int, y_hi: int) -> tuple[int, int]:
        """Step 5: the full scan over y (vectorized through map): f(y) + g(t - y)."""
        vals = list(map(add, self.fs[self.y_lo:y_hi + 1],
                        self.g_col[t - y_hi:t - self.y_lo + 1][::-1]))
        best = min(vals)
        return best, self.y_lo + vals.index(best)

    def _merge(self, t: int, y_hi: int) -> tuple[int, int]:
        """Step 2: f and g convex: from t - 1's optimum (y, k), advance y or k."""
        if self.y is None:
            best, self.y = self._scan(t, y_hi)
            return best, self.y
        fs, g, y = self.fs, self.g_col, self.y
        k = t - 1 - y
        if y + 1 <= y_hi and fs[y + 1] - fs[y] < g[k + 1] - g[k]:
            y += 1
        self.y = y
        return fs[y] + g[t - y], y

    def _monge(self, t: int, y_hi: int) -> tuple[int, int]:
        """Steps 3-4: the envelope's argmin y of f(y) + h(t - y), h = hull(g), is exact
        when g(t - y) - h(t - y) < 1; else step 5."""
        env, hull, fs = self.envelope, self.hull, self.fs
        if env is None:  # the first row here: every y so far is a candidate
            self.hull = hull = self.g_hull()
            env = self.envelope = _Envelope(hull.scaled, len(self.g_col) - 1)
            for y in range(self.y_lo, y_hi):
                env.push(y, fs[y] * hull.scale, t)
        y = env.push(y_hi, fs[y_hi] * hull.scale, t)
        if hull.tight or hull.within_one(t - y):
            return fs[y] + self.g_col[t - y], y
        return self._scan(t, y_hi)


class _Envelope:
    """Row minima of K(r, y) = F(y) + H(r - y), rows r asked in order, columns y pushed
    in increasing order, H convex: K is Monge, so a later y that beats an earlier one
    at row r beats it at every row after r (Galil and Giancarlo 1989). Kept: the
    candidates best somewhere ahead, each with the row it takes over from; a push pops
    the candidates it beats where they start and binary-searches where it overtakes
    the last one left: O(log T) per candidate kept, O(1) per one dropped or per row.
    Only entries of one row are ever compared: with H = floor(S h) (``_Hull``) they
    compare as the exact f(y) + h(r - y) do, and the Monge argument holds for those."""

    def __init__(self, scaled_h: list[int], T: int) -> None:
        self.h, self.T = scaled_h, T
        self.F = [0] * (T + 1)
        self.ys: list[int] = []
        self.starts: list[int] = []
        self.head = 0          # ys[head] is best at the last row asked
        self.back_at_T = INF   # K(T, ys[-1])

    def push(self, y: int, fy: int, t: int) -> int:
        """Candidate y with F(y) = fy, for rows r >= t; returns the best y at row t."""
        self.F[y] = fy
        at_T = fy + self.h[self.T - y]
        if at_T <= self.back_at_T:  # else never better than the last one: dropped
            self._keep(y, fy, t)
            self.back_at_T = at_T
        ys, starts, i = self.ys, self.starts, self.head
        while i + 1 < len(ys) and starts[i + 1] <= t:
            i += 1
        self.head = i
        return ys[i]

    def _keep(self, y: int, fy: int, t: int) -> None:
        """Pop the candidates y beats wherever they are best, then append y from the
        first row where it beats the last one left."""
        ys, starts = self.ys, self.starts
        start = t
        while len(ys) > self.head:
            lo = max(starts[-1], t)
            start = self._overtakes(y, fy, ys[-1], lo)
            if start > lo:
                break
            ys.pop()
            starts.pop()
            start = t
        ys.append(y)
        starts.append(start)

    def _overtakes(self, y: int, fy: int, yb: int, lo: int) -> int:
        """The first row r >= lo where y is at least as good as yb (it is at row T)."""
        h, fb = self.h, self.F[yb]

        def wins(r: int) -> bool:
            return fy + h[r - y] <= fb + h[r - yb]

        if wins(lo):
            return lo
        hi = lo + 1 if wins(lo + 1) else self.T  # most often the next row
        while hi - lo > 1:  # binary search: y loses at lo, wins at hi
            mid = (lo + hi) >> 1
            if wins(mid):
                hi = mid
            else:
                lo = mid
        return hi


_TABLES: dict[tuple[str, int, int], _Table] = {}


def cost(t: int, m: int, strategy: str = "hsm", alpha: int | None = None,
         beta: int | None = None) -> int:
    """C(t, m) alone (no schedule)."""
    alpha, beta = _check(t, m, strategy, alpha, beta)
    table = _table(strategy, alpha, beta, t, m)
    return table.cost[m][t]


def _table(strategy: str, alpha: int, beta: int, t: int, m: int) -> _Table:
    key = (strategy, alpha, beta)
    table = _TABLES.setdefault(key, _Table(strategy, alpha, beta))
    table.ensure(t, m)
    return table


def solve(t: int, m: int, strategy: str = "hsm", alpha: int | None = None,
          beta: int | None = None) -> Policy:
    """The optimal policy (Gruslys et al. 2016, eq. 2-10) for ``t`` steps in ``m`` units.

    ``alpha``/``beta`` (msm only): an internal state's size in hidden states, and its
    size when its input hidden state is already stored (default ``alpha``: no
    refinement; the paper notes alpha = beta + 1 is common). Raises ValueError for
    t < 1, m < 1, an unknown strategy or a bad alpha/beta.
    """
    alpha, beta = _check(t, m, strategy, alpha, beta)
    table = _table(strategy, alpha, beta, t, m)
    schedule, internal_units = _backtrack(table, t, m)
    return Policy(strategy=strategy, t=t, m=m, alpha=alpha if strategy == "msm" else None,
                  beta=beta if strategy == "msm" else None, cost=table.cost[m][t],
                  schedule=schedule, peak_units=_peak_units(strategy, schedule, internal_units),
                  internal_units=internal_units)


def _backtrack(table: _Table, t: int, m: int) -> tuple[tuple[Action, ...], dict[int, int]]:
    """Phase 2: the schedule of D(t, m), by an explicit stack (chains of 10^4 steps
    would overflow Python's recursion). Also the memory units each stored internal
    state takes (0: it is the core, stored for the segment's last step)."""
    out: list[Action] = []
    units: dict[int, int] = {}
    stack: list[object] = [(s := 0, t, m)]
    strategy = table.strategy
    while stack:
        task = stack.pop()
        if isinstance(task, Action):
            out.append(task)
            continue
        s, n, mm = task  # segment: steps s..s+n-1, its initial state available
        if n == 0:
            continue
        if n == 1 and strategy == "hsm":
            out.append(Action("backward", s, s + 1))
            continue
        y = table.choice[mm][n]
        todo: list[object]
        if y == 0:  # HSM, m = 1: recompute from the segment start for every step
            todo = []
            for i in reversed(range(n)):
                if i:
                    todo.append(Action("advance", s, s + i))
                todo.append(Action("backward", s + i, s + i + 1))
        elif y > 0:  # a hidden state at s + y
            todo = [Action("advance", s, s + y), Action("store_hidden", s + y, s + y),
                    (s + y, n - y, mm - 1), Action("free", s + y, s + y), (s, y, mm)]
        else:  # the internal state of step s + y - 1 (y = -choice)
            y = -y
            if strategy == "ism":
                units[s + y - 1] = 1
                drop = 1
            else:
                units[s + y - 1] = 0 if y == n else (table.beta if y == 1 else table.alpha)
                drop = table.beta if y == 1 else table.alpha
            todo = ([Action("advance", s, s + y - 1)] if y > 1 else []) + [
                Action("store_internal", s + y - 1, s + y), (s + y, n - y, mm - drop),
                Action("backward", s + y - 1, s + y), (s, y - 1, mm)]
        stack.extend(reversed(todo))
    return tuple(out), units


def _peak_units(strategy: str, schedule: tuple[Action, ...], units: dict[int, int]) -> int:
    """Replay the schedule counting memory units (see the module docstring)."""
    live = 0 if strategy == "ism" else 1  # h_0's slot (HSM and MSM count it)
    peak = live
    stored: dict[int, int] = {}
    for op, i, _ in schedule:
        if op == "store_hidden":
            live += 1
        elif op == "free":
            live -= 1
        elif op == "store_internal":
            stored[i] = units.get(i, 1)
            live += stored[i]
        elif op == "backward":
            if i in stored:
                peak = max(peak, live)
                live -= stored.pop(i)
            elif strategy == "ism":  # the core, while this step is recomputed
                peak = max(peak, live + 1)
        peak = max(peak, live)
    return peak


def strategy_text(strategy: str, alpha: int | None = None, beta: int | None = None) -> str:
    """A policy's strategy as one string, ``"hsm"``, ``"ism"`` or ``"msm:ALPHA:BETA"``:
    how the chain ops (memopt.recurrent.ops) carry it in their ``strategy`` argument, so
    that their schema stays ``(chunk, m, strategy)``. ``parse_strategy`` inverts it."""
    alpha, beta = _check(1, 1, strategy, alpha, beta)
    return f"msm:{alpha}:{beta}" if strategy == "msm" else strategy


def parse_strategy(text: str) -> tuple[str, int | None, int | None]:
    """(strategy, alpha, beta) of ``strategy_text``'s string; a bare ``"msm"`` has no
    alpha and fails in ``solve``. Raises ValueError for anything else."""
    strategy, *rest = text.split(":")
    if strategy != "msm" or not rest:
        if rest:
            raise ValueError(f"only msm takes alpha and beta, got {text!r}")
        return strategy, None, None
    try:
        alpha, beta = (int(v) for v in rest)
    except ValueError:
        raise ValueError(f"expected 'msm:ALPHA:BETA' with two ints, got {text!r}") from None
    return strategy, alpha, beta


def useful_m(t: int, m: int, strategy: str, alpha: int | None = None) -> int:
    """m capped where more memory stops lowering C(t, m): t slots for HSM and ISM,
    alpha t units for MSM (every internal state stored)."""
    top = (alpha or 1) * t if strategy == "msm" else t
    return max(1, min(m, top))


def chunk_sizes(steps: int, chunk: int) -> list[int]:
    """The lengths of the chain's chunks: ``chunk`` steps each but the FIRST, which takes
    the remainder. The last chunk (the core, Gruslys et al. 2016 Sec. 3.1) is never
    recomputed, so a full last chunk leaves the fewest steps to recompute: T - chunk
    when every chunk boundary is kept."""
    chunk = max(1, min(chunk, steps))
    first = steps - (steps - 1) // chunk * chunk
    return [first] + [chunk] * ((steps - first) // chunk) if steps else []
