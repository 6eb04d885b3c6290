"""A model of PyTorch's CUDA caching allocator: the segments a sequence of allocations and
frees makes it reserve (issue 26, item 5). Torch-free.

A memopt budget counts allocated bytes; a GPU runs out of reserved ones, the segments the
caching allocator took from the driver and keeps. This replays a step's allocations
(a plan's storages, in schedule order) through the allocator's policy as
`c10/cuda/CUDACachingAllocator.cpp` states it (torch 2.11-2.13, default settings:
no `max_split_size_mb`, no expandable segments, one stream), and reports the segments'
bytes at their most:

- sizes round up to 512 bytes;
- requests of at most 1 MiB come from the small pool, whose segments are 2 MiB; larger
  ones from the large pool, whose segments are 20 MiB for a request under 10 MiB and the
  request rounded up to 2 MiB otherwise;
- a request takes the smallest free block of its pool that fits (the lowest address on
  ties), split when what remains is at least 512 bytes (small pool) or more than 1 MiB
  (large pool);
- a freed block merges with free neighbours of its segment; segments are never given
  back (no `empty_cache`), so later steps reuse what earlier ones cut.

What it leaves out: other streams, the allocator's garbage collection and out-of-memory
retries (which free cached segments), allocations memopt's plan does not list (library
workspaces, the autograd engine's bookkeeping), and the order of allocations inside one
op. The measured H200 figures it is checked against are in docs/benchmarks/cuda.md.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable
from dataclasses import dataclass, field

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20        # requests up to 1 MiB: the small pool
SMALL_BUFFER = 2 << 20      # a small pool segment
LARGE_BUFFER = 20 << 20     # a large pool segment for a request under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20       # larger requests: their own segment, rounded up to this


def round_size(nbytes: int) -> int:
    """A request's size as the allocator serves it: 512 bytes at least, a multiple of 512."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    """The segment a `size` request (rounded) makes the allocator reserve when no cached
    block fits it."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass
class _Block:
    segment: int
    offset: int
    size: int
    free: bool = True


@dataclass
class CachingAllocator:
    """The allocator's state: its segments and their blocks, and the most it reserved."""

    #: per segment: its blocks in address order
    segments: list[list[_Block]] = field(default_factory=list)
    #: free blocks per pool (True: small), sorted by (size, segment, offset)
    _free: dict[bool, list[tuple[int, int, int]]] = field(
        default_factory=lambda: {True: [], False: []})
    _small: list[bool] = field(default_factory=list)  # per segment: in the small pool
    reserved: int = 0
    peak_reserved: int = 0
    allocated: int = 0
    peak_allocated: int = 0

    def malloc(self, nbytes: int) -> tuple[int, int]:
        """Serve a request; the (segment, offset) of its block."""
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self._free[small]
        found = bisect_left(pool, (size, -1, -1))  # the smallest free block that fits
        if found == len(pool):
            seg = len(self.segments)
            total = segment_size(size)
            self.segments.append([_Block(seg, 0, total)])
            self._small.append(small)
            self.reserved += total
            self.peak_reserved = max(self.peak_reserved, self.reserved)
            insort(pool, (total, seg, 0))
            found = bisect_left(pool, (size, -1, -1))
        _, seg, offset = pool.pop(found)
        blocks = self.segments[seg]
        k = next(i for i, b in enumerate(blocks) if b.offset == offset)
        block = blocks[k]
        rest = block.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL_SIZE:
            blocks.insert(k + 1, _Block(seg, offset + size, rest))
            insort(pool, (rest, seg, offset + size))
            block.size = size
        block.free = False
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return seg, offset

    def free(self, where: tuple[int, int]) -> None:
        """Return a block to its pool, merged with its free neighbours."""
        seg, offset = where
        blocks, pool = self.segments[seg], self._free[self._small[seg]]
        k = next(i for i, b in enumerate(blocks) if b.offset == offset)
        block = blocks[k]
        self.allocated -= block.size
        block.free = True
        for j in (k + 1, k - 1):  # the next block first, so that k stays valid
            if 0 <= j < len(blocks) and blocks[j].free:
                other = blocks[j]
                pool.remove((other.size, seg, other.offset))
                lo, hi = (block, other) if j > k else (other, block)
                lo.size += hi.size
                blocks.remove(hi)
                block = lo
        insort(pool, (block.size, seg, block.offset))


def replay(resident: Iterable[int], step: list[tuple[int, int, int]], num_steps: int,
           repeats: int = 3) -> CachingAllocator:
    """The allocator after the `resident` tensors (allocated first, in order, and kept)
    and `repeats` training steps. `step` lists (bytes, first step, last step) of every
    other storage: each is allocated when its first step begins, in the listed order,
    and freed after its last step; what lives to the step's end is freed then, as a
    loop's `zero_grad(set_to_none=True)` frees the gradients before the next step."""
    cache = CachingAllocator()
    for nbytes in resident:
        cache.malloc(nbytes)
    starts: dict[int, list[int]] = {}
    ends: dict[int, list[int]] = {}
    for i, (_, start, end) in enumerate(step):
        starts.setdefault(max(start, 0), []).append(i)
        ends.setdefault(min(end, num_steps - 1), []).append(i)
    for _ in range(repeats):
        held: dict[int, tuple[int, int]] = {}
        for s in range(num_steps):
            for i in starts.get(s, ()):
                held[i] = cache.malloc(step[i][0])
            for i in ends.get(s, ()):
                cache.free(held.pop(i))
    return cache


def reserved_for(storages: Iterable[tuple[int, int, int]], repeats: int = 3) -> int:
    """The most bytes the caching allocator reserves for a step of `storages`, each
    (bytes, first step, last step) as a memopt plan lists them (first step < 0: resident,
    allocated before the step, in the listed order), over `repeats` steps (`replay`)."""
    storages = list(storages)
    resident = [nbytes for nbytes, start, _ in storages if start < 0]
    step = sorted(((n, s, e) for n, s, e in storages if s >= 0), key=lambda t: (t[1], t[2]))
    num_steps = max((e for _, _, e in storages), default=-1) + 1
    return replay(resident, step, num_steps, repeats).peak_reserved
