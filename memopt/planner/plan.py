"""plan_joint: memopt's planner over one joint forward+backward graph, stage by stage.

    request -> prepare -> op families (find, one chunk) -> step model -> baseline
            -> budget -> op families (choose) -> mirror set (Chen, per head chunk)
            -> relax families
            -> exact build -> MemoryPlan

Each stage is a pass in `memopt.passes`, a solver in `memopt.allocator` or a module of
this package (build, chen, families, assemble); `plan_joint` runs them in order, and a
stage that fails is re-raised as PassError naming it and the stages before it.
"""

from __future__ import annotations

import dataclasses

import logging
import math
import time

from torch import fx
from tqdm.auto import tqdm

from memopt.allocator.caching import reserved_for
from memopt.allocator.timeline import other_lowered
from memopt.allocator.offload import Link
from memopt.link import measured
from memopt.passes.embedding_grads import add_embedding_grads_in_place
from memopt.passes.partition import find_cut, forward_region, read_concat_views
from memopt.passes.recompute import mirrorable, node_flops, user_checkpointed
from memopt.passes.simulate import Simulated, StepModel, peak_without
from memopt.passes.grad_layouts import accumulate_copy_bytes
from memopt.passes.runtime_layouts import restore_runtime_layouts
from memopt.passes.storage_sizes import restore_storage_sizes

from ..budget import Budget, default_headroom, format_bytes
from ..errors import BudgetError
from ..memory_plan import MemoryPlan, SearchCandidate
from .assemble import Decisions, assemble
from .build import Built, Mirror, allocation_granularity, as_simulated, build, device_of, stage
from .chain_family import ChainFamily
from .chen import choose_mirror, solve_exactly
from .families import ChoiceContext, HeadFamily, ReversibleFamily, Sites, relax
from .fusible import fusible_mirror
from .joint_heads import choose_heads_jointly
from .offload_choice import Mix, apply, best_mix, records
from .observe import Observed, is_verifying, notify, verify
from .request import PlanRequest

log = logging.getLogger("memopt")

#: Seconds a plan runs before its progress bar shows.
PROGRESS_DELAY = 2.0
#: How many times Step 6b (`reserved=True`) aims lower before it gives up.
RESERVED_TRIES = 8

#: memopt's op families, in the order they are found in the joint graph.
CHAINS, HEADS, REVERSIBLE = ChainFamily(), HeadFamily(), ReversibleFamily()
FAMILIES = (CHAINS, HEADS, REVERSIBLE)
#: The order they choose in: a head's chunk is fixed before the chains take their share
#: of what is still over the budget (a head's bytes are one matmul's to recompute).
CHOOSE_ORDER = (HEADS, CHAINS, REVERSIBLE)
#: The order they are relaxed in after the mirror set: chains first, whose faster
#: policies save whole recomputed time steps.
RELAX_ORDER = (CHAINS, HEADS)


#: Plans at a minimum named by a refusal, each at the minimum the one before named, before
#: the refusal names the last (`plan_joint`)
MINIMUM_ROUNDS = 3


def plan_joint(request: PlanRequest) -> tuple[fx.GraphModule, fx.GraphModule, MemoryPlan]:
    """`plan_once`, and where it refuses the budget after measuring an op family within
    it (a chain's chunks, priced within a byte budget: `PlanRequest.measuring_room`), the
    minimum it names planned again as a byte budget, whose room measures other chunks,
    until a minimum holds at its own measurements: the refusal names that one. A CTC
    model's BiLSTM refused at 0.01 named 303,789 bytes, refused when passed back naming
    306,069 (found from outside, 2026-11-30)."""
    try:
        return plan_once(request)
    except BudgetError as err:
        refused = err
    for _ in range(MINIMUM_ROUNDS):
        if not refused.measured_within:
            break
        try:
            plan_once(dataclasses.replace(request, budget=Budget(nbytes=refused.minimum_bytes)))
        except BudgetError as higher:
            if higher.minimum_bytes <= refused.minimum_bytes:
                break
            refused = refused.with_minimum(higher.minimum_bytes)
            refused.measured_within = higher.measured_within
        else:
            break
    raise refused


