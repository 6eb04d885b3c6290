"""Find unrolled loops in a list of operations: the pattern finder behind memopt's
detection of a user's cell loop (memopt.passes.cell_loops), on plain data.

Tracing ``for t in range(T): h = cell(xs[t], h)`` unrolls it: the captured graph
holds T consecutive copies of the cell's operations. Gruslys et al. 2016 (Sec. 3.1)
plan such a chain as a whole; this module finds the copies. An operation is an
``Op``: a ``key`` (equal for two ops exactly when they call the same function with
the same constants and read the same graph inputs, parameters included) and its
tensor arguments, each a reference:

- ``("op", j)``: the value of op j of the list;
- ``("in", name)``: a value from outside the list (a graph input, a parameter);
- ``("at", base, dim, i, name)``: ``base`` (an "op" or "in" reference) indexed at i
  along dim (``xs[t]``, ``xs.select(dim, t)``, ``xs.unbind(dim)[t]``); ``name`` tells
  indexing ops apart, the finder compares only the rest.

A loop is a run of T >= ``min_steps`` consecutive repetitions ("steps") of L ops in
which the k-th op of every step has the same key and each argument, in every step, is
of one kind (a ``Slot``):

- ``("same", k)``: offset k of the same step;
- ``("out", ref)``: one value from before the loop, the same in every step (the cell's
  parameters: a transformer's layers, each with its own weights, never match);
- ``("state", k)``: offset k of the previous step, the carried state; the first step
  reads the state's initial value from before the loop instead;
- ``("step", base, dim, i0)``: ``base`` indexed at ``i0 + r`` along dim in step r: the
  per-step input;
- ``("at", slot, dim, i)``: the value of ``slot`` indexed at a constant i.

The last step may omit ops whose values only a next step would read (a trace drops
the unused final cell state). Values leave the loop in two ways only: offsets whose
value of every step, in order, is stacked by ``torch.stack`` ops (``Op.stack_dim``; one
or several such outputs), and the last step's carried state, read by anything. A loop
needs a carried state; it may read any number of per-step inputs (``xs[t]`` and
``ys[t]``, listed in the order the step first reads them). A candidate that fails any
of this is refused with a reason.

Algorithm:
    Step 1: candidate step lengths L: distances between ops with equal keys that read
        an outside value or an indexed one (a cell reads its parameters once per step; a
        scan reads its per-step slices).
    Step 2: for each L, the regions where key[i] == key[i + L]; in each, grow a loop
        from each start: the argument kinds from the first two steps, then steps while
        they fit, then a partial last step; check what leaves the loop.
    Step 3: keep the loops covering the most ops (then the shortest steps), disjoint.

Pure Python on plain tuples: never imports torch.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass

#: Fewest steps a run needs to count as a loop.
MIN_STEPS = 4

Ref = tuple   # ("op", j) | ("in", name) | ("at", base, dim, i, name)
Slot = tuple  # ("same", k) | ("out", ref) | ("state", k) | ("step", base, dim, i0) | ("at", slot, dim, i)


@dataclass(frozen=True)
class Op:
    """One operation as the finder sees it (see the module docstring)."""

    key: Hashable
    args: tuple[Ref, ...] = ()
    stack_dim: int | None = None   # torch.stack along this dim; None for any other op
    name: str = ""                 # for messages


@dataclass(frozen=True)
class Loop:
    """A found loop: steps ``0..steps-1`` of ``length`` ops each."""

    start: int                                  # the first op of step 0
    length: int                                 # L: ops per step
    steps: int                                  # T
    ops: tuple[tuple[int | None, ...], ...]     # ops[r][k]: op index of offset k in step r
                                                # (None: omitted by the last step)
    slots: tuple[tuple[Slot, ...], ...]         # slots[k]: the kind of each argument of offset k
    state: tuple[int, ...]                      # offsets carried to the next step, ascending
    init: tuple[Ref, ...]                       # their initial values, from before the loop
    step_inputs: tuple[tuple[Ref, int, int], ...]  # (base, dim, i0) of each per-step input
    outputs: tuple[tuple[int, int], ...]        # (offset, stack dim) of each stacked value
    stacks: tuple[int, ...]                     # the stack ops reading them
    stacked: tuple[int, ...] = ()               # stacks[i] stacks outputs[stacked[i]]

    @property
    def step_input(self) -> tuple[Ref, int, int] | None:
        """The per-step input when there is exactly one (None with none or several)."""
        return self.step_inputs[0] if len(self.step_inputs) == 1 else None

    @property
    def output(self) -> int | None:
        """The stacked offset when there is exactly one (None with none or several)."""
        return self.outputs[0][0] if len(self.outputs) == 1 else None

    @property
    def stack_dim(self) -> int | None:
        return self.outputs[0][1] if len(self.outputs) == 1 else None

    @property
    def end(self) -> int:
        """One past the last op of the loop."""
        return max(j for rep in self.ops for j in rep if j is not None) + 1


@dataclass(frozen=True)
class LoopSearch:
    """The loops found, and the candidates refused: (start, length, reason)."""

    loops: tuple[Loop, ...]
    refused: tuple[tuple[int, int, str], ...]


def find_loops(ops: Sequence[Op], min_steps: int = MIN_STEPS) -> LoopSearch:
    """Every maximal unrolled loop of ``ops`` (see the module docstring)."""
    if min_steps < 2:
        raise ValueError(f"a loop needs at least 2 steps, got min_steps={min_steps}")
    users = _users(ops)
    found: list[Loop] = []
    refused: dict[tuple[int, int], tuple[int, int, str]] = {}
    # Step 1: candidate step lengths.
    for length in _periods(ops, min_steps):
        # Step 2: grow loops in the periodic regions.
        for a, b in _regions(ops, length, min_steps):
            s, stop = a, min(b, a + 2 * length)
            while s < stop:
                got = _grow(ops, users, s, length, min_steps)
                if isinstance(got, Loop):
                    found.append(got)
                    s = got.end
                    stop = min(b, s + 2 * length)
                else:
                    refused.setdefault((a, length), (s, length, got))
                    s += 1
    # Step 3: the largest disjoint loops.
    chosen: list[Loop] = []
    for loop in sorted(found, key=lambda lp: (lp.start - lp.end, lp.length, lp.start)):
        if all(loop.end <= c.start or c.end <= loop.start for c in chosen):
            chosen.append(loop)
    chosen.sort(key=lambda lp: lp.start)
    reasons = tuple(r for r in refused.values()
                    if all(r[0] >= c.end or r[0] + r[1] <= c.start for c in chosen))
    return LoopSearch(loops=tuple(chosen), refused=reasons)


# -- Step 1 and 2's regions ------------------------------------------------------------


def _reads_outside(ref: Ref) -> bool:
    """A value from outside the list, or one indexed at a constant (``xs[t]``: a scan's
    per-step slice of a tensor computed before it, where its step reads no parameter)."""
    return ref[0] in ("in", "at")


def _periods(ops: Sequence[Op], min_steps: int) -> list[int]:
    """Distances between ops of equal key that read an outside value, seen often
    enough to make a loop of ``min_steps`` steps (the last one may be partial)."""
    positions: dict[Hashable, list[int]] = defaultdict(list)
    for i, op in enumerate(ops):
        if any(_reads_outside(a) for a in op.args):
            positions[op.key].append(i)
    counts: Counter[int] = Counter()
    for pos in positions.values():
        for c in range(1, 5):  # a key read c times per step recurs at distance L every c
            for i in range(len(pos) - c):
                counts[pos[i + c] - pos[i]] += 1
    return sorted(d for d, n in counts.items() if n >= max(1, min_steps - 2))


def _regions(ops: Sequence[Op], length: int, min_steps: int) -> Iterator[tuple[int, int]]:
    """Maximal [a, b) where ops[i].key == ops[i + length].key for every i in [a, b),
    long enough for ``min_steps`` steps."""
    need = (min_steps - 2) * length + 1
    i, n = 0, len(ops)
    while i + length < n:
        if ops[i].key != ops[i + length].key:
            i += 1
            continue
        j = i
        while j + length < n and ops[j].key == ops[j + length].key:
            j += 1
        if j - i >= need:
            yield i, j
        i = j + 1


# -- Step 2: growing one loop ----------------------------------------------------------


def _users(ops: Sequence[Op]) -> list[set[int]]:
    users: list[set[int]] = [set() for _ in ops]
    for u, op in enumerate(ops):
        for ref in op.args:
            j = _base_op(ref)
            if j is not None:
                users[j].add(u)
    return users


def _base_op(ref: Ref) -> int | None:
    if ref[0] == "op":
        return ref[1]
    return _base_op(ref[1]) if ref[0] == "at" else None


def _rel(ref: Ref, cur: dict[int, int], prev: dict[int, int] | None, start: int):
    """Where ``ref`` points, seen from a step whose ops are ``cur`` (op -> offset)."""
    if ref[0] == "in":
        return ("out", ref)
    if ref[0] == "op":
        j = ref[1]
        if j in cur:
            return ("same", cur[j])
        if prev is not None and j in prev:
            return ("prev", prev[j])
        return ("out", ref) if j < start else None  # None: further back inside the loop
    base = _rel(ref[1], cur, prev, start)
    return None if base is None else ("at", base, ref[2], ref[3])


def _outside(rel) -> bool:
    return rel[0] == "out" or (rel[0] == "at" and _outside(rel[1]))


def _slot(a, b) -> Slot | None:
    """The kind of an argument from where it points in step 0 (``a``) and step 1 (``b``)."""
    if a is None or b is None:
        return None
    if a == b and a[0] in ("same", "out"):
        return a
    if b[0] == "prev" and _outside(a):
        return ("state", b[1])
    if a[0] == b[0] == "at" and a[2] == b[2]:
        if a[1] == b[1] and a[1][0] == "out" and b[3] == a[3] + 1:
            return ("step", a[1][1], a[2], a[3])
        if a[3] == b[3]:
            inner = _slot(a[1], b[1])
            return None if inner is None else ("at", inner, a[2], a[3])
    return None


def _fits(kind: Slot, rel, r: int) -> bool:
    """Whether ``rel``, seen from step r >= 1, is an argument of kind ``kind``."""
    if rel is None:
        return False
    tag = kind[0]
    if tag in ("same", "out"):
        return rel == kind
    if tag == "state":
        return rel == ("prev", kind[1])
    if tag == "step":
        return rel == ("at", ("out", kind[1]), kind[2], kind[3] + r)
    return rel[0] == "at" and rel[2:] == kind[2:] and _fits(kind[1], rel[1], r)


def _matches(ops: Sequence[Op], q: int, k: int, start: int, slots: list[tuple[Slot, ...]],
             cur: dict[int, int], prev: dict[int, int], r: int) -> bool:
    op, pattern = ops[q], ops[start + k]
    return (op.key == pattern.key and len(op.args) == len(slots[k])
            and all(_fits(kind, _rel(a, cur, prev, start), r)
                    for kind, a in zip(slots[k], op.args)))


def _grow(ops: Sequence[Op], users: list[set[int]], start: int, length: int,
          min_steps: int) -> Loop | str:
    """The loop of steps of ``length`` ops starting at ``start``, or why there is none."""
    n, L = len(ops), length
    if start + 2 * L > n:
        return "fewer than two steps"
    first = {start + k: k for k in range(L)}
    second = {start + L + k: k for k in range(L)}
    slots: list[tuple[Slot, ...]] = []
    for k in range(L):
        a, b = ops[start + k], ops[start + L + k]
        if a.key != b.key or len(a.args) != len(b.args):
            return f"{_label(ops, start + k)} differs from {_label(ops, start + L + k)}"
        row = tuple(_slot(_rel(x, first, None, start), _rel(y, second, first, start))
                    for x, y in zip(a.args, b.args))
        if None in row:
            return (f"{_label(ops, start + L + k)} reads a value that is neither shared, "
                    "carried from the previous step, of its own step nor the next per-step input")
        slots.append(row)
    reps: list[tuple[int | None, ...]] = [tuple(first), tuple(second)]
    prev, p = second, start + 2 * L
    while p + L <= n:
        cur = {p + k: k for k in range(L)}
        if not all(_matches(ops, p + k, k, start, slots, cur, prev, len(reps)) for k in range(L)):
            break
        reps.append(tuple(cur))
        prev, p = cur, p + L
    # the last step may omit ops (their values would only feed a next step)
    cur, q = {}, p
    for k in range(L):
        if q >= n:
            break
        cur[q] = k
        if _matches(ops, q, k, start, slots, cur, prev, len(reps)):
            q += 1
        else:
            del cur[q]
    if cur:
        at = {k: j for j, k in cur.items()}
        reps.append(tuple(at.get(k) for k in range(L)))
    if len(reps) < min_steps:
        return f"{len(reps)} steps, fewer than {min_steps}"
    return _close(ops, users, start, L, reps, slots)


def _label(ops: Sequence[Op], j: int) -> str:
    return ops[j].name or f"op {j}"


def _state_inits(kind: Slot, raw: Ref) -> Iterator[tuple[int, Ref]]:
    if kind[0] == "state":
        yield kind[1], raw
    elif kind[0] == "at":
        yield from _state_inits(kind[1], raw[1])


def _identity(ref: Ref) -> Ref:
    return ref[:4] if ref[0] == "at" else ref


def _stacked(op: Op, where: dict[int, tuple[int, int]], steps: int) -> int | None:
    """The offset whose values of steps 0..T-1, in order, are exactly ``op``'s stacked
    arguments, or None."""
    if op.stack_dim is None or len(op.args) != steps:
        return None
    places = [where.get(ref[1]) if ref[0] == "op" else None for ref in op.args]
    if places[0] is None:
        return None
    k = places[0][1]
    return k if all(p == (r, k) for r, p in enumerate(places)) else None


def _close(ops: Sequence[Op], users: list[set[int]], start: int, length: int,
           reps: list[tuple[int | None, ...]], slots: list[tuple[Slot, ...]]) -> Loop | str:
    """The loop's state, per-step input and outputs, or why it is refused."""
    inits: dict[int, Ref] = {}
    for k, row in enumerate(slots):
        for kind, raw in zip(row, ops[start + k].args):
            for o, ref in _state_inits(kind, raw):
                if _identity(inits.setdefault(o, ref)) != _identity(ref):
                    return f"the value carried at offset {o} starts from two different values"
    if not inits:
        return "nothing is carried from one step to the next"
    inputs: dict[tuple, None] = {}  # first-read order
    for row in slots:
        for kind in row:
            _step_inputs(kind, inputs)
    steps = len(reps)
    where = {j: (r, k) for r, rep in enumerate(reps) for k, j in enumerate(rep) if j is not None}
    outputs: dict[tuple[int, int], int] = {}  # (offset, stack dim) -> its index
    stacks, stacked = [], []
    for u in sorted({u for j in where for u in users[j]} - where.keys()):
        k = _stacked(ops[u], where, steps)
        if k is not None:
            stacked.append(outputs.setdefault((k, ops[u].stack_dim), len(outputs)))
            stacks.append(u)
            continue
        for ref in ops[u].args:
            j = _base_op(ref)
            if j in where and (where[j][0] != steps - 1 or where[j][1] not in inits):
                return (f"{_label(ops, u)} reads {_label(ops, j)} (step {where[j][0]}), which "
                        "is neither stacked with every step's value nor the final carried state")
    state = tuple(sorted(inits))
    return Loop(start=start, length=length, steps=steps, ops=tuple(reps), slots=tuple(slots),
                state=state, init=tuple(inits[o] for o in state), step_inputs=tuple(inputs),
                outputs=tuple(outputs), stacks=tuple(stacks), stacked=tuple(stacked))


def _step_inputs(kind: Slot, found: dict[tuple, None]) -> None:
    """Add the per-step inputs ``kind`` reads (as (base, dim, i0)) to ``found``."""
    if kind[0] == "step":
        found.setdefault(kind[1:])
    elif kind[0] == "at":
        _step_inputs(kind[1], found)
