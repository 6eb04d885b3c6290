"""Live bytes over a step's schedule, by kind, downsampled for a picture of memory.

The peak of a step (allocator.liveness) is one number; `live_by_kind` gives the whole
profile behind it, split by what holds the memory (parameters, saved activations,
recomputed values, ...), as one difference array per kind (inductor's
`estimate_peak_memory`). `downsample` keeps at most a few thousand points of it for a
plan's JSON and its plot: each point is the step of its bucket where the total is
highest, so the peak step always survives and every point's kinds still add up to its
total.

Pure Python on plain ints: never imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence

#: The kinds a timeline splits live bytes into, bottom to top of the picture.
KINDS = ("parameters", "inputs", "gradients", "chain_states", "saved", "recomputed",
         "temporaries", "workspace", "other_graphs")

#: What each kind holds, as a legend says it.
KIND_LABELS = {
    "parameters": "parameters + buffers",
    "inputs": "inputs",
    "gradients": "gradients",
    "chain_states": "chain states (recurrent, reversible)",
    "saved": "saved activations",
    "recomputed": "recomputed values",
    "temporaries": "temporaries",
    "workspace": "kernel workspace",
    "other_graphs": "other graphs of the step",
}

#: Points a timeline keeps (a picture is about a thousand pixels wide).
MAX_POINTS = 1000


def live_by_kind(intervals: Sequence[tuple[int, int, int]], kinds: Sequence[str],
                 num_steps: int, granularity: int = 1) -> dict[str, list[int]]:
    """Live bytes of each kind at each step 0..num_steps-1: {kind: [bytes per step]},
    only the kinds some interval has.

    `intervals` are (bytes, first step, last step), both inclusive, first < 0 for what
    lives before the step (counted from step 0), as allocator.liveness reads them;
    `kinds[i]` is interval i's kind. Each interval is rounded up to `granularity`
    bytes, as the pipeline rounds them for the predicted peak, so the totals' maximum
    is that peak.
    """
    if len(intervals) != len(kinds):
        raise ValueError(f"{len(intervals)} intervals but {len(kinds)} kinds")
    diffs: dict[str, list[int]] = {}
    last = num_steps - 1
    for (size, start, end), kind in zip(intervals, kinds):
        s, e = max(start, 0), min(end, last)
        if s > e:
            continue
        diff = diffs.setdefault(kind, [0] * (num_steps + 1))
        size = -(-size // granularity) * granularity
        diff[s] += size
        diff[e + 1] -= size
    profiles = {}
    for kind in sorted(diffs, key=_kind_order):
        live, profile = 0, []
        for d in diffs[kind][:num_steps]:
            live += d
            profile.append(live)
        profiles[kind] = profile
    return profiles


def downsample(profiles: dict[str, list[int]], num_steps: int, max_points: int = MAX_POINTS
               ) -> tuple[tuple[int, ...], dict[str, tuple[int, ...]]]:
    """(steps, {kind: bytes at each of those steps}): at most `max_points` points, one
    per bucket of consecutive steps, at the bucket's step with the highest total (the
    first on ties). Every step is kept when there are no more than `max_points`."""
    if max_points < 1:
        raise ValueError(f"max_points must be >= 1, got {max_points}")
    totals = [sum(column) for column in zip(*profiles.values())] or [0] * num_steps
    width = -(-num_steps // max_points) if num_steps else 1
    steps = tuple(max(range(b, min(b + width, num_steps)), key=totals.__getitem__)
                  for b in range(0, num_steps, width))
    return steps, {kind: tuple(profile[s] for s in steps) for kind, profile in profiles.items()}


def _kind_order(kind: str) -> tuple[int, str]:
    return (KINDS.index(kind) if kind in KINDS else len(KINDS), kind)


def other_lowered(live: Sequence[Sequence[int]], kinds: Sequence[str], steps: Sequence[int],
                  num_forward: int, backward: int, at_end: int
                  ) -> tuple[tuple[int, ...], ...] | None:
    """A timeline's columns (`live[k][p]`, bytes of `kinds[k]` at `steps[p]`) with
    "other_graphs" `backward` bytes lower at each backward step and `at_end` lower at the
    forward's last: one storage held outside the graph over its backward taken off (the
    room memopt.caller_loss holds for the caller's loss). None where it has no such
    kind."""
    if "other_graphs" not in kinds:
        return None
    k = list(kinds).index("other_graphs")
    lowered = [tuple(column) for column in live]
    lowered[k] = tuple(max(0, v - (backward if step >= num_forward
                                   else at_end if step == num_forward - 1 else 0))
                       for step, v in zip(steps, live[k]))
    return tuple(lowered)

