"""The step as a recomputation problem for the exact oracle (memopt.allocator.milp).

Requires: a StepModel (passes.simulate) of a step planned without in-place rewrites.

Ensures: `recompute_problem(model)` returns the `RecomputeProblem` of the step and the
joint node of each unit, with the simulator's byte accounting: every storage's bytes
and lifetime come from the simulator's own schedule of the plan that recomputes
nothing (Step 1), split into what the plan cannot change and the units it can (forward
values the backward reads, and the values recomputing them reads).

Algorithm:
    Step 1: simulate the step with nothing recomputed; keep every storage's lifetime.
    Step 2: the units: single-tensor forward values whose storage the forward creates
        and the step does not hold to its end (not a parameter, input or user output),
        the first node of each storage its owner and the others its views.
    Step 3: per unit, what recomputing it costs and reads (a mirror copy, the op of a
        getitem, or a twin of passes.twins with its temporaries as workspace).
    Step 4: the bytes the plan cannot change at each forward step and each backward
        stage (a backward op that reads a unit), between the stages and before them.
"""

from __future__ import annotations

import itertools

from memopt.allocator.milp import RecomputeProblem

from .simulate import StepModel
from .simulate_steps import Candidate


def recompute_problem(model: StepModel) -> tuple[RecomputeProblem, list[int]]:
    """The step's RecomputeProblem, and the StepModel node index of each unit."""
    # Step 1: the plan that recomputes nothing, as the simulator schedules it
    run = Candidate(model)
    run.add_mirror_nodes(frozenset(), frozenset())
    fw, bw, saved = run.partition()
    run.liveness(fw, bw, saved)
    lifetimes, keys, F = run.lifetimes, run.keys, run.num_forward
    steps = F + len(bw.body)

    # Step 2: the units
    held = {k for i in fw.outputs[:model.num_fwd_outputs] if i is not None
            for k in keys.get(i, ())}
    units: list[int] = []
    owner: dict[int, int] = {}   # storage -> its owner's unit number
    bases: list[int | None] = []
    for i in fw.body:
        p = run.P[i]
        key = p.single
        if key is None or key not in lifetimes or lifetimes[key][1] < 0 or key in held:
            continue
        bases.append(owner.get(key))
        owner.setdefault(key, len(units))
        units.append(i)
    unit_of = {i: u for u, i in enumerate(units)}
    storage = [run.P[i].single for i in units]

    forward_last: dict[int, int] = {}
    for f, i in enumerate(fw.body):
        for a in run.I[i] + (i,):
            for key in keys.get(a, ()):
                forward_last[key] = f

    # Step 3: what recomputing each unit costs and reads
    spaces = run._workspaces(fw.body, {})
    costs, sources, workspace = [], [], []
    for i in units:
        how = model.made_by.get(i)
        extra = spaces.get(i, 0)
        if how == "twin":
            protos, position = model._twin(i, "S")
            cost = sum(p.flops for p, _ in protos)
            extra += sum(sum(p.nbytes) for k, (p, _) in enumerate(protos) if k != position)
        elif how == "getitem":
            op = model.getitem_of[i]
            cost = model.protos[op].flops + run._flops(i)
            extra += spaces.get(op, 0)
        else:
            cost = run._flops(i)
        costs.append(cost)
        sources.append(tuple(sorted({unit_of[a] for a in model.sources.get(i, run.I[i])
                                     if a in unit_of})))
        workspace.append(extra)

    # Step 4: the bytes no plan changes
    unit_keys = set(storage)
    live = [0] * (steps + 1)
    g = model.granularity

    def rounded(size: int) -> int:  # the allocator's blocks (StepModel.granularity)
        return -(-size // g) * g

    def add(size: int, start: int, end: int) -> None:
        start, end, size = max(start, 0), min(end, steps - 1), rounded(size)
        if start <= end:
            live[start] += size
            live[end + 1] -= size

    for key, (size, start, end) in lifetimes.items():
        add(size, start, forward_last[key] if key in unit_keys else end)
    singletons = [0] * steps  # an op's own workspace at its step
    for size, start, end in run.unkeyed:
        add(size, start, end)
        if start == end and start >= F:
            singletons[start] += rounded(size)
    fixed, level = [], 0
    for d in live[:steps]:
        level += d
        fixed.append(level)

    reads, phase, at, after, stage_steps = [], [], [], [], []
    for t, b in enumerate(bw.body):
        read = tuple(sorted({unit_of[a] for a in run.I[b] if a in unit_of}))
        if not read:
            continue
        step = F + t
        made = sum(rounded(lifetimes[k][0]) for k in keys.get(b, ())
                   if k in lifetimes and lifetimes[k][1] == step and k not in unit_keys)
        reads.append(read)
        at.append(fixed[step])
        phase.append(fixed[step] - made - singletons[step])
        stage_steps.append(step)
    bounds = stage_steps + [steps]
    after = [max(fixed[a + 1:b], default=0) for a, b in itertools.pairwise(bounds)]
    before = max(fixed[F:bounds[0]], default=0)
    problem = RecomputeProblem(
        sizes=tuple(0 if bases[u] is not None else rounded(lifetimes[storage[u]][0])
                    for u in range(len(units))),
        costs=tuple(costs), recomputable=tuple(i in model.mirrorable for i in units),
        sources=tuple(sources), bases=tuple(bases), workspace=tuple(workspace),
        forward_last=tuple(forward_last[storage[u]] for u in range(len(units))),
        forward_fixed=tuple(fixed[:F]), reads=tuple(reads), phase_fixed=tuple(phase),
        at_fixed=tuple(at), after_fixed=tuple(after), before_fixed=before)
    return problem, units
