"""Tests for memopt.allocator (Chen et al. 2016, Sec. 3, Fig. 2; greedy-by-size offsets).

Tiers (STYLE.md section 7): table-driven cases on plain numbers; invariant checkers
and brute-force oracles written here, apart from the solvers; a hypothesis property
test over random interval sets; and an import check with torch blocked.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memopt.allocator import (
    Interval,
    PeakOfSizes,
    assign_offsets,
    find_overlap,
    live_bytes_profile,
    no_sharing_bytes,
    peak_live_bytes,
    share_by_tags,
)

REPO = Path(__file__).resolve().parents[1]


def ivs(*triples: tuple[int, int, int]) -> list[Interval]:
    return [Interval(size, start, end) for size, start, end in triples]


def chain(sizes: Sequence[int]) -> list[Interval]:
    """Buffer i is produced at step i and last read at step i + 1."""
    return [Interval(s, i, i + 1) for i, s in enumerate(sizes)]


# Tier 2 helpers: checkers written apart from the solvers (plain O(n^2) / O(n * steps)).


def times_overlap(a: Interval, b: Interval) -> bool:
    return a.start <= b.end and b.start <= a.end


def aligned(size: int, alignment: int) -> int:
    return (size + alignment - 1) // alignment * alignment


def brute_live(intervals: Sequence[Interval], step: int) -> list[int]:
    return [i for i, iv in enumerate(intervals) if max(iv.start, 0) <= step <= iv.end]


def brute_address_clash(
    intervals: Sequence[Interval], offsets: Sequence[int], alignment: int
) -> list[tuple[int, int]]:
    clashes = []
    for i, a in enumerate(intervals):
        for j in range(i + 1, len(intervals)):
            b = intervals[j]
            a_end = offsets[i] + aligned(a.size, alignment)
            b_end = offsets[j] + aligned(b.size, alignment)
            if times_overlap(a, b) and offsets[i] < b_end and offsets[j] < a_end:
                if a.size and b.size:
                    clashes.append((i, j))
    return clashes


def check_sharing(intervals: Sequence[Interval]) -> None:
    res = share_by_tags(intervals)
    assert len(res.tag_of) == len(intervals)
    members: dict[int, list[int]] = {}
    for i, tag in enumerate(res.tag_of):
        members.setdefault(tag, []).append(i)
    assert sorted(members) == list(range(len(res.tag_sizes)))  # every tag is used
    for tag, group in members.items():
        assert res.tag_sizes[tag] == max(intervals[i].size for i in group)
        for x in group:
            for y in group:
                if x < y:
                    assert not times_overlap(intervals[x], intervals[y]), (tag, x, y)
        if any(intervals[i].start < 0 for i in group):
            assert len(group) == 1  # residents never recycle their tag
    steps = max((iv.end for iv in intervals), default=-1) + 1
    assert res.total_bytes == sum(res.tag_sizes)
    assert peak_live_bytes(intervals, steps).peak_bytes <= res.total_bytes
    assert res.total_bytes <= no_sharing_bytes(intervals)


def check_offsets(intervals: Sequence[Interval], alignment: int) -> None:
    res = assign_offsets(intervals, alignment)
    assert len(res.offsets) == len(intervals)
    assert all(o >= 0 and o % alignment == 0 for o in res.offsets)
    assert brute_address_clash(intervals, res.offsets, alignment) == []
    assert find_overlap(intervals, res.offsets, alignment) is None
    sizes = [aligned(iv.size, alignment) for iv in intervals]
    assert res.arena_bytes == max((o + s for o, s in zip(res.offsets, sizes)), default=0)
    steps = max((iv.end for iv in intervals), default=-1) + 1
    padded = [Interval(s, iv.start, iv.end) for s, iv in zip(sizes, intervals)]
    assert peak_live_bytes(padded, steps).peak_bytes <= res.arena_bytes <= sum(sizes)


# Tier 1: table-driven cases on plain numbers.

PROFILE_CASES = [
    # (intervals, num_steps, expected profile)
    ([], 3, (0, 0, 0)),
    (ivs((5, 0, 0)), 0, ()),
    (ivs((5, 1, 2)), 4, (0, 5, 5, 0)),
    (ivs((5, -1, 1), (2, 1, 1)), 3, (5, 7, 0)),  # resident counts from step 0
    (ivs((4, 1, 9)), 3, (0, 4, 4)),  # end clipped
    (ivs((4, 3, 5)), 3, (0, 0, 0)),  # born after the last step
    (ivs((0, 0, 2), (3, 0, 0)), 2, (3, 0)),
    (chain([3, 5, 2, 7, 1]), 6, (3, 8, 7, 9, 8, 1)),
]


@pytest.mark.parametrize("intervals, steps, expected", PROFILE_CASES)
def test_live_bytes_profile_table(intervals, steps, expected):
    assert live_bytes_profile(intervals, steps) == expected


def test_peak_of_a_chain_is_the_two_largest_neighbors():
    sizes = [3, 5, 2, 7, 1]
    res = peak_live_bytes(chain(sizes), len(sizes) + 1)
    assert res.peak_bytes == max(a + b for a, b in zip(sizes, sizes[1:])) == 9
    assert (res.peak_step, res.live_at_peak) == (3, (2, 3))


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(-1, 12), st.integers(0, 6)),
                max_size=12),
       st.lists(st.lists(st.tuples(st.integers(-1, 12), st.integers(0, 6)), min_size=1,
                         max_size=3), max_size=3),
       st.lists(st.integers(0, 100), min_size=3, max_size=3),
       st.sampled_from([1, 8]))
@settings(max_examples=200, deadline=None)
def test_peak_of_sizes_is_the_peak_with_those_sizes(fixed, variable, sizes, granularity):
    """PeakOfSizes (a chain's policies priced on one schedule) against the peak of the
    intervals with the sizes put in, each rounded as the planner rounds a storage."""
    steps = 10
    fixed = [Interval(size, start, start + length) for size, start, length in fixed]
    spans = [[(start, start + length) for start, length in v] for v in variable]
    rounded = [-(-size // granularity) * granularity for size in sizes]
    everything = [*fixed, *(Interval(size, s, e) for v, size in zip(spans, rounded)
                            for s, e in v)]
    expected = peak_live_bytes(everything, steps).peak_bytes
    assert PeakOfSizes(fixed, spans, steps, granularity)(*sizes[:len(spans)]) == expected


def test_peak_of_nothing():
    res = peak_live_bytes([], 0)
    assert (res.peak_bytes, res.peak_step, res.live_at_peak) == (0, -1, ())


# Chen Fig. 2-like graph in topological order, unit sizes: A -> B -> C; D reads C at
# step 4 together with C, so C, D, E are live at step 4; F reuses a recycled tag.
FIG2 = ivs((1, 0, 1), (1, 1, 2), (1, 2, 4), (1, 3, 4), (1, 4, 5), (1, 5, 5))

SHARING_CASES = [
    # (intervals, expected tag_of, expected tag_sizes)
    ([], (), ()),
    (chain([3, 5, 2, 7, 1]), (0, 1, 0, 1, 0), (3, 7)),  # tag 1 grows from 5 to 7
    (FIG2, (0, 1, 0, 1, 2, 0), (1, 1, 1)),
    # freed at step 1 cannot be reused by a birth at step 1, but can at step 2
    (ivs((4, 0, 1), (4, 1, 2), (4, 2, 2)), (0, 1, 0), (4, 4)),
    # born together: distinct tags
    (ivs((4, 0, 0), (4, 0, 0)), (0, 1), (4, 4)),
    # births of a step go largest first; best fit: 5 takes the 10-byte tag, 3 the 4-byte one
    (ivs((4, 0, 0), (10, 0, 0), (3, 1, 1), (5, 1, 1)), (1, 0, 1, 0), (10, 4)),
    # nothing fits 8: the largest free tag (6) grows to 8
    (ivs((4, 0, 0), (6, 0, 0), (8, 1, 1)), (1, 0, 0), (8, 4)),
    # residents keep their own tags even after their last step
    (ivs((7, -1, 0), (7, 1, 1), (3, -1, 5)), (0, 2, 1), (7, 3, 7)),
]


@pytest.mark.parametrize("intervals, tag_of, tag_sizes", SHARING_CASES)
def test_share_by_tags_table(intervals, tag_of, tag_sizes):
    res = share_by_tags(intervals)
    assert (res.tag_of, res.tag_sizes, res.total_bytes) == (tag_of, tag_sizes, sum(tag_sizes))
    check_sharing(intervals)


def test_chain_sharing_vs_no_sharing():
    intervals = chain([3, 5, 2, 7, 1])
    assert no_sharing_bytes(intervals) == 18
    assert share_by_tags(intervals).total_bytes == 10
    assert peak_live_bytes(intervals, 6).peak_bytes == 9
    assert share_by_tags(FIG2).total_bytes == peak_live_bytes(FIG2, 6).peak_bytes == 3


OFFSET_CASES = [
    # (intervals, alignment, expected offsets, expected arena)
    ([], 1, (), 0),
    (ivs((4, 0, 1), (6, 2, 3)), 1, (0, 0), 6),  # disjoint lifetimes reuse address 0
    (ivs((4, 0, 2), (6, 2, 3)), 1, (6, 0), 10),  # larger first, smaller on top
    (chain([3, 5, 2, 7, 1]), 1, (5, 0, 7, 0, 7), 9),  # reaches the peak
    # best fit: at step 1 the gaps are [0, 10) and [19, 27); 5 bytes go to the smaller one
    (ivs((10, 0, 0), (9, 0, 4), (8, 0, 0), (7, 0, 4), (5, 1, 1)), 1, (0, 10, 19, 27, 19), 34),
    (ivs((1, 0, 0), (65, 0, 0)), 64, (128, 0), 192),  # sizes padded to the alignment
    (ivs((0, 0, 5), (3, 0, 5)), 1, (0, 0), 3),  # an empty buffer takes no room
    (ivs((8, -1, 9), (8, 0, 0), (8, 1, 1)), 1, (0, 8, 8), 16),  # a resident overlaps all
]


@pytest.mark.parametrize("intervals, alignment, offsets, arena", OFFSET_CASES)
def test_assign_offsets_table(intervals, alignment, offsets, arena):
    res = assign_offsets(intervals, alignment)
    assert (res.offsets, res.arena_bytes) == (offsets, arena)
    check_offsets(intervals, alignment)


FIND_OVERLAP_CASES = [
    (ivs((4, 0, 1), (4, 1, 2)), (0, 2), (0, 1)),  # both live at step 1, [0,4) vs [2,6)
    (ivs((4, 0, 1), (4, 1, 2)), (0, 4), None),  # adjacent ranges do not overlap
    (ivs((4, 0, 0), (4, 1, 2)), (0, 0), None),  # same address, disjoint lifetimes
    (ivs((0, 0, 1), (4, 0, 1)), (1, 0), None),  # empty buffers never clash
    (ivs((8, 0, 9), (4, 5, 5), (4, 3, 3)), (0, 100, 7), (0, 2)),
]


@pytest.mark.parametrize("intervals, offsets, expected", FIND_OVERLAP_CASES)
def test_find_overlap_table(intervals, offsets, expected):
    assert find_overlap(intervals, offsets) == expected


def test_find_overlap_uses_the_alignment():
    intervals = ivs((1, 0, 0), (1, 0, 0))
    assert find_overlap(intervals, (0, 32)) is None
    assert find_overlap(intervals, (0, 32), alignment=64) == (0, 1)


@pytest.mark.parametrize(
    "call",
    [
        lambda: Interval(-1, 0, 0),
        lambda: Interval(1, 3, 2),
        lambda: live_bytes_profile([], -1),
        lambda: assign_offsets([], alignment=0),
        lambda: find_overlap(ivs((1, 0, 0)), ()),
    ],
)
def test_bad_input_raises_value_error(call):
    with pytest.raises(ValueError):
        call()


def test_results_are_frozen():
    res = assign_offsets(ivs((1, 0, 0)))
    with pytest.raises(AttributeError):
        res.arena_bytes = 0  # type: ignore[misc]


# Tier 2: brute-force oracles on small random cases.


def random_intervals(rng: random.Random, n: int, steps: int) -> list[Interval]:
    out = []
    for _ in range(n):
        start = rng.randrange(-1, steps)
        out.append(Interval(rng.randrange(0, 50), start, start + rng.randrange(0, 6)))
    return out


@pytest.mark.parametrize("seed", range(30))
def test_peak_matches_brute_force(seed):
    rng = random.Random(seed)
    steps = rng.randrange(0, 12)
    intervals = random_intervals(rng, rng.randrange(0, 15), steps + 3)
    profile = [sum(intervals[i].size for i in brute_live(intervals, t)) for t in range(steps)]
    assert live_bytes_profile(intervals, steps) == tuple(profile)
    res = peak_live_bytes(intervals, steps)
    assert res.peak_bytes == max(profile, default=0)
    if steps:
        assert res.peak_step == profile.index(res.peak_bytes)
        assert res.live_at_peak == tuple(brute_live(intervals, res.peak_step))


@pytest.mark.parametrize("seed", range(30))
def test_find_overlap_matches_brute_force(seed):
    rng = random.Random(seed)
    intervals = random_intervals(rng, rng.randrange(0, 12), 8)
    offsets = [rng.randrange(0, 120) for _ in intervals]
    alignment = rng.choice([1, 16])
    found = find_overlap(intervals, offsets, alignment)
    clashes = brute_address_clash(intervals, offsets, alignment)
    assert (found is None) == (not clashes)
    assert found is None or found in clashes


def test_large_schedule_is_fast_and_valid():
    rng = random.Random(0)
    n = 10_000
    intervals = [Interval(rng.randrange(1, 1 << 16), -1, n) for _ in range(20)]
    for _ in range(n):
        start = rng.randrange(0, n)
        intervals.append(Interval(rng.randrange(1, 1 << 20), start, start + rng.randrange(0, 40)))
    t0 = time.process_time()
    res = assign_offsets(intervals, alignment=64)
    tags = share_by_tags(intervals)
    assert time.process_time() - t0 < 10.0  # O(n^2) would take minutes
    assert find_overlap(intervals, res.offsets, 64) is None
    peak = peak_live_bytes(intervals, n + 40).peak_bytes
    assert peak <= res.arena_bytes and peak <= tags.total_bytes


# Tier 2: property test over random interval sets.

interval_sets = st.lists(
    st.builds(
        lambda size, start, length: Interval(size, start, start + length),
        st.integers(0, 100),
        st.integers(-1, 20),
        st.integers(0, 8),
    ),
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(intervals=interval_sets, alignment=st.sampled_from([1, 8, 64]))
def test_allocators_respect_invariants(intervals, alignment):
    check_sharing(intervals)
    check_offsets(intervals, alignment)


# No torch in the solvers.


def test_solvers_import_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None; "
        f"sys.path.insert(0, {str(REPO)!r}); "
        "import allocator, allocator.liveness, allocator.sharing, allocator.offsets; "
        "iv = [allocator.Interval(4, 0, 1), allocator.Interval(4, 1, 2)]; "
        "assert allocator.assign_offsets(iv).arena_bytes == 8; "
        "assert allocator.share_by_tags(iv).total_bytes == 8; "
        "assert sys.modules['torch'] is None"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
