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

import copy
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import fx

from memopt.passes.loops import chain_loops

from ._torch_compat import aot_module_simplified, loss_decompositions, make_boxed, storage_key
from .budget import Budget, parse_budget
from .errors import CaptureError, PassError
from .grads import GradSink
from .pipeline import ExistingGrads, Options, plan_joint
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


@dataclass
class _PlanLog:
    """Plans in capture order and the plan of the graph that ran last, shared by a
    backend and its `with_existing_grads` twin."""

    plans: list[MemoryPlan] = field(default_factory=list)
    last: MemoryPlan | None = None
    graphs: dict[bool, int] = field(default_factory=dict)  # captured, by existing_grads
    graph_limit: int = 8  # the most graphs of one kind (torch._dynamo.config.recompile_limit)


class MemoptBackend:
    """A torch.compile backend that plans every captured training graph.

    `budget` is parsed once here (see memopt.budget for what it counts). Plans
    are kept in `self.plans` in capture order; `self.last_plan` is the plan of
    the graph that ran most recently. `existing_grads=True` plans the step in which
    the parameters' `.grad` tensors already exist (memopt.grads): `memopt.compile`
    runs such a twin for the steps that find gradients kept from earlier ones.
    """

    def __init__(self, budget: object = None, *, inplace: bool = True,
                 mirror: object = None, headroom: float = Options.headroom,
                 plan_only: bool = False, loops: bool = True,
                 existing_grads: bool = False) -> None:
        self.budget: Budget | None = parse_budget(budget)
        for name, flag in (("loops", loops), ("existing_grads", existing_grads),
                           ("inplace", inplace)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be True or False, got {flag!r}")
        self.loops = loops
        self.existing_grads = existing_grads
        self._log = _PlanLog()
        if mirror is not None and mirror != "all":
            mirror = frozenset(mirror)
        if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) \
                or not 0 <= headroom < 1:
            raise ValueError(f"headroom must be a fraction in [0, 1), got {headroom!r}")
        self.options = Options(inplace=inplace, mirror=mirror, headroom=float(headroom))
        self.plan_only = plan_only

    @property
    def plans(self) -> list[MemoryPlan]:
        return self._log.plans

    @property
    def last_plan(self) -> MemoryPlan | None:
        return self._log.last

    @property
    def graph_limit(self) -> int:
        return self._log.graph_limit

    @graph_limit.setter
    def graph_limit(self, value: int) -> None:
        self._log.graph_limit = value

    def _count_graph(self) -> None:
        """One more captured graph: refuse past the limit, naming the fix."""
        count = self._log.graphs.get(self.existing_grads, 0) + 1
        if count > self.graph_limit:
            raise CaptureError(
                f"memopt plans each input shape / dtype / train-eval mode separately and this "
                f"module has now seen more than torch._dynamo.config.recompile_limit = "
                f"{self.graph_limit} of them. Pad inputs to a few bucket sizes, or raise "
                f"that limit (torch._dynamo.config.patch(recompile_limit=...)) if every "
                f"shape really needs its own plan.")
        self._log.graphs[self.existing_grads] = count

    def with_existing_grads(self) -> "MemoptBackend":
        """A twin with the same budget and options, for the steps whose parameters
        already hold `.grad`; it records its plans in this backend's log."""
        twin = copy.copy(self)
        twin.existing_grads = True
        return twin

    def __repr__(self) -> str:
        return (f"MemoptBackend(budget={self.budget}, options={self.options}"
                f"{'' if self.loops else ', loops=False'}"
                f"{', existing_grads=True' if self.existing_grads else ''})")

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **_: Any) -> Callable:
        self._count_graph()
        kinds = _primal_kinds(gm, example_inputs)
        attributes = [*gm.parameters(), *gm.buffers()]  # AOTAutograd's first primals
        sink, grads = None, None
        if self.existing_grads:
            sink, grads = _grad_sink(kinds, [*attributes, *example_inputs])
        planned: list[MemoryPlan] = []
        outside = _aliased_output_grad_bytes(gm)
        if self.loops:
            _chain_loops(gm)

        def partition_fn(joint: fx.GraphModule, _joint_inputs: Any, *, num_fwd_outputs: int,
                         **_kw: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
            fw, bw, plan = plan_joint(joint, num_fwd_outputs, primal_kinds=kinds,
                                      budget=self.budget, options=self.options, grads=grads,
                                      outside_grad_bytes=outside)
            planned.append(plan)
            self._log.plans.append(plan)
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
            self._log.last = plan
            if sink is not None:
                sink.bind([*attributes, *args])
            return compiled(*args)

        return run


def _aliased_output_grad_bytes(gm: fx.GraphModule) -> int:
    """Bytes of the output gradients autograd forms outside the compiled backward.

    AOTAutograd returns one tensor per storage and regenerates outputs that alias another
    output (`return h, h`, a slice of an output, HF's hidden-states tuple holding the last
    hidden state twice) or a graph input as views outside the compiled graph, so the loss's
    gradients for those outputs are summed by autograd before the compiled backward runs
    (and those of an input's view flow to the input outside it). While autograd sums k
    gradients of one storage it holds up to k + 1 storage-sized buffers (the contributions,
    a slice's gradient expanded to its base, the running sum), one of which becomes the
    tangent the plan counts: k more, every one for an input's storage. The fuzzer
    (tests/test_fuzz.py) measured a model returning `{"a": h[:, :1], "b": h}` 1.10x its
    budget when the plan left them out. Dynamo hands memopt the same tensor returned
    twice as one output, so `return h, h` is not seen here (README, "Known limits")."""
    placeholders = {storage_key(v): True for v in
                    (n.meta.get("example_value") for n in gm.graph.find_nodes(op="placeholder"))
                    if isinstance(v, torch.Tensor)}
    output = next(iter(gm.graph.find_nodes(op="output")))
    uses: dict[Any, list[int]] = {}
    for node in torch.utils._pytree.tree_leaves(output.args):
        value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
        if isinstance(value, torch.Tensor) and value.requires_grad:
            storage = value.untyped_storage()
            uses.setdefault(storage_key(value), []).append(storage.nbytes())
    return sum(sizes[0] * len(sizes) for key, sizes in uses.items()
               if len(sizes) > 1 or key in placeholders)


def _grad_sink(kinds: dict[str, str], inputs: Sequence[Any]) -> tuple[GradSink, ExistingGrads]:
    """The runtime sink and the plan's view of the `.grad` tensors of every parameter that
    requires grad (primal `primals_{i+1}` is `inputs[i]`)."""
    slots = {name: i for i, (name, kind) in enumerate(kinds.items())
             if kind == "parameter" and i < len(inputs)
             and isinstance(inputs[i], torch.Tensor) and inputs[i].requires_grad}
    sink = GradSink(slots)
    nbytes = {name: inputs[i].numel() * inputs[i].element_size() for name, i in slots.items()}
    return sink, ExistingGrads(nbytes=nbytes, add=sink.add)


def memopt_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], **options: Any) -> Callable:
    """The registered `backend="memopt"`: `torch.compile(m, backend="memopt",
    options={"budget": "4GB"})` passes its options here."""
    return MemoptBackend(**options)(gm, example_inputs)

