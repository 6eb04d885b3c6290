"""Score a mirror plan without building its graphs: the step simulator.

Chen et al. 2016, Appendix A scores every candidate of its search over the budget B by
the exact static allocation of the candidate's graph. memopt's exact build of a
candidate (memopt.planner: copy the joint graph with mirror nodes, partition it,
rewrite in place, measure workspaces, analyze liveness) spends most of its time in
torch.fx graph copies, about half a millisecond per node; Alg. 3's search tries dozens
of candidates and a ResNet-1000 has tens of thousands of nodes. This pass runs the same
analysis on plain arrays built once from the joint graph, a few microseconds per node
per candidate, and gives the same schedule of storages, hence the same peak.

Requires: the joint GraphModule as the pipeline plans it (after
passes.partition.read_concat_views), the buffers the step may mutate, and the step
context (memopt.planner.StepContext: existing gradients, what the rest of the step
holds). What memopt's own ops (recurrent chains, LM heads, reversible stacks) hold and
allocate is an argument of each simulation (`ops`: their configurations' bytes,
passes.meta.OpBytes, as the planner's op families give them), so the planner prices
configurations without touching the graph; without it, they are read from the joint
graph's node.meta, where the passes that configure them record them.

Ensures: `StepModel(...).simulate(mirror, twice, inplace, kinds, ops)` returns the storages'
(bytes, first step, last step) that memopt.planner's exact build of the same mirror
counts would give to liveness, the recomputed FLOPs, and the peak. Nothing is
changed: not the joint graph, not its nodes' meta.

Step 1 lives here (StepModel); Steps 2-5 run per candidate in passes.simulate_steps
(Candidate), on the plain data of passes.step_data.

Algorithm (each step mirrors the pass it names, and must agree with it exactly;
tests/test_simulate.py compares both on the corpus, the third-party zoo and fuzzed
models, and memopt.planner builds the plan it chooses for real):
    Step 1 (once, in StepModel): every joint node as plain data: its input nodes, its
        top-level arguments, the storages of its FakeTensor value and their bytes, the
        forward region, impurity (torch's dead-code elimination), the nodes that may be
        mirrored and the twins of random and stateful ops (passes.recompute,
        passes.twins), what passes.inplace's static rules allow, and FLOPs.
    Step 2: Chen Alg. 2: the mirror nodes backward needs and the order that runs each
        just before its first use (passes.recompute.add_mirror_nodes).
    Step 3: the cut, one copy saved of values computed twice (passes.shared_saves),
        gradients added into kept `.grad` tensors (passes.gradients), and
        the nodes AOTAutograd's extraction keeps in each graph (passes.partition).
    Step 4: in-place rewrites where an input dies (passes.inplace), and the kernel
        workspace of each op variant that runs (passes.workspace's cache).
    Step 5: liveness over the whole step (passes.liveness) and its peak, and the kind
        of each storage as a timeline of the step counts it (passes.liveness
        .timeline_kind).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import fx


from ._torch_compat import OpOverload, is_sym_node, is_tangent, storage_key

from .fusion import Traits, traits
from .liveness import kept_by_caller
from .inplace import inplace_overload, is_whole_dense, opaque_output, out_overload
from .meta import WORKSPACE_BYTES, OpBytes, fake_value, tensor_value, value_tensors
from .partition import forward_region
from .simulate_steps import Candidate
from .simulate_steps import peak_and_runs
from .step_data import Proto, Simulated
from .workspace import WorkspaceCache
from .recompute import arithmetic, mirrorable, recompute_sources
from .shared_saves import duplicates
from .twins import emit_twin, is_twinned

class StepModel:
    """The joint graph of one training step as arrays (Step 1), for `simulate`."""

    def __init__(self, joint: fx.GraphModule, num_fwd_outputs: int, *,
                 mutable_inputs: frozenset[str], primal_kinds: dict[str, str] | None = None,
                 existing_grads: dict[str, int] | None = None,
                 accumulate: Callable[..., Any] | None = None,
                 step_bytes: dict[str, int] | None = None, outside_grad_bytes: int = 0,
                 outside: tuple[int, ...] = (0, 0), granularity: int = 1,
                 outputs_dropped: bool = False,
                 workspaces: WorkspaceCache | None = None, fused: bool = False) -> None:
        self.num_fwd_outputs = num_fwd_outputs
        #: inductor runs the graphs (kernels="inductor"): liveness counts the buffers its
        #: fused kernels allocate (passes.fusion)
        self.fused = fused
        self._traits: dict[fx.Node, Traits] = {}
        #: the owner's measured workspaces (passes.workspace): read and filled per candidate
        self.workspaces = workspaces if workspaces is not None else WorkspaceCache()
        self.outputs_dropped = outputs_dropped  # passes.liveness's
        self.primal_kinds = primal_kinds or {}  # parameter / buffer / input, by primal name
        self.existing_grads = existing_grads
        self.accumulate = accumulate
        #: the optimizer steps each parameter in `existing_grads` inside the backward and
        #: frees its gradient (memopt.stepper): the bytes each step allocates; no `.grad`
        #: is then resident (passes.gradients)
        self.step_bytes = step_bytes
        self.outside_grad_bytes = outside_grad_bytes
        self.outside = outside
        self.granularity = granularity
        self._storage_ids: dict[Any, int] = {}
        nodes = list(joint.graph.nodes)
        self.index = {n: i for i, n in enumerate(nodes)}
        self.protos: list[Proto] = [self._proto(n) for n in nodes]
        self.inputs: list[tuple[int, ...]] = [tuple(self.index[a] for a in n.all_input_nodes)
                                              for n in nodes]
        self.args: list[tuple[Any, ...]] = [tuple(self.index[a] if isinstance(a, fx.Node)
                                                  else None for a in n.args) for n in nodes]
        region = forward_region(joint, num_fwd_outputs)
        self.region = [n in region for n in nodes]
        output = nodes[-1]
        assert output.op == "output", "a joint graph ends with its output"
        outs = list(output.args[0])
        self.fw_outputs = [self.index[a] if isinstance(a, fx.Node) else None
                           for a in outs[:num_fwd_outputs]]
        #: the forward outputs the caller holds until the step ends (passes.liveness)
        self.kept_outputs = [i for i in self.fw_outputs if i is not None and (
            not outputs_dropped or kept_by_caller(fake_value(nodes[i])))]
        self.bw_outputs = [self.index[a] if isinstance(a, fx.Node) else None
                           for a in outs[num_fwd_outputs:]]
        self.placeholders = [i for i, n in enumerate(nodes) if n.op == "placeholder"]
        self.primals = [i for i in self.placeholders if not is_tangent(nodes[i])]
        self.tangents = [i for i in self.placeholders if is_tangent(nodes[i])]
        self.backward = [i for i, n in enumerate(nodes)
                         if not self.region[i] and n.op not in ("output", "placeholder")]
        self.mirrorable = {self.index[n]: n for n in
                           mirrorable(joint, num_fwd_outputs, mutable_inputs)}
        # for Step 2, per mirrorable node: what recomputing it reads (passes.recompute's
        # recompute_sources), how its mirror is made ("twin", "getitem" of an op, or "copy"), and
        # the backward nodes that read it
        self.sources = {i: tuple(self.index[a] for a in recompute_sources(n))
                        for i, n in self.mirrorable.items()}
        self.mirrorable_of: dict[Any, tuple[str, ...]] = {}  # storage -> its mirrorable nodes
        for i, n in self.mirrorable.items():
            if self.protos[i].single is not None:
                key = self.protos[i].single
                self.mirrorable_of[key] = self.mirrorable_of.get(key, ()) + (n.name,)
        self.made_by = {i: "twin" if is_twinned(n) else
                        "getitem" if n.target is operator.getitem else "copy"
                        for i, n in self.mirrorable.items()}
        self.getitem_of = {i: self.index[n.args[0]] for i, n in self.mirrorable.items()
                           if self.made_by[i] == "getitem"}
        self.read_by_backward = [(b, a) for b in self.backward for a in self.inputs[b]
                                 if a in self.mirrorable]
        self.by_name = {n.name: i for i, n in enumerate(nodes)}
        #: Step 3's merge of saved copies (passes.shared_saves): node -> its first equal
        self.first_equal = {self.by_name[a]: self.by_name[b]
                            for a, b in duplicates(joint, num_fwd_outputs).items()}
        self._nodes = nodes
        self._twins: dict[tuple[int, str], tuple[list[tuple[Proto, tuple]], dict]] = {}
        self._accumulate: dict[int | None, Proto] = {}
        #: kernels' workspaces are measured on CPU and CUDA only (passes.workspace)
        devices = {t.device.type for n in nodes for t in value_tensors(fake_value(n))[:1]}
        self.measures = bool(devices & {"cpu", "cuda"})
        self.cpu = devices == {"cpu"}  # inductor's CPU realization heuristic (passes.fusion)

    def traits(self, proto: Proto) -> Traits:
        """passes.fusion's Traits of a proto's node, read once."""
        node = proto.node
        if node not in self._traits:
            self._traits[node] = traits(node)
        return self._traits[node]

    def accumulate_proto(self, step_bytes: int | None = None) -> Proto:
        """passes.gradients' `add(grad, parameter)` node: it reads, returns nothing; an
        optimizer step's allocates `step_bytes` while it runs (its workspace)."""
        if step_bytes not in self._accumulate:
            node = fx.Graph().call_function(self.accumulate, ())
            node.meta["val"] = None
            if step_bytes is not None:
                node.meta[WORKSPACE_BYTES] = step_bytes
            self._accumulate[step_bytes] = self._proto(node)
        return self._accumulate[step_bytes]

    # Step 1 -------------------------------------------------------------------------

    def _raw(self, t: torch.Tensor) -> int:
        return self._storage_ids.setdefault(storage_key(t), len(self._storage_ids))

    def _proto(self, node: fx.Node) -> Proto:
        value = fake_value(node)
        tensors = value_tensors(value)
        single = tensor_value(node)
        kind = {"placeholder": "tangent" if is_tangent(node) else "primal",
                "call_function": "call", "get_attr": "get_attr"}.get(node.op, node.op)
        mutable = isinstance(node.target, OpOverload) and \
            node.target._schema.is_mutable
        tag = node.meta.get("partitioner_tag")
        proto = Proto(
            name=node.name, kind=kind, raw=tuple(self._raw(t) for t in tensors),
            nbytes=tuple(t.untyped_storage().nbytes() for t in tensors),
            single=self._raw(single) if single is not None else None,
            tuple_valued=isinstance(value, (tuple, list)), symbolic=is_sym_node(node),
            impure=node.is_impure(impure_random=False),  # _torch_compat.extract_fwd_bwd
            in_forward=tag == "must_be_in_forward" or (
                mutable and tag not in ("is_backward", "must_be_in_backward")),
            in_backward=tag == "must_be_in_backward" or (mutable and tag == "is_backward"),
            opaque_output=opaque_output(node),
            opaque=isinstance(node.target, OpOverload)
            and node.target.namespace == "memopt",
            flops=arithmetic(node) if node.op == "call_function" else 0, node=node)
        if node.op != "call_function" or single is None:
            return proto
        # passes.inplace Step 2, the checks that do not depend on liveness
        proto.arg_ok = tuple(isinstance(a, fx.Node) and _static_overwrite(node, a)
                             for a in node.args)
        target = inplace_overload(node.target)
        if target is not None and node.args and isinstance(node.args[0], fx.Node):
            proto.inplace_target = target
        proto.out_variant = out_overload(node.target)
        return proto

    def _twin(self, item: int, level: str) -> tuple[list[tuple[Proto, tuple]], int]:
        """The nodes passes.twins emits for the twin of `item`'s op at `level`, as protos
        with their inputs (a joint node index, or ("t", k) for the twin's own k-th
        node), and the position of `item`'s value among them. Traced once per op and
        level, as the exact build does, so that each level's values are storages of
        their own and a BatchNorm twin's outputs come from one call."""
        node = self._nodes[item]
        op = node.args[0]
        key = (self.index[op], level)
        if key not in self._twins and level != "S":  # level S's, each storage a new one
            protos, position = self._twin(item, "S")
            fresh: dict[Any, int] = {}

            def relabel(raw: Any) -> Any:
                if raw is None:
                    return None
                if raw not in fresh:
                    fresh[raw] = self._storage_ids.setdefault((key, raw), len(self._storage_ids))
                return fresh[raw]

            self._twins[key] = ([(dataclasses.replace(p, raw=tuple(map(relabel, p.raw)),
                                                      single=relabel(p.single), workspace=None),
                                  inputs) for p, inputs in protos], self._twins[key[0], "S"][1])
        if key not in self._twins:
            scratch = fx.Graph()
            stand_in: dict[fx.Node, fx.Node] = {}

            def env(a: fx.Node) -> fx.Node:
                if a not in stand_in:
                    stand_in[a] = scratch.placeholder(a.name)
                    stand_in[a].meta = dict(a.meta)
                return stand_in[a]

            items = sorted((u for u in op.users if is_twinned(u)), key=lambda u: u.args[1])
            shared: dict[fx.Node, fx.Node] = {}
            values = {u.args[1]: emit_twin(scratch, u, env, shared, level) for u in items}
            made = [n for n in scratch.nodes if n.op == "call_function"]
            local = {n: ("t", k) for k, n in enumerate(made)}
            joint_of = {v: ("j", self.index[k]) for k, v in stand_in.items()}
            protos = [(self._proto(n), tuple(local.get(a) or joint_of[a]
                                             for a in n.all_input_nodes)) for n in made]
            self._twins[key] = (protos, {i: made.index(v) for i, v in values.items()})
        protos, position = self._twins[key]
        return protos, position[node.args[1]]

    # Steps 2-5 ----------------------------------------------------------------------

    def simulate(self, mirrored: Iterable[str] = (), twice: Iterable[str] = (),
                 inplace: bool = True, kinds: bool = False,
                 ops: Mapping[str, OpBytes] | None = None) -> Simulated:
        """The step of mirror counts m(v) = 1 for the nodes named in `mirrored`, 2 for
        those also in `twice` (memopt.planner.Mirror), with or without in-place
        rewrites; with `kinds`, each interval's timeline kind too (Simulated.kinds, for
        a plan's timeline: the search does without). `ops`: what memopt's own ops (chains,
        heads, reversible stacks) hold and allocate under their configurations, by node
        name (passes.meta.OpBytes); None: as recorded in the joint graph's node.meta."""
        run = Candidate(self, ops)
        run.add_mirror_nodes(frozenset(mirrored), frozenset(twice))     # Step 2
        fw, bw, saved = run.partition()                                 # Step 3
        fw.rewrites = run.reinplace(fw, inplace)                        # Step 4
        bw.rewrites = run.reinplace(bw, inplace)
        return run.liveness(fw, bw, saved, kinds)                       # Step 5


def _static_overwrite(node: fx.Node, src: fx.Node) -> bool:
    """passes.inplace's may_overwrite, less what depends on the step's liveness."""
    out, inp = tensor_value(node), tensor_value(src)
    return not (inp is None or out is None
                or sum(a is src for a in node.args) != 1
                or out.shape != inp.shape or out.dtype != inp.dtype
                or out.device != inp.device or out.stride() != inp.stride()
                or not is_whole_dense(inp))


def peak_without(sim: Simulated, backward_bytes: int, at_forward_end: int,
                 granularity: int) -> int:
    """`sim`'s peak with `backward_bytes` fewer live at each of its backward steps and
    `at_forward_end` fewer at its forward's last step (what the step model holds there
    for one storage held over the backward: memopt.caller_loss's room, by
    allocator.lifetimes.held_outside), both multiples of `granularity`."""
    nf, steps = sim.num_forward_steps, sim.num_steps
    if not backward_bytes and not at_forward_end or nf >= steps:
        return sim.peak_bytes
    less = [(-backward_bytes, nf, steps - 1), (-at_forward_end, nf - 1, nf - 1)]
    return peak_and_runs([*sim.intervals, *less], steps, granularity)[0]
