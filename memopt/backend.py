"""memopt as a torch.compile backend: AOTAutograd with memopt's partition function.

Dynamo hands the backend an FX graph of torch-level ops and example inputs;
AOTAutograd traces the joint forward+backward graph of aten ops on FakeTensors
and calls `partition_fn`, where memopt's pipeline (memopt.pipeline) produces
the forward and backward GraphModules and the plan. Both modules then run with
the boxed calling convention, so each saved tensor is freed at its last use in
backward.

    torch.compile(model, backend="memopt")                       # registered name (the
                                                                 # package's entry point)
    torch.compile(model, backend=MemoptBackend(budget="4GB"))   # with options
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch
from torch import fx

from memopt.passes.loops import chain_loops

from ._torch_compat import aot_module_simplified, loss_decompositions, make_boxed
from .budget import Budget, parse_budget
from .errors import PassError
from .pipeline import Options, plan_joint
from .memory_plan import MemoryPlan

log = logging.getLogger("memopt")


def _primal_kinds(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> dict[str, str]:
    """Names of the joint graph's primals ("primals_1", ...) mapped to parameter/buffer/input.

    AOTAutograd's primals are the GraphModule's own parameters and buffers, then
    the example inputs, in order. With dynamo's inlined nn.Modules the parameters
    arrive as inputs; a parameter is recognised by its type, a buffer by the
    dynamo source name recorded on the placeholder.
    """
    kinds: list[str] = ["parameter"] * len(list(gm.parameters()))
    kinds += ["buffer"] * len(list(gm.buffers()))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, value in enumerate(example_inputs):
        if isinstance(value, torch.nn.Parameter):
            kinds.append("parameter")
            continue
        source = ""
        if i < len(placeholders):
            grapharg = placeholders[i].meta.get("grapharg")
            source = str(getattr(getattr(grapharg, "source", None), "name", ""))
            if callable(getattr(getattr(grapharg, "source", None), "name", None)):
                source = grapharg.source.name()
        kinds.append("buffer" if "_buffers" in source else "input")
    return {f"primals_{i + 1}": kind for i, kind in enumerate(kinds)}


def _cuda_devices() -> list[int]:
    return list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []


def _autocast_on() -> bool:
    return any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))


def _chain_loops(gm: fx.GraphModule) -> None:
    """Run the user's unrolled cell loops as recurrent chains (memopt.passes.loops), in
    graphs that record gradients outside autocast (a chain step would run outside it)."""
    if not torch.is_grad_enabled():
        log.debug("memopt loops: an inference graph: loops left unrolled")
        return
    if _autocast_on():
        log.debug("memopt loops: autocast is on: loops left unrolled")
        return
    try:
        chain_loops(gm, keep=True)
    except Exception as exc:
        raise PassError("recurrent loops", ("capture",), exc) from exc


class MemoptBackend:
    """A torch.compile backend that plans every captured training graph.

    `budget` is parsed once here (see memopt.budget for what it counts). Plans
    are kept in `self.plans` in capture order; `self.last_plan` is the plan of
    the graph that ran most recently.
    """

    def __init__(self, budget: object = None, *, inplace: bool = True,
                 mirror: object = None, headroom: float = Options.headroom,
                 plan_only: bool = False, loops: bool = True) -> None:
        self.budget: Budget | None = parse_budget(budget)
        if not isinstance(loops, bool):
            raise ValueError(f"loops must be True or False, got {loops!r}")
        self.loops = loops
        if mirror is not None and mirror != "all":
            mirror = frozenset(mirror)
        if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) \
                or not 0 <= headroom < 1:
            raise ValueError(f"headroom must be a fraction in [0, 1), got {headroom!r}")
        self.options = Options(inplace=inplace, mirror=mirror, headroom=float(headroom))
        self.plan_only = plan_only
        self.plans: list[MemoryPlan] = []
        self.last_plan: MemoryPlan | None = None

    def __repr__(self) -> str:
        return (f"MemoptBackend(budget={self.budget}, options={self.options}"
                f"{'' if self.loops else ', loops=False'})")

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **_: Any) -> Callable:
        kinds = _primal_kinds(gm, example_inputs)
        planned: list[MemoryPlan] = []
        if self.loops:
            _chain_loops(gm)

        def partition_fn(joint: fx.GraphModule, _joint_inputs: Any, *, num_fwd_outputs: int,
                         **_kw: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
            fw, bw, plan = plan_joint(joint, num_fwd_outputs, primal_kinds=kinds,
                                      budget=self.budget, options=self.options)
            planned.append(plan)
            self.plans.append(plan)
            if self.plan_only:  # stop before AOTAutograd builds its runtime wrappers
                from .api import _PlanOnly

                raise _PlanOnly(plan)
            return fw, bw

        def compile_graph(graph: fx.GraphModule, _inputs: Any) -> Callable:
            return make_boxed(graph)

        # Planning runs chain steps on real tensors (passes.chains measures what they
        # save): the user's RNG state must not move, or dropout would draw other masks.
        with torch.random.fork_rng(devices=_cuda_devices()):
            compiled = aot_module_simplified(
                gm, example_inputs, fw_compiler=compile_graph, bw_compiler=compile_graph,
                inference_compiler=compile_graph, partition_fn=partition_fn,
                decompositions=loss_decompositions(),
            )
        if not planned:
            return compiled  # an inference graph (no gradients needed): nothing to plan

        plan = planned[-1]

        def run(*args: Any) -> Any:
            self.last_plan = plan
            return compiled(*args)

        return run


def memopt_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], **options: Any) -> Callable:
    """The registered `backend="memopt"`: `torch.compile(m, backend="memopt",
    options={"budget": "4GB"})` passes its options here."""
    return MemoptBackend(**options)(gm, example_inputs)

