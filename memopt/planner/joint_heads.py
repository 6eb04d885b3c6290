"""A head's chunk chosen with the mirror set, not before it.

`HeadFamily.choose` fixes each language-model head's chunk before the Chen planner sees
the graph: the largest chunk that fits the budget alone, else the chunk of the lowest
peak. Both leave recomputation on the table. Every split of a head recomputes its whole
matmul (passes.lm_heads: the logits are made again in backward), and where no chunk fits
alone the lowest peak is the smallest chunk, so the step runs many short chunks, each a
few kernels launched from Python, while Chen's search may have brought the step under the
budget with the head whole and less recomputed in all. Measured on a Llama (4 layers,
d 256, vocabulary 8000, 512 tokens; 92 MiB against eager's 135): the head alone chose 32
chunks and the mirror set then recomputed 0.39 of the forward's FLOPs, where one chunk
with Chen's search fits at 0.15; on an H100 the 32 chunks launched 550 more kernels a
step (24.2 ms against 9.3 ms at no budget, the GPU busy 3.0 ms of it).

`choose_heads_jointly` makes the choice one search: for each head in turn (the others as
they stand), each of its chunk sizes with the mirror set Chen's search finds for it, and
the pair that fits with the fewest recomputed FLOPs, the head's own included. This is
Chen et al. 2016's objective (Sec. 4: the least recomputation within the memory bound)
over the head's configurations as well as the graph's nodes. Near-ties (within
`TIE_FRACTION` of the forward's FLOPs) go to the larger chunk: fewer chunks launch fewer
kernels for the same arithmetic. The candidates do not depend on the budget, so a lower
budget still never finds a plan a higher one would have preferred and passed over.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from memopt.passes import lm_heads as head_pass
from memopt.passes.simulate import Simulated

from ..budget import format_bytes
from ..memory_plan import SearchCandidate
from .build import Mirror
from .families import Choice, Sites

log = logging.getLogger("memopt")

#: Recomputed FLOPs closer than this fraction of the forward's count a tie, which the
#: larger chunk wins.
TIE_FRACTION = 0.01

Search = tuple[Mirror, tuple[SearchCandidate, ...]]


def choose_heads_jointly(heads: Sites, mirror: Mirror, search: tuple[SearchCandidate, ...],
                         search_for: Callable[[int], Search],
                         simulate: Callable[[Mirror], Simulated], target: int,
                         forward_flops: int, free: Mirror = Mirror()) -> Search:
    """Each head's chunk and the mirror set, chosen together (the module docstring).

    `heads` runs its current choices, with which `mirror` (found by `search`) was
    searched; `search_for(target)` runs the planner's mirror-set search with every family
    as it runs now, `simulate` scores a mirror set the same way. `free` is what fused
    kernels recompute at no cost (planner.fusible, the inductor mode): every candidate
    starts from it, and its FLOPs are not counted against a candidate (counted, the head
    choice preferred a plan that kept those values: the zoo GPT-2 held 26% more at a
    budget 1.3x the no-budget peak than with no budget). Returns the mirror set and
    search of the chosen configurations, which `heads` then runs."""
    def cost(m: Mirror) -> int | None:
        step = simulate(m)
        if step.peak_bytes > target:
            return None
        shared = m.names & free.names
        paid = step.recompute_flops - (simulate(Mirror(shared)).recompute_flops if shared else 0)
        return paid + heads.recompute_flops()

    tie = TIE_FRACTION * forward_flops
    for i, chosen in enumerate(heads.choices):
        site = chosen.site
        best = (cost(mirror), chosen.config, mirror, search)
        if best[0] is None:  # the lowest-peak chunk misses with Chen's search: so would
            break            # the others, which hold more (the plan is refused as it was)
        for config in head_pass.configurations(site, heads.costs[site.fwd]):  # largest first
            if config == chosen.config:
                continue
            # a split recomputes the head's matmul whatever the mirror set: no search
            # when that alone loses, or when a larger split already needed no mirror set
            if config.recompute_flops + _others(heads, i) \
                    >= best[0] - tie and config.chunk < best[1].chunk:
                continue
            heads.run(site, config)
            heads.choices[i] = Choice(site, config, chosen.reason)
            trial = (free, ()) if simulate(free).peak_bytes <= target \
                else search_for(target)
            flops = cost(trial[0])
            if flops is not None and _better(flops, config, best[0], best[1], tie):
                best = (flops, config, *trial)
        flops, config, mirror, search = best
        heads.run(site, config)
        reason = chosen.reason if config == chosen.config else (
            f"with the mirror set, the fewest recomputed FLOPs of "
            f"{len(head_pass.configurations(site, heads.costs[site.fwd]))} chunk sizes "
            f"(the head's matmul again in backward when split; Chen's search for each)")
        heads.choices[i] = Choice(site, config, reason)
        log.debug("memopt head %s with the mirror set: %d chunks, %s recomputed FLOPs, "
                  "peak %s", site.name, config.chunks, flops,
                  format_bytes(simulate(mirror).peak_bytes))
    return mirror, search


def _others(heads: Sites, i: int) -> int:
    """The recomputed FLOPs of every head but the `i`-th, as they run now."""
    return sum(heads.family.recompute_flops(c) for j, c in enumerate(heads.choices) if j != i)


def _better(flops: int, config: head_pass.HeadConfig, best_flops: int,
            best_config: head_pass.HeadConfig, tie: float) -> bool:
    """Whether (`flops`, `config`) beats the best so far (which fits: the search stops
    before a head whose chosen chunk misses): it recomputes clearly less, or as much
    within `tie` in larger chunks."""
    if flops < best_flops - tie:
        return True
    return abs(flops - best_flops) <= tie and config.chunk > best_config.chunk
