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
rotor / rockmate): each column C(., m) is a min-plus convolution of column m's own
prefix (f(y) = y + C(y, m)) with an earlier column (g(k) = C(k, m - 1)). When both
are convex, the minimum over y for t + 1 is found from the one for t by advancing
whichever of y or k has the smaller next increment: O(1) per entry. Every column
is checked for convexity as it is filled; where it fails (mixed strategies can
break it) that column falls back to the full scan over y. So the table for
(t, m) costs O(t m) when convex (HSM, ISM: binomial checkpointing's costs are
convex in t), O(t^2 m) at worst, and is exact either way. ``solve`` keeps one table
per (strategy, alpha, beta) and extends it, so every m <= the largest solved is
free after the first call.

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

from dataclasses import dataclass, field
from operator import add
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
    base case: recompute from the segment start for every step)."""

    def __init__(self, strategy: str, alpha: int, beta: int) -> None:
        self.strategy, self.alpha, self.beta = strategy, alpha, beta
        self.cost: list[list[int]] = [[0]]      # column 0: C(0, 0) = 0, C(t > 0, 0) = inf
        self.choice: list[list[int]] = [[0]]
        self.convex: list[bool] = [True]
        self.t = 0

    def column(self, m: int) -> list[int]:
        """C(., m); C(0, m) = 0 and C(t > 0, m <= 0) = inf."""
        if m <= 0:
            return self.cost[0]
        return self.cost[m]

    def ensure(self, t: int, m: int) -> None:
        if t > self.t:  # longer chains: rebuild every column to the new length
            self.t = max(t, 2 * self.t)
            self.cost, self.choice, self.convex = [[0] + [INF] * self.t], [[0] * (self.t + 1)], [True]
        while len(self.cost) <= m:
            self._fill(len(self.cost))

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
        if self.strategy == "hsm":
            branches = [_Branch(self, m, shift=0, y_lo=1, k_lo=1, sign=1, drop=1)]
        elif self.strategy == "ism":
            branches = [_Branch(self, m, shift=1, y_lo=1, k_lo=0, sign=-1, drop=1)]
        else:
            branches = [_Branch(self, m, shift=0, y_lo=1, k_lo=1, sign=1, drop=1),
                        _Branch(self, m, shift=1, y_lo=2, k_lo=0, sign=-1, drop=self.alpha)]
        first_internal = self.column(m - self.beta) if self.strategy == "msm" else None
        convex = True
        for t in range(1, T + 1):
            best, arg = INF, 0
            if t == 1 and self.strategy == "hsm":
                best = 1  # one step: recompute it in the core and backpropagate
            if first_internal is not None:  # eq. 10: y = 1, an internal state costing beta
                best, arg = 1 + first_internal[t - 1], -1
            for br in branches:
                c, y = br.at(t, exact=not convex)
                if c < best:
                    best, arg = c, y
            cost[t] = best
            choice[t] = arg
            if convex and t >= 2 and best - cost[t - 1] < cost[t - 1] - cost[t - 2]:
                convex = False  # later entries need the full scan
        self.convex.append(convex)


class _Branch:
    """One branch of the minimum: min over y of f(y) + g(t - y) with f(y) = y +
    C(y - shift, m) (this column) and g(k) = C(k, m - drop) (an earlier column),
    y >= y_lo, k >= k_lo. Walks the convex merge; ``exact`` forces a full scan."""

    def __init__(self, table: _Table, m: int, *, shift: int, y_lo: int, k_lo: int,
                 sign: int, drop: int) -> None:
        self.f_col = table.cost[m]
        self.g_col = table.column(m - drop)
        self.g_convex = table.convex[m - drop] if m - drop > 0 else True
        self.g_finite = m - drop > 0
        self.shift, self.y_lo, self.k_lo, self.sign = shift, y_lo, k_lo, sign
        self.y = None  # the merge's current y (for the last t reached)
        self.fs: list[int] = [INF]  # f(y) for y = 0.. (f(0) unused)

    def f(self, y: int) -> int:
        return y + self.f_col[y - self.shift]

    def at(self, t: int, *, exact: bool) -> tuple[int, int]:
        y_hi = t - self.k_lo
        if y_hi < self.y_lo:
            return INF, 0
        if not self.g_finite:  # only k = 0 is possible
            if self.k_lo > 0 or y_hi != t:
                return INF, 0
            return self.f(t) + self.g_col[0], self.sign * t
        g = self.g_col
        if exact or not self.g_convex or self.y is None:
            # The full scan over y (vectorized through map): f(y) + g(t - y).
            fs = self.fs
            while len(fs) <= y_hi:
                fs.append(self.f(len(fs)))
            vals = list(map(add, fs[self.y_lo:y_hi + 1], g[t - y_hi:t - self.y_lo + 1][::-1]))
            best = min(vals)
            y = self.y_lo + vals.index(best)
            self.y = None if exact or not self.g_convex else y
            return best, self.sign * y
        # The convex merge: from t - 1's optimum (y, k), advance y or k.
        y = self.y
        k = t - 1 - y
        if y + 1 <= y_hi and self.f(y + 1) - self.f(y) < g[k + 1] - g[k]:
            y += 1
        self.y = y
        return self.f(y) + g[t - y], self.sign * y


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
