"""memopt's own op families under one protocol: recurrent chains, language-model heads,
reversible stacks.

Each family is an opaque op of memopt's (`memopt::chain_fwd`, `memopt::head_fwd`,
`memopt::reversible_fwd`) whose memory the planner chooses by a configuration rather
than by recomputing graph values. They share a life:

    find           the sites in the joint graph (passes.chain_policy, passes.lm_heads,
                   passes.reversible_stacks)
    costs          what one site's calls cost, measured once per site
    initial        the configuration that recomputes nothing (eager's memory)
    choose         the configuration under the budget, before the Chen planner
    faster         after the mirror set: the faster configurations to try (`relax`)
    apply          rewrite the site's ops and record their bytes for liveness
    record         the plan's record of the choice (memopt.memory_plan)

`Sites` holds what was found and the configuration each site runs now; what those make
the ops hold and allocate (`Sites.op_bytes`) is an argument of every simulation and part
of the planner's cache key, so a cached simulation never outlives the configurations it
was made with.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import fx

from memopt.passes import lm_heads as head_pass
from memopt.passes import reversible_stacks as reversible_pass
from memopt.passes.liveness import StepSchedule
from memopt.passes.meta import OpBytes

from ..budget import format_bytes
from ..memory_plan import HeadRecord, ReversibleRecord
from .build import Built, Mirror, allocation_granularity, device_of, peak_bytes
from .request import StepContext

log = logging.getLogger("memopt")


@dataclass(frozen=True)
class Choice:
    """What the planner chose for one site of a family and why."""

    site: Any
    config: Any
    reason: str


@dataclass(frozen=True)
class ChoiceContext:
    """What a family's `choose` prices its configurations against: the peak to reach
    (None: no budget), the step, and the exact build of a mirror set (the joint graph
    itself is the family's `Sites.joint`)."""

    num_fwd_outputs: int
    target: int | None
    step: StepContext
    build: Callable[[Mirror], Built]
    #: where no configuration of a site fits its goal alone, the fastest within this
    #: fraction of the target above the lowest peak is taken (0: the lowest peak)
    near_lowest: float = 0.0

    def schedule(self, built: Built) -> StepSchedule:
        """`built`'s liveness after a configuration was applied to its graphs in place."""
        return self.step.liveness(built.fw, built.bw, built.saved_names, self.num_fwd_outputs)

    def peak(self, built: Built) -> int:
        """`built`'s peak after a configuration was applied to its graphs in place."""
        return peak_bytes(self.schedule(built), allocation_granularity(device_of(built.fw)))


class OpFamily(Protocol):
    """One family of memopt's own ops (see the module docstring)."""

    #: the pipeline stages that find the sites and choose their configurations
    find_stage: str
    choose_stage: str
    #: the MemoryPlan field its records go to
    plan_field: str

    def find(self, joint: fx.GraphModule) -> list[Any]: ...
    def costs(self, joint: fx.GraphModule, site: Any, room: int | None = None) -> Any: ...
    def initial(self, site: Any, costs: Any, lean: bool = False) -> Any: ...
    def apply(self, graphs: list[fx.GraphModule], site: Any, config: Any) -> None: ...
    def op_bytes(self, site: Any, config: Any) -> dict[str, OpBytes]: ...
    def choose(self, found: Sites, ctx: ChoiceContext) -> list[Choice]: ...
    def faster(self, choice: Choice, costs: Any) -> list[Any]: ...
    def record(self, choice: Choice) -> Any: ...
    def forward_flops(self, site: Any) -> int: ...
    def recompute_flops(self, choice: Choice) -> int: ...


@dataclass
class Sites:
    """The sites one family found in a joint graph, their costs, what the joint graph
    runs at each (`current`), and the choices made."""

    family: OpFamily
    joint: fx.GraphModule
    sites: list[Any]
    costs: dict[str, Any] = field(default_factory=dict)
    current: dict[str, Any] = field(default_factory=dict)   # site.fwd -> config
    choices: list[Choice] = field(default_factory=list)

    def run(self, site: Any, config: Any, *also: fx.GraphModule) -> None:
        """Run `config` at `site` in the joint graph and in the graphs `also` (a build's
        forward and backward: node names are kept)."""
        self.family.apply([self.joint, *also], site, config)
        self.current[site.fwd] = config

    def begin(self, lean: bool = False, room: int | None = None) -> None:
        """Price each site once and run it in its initial configuration (nothing
        recomputed: what the baseline plans). ``lean``: the plan has no budget, so the
        initial configuration is final (a family may then hold less: ChainFamily.initial).
        ``room``: the bytes a measurement made while pricing may allocate (None: any)."""
        for site in self.sites:
            self.costs[site.fwd] = self.family.costs(self.joint, site, room)
            self.run(site, self.family.initial(site, self.costs[site.fwd], lean))

    def reset(self) -> None:
        """Every site back in its initial configuration (a budget, so not lean), for
        Step 5 to choose again."""
        for site in self.sites:
            self.run(site, self.family.initial(site, self.costs[site.fwd]))
        self.choices = []

    def op_bytes(self) -> dict[str, OpBytes]:
        """What the family's ops hold and allocate as the joint graph runs them now, by
        node name: the step simulator's `ops` argument."""
        return {name: b for site in self.sites
                for name, b in self.family.op_bytes(site, self.current[site.fwd]).items()}

    def records(self) -> tuple:
        return tuple(self.family.record(c) for c in self.choices)

    def forward_flops(self) -> int:
        """What the family's ops run in one forward (node_flops counts one element an
        output for an opaque op)."""
        return sum(self.family.forward_flops(c.site) for c in self.choices)

    def recompute_flops(self) -> int:
        return sum(self.family.recompute_flops(c) for c in self.choices)


def unchanged(found: Sites, ctx: ChoiceContext) -> tuple[list[Choice] | None, Built | None]:
    """Steps 1-2 of every family's choice: each site as the joint graph runs it now (its
    initial configuration) when there is no budget, or when the step fits with every site
    so; else (None, the build without recomputation, to price configurations on)."""
    def keep(reason: str) -> list[Choice]:
        return [Choice(s, found.current[s.fwd], reason) for s in found.sites]
    if ctx.target is None:
        return keep("no budget: one chunk, nothing recomputed"), None
    built = ctx.build(Mirror())
    if built.peak_bytes <= ctx.target:
        return keep("the budget fits with one chunk: nothing recomputed"), None
    return None, built


def relax(found: Sites, peak: Callable[[], int], target: int) -> None:
    """After the mirror set: give each site the fastest of its configurations that still
    fits ``target`` with the Chen planner's recomputation as chosen.

    Sites choose before the Chen planner (their bytes are part of what it plans around);
    where none fits alone they take their lowest peak, and the mirror set then brings
    the step under the target, often with room to spare: near memopt's minimum an LSTM
    LM's chain kept one boundary state of 128 chunks (16,256 time steps recomputed, 8.7x
    eager's time) where the step had room for a faster policy. Each choice in turn tries
    the configurations its family lists as faster, fastest first, on the step simulator
    (``peak()``: the simulated peak with the mirror set fixed, other choices as they
    stand), and keeps the first that fits; none fitting, it keeps its own. Gruslys et al.
    2016, Sec. 3 prices a policy by its time under a memory bound: this is that bound
    taken from the whole step rather than the chain's share of it.
    """
    relaxed = []
    for c in found.choices:
        for config in found.family.faster(c, found.costs[c.site.fwd]):
            found.run(c.site, config)
            if peak() <= target:
                c = Choice(c.site, config, c.reason + "; after the Chen planner's mirror "
                           "set, the fastest that still fits")
                break
        else:
            found.run(c.site, c.config)
        relaxed.append(c)
    found.choices = relaxed


class HeadFamily:
    """Language-model heads run chunk by chunk over the tokens (passes.lm_heads)."""

    find_stage = "language-model heads"
    choose_stage = "language-model head chunks"
    plan_field = "heads"

    def find(self, joint: fx.GraphModule) -> list[head_pass.HeadSite]:
        return head_pass.find_heads(joint)

    def costs(self, joint: fx.GraphModule, site: head_pass.HeadSite,
              room: int | None = None) -> head_pass.HeadCosts:
        return head_pass.head_costs(joint, site)

    def initial(self, site: head_pass.HeadSite, costs: head_pass.HeadCosts,
                lean: bool = False) -> head_pass.HeadConfig:
        return head_pass.configure(site, costs, site.rows)

    def apply(self, graphs: list[fx.GraphModule], site: head_pass.HeadSite,
              config: head_pass.HeadConfig) -> None:
        head_pass.apply(graphs, site, config)

    def op_bytes(self, site: head_pass.HeadSite, config: head_pass.HeadConfig
                 ) -> dict[str, OpBytes]:
        return head_pass.op_bytes(site, config)

    def choose(self, found: Sites, ctx: ChoiceContext) -> list[Choice]:
        """Each head's chunk, chosen before the chains and the Chen planner see the rest
        of the graph.

        Step 1: every head starts as one chunk (eager's log-probabilities kept, nothing
            recomputed).
        Step 2: with no budget, or when that fits, done (`unchanged`).
        Step 3: else price each head's chunk sizes (head_pass.configurations) by the exact
            liveness of one build, other heads fixed. Every split recomputes the same one
            matmul of the head, so take the largest chunk that fits; where none fits
            alone, the largest chunk of the lowest peak (the head then no longer sets
            it), and leave the rest of the budget to the chains and the Chen planner.
        """
        kept, built = unchanged(found, ctx)
        if kept is not None:
            return kept
        choices = []
        for s in found.sites:
            priced = []
            for config in head_pass.configurations(s, found.costs[s.fwd]):
                head_pass.apply([built.fw, built.bw], s, config)
                priced.append((ctx.peak(built), config))
            fitting = [(p, c) for p, c in priced if p <= ctx.target]
            if fitting:
                p, best = max(fitting, key=lambda pc: pc[1].chunk)
                reason = (f"the largest of {len(priced)} chunk sizes that fits"
                          if best.chunks > 1 else "the budget fits with one chunk")
            else:
                low = min(p for p, _ in priced)
                p, best = max(((p, c) for p, c in priced if p <= low),
                              key=lambda pc: pc[1].chunk)
                reason = (f"the largest chunk of the lowest peak of {len(priced)} chunk "
                          f"sizes (none fits alone; the rest is recomputed elsewhere)")
            log.debug("memopt head %s: %d chunks of %d tokens, peak %s", s.name, best.chunks,
                      best.chunk, format_bytes(p))
            found.run(s, best, built.fw, built.bw)
            choices.append(Choice(s, best, reason))
        return choices

    def faster(self, choice: Choice, costs: head_pass.HeadCosts) -> list[head_pass.HeadConfig]:
        return sorted((g for g in head_pass.configurations(choice.site, costs)
                       if g.chunk > choice.config.chunk), key=lambda g: -g.chunk)

    def record(self, c: Choice) -> HeadRecord:
        return HeadRecord(
            module=c.site.name, tokens=c.site.rows, vocab=c.site.vocab, chunk=c.config.chunk,
            chunks=c.config.chunks, held_bytes=c.config.held_bytes,
            forward_workspace_bytes=c.config.forward_workspace_bytes,
            workspace_bytes=c.config.workspace_bytes,
            recompute_flops=c.config.recompute_flops, reason=c.reason,
            returns_logits=c.site.returns_logits)

    def forward_flops(self, site: head_pass.HeadSite) -> int:
        return site.matmul_flops

    def recompute_flops(self, choice: Choice) -> int:
        return choice.config.recompute_flops


class ReversibleFamily:
    """Reversible RNN stacks (MacKay et al. 2018; passes.reversible_stacks): nothing to choose,
    the information buffers' bound and the final state are charged as they are."""

    find_stage = "reversible stacks"
    choose_stage = "reversible stacks (nothing to choose)"
    plan_field = "reversible"

    def find(self, joint: fx.GraphModule) -> list[reversible_pass.ReversibleSite]:
        return reversible_pass.find_reversible(joint) if reversible_pass.present(joint) \
            else []

    def costs(self, joint: fx.GraphModule, site: reversible_pass.ReversibleSite,
              room: int | None = None) -> None:
        return None

    def initial(self, site: reversible_pass.ReversibleSite, costs: None,
                lean: bool = False) -> None:
        return None

    def apply(self, graphs: list[fx.GraphModule], site: reversible_pass.ReversibleSite,
              config: None) -> None:
        reversible_pass.apply(graphs, site)

    def op_bytes(self, site: reversible_pass.ReversibleSite, config: None
                 ) -> dict[str, OpBytes]:
        return reversible_pass.op_bytes(site)

    def choose(self, found: Sites, ctx: ChoiceContext) -> list[Choice]:
        return [Choice(s, None, "reversible: no slots to choose") for s in found.sites]

    def faster(self, choice: Choice, costs: None) -> list[None]:
        return []

    def record(self, c: Choice) -> ReversibleRecord:
        r = c.site
        return ReversibleRecord(
            module=r.name, module_type=r.module_type, steps=r.steps, layers=r.layers,
            max_forget_bits=r.max_forget_bits, stored_state_bytes=r.stored_state_bytes,
            buffer_bound_bytes=r.buffer_bound_bytes, held_bytes=r.held_bytes,
            forward_workspace_bytes=r.forward_workspace_bytes,
            workspace_bytes=r.workspace_bytes, dropout=r.dropout)

    def forward_flops(self, site: reversible_pass.ReversibleSite) -> int:
        return 0

    def recompute_flops(self, choice: Choice) -> int:
        return 0