def plan_once(request: PlanRequest) -> tuple[fx.GraphModule, fx.GraphModule, MemoryPlan]:
    """Run memopt's passes on `request.joint`; return the forward, the backward and the
    plan (PlanRequest says what each field asks).

    Step 1: the layouts a few ops' kernels return where their FakeTensors say others
        (passes.runtime_layouts) and the storage a few allocate beyond their FakeTensor's
        (passes.storage_sizes), both op by op only; a tied embedding's gradient added into
        the weight's other gradient (passes.embedding_grads), and minimum dependencies declared
        (passes.partition.read_concat_views).
    Step 2: memopt's op families found, each site run as one chunk (planner.families).
    Step 3: the step model the search scores candidates on (passes.simulate), and the
        baseline: no in-place, no recomputation.
    Step 4: the budget in bytes, less headroom for a byte budget.
    Step 5: each op family's configuration under the budget.
    Step 6: the mirror set: the user's (`options.mirror`), none when the plan without
        recomputation fits, else Chen's search (planner.chen), run again for each of a
        head's chunk sizes (planner.joint_heads); then each family takes the fastest
        configuration that still fits with that mirror set.
    Step 6b (`reserved=True`): while the bytes CUDA's caching allocator would reserve for
        the step exceed the budget, Steps 5 and 6 again aiming lower by the excess.
    Step 6c: keep, recompute or offload (planner.offload_choice): where offload is on,
        the fastest predicted mix of the search's mirror set, no recomputation, a search
        aimed halfway between them, and (where recomputation alone misses) the lowest-peak
        mirror set, each with what the budget needs copied to host memory.
    Step 7: the exact build of the choice and its plan (planner.assemble), with the
        timelines of live bytes by kind of the step and of the baseline.
    """
    run = _Planning(request)
    run.prepare()                                   # Step 1
    run.find_families()                             # Step 2
    run.model_step()                                # Step 3
    run.resolve_budget()                            # Step 4
    run.choose_families()                           # Step 5
    mirror, search = run.mirror_set()               # Step 6
    if request.options.reserved and run.fits is not None:
        mirror, search = run.fit_reserved(mirror, search)  # Step 6b
    expected = run.simulate(mirror).peak_bytes
    if request.must_fit and run.fits is not None and expected > run.fits and run.found_sites():
        # Step 5 again as memopt's minimum takes it: each site at its lowest peak (its
        # choice for this budget can leave the Chen planner too little), so that a budget
        # between the minimum and the no-budget peak is never refused where the minimum
        # is accepted; then the mirror set and the families' relaxation for the budget
        for found in run.found.values():
            found.reset()
        aim, run.target = run.target, 1
        run.choose_families()
        run.target = aim
        mirror, search = run.mirror_set()
        if request.options.reserved:
            mirror, search = run.fit_reserved(mirror, search)
        expected = run.simulate(mirror).peak_bytes
    mix = run.offload(mirror)                       # Step 6c
    if mix is not None and mix.offloaded:
        return run.finish(mix.mirror, search, mix.schedule.peak_bytes, mix)
    if request.must_fit and run.fits is not None and expected > run.fits:
        run.bar.close()  # below reach: no graphs to build (the simulated peak is the build's)
        refused = run.budget_error(min(expected, run.offload_floor or expected))
        refused.measured_within = bool(run.found[CHAINS].sites)
        raise refused
    return run.finish(mirror, search, expected)     # Step 7


#: Where no configuration of a site (a recurrent chain) fits its share of the budget
#: alone, it takes the fastest within this fraction of the target above its lowest peak,
#: and the Chen planner recomputes the rest: a chunk of one step with one slot recomputes
#: T(T-1)/2 steps to hold a few states less than a policy many times faster (a Mamba at
#: 0.7: 2.3x eager's time, 1.0x so). Where the plan then misses, Step 5 runs again as for
#: memopt's minimum (``plan_joint``).
NEAR_LOWEST = 0.01


