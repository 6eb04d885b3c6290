"""Recurrent chains as an op family (planner.families): each chain's Gruslys policy.

A chain (passes.chain_policy: an `nn.LSTM`/`nn.GRU`/`nn.RNN` split into chunks, or a user's
cell loop found in the graph) runs under a (chunk length, strategy, m) policy of
Gruslys et al. 2016: BPTT-HSM, ISM or MSM (Sec. 3.1-3.4), priced by the exact liveness
of the step and by each chunk's measured call time (passes.chain_policy.ChunkCosts).
"""

from __future__ import annotations

import dataclasses
import logging
import warnings

from torch import fx

from memopt.passes import chain_policy as chain_pass
from memopt.passes.meta import OpBytes, held_bytes, workspace_bytes

from ..budget import format_bytes
from ..memory_plan import ChainRecord
from memopt.allocator import Interval, PeakOfSizes

from .build import Built, allocation_granularity, device_of
from .families import Choice, ChoiceContext, Sites, unchanged
from .observe import is_verifying

log = logging.getLogger("memopt")

#: the module types of nn.LSTM / nn.GRU / nn.RNN stacks, whose dropout between layers a
#: split chain draws chunk by chunk
_STACKS = ("LSTM", "GRU", "RNN")


class ChainFamily:
    """Recurrent chains (Gruslys et al. 2016)."""

    find_stage = "recurrent chains"
    choose_stage = "recurrent chain policies"
    plan_field = "chains"

    def find(self, joint: fx.GraphModule) -> list[chain_pass.ChainSite]:
        return chain_pass.find_chains(joint)

    def costs(self, joint: fx.GraphModule, site: chain_pass.ChainSite,
              room: int | None = None) -> chain_pass.ChunkCosts:
        return chain_pass.chunk_costs(joint, site, room)

    def initial(self, site: chain_pass.ChainSite, costs: chain_pass.ChunkCosts,
                lean: bool = False) -> chain_pass.ChainConfig:
        """One chunk (t = 1): no recomputation, eager's memory. ``lean`` (no budget: the
        policy stays so): its backward op gets stand-ins for the sliced per-step inputs the
        chunk does not save (a scan's ``deltaB_u``), so that the forward does not save them
        and they are freed after it, as eager frees them. With a budget they stay, since a
        split chain recomputes from them (the graph's structure is fixed once the step
        model is made)."""
        config = chain_pass.configure(site, costs, site.steps, 1)
        if lean:
            return dataclasses.replace(config, stand_ins=costs.unsaved,
                                       stand_in_xs=costs.xs_unsaved)
        return dataclasses.replace(config, holds_sliced=False)  # see ChainConfig

    def apply(self, graphs: list[fx.GraphModule], site: chain_pass.ChainSite,
              config: chain_pass.ChainConfig) -> None:
        chain_pass.apply(graphs, site, config)

    def op_bytes(self, site: chain_pass.ChainSite, config: chain_pass.ChainConfig
                 ) -> dict[str, OpBytes]:
        return chain_pass.op_bytes(site, config)

    def choose(self, found: Sites, ctx: ChoiceContext) -> list[Choice]:
        """Each recurrent chain's policy (Gruslys et al. 2016: BPTT-HSM, ISM or MSM),
        chosen before Chen's planner sees the rest of the graph.

        Step 1: every chain starts as one chunk (t = 1: no recomputation, eager's memory).
        Step 2: with no budget, or when that fits, done (`unchanged`).
        Step 3: else, chain by chain, price every (chunk length, strategy, m) of its grid
            (chain_pass.configurations) by the exact liveness of one build (only the
            chain's held and workspace bytes change between configurations: one liveness
            analysis, those bytes its variables, `_ChainPeak`), other chains fixed,
            against a goal: the peak less this
            chain's share of the bytes still over the target (the excess over the chains
            left, this one included), so that the first chain of several (a
            bidirectional RNN's, a stack's) is not split to its lowest peak while the
            others stay whole.
        Step 4: between the longest grid chunk that fits with every boundary kept
            (m = t) and the next longer grid chunk, bisect for the longest chunk that
            fits (chain_pass.longest_fitting_chunk): its T - L recomputed steps can beat
            the grid. Take the configuration that fits the goal in the least estimated
            time (chunk calls at their measured cost; then the fewest recomputed steps),
            else the lowest peak, and leave the rest of the budget to the Chen planner.
        Step 5: with several chains, when they fit together, each chooses again (Steps
            3-4) against the target itself, the others fixed at their choice, among the
            configurations estimated faster than its own.
        """
        kept, built = unchanged(found, ctx)
        if kept is not None:
            for s in found.sites:  # one chunk stays: its graph holds the sliced inputs
                found.run(s, dataclasses.replace(found.current[s.fwd], holds_sliced=True))
            return [dataclasses.replace(c, config=found.current[c.site.fwd]) for c in kept]
        pricing = _Pricing(found, ctx, built)
        sites = found.sites
        # Step 3: each chain in turn removes its share of what is still over the target
        chosen: dict[str, Choice] = {}
        now = built.peak_bytes
        for k, s in enumerate(sites):
            goal = max(ctx.target, now - (now - ctx.target) // (len(sites) - k))
            chosen[s.fwd], now = pricing.choose(s, goal)
        # Step 5: with several chains, each chooses again, the others fixed, against the
        # target itself: a chain that took more than its share lets the others split less
        if len(sites) > 1 and now <= ctx.target:
            for s in sites:
                chosen[s.fwd], now = pricing.choose(s, ctx.target, kept=now)
        for s in sites:
            found.run(s, pricing.current[s.fwd], built.fw, built.bw)
        return [chosen[s.fwd] for s in sites]

    def faster(self, choice: Choice, costs: chain_pass.ChunkCosts
               ) -> list[chain_pass.ChainConfig]:
        # one chunk holds the sliced inputs its graph saves, which the mirror set may
        # recompute: a chain that slices them stays split once it is
        grid = [g for g in chain_pass.configurations(choice.site, costs)
                if g.seconds < choice.config.seconds
                and (g.t > 1 or not choice.site.sliced_bytes or choice.config.t == 1)]
        return sorted(grid, key=lambda g: (g.seconds, g.recompute_steps, g.held_bytes))

    def record(self, c: Choice) -> ChainRecord:
        if c.config.t > 1 and c.site.module_type in _STACKS \
                and chain_pass.chain_spec(c.site.chain).preserve_rng:
            warnings.warn(
                f"memopt: {c.site.name} ({c.site.module_type} with dropout between layers) "
                f"runs as {c.config.t} chunks under this budget: its dropout masks are drawn "
                f"chunk by chunk, of eager's distribution but not eager's numbers for the "
                f"same seed (with no budget it is one chunk, which draws eager's; "
                f"docs/recurrent.md)", UserWarning, stacklevel=2)
        return ChainRecord(
            module=c.site.name, module_type=c.site.module_type, steps=c.site.steps,
            chunk=c.config.chunk, t=c.config.t, m=c.config.m,
            strategy=c.config.policy.strategy, alpha=c.config.policy.alpha,
            beta=c.config.policy.beta, cost=c.config.policy.cost,
            recompute_steps=c.config.recompute_steps, estimated_seconds=c.config.seconds,
            recompute_flops=self.recompute_flops(c), hidden_bytes=c.site.hidden_bytes,
            internal_bytes=c.config.internal_bytes, held_bytes=c.config.held_bytes,
            forward_workspace_bytes=c.config.forward_workspace_bytes,
            workspace_bytes=c.config.workspace_bytes, reason=c.reason)

    def forward_flops(self, site: chain_pass.ChainSite) -> int:
        return site.steps * site.step_flops

    def recompute_flops(self, choice: Choice) -> int:
        return choice.config.recompute_steps * choice.site.step_flops


class _Unpriced(Exception):
    """The schedule does not show a chain's buffers as `_ChainPeak` models them."""


class _ChainPeak:
    """The step's peak as a function of one chain's policy, from one liveness analysis.

    Between a chain's policies only the bytes its ops hold and allocate change (the
    handle's stored states, the forward op's and each backward op's workspace), not the
    graphs: the peak is the schedule's with those buffers' sizes as variables
    (allocator.PeakOfSizes). A buffer's size in the schedule can exceed the op's bytes
    (under inductor an extern kernel's workspace includes its layout copies): that
    excess is kept. Under `memopt.planner.verifying()` each price is checked against
    a full liveness analysis.
    """

    def __init__(self, ctx: ChoiceContext, built: Built, site: chain_pass.ChainSite) -> None:
        self.ctx, self.built, self.site = ctx, built, site
        schedule = ctx.schedule(built)
        steps = {name: k for k, name in enumerate(schedule.steps)}
        # the bytes the graphs run now, as the chain's ops record them (passes.meta)
        ops = {f"fw.{n.name}": n for n in built.fw.graph.nodes if n.name == site.fwd}
        ops.update({f"bw.{n.name}": n for n in built.bw.graph.nodes if n.name in site.bwds})
        fwd = f"fw.{site.fwd}"
        if fwd not in ops or fwd not in steps or not all(k in steps for k in ops):
            raise _Unpriced(f"chain {site.fwd}: its ops are not all in the schedule")
        handle = f"{fwd}[{site.handle}]"
        spaces = {f"{k}.workspace": k for k in ops}
        held, found, fixed = [], dict.fromkeys(spaces, 0), []
        g = allocation_granularity(device_of(built.fw))  # as build.intervals rounds
        for s in schedule.storages:
            if handle in s.nodes:
                held.append((s.start, s.end, s.nbytes))
            elif s.name in spaces:
                found[s.name] = s.nbytes
            else:
                fixed.append(Interval(size=-(-s.nbytes // g) * g, start=s.start, end=s.end))
        if len(held) != 1:
            raise _Unpriced(f"chain {site.fwd}: {len(held)} storages hold its handle")
        (start, end, nbytes), = held
        self.held_extra = nbytes - held_bytes(ops[fwd]).get(site.handle, 0)
        # the workspaces the schedule counts (not where it leaves an op's out: inductor's
        # own kernels), each with what the schedule adds to the op's bytes
        spaces = {name: op for name, op in spaces.items()
                  if found[name] or not workspace_bytes(ops[op])}
        self.spaces = [(name.startswith("fw."), found[name] - workspace_bytes(ops[op]))
                       for name, op in spaces.items()]
        spans = [[(start, end)], *([(steps[op], steps[op])] for op in spaces.values())]
        self.curve = PeakOfSizes(fixed, spans, len(schedule.steps), g)

    def __call__(self, config: chain_pass.ChainConfig) -> int:
        peak = self.curve(config.held_bytes + self.held_extra,
                          *((config.forward_workspace_bytes if forward
                             else config.workspace_bytes) + extra
                            for forward, extra in self.spaces))
        if is_verifying():
            chain_pass.apply([self.built.fw, self.built.bw], self.site, config)
            exact = self.ctx.peak(self.built)
            assert peak == exact, (f"chain {self.site.fwd}: priced {peak} bytes, "
                                   f"liveness says {exact}")
        return peak


class _Pricing:
    """Steps 3-4 of `ChainFamily.choose` for one chain at a time, on one build whose
    other chains run what `current` says."""

    def __init__(self, found: Sites, ctx: ChoiceContext, built: Built) -> None:
        self.found, self.ctx, self.built = found, ctx, built
        self.current = dict(found.current)

    @staticmethod
    def _bytes(config: chain_pass.ChainConfig) -> tuple[int, int, int]:
        # liveness sees only these bytes: policies that share them share a peak
        return (config.held_bytes, config.forward_workspace_bytes, config.workspace_bytes)

    def choose(self, s: chain_pass.ChainSite, goal: int, kept: int | None = None
               ) -> tuple[Choice, int]:
        """``kept``: the peak with the chain's current configuration, which fits the
        goal: only the configurations estimated faster are priced besides it."""
        costs, built, target = self.found.costs[s.fwd], self.built, self.ctx.target
        peaks: dict[tuple[int, int, int], int] = {}  # other chains as in ``current``
        tried: set[tuple[int, str, int]] = set()

        curve: list = []  # made at the first price: one liveness analysis per choice

        def exact(config: chain_pass.ChainConfig) -> int:
            chain_pass.apply([built.fw, built.bw], s, config)
            return self.ctx.peak(built)

        def peak(config: chain_pass.ChainConfig) -> int:
            tried.add((config.chunk, config.policy.strategy, config.m))
            key = self._bytes(config)
            if key not in peaks:
                if not curve:
                    try:
                        curve.append(_ChainPeak(self.ctx, built, s))
                    except _Unpriced as why:
                        log.debug("memopt: %s; each policy priced by its own liveness", why)
                        curve.append(exact)
                peaks[key] = curve[0](config)
            return peaks[key]

        grid = chain_pass.configurations(s, costs)
        if kept is not None:
            mine = self.current[s.fwd]
            peaks[self._bytes(mine)] = kept
            grid = [mine, *(c for c in grid if c.seconds < mine.seconds)]
        priced = [(peak(c), c) for c in grid]
        fitting = [(p, c) for p, c in priced if p <= goal]
        full = [c.chunk for _, c in fitting
                if c.policy.strategy == "hsm" and c.m == c.t and c.t > 1]
        if full:  # Step 4: bisect past the grid
            lo = max(full)
            hi = min((c.chunk for c in grid if c.chunk > lo), default=lo + 1)
            refined = chain_pass.longest_fitting_chunk(
                s, costs, lambda c: peak(c) <= goal, lo, hi)
            if refined is not None:
                fitting.append((peak(refined), refined))
        if fitting:
            fitting.sort(key=lambda pc: (pc[1].seconds, pc[1].recompute_steps, pc[1].t, pc[0]))
            for p, c in fitting[:5]:
                log.debug("memopt chain %s: fits: %d x %d, %s m=%d, %d steps recomputed, "
                          "%.1f ms, peak %s", s.name, c.t, c.chunk, c.policy.strategy, c.m,
                          c.recompute_steps, c.seconds * 1e3, format_bytes(p))
            p, best = fitting[0]
            reason = (f"least estimated time of the {len(fitting)} of {len(tried)} "
                      f"policies priced that fit")
            if goal > target:
                reason += f" its share of the excess (a peak of {format_bytes(goal)})"
        else:
            # none fits: the lowest peak, or the fastest within ctx.near_lowest of the
            # target above it (a chunk of one step and one slot recomputes T(T-1)/2 steps to hold
            # a few states less than a policy many times faster)
            lowest = min(p for p, _ in priced)
            near = [(p, c) for p, c in priced
                    if p <= lowest + self.ctx.near_lowest * target]
            p, best = min(near, key=lambda pc: (pc[1].seconds, pc[0], pc[1].recompute_steps))
            reason = (f"lowest peak of {len(priced)} policies (none fits alone; the Chen "
                      f"planner recomputes the rest)")
            if len(near) > 1:
                reason = (f"fastest of the {len(near)} of {len(priced)} policies priced within "
                          f"{self.ctx.near_lowest:.0%} of the budget of the lowest peak (none "
                          "fits alone; the Chen planner recomputes the rest)")
        chain_pass.apply([built.fw, built.bw], s, best)
        self.current[s.fwd] = best
        return Choice(s, best, reason), p
