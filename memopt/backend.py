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

from ._torch_compat import aot_module_simplified, make_boxed
from .budget import Budget, parse_budget
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


class MemoptBackend:
    """A torch.compile backend that plans every captured training graph.

    `budget` is parsed once here (see memopt.budget for what it counts). Plans
    are kept in `self.plans` in capture order; `self.last_plan` is the plan of
    the graph that ran most recently.
    """

    def __init__(self, budget: object = None, *, inplace: bool = True,
                 mirror: object = None, headroom: float = Options.headroom,
                 plan_only: bool = False) -> None:
        self.budget: Budget | None = parse_budget(budget)
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
        return f"MemoptBackend(budget={self.budget}, options={self.options})"

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **_: Any) -> Callable:
        kinds = _primal_kinds(gm, example_inputs)
        planned: list[MemoryPlan] = []

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

        compiled = aot_module_simplified(
            gm, example_inputs, fw_compiler=compile_graph, bw_compiler=compile_graph,
            inference_compiler=compile_graph, partition_fn=partition_fn,
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