class _Planning:
    """The state of one `plan_joint` call, one method a step."""

    def __init__(self, request: PlanRequest) -> None:
        self.request, self.t0, self.done = request, time.perf_counter(), []
        self.joint, self.n = request.joint, request.num_fwd_outputs
        self.options, self.step = request.options, request.step
        self.found: dict[object, Sites] = {}
        self.cache: dict[tuple, Simulated] = {}
        self.offload_floor = 0  # the lowest peak offload reached (Step 6c), 0: not tried

    def build(self, mirror: Mirror, inplace: bool | None = None, done: list | None = None
              ) -> Built:
        inplace = self.options.inplace if inplace is None else inplace
        return build(self.joint, self.n, mirror, inplace=inplace, step=self.step,
                     workspaces=self.request.workspaces, done=[] if done is None else done)

    # Step 1
    def prepare(self) -> None:
        if not self.step.fused:  # inductor's kernels allocate what the FakeTensors say
            with stage("runtime layouts", self.done):
                restore_runtime_layouts(self.joint, self.request.workspaces)
            with stage("storage sizes", self.done):
                restore_storage_sizes(self.joint)
            with stage("gradient layout copies", self.done):
                self._charge_accumulate_copies()
        with stage("tied embedding gradients", self.done):
            add_embedding_grads_in_place(self.joint)
        with stage("minimum dependencies", self.done):
            read_concat_views(self.joint, self.n, find_cut(self.joint, self.n))

    def _charge_accumulate_copies(self) -> None:
        """What AccumulateGrad copies into a parameter's layout (passes.grad_layouts),
        charged as the graph's backward ends."""
        r = self.request
        kept = frozenset(r.grads.nbytes) if r.grads is not None else frozenset()
        extra = accumulate_copy_bytes(self.joint, self.n, r.primal_kinds, kept)
        if extra:
            outside = dataclasses.replace(r.outside,
                                          after_backward=r.outside.after_backward + extra)
            self.request = dataclasses.replace(r, outside=outside)
            self.step = self.request.step

    # Step 2
    def find_families(self) -> None:
        for family in FAMILIES:
            found = Sites(family, self.joint, family.find(self.joint))
            if found.sites:
                with stage(family.find_stage, self.done):  # one chunk: for the baseline
                    # lean: no budget, op by op (under inductor's kernels the stand-ins'
                    # savings measured half what the plan counted: not taken there)
                    found.begin(lean=self.request.budget is None
                                and self.request.first_fraction is None
                                and not self.request.lowest_peak and not self.step.fused,
                                room=self.request.measuring_room())
            self.found[family] = found

    def found_sites(self) -> bool:
        """Whether any op family found a site (Step 5 has choices to make)."""
        return any(found.sites for found in self.found.values())

    # Step 3
    def model_step(self) -> None:
        r = self.request
        self.gran = allocation_granularity(device_of(self.joint))
        with stage("step model", self.done):
            self.model = StepModel(
                self.joint, self.n, mutable_inputs=self.step.mutable_inputs,
                primal_kinds=r.primal_kinds,
                existing_grads=r.grads.nbytes if r.grads is not None else None,
                accumulate=r.grads.add if r.grads is not None else None,
                step_bytes=r.grads.step_bytes if r.grads is not None else None,
                outside_grad_bytes=r.outside_grad_bytes, outside=r.outside.bytes(),
                granularity=self.gran,
                outputs_dropped=self.step.outputs_dropped, workspaces=r.workspaces,
                fused=self.step.fused)
        notify(Observed(model=self.model, joint=self.joint, num_fwd_outputs=self.n,
                        primal_kinds=r.primal_kinds, options=self.options))
        label = f" {r.label}" if r.label else ""
        self.bar = tqdm(desc=f"memopt: planning{label}", unit=" plans", delay=PROGRESS_DELAY,
                        leave=False, disable=None if self.options.progress else True)
        with stage("baseline", self.done):
            self.baseline = self.simulate(Mirror(), inplace=False, kinds=True)  # its timeline

    def simulate(self, mirror: Mirror, inplace: bool | None = None, kinds: bool = False
                 ) -> Simulated:
        """The simulated step of `mirror` with every family as it runs now (cached: the
        families' bytes are an argument of the simulation and part of the key)."""
        inplace = self.options.inplace if inplace is None else inplace
        ops = self.op_bytes()
        key = (mirror, inplace, frozenset(ops.items()))
        if key not in self.cache or (kinds and not self.cache[key].kinds):
            result = self.model.simulate(mirror.names, mirror.twice, inplace,
                                         kinds=kinds or is_verifying(), ops=ops)
            if is_verifying():
                verify(result, self.build(mirror, inplace), mirror)
            self.bar.update()
            self.cache[key] = result
        return self.cache[key]

    def op_bytes(self) -> dict:
        """What memopt's own ops hold and allocate as every family runs now."""
        return {k: v for f in self.found.values() for k, v in f.op_bytes().items()}

    def fraction_base(self) -> int:
        """The baseline's peak a fraction budget is of: without the room held for the
        caller's loss (PlanRequest.room_bytes), as with no budget (the same bytes)."""
        return peak_without(self.baseline, *self.room_held(), self.gran)

    def room_held(self) -> tuple[int, int]:
        """What the room (PlanRequest.room_bytes) adds at each backward step of the step
        model and at its forward's last step (allocator.lifetimes.held_outside), rounded
        as the model rounds: (0, 0) where there is none."""
        o, room, g = self.request.outside, self.request.room_bytes, self.gran
        if not room or o.own:
            return 0, 0

        def up(n: int) -> int:
            return -(-n // g) * g

        at_end = 0  # the backward's outside bytes are charged there too, over the forward's
        if o.before_backward:
            at_end = up(o.before_backward + max(0, o.backward - o.forward)) \
                - up(o.before_backward + max(0, o.backward - room - o.forward))
        return up(o.backward) - up(o.backward - room), at_end

    def baseline_without_room(self, plan: MemoryPlan) -> dict:
        """`plan`'s baseline peak and timeline without the room (room_held)."""
        timeline, (backward, at_end) = plan.baseline_timeline, self.room_held()
        update: dict = {"baseline_peak_bytes": self.fraction_base()}
        live = None if timeline is None else other_lowered(
            timeline.live, timeline.kinds, timeline.steps, timeline.num_forward_steps,
            backward, at_end)
        if live is not None:
            update["baseline_timeline"] = timeline.model_copy(update={"live": live})
        return update

    # Step 4
    def resolve_budget(self) -> None:
        r = self.request
        base = self.fraction_base()
        self.budget_bytes = r.budget.resolve(r.step_baseline or base) \
            if r.budget is not None else None
        if r.budget is not None and r.budget.fraction is not None:
            self.budget_bytes = max(self.budget_bytes, r.fraction_floor)
        if r.first_fraction is not None:
            # A first plan made before the step's baseline is known (graph breaks): the
            # fraction of this graph's baseline, at most the step's. Kept whole, a chain
            # there measured 1.86x a 0.5 budget in its first step (an nn.LSTM with forward
            # hooks, found from outside); the plan is provisional, made again as the
            # forward ends (memopt.graph_breaks)
            self.budget_bytes = max(1, int(r.first_fraction * base))
        # Headroom guards every budget against what the plan does not model, by the worst
        # measured prediction error on the device (memopt.budget.HEADROOM)
        headroom = self.options.headroom
        if headroom is None:
            headroom = default_headroom(device_of(self.joint), fused=self.step.fused)
        self.headroom = headroom if self.budget_bytes is not None else 0.0
        self.fits = self.budget_bytes - math.ceil(self.budget_bytes * self.headroom) \
            - r.reserve_bytes if self.budget_bytes else None  # what the plan must fit
        self.target = 1 if r.lowest_peak else self.fits  # what the search aims at

    # Step 5
    def choose_families(self) -> None:
        ctx = ChoiceContext(self.n, self.target, self.step, self.build, NEAR_LOWEST)
        for family in CHOOSE_ORDER:
            found = self.found[family]
            if found.sites:
                with stage(family.choose_stage, self.done):
                    found.choices = family.choose(found, ctx)

    # Step 6
    def mirror_set(self) -> tuple[Mirror, tuple[SearchCandidate, ...]]:
        r, target, mirror, search = self.request, self.target, Mirror(), ()
        if self.options.mirror == "all":
            mirror = Mirror(frozenset(n.name for n in mirrorable(
                self.joint, self.n, self.step.mutable_inputs)))
        elif self.options.mirror is not None:
            mirror = Mirror(frozenset(self.options.mirror))
        free = self.fusible() if self.options.mirror is None and self.options.fusible \
            else Mirror()
        if self.options.mirror is None:
            mirror = free
            if target is None:  # no budget: what the model's own checkpoints recompute
                mirror = self.user_checkpoints(free)
            elif self.simulate(free).peak_bytes > target:
                mirror, search = self.search_with(target, free)
                if self.simulate(mirror).peak_bytes > self.simulate(free).peak_bytes:
                    # below its reach the search's lowest set can hold more than keeping
                    # everything (recomputed values live beside outputs the loss holds):
                    # keep, so the minimum named is no higher than the plan with no budget
                    # (a model returning a dict of four layers' values: 1,668,037 bytes
                    # named, 10% above it, found from outside)
                    mirror = free
        heads = self.found[HEADS]
        if self.options.mirror is None and target is not None and not r.lowest_peak \
                and self.options.solver != "milp" and heads.choices \
                and (mirror.names or any(c.config.chunks > 1 for c in heads.choices)):
            with stage("head chunks with the mirror set", self.done):
                mirror, search = choose_heads_jointly(
                    heads, mirror, search, lambda t: self.search_with(t, free),
                    self.simulate, target, self.forward_flops(), free)
        relaxing = [self.found[f] for f in RELAX_ORDER if self.found[f].choices]
        if target is not None and relaxing and self.simulate(mirror).peak_bytes <= target:
            with stage("faster heads and chains within the mirror set", self.done):
                def peak() -> int:
                    return self.model.simulate(mirror.names, mirror.twice,
                                               self.options.inplace,
                                               ops=self.op_bytes()).peak_bytes
                for found in relaxing:
                    relax(found, peak, target)
        return mirror, search

    # Step 6b
    def fit_reserved(self, mirror: Mirror, search: tuple[SearchCandidate, ...]
                     ) -> tuple[Mirror, tuple[SearchCandidate, ...]]:
        """The plan whose modelled reserved bytes fit (memopt.allocator.caching, replayed
        on the simulated storages). A budget counts allocated bytes; a GPU runs out of
        the caching allocator's segments, 0.95-1.36x the budget on an H200. Reserved bytes
        move in whole segments (2 or 20 MiB), so the search's aim is found by trial:
        lowered by the excess until a plan fits, then bisected back up towards the
        budget (the least recomputation that fits), RESERVED_TRIES searches in all. A
        BudgetError, in reserved bytes, where no lower aim lowers them enough."""
        def reserved(m: Mirror) -> int:
            return reserved_for(self.simulate(m).intervals)

        with stage("reserved bytes", self.done):
            high, low, best = self.target, None, reserved(mirror)  # high: an aim that misses
            if best <= self.fits:
                return mirror, search
            aim = high - max(best - self.fits, self.gran)
            for _ in range(RESERVED_TRIES):
                if aim <= 0:
                    break
                self.target = aim
                self.choose_families()
                mirror, search = self.mirror_set()
                if self.simulate(mirror).peak_bytes > aim and low is None:
                    break  # below reach: a lower aim finds no lower peak
                got = reserved(mirror)
                best = min(best, got)
                if got <= self.fits:
                    low = aim
                else:
                    high = aim
                if low is None:
                    aim = high - max(got - self.fits, self.gran)
                elif high - low <= max(self.gran, self.fits // 100):
                    break
                else:
                    aim = (low + high) // 2
            if low is not None:
                if self.target != low:  # the last try missed: the plan found at `low`
                    self.target = low
                    self.choose_families()
                    mirror, search = self.mirror_set()
                return mirror, search
        self.bar.close()
        raise self.budget_error(best, reserved=True)

    def fusible(self) -> Mirror:
        """Under inductor: the pointwise values its fused kernels recompute for free
        (planner.fusible), where the simulated peak is no higher than without them."""
        with stage("fusible recomputation", self.done):
            saved = self.build(Mirror()).saved_names
            names = fusible_mirror(self.joint, self.n, saved, self.step.mutable_inputs)
            if names and self.simulate(Mirror(names)).peak_bytes \
                    <= self.simulate(Mirror()).peak_bytes:
                return Mirror(names)
        return Mirror()

    def user_checkpoints(self, free: Mirror) -> Mirror:
        """With no budget: `free` and the values the model's own torch.utils.checkpoint
        regions recompute in eager (passes.recompute.user_checkpointed), where the
        simulated peak is then no higher (a plan with no budget stays at or below eager's
        peak for a model that checkpoints: it measured 1.52x eager's keeping them)."""
        if not any("recompute" in n.meta for n in self.joint.graph.nodes):
            return free  # no checkpoint in the model: no stage
        with stage("the model's own checkpoints", self.done):
            names = user_checkpointed(self.joint, self.n, self.step.mutable_inputs)
            both = Mirror(free.names | names, free.twice)
            if names and self.simulate(both).peak_bytes <= self.simulate(free).peak_bytes:
                return both
        return free

    def search_with(self, target: int, free: Mirror) -> tuple[Mirror, tuple[SearchCandidate, ...]]:
        """The budget search (`search`), its mirror set with the free one added
        (`with_free`)."""
        mirror, search = self.search(target)
        return self.with_free(mirror, free), search

    def with_free(self, mirror: Mirror, free: Mirror) -> Mirror:
        """The budget search's `mirror` with the free recomputation added where that
        lowers its simulated peak no less (a budget never keeps more than no budget)."""
        if not free.names or free.names <= mirror.names:
            return mirror
        both = Mirror(mirror.names | free.names, mirror.twice)
        return both if self.simulate(both).peak_bytes <= self.simulate(mirror).peak_bytes \
            else mirror

    def search(self, target: int) -> tuple[Mirror, tuple[SearchCandidate, ...]]:
        """The mirror set for `target` with every family as it runs now: Chen's search
        (planner.chen), then the exact solver where the options ask for it."""
        r = self.request
        with stage("budget search", self.done):
            # the peak-directed path only where the step is this one graph: with graph
            # breaks its lean plans measured above their prediction
            # (tests/test_graph_breaks); what a whole step holds outside its graph is a
            # constant (DDP's buckets)
            path = not r.lowest_peak and (r.whole_step or r.outside.repeats > 0 or not (
                r.outside.forward or r.outside.backward))
            mirror, search = choose_mirror(self.joint, self.n, target,
                                           self.step.mutable_inputs, self.simulate, path)
        if self.options.solver == "milp":
            with stage("exact solver", self.done):
                mirror, search = solve_exactly(self.model, target, self.simulate, mirror,
                                               search, self.options.solver_seconds)
        return mirror, search

    def forward_flops(self) -> int:
        """What one forward runs: the graph's ops and memopt's own (node_flops counts one
        element an output for an opaque op)."""
        return sum(node_flops(n) for n in forward_region(self.joint, self.n)
                   if n.op == "call_function") + sum(
            f.forward_flops() for f in self.found.values())

    def budget_error(self, peak: int, reserved: bool = False) -> BudgetError:
        r = self.request
        words = [r.label] if r.label else []
        if reserved:
            words.append("counting the bytes CUDA's caching allocator would reserve: "
                         "reserved=True")
        if r.grads is not None and r.grads.step_bytes is not None:
            words.append("the optimizer stepped inside the backward")
        elif r.grads is not None:
            words.append("the step that finds .grad kept from earlier steps: gradient "
                         "accumulation, zero_grad(set_to_none=False)")
        err = BudgetError(
            budget_bytes=self.budget_bytes, minimum_bytes=math.ceil(peak / (1 - self.headroom)),
            baseline_bytes=r.step_baseline or self.fraction_base(), budget=str(r.budget),
            headroom=self.headroom,
            step=f" ({'; '.join(words)})" if words else "")
        err.plan_seconds = time.perf_counter() - self.t0
        return err

    # Step 6c
    def offload(self, mirror: Mirror) -> Mix | None:
        """The fastest mix of keep, recompute and offload that fits (None: offload is off,
        no budget, or nothing fits)."""
        r, opt = self.request, self.options.offload
        device = device_of(self.joint)
        if opt is False or self.fits is None or r.lowest_peak or self.step.fused \
                or self.options.mirror is not None or self.options.reserved \
                or (opt is None and not device.startswith("cuda")):
            return None
        if not mirror.names and not mirror.twice and self.simulate(mirror).peak_bytes <= self.fits:
            return None  # nothing recomputed and it fits: nothing for offload to buy
        with stage("offload", self.done):
            link, compute = measured(device)
            if isinstance(opt, Link):
                link = opt
            # the search's choice, none, one recomputing about half as much, the lowest
            mirrors = [mirror, Mirror()]
            top = self.simulate(Mirror()).peak_bytes
            if self.simulate(mirror).peak_bytes > self.fits:  # below recomputation's reach
                mirrors.append(self.search(1)[0])
            elif top > self.fits:
                mirrors.append(self.search((top + self.fits) // 2)[0])
            mix, self.offload_floor = best_mix(mirrors, self.build, self.fits, link, compute,
                                               self.gran)
            return mix

    # Step 7
    def finish(self, mirror: Mirror, search: tuple[SearchCandidate, ...], expected: int,
               mix: Mix | None = None) -> tuple[fx.GraphModule, fx.GraphModule, MemoryPlan]:
        self.bar.set_postfix_str("building the plan's graphs")
        final = self.build(mirror, done=self.done) if mix is None else apply(mix)
        if mix is None and final.peak_bytes != expected:  # the exact build decides
            log.warning("memopt: the step simulator predicted a peak of %d bytes, the exact "
                        "build %d (please report this model); planning with exact builds",
                        expected, final.peak_bytes)
            if search:
                with stage("budget search", self.done):
                    mirror, search = choose_mirror(
                        self.joint, self.n, self.target, self.step.mutable_inputs,
                        lambda m: as_simulated(self.build(m)))
                final = self.build(mirror)
        families = tuple(self.found[f] for f in FAMILIES)
        fits = None if self.fits is None else self.fits + self.request.reserve_bytes
        decisions = Decisions(budget_bytes=self.budget_bytes, fits=fits,  # headroom's
                              baseline=self.baseline, search=search, families=families,
                              forward_flops=self.forward_flops())
        with stage("allocator", self.done):
            plan = assemble(final, self.request, decisions, device_of(final.fw), self.gran,
                            time.perf_counter() - self.t0)
            if self.request.room_bytes:  # what a fraction is of, as with no budget
                plan = plan.model_copy(update=self.baseline_without_room(plan))
            if mix is not None:
                offloaded, link = records(mix)
                names = set(mix.names)
                plan = plan.model_copy(update={
                    "offloaded": offloaded, "link": link,
                    "saved": tuple(s.model_copy(update={"decision": "offloaded"})
                                   if s.name in names else s for s in plan.saved)})
        self.bar.close()
        log.info(
            "memopt: peak %s -> %s (lower bound %s, arena %s), %d in-place, %d saved tensors, "
            "%d recomputed, planned in %.2fs", format_bytes(plan.baseline_peak_bytes),
            format_bytes(plan.predicted_peak_bytes), format_bytes(plan.lower_bound_bytes),
            format_bytes(plan.arena_bytes), len(final.rewrites), len(plan.saved),
            len(final.recomputed), plan.plan_seconds)
        if self.request.must_fit and self.fits is not None \
                and plan.predicted_peak_bytes > self.fits:
            raise self.budget_error(plan.predicted_peak_bytes)
        return final.fw, final.bw, plan
