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
holds). Recurrent chains' and reversible stacks' held and workspace bytes are read from
their nodes' meta at each simulation, so passes.chain_policy may reconfigure them in between.

Ensures: `StepModel(...).simulate(mirror, twice, inplace, kinds)` returns the storages'
(bytes, first step, last step) that memopt.planner's exact build of the same mirror
counts would give to liveness, the recomputed FLOPs, and the peak. Nothing is
changed: not the joint graph, not its nodes' meta.

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
    Step 3: the cut, gradients added into kept `.grad` tensors (passes.gradients), and
        the nodes AOTAutograd's extraction keeps in each graph (passes.partition).
    Step 4: in-place rewrites where an input dies (passes.inplace), and the kernel
        workspace of each op variant that runs (passes.workspace's cache).
    Step 5: liveness over the whole step (passes.liveness) and its peak, and the kind
        of each storage as a timeline of the step counts it (passes.liveness
        .timeline_kind).
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from memopt.allocator.lifetimes import Holds, StepShape, held_outside
from memopt.allocator.mirror import placement_order

from ._torch_compat import OpOverload, is_sym_node, is_tangent, storage_key

from .liveness import kept_by_caller, timeline_kind
from .inplace import (inplace_overload, is_whole_dense, opaque_output, out_overload,
                      merge_storage)
from .meta import fake_value, held_bytes, preset_workspace_bytes, tensor_value, value_tensors
from .partition import forward_region
from .recompute import arithmetic, mirrorable, recompute_sources
from .twins import emit_twin, is_twinned
from .workspace import Call, node_call, workspace_bytes_of

_LEVELS = ("A", "S", "B")


@dataclass(frozen=True)
class Simulated:
    """One candidate's step: its storages as (bytes, first step, last step) with
    first = -1 for what lives before the step, the number of steps, its peak (each
    storage rounded up to the allocator's granularity), and its recomputed FLOPs."""

    intervals: tuple[tuple[int, int, int], ...]
    num_steps: int
    peak_bytes: int
    recompute_flops: int
    saved_bytes: int  # the storages of kind "saved" (passes.liveness.KINDS)
    #: per run of consecutive steps where the peak is reached (at most PEAK_RUNS, the last
    #: one stretched over the rest), the forward storages live throughout it, each as the
    #: mirrorable nodes that hold it (the value and its views; memopt.planner's
    #: peak-directed path)
    at_peak: tuple[frozenset[tuple[str, ...]], ...] = ()
    #: per interval, its kind in a timeline of the step (allocator.timeline.KINDS), where
    #: asked for (StepModel.simulate's `kinds`)
    kinds: tuple[str, ...] = ()
    #: the step where the peak is first reached, as passes.liveness names steps
    #: ("fw.addmm", "bw.mm_3"), and the number of forward steps
    peak_step: str = ""
    num_forward_steps: int = 0


@dataclass
class _Proto:
    """What a node computes, shared by the joint node and its mirror copies (Step 1)."""

    name: str
    kind: str                      # "primal", "tangent", "call", "get_attr", "output"
    raw: tuple[Any, ...]           # storage identity of each tensor of its value
    nbytes: tuple[int, ...]        # each one's storage bytes
    single: Any                    # raw storage of a single-tensor value, else None
    tuple_valued: bool
    symbolic: bool
    impure: bool
    in_forward: bool               # AOTAutograd's extraction: must be / cannot be
    in_backward: bool
    opaque_output: bool            # never written in place (passes.inplace)
    flops: int                     # passes.recompute.node_flops, were it not a view
    opaque: bool                   # memopt's own op: bytes behind its outputs (HELD_BYTES)
    node: fx.Node                  # for the workspace key of a variant
    inplace_target: Any = None     # passes.inplace Step 2's variants, static checks passed
    out_variant: tuple[Any, str] | None = None
    arg_ok: tuple[bool, ...] = ()  # per top-level node argument: may it be overwritten
    workspace: dict | None = None  # variant -> bytes, filled on first use


class StepModel:
    """The joint graph of one training step as arrays (Step 1), for `simulate`."""

    def __init__(self, joint: fx.GraphModule, num_fwd_outputs: int, *,
                 mutable_inputs: frozenset[str], primal_kinds: dict[str, str] | None = None,
                 existing_grads: dict[str, int] | None = None,
                 accumulate: Callable[..., Any] | None = None, outside_grad_bytes: int = 0,
                 outside: tuple[int, ...] = (0, 0), granularity: int = 1,
                 impure_random: bool = False, outputs_dropped: bool = False) -> None:
        self.num_fwd_outputs = num_fwd_outputs
        self.outputs_dropped = outputs_dropped  # passes.liveness's
        self.primal_kinds = primal_kinds or {}  # parameter / buffer / input, by primal name
        self.existing_grads = existing_grads
        self.accumulate = accumulate
        self.outside_grad_bytes = outside_grad_bytes
        self.outside = outside
        self.granularity = granularity
        self._impure_random = impure_random
        self._storage_ids: dict[Any, int] = {}
        nodes = list(joint.graph.nodes)
        self.index = {n: i for i, n in enumerate(nodes)}
        self.protos: list[_Proto] = [self._proto(n) for n in nodes]
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
        self._nodes = nodes
        self._twins: dict[tuple[int, str], tuple[list[tuple[_Proto, tuple]], dict]] = {}
        self._accumulate: _Proto | None = None
        #: kernels' workspaces are measured on CPU and CUDA only (passes.workspace)
        self.measures = any(t.device.type in ("cpu", "cuda")
                            for n in nodes for t in value_tensors(fake_value(n))[:1])

    def accumulate_proto(self) -> _Proto:
        """passes.gradients' `add(grad, parameter)` node: it reads, returns nothing."""
        if self._accumulate is None:
            node = fx.Graph().call_function(self.accumulate, ())
            node.meta["val"] = None
            self._accumulate = self._proto(node)
        return self._accumulate

    # Step 1 -------------------------------------------------------------------------

    def _raw(self, t: torch.Tensor) -> int:
        return self._storage_ids.setdefault(storage_key(t), len(self._storage_ids))

    def _proto(self, node: fx.Node) -> _Proto:
        value = fake_value(node)
        tensors = value_tensors(value)
        single = tensor_value(node)
        kind = {"placeholder": "tangent" if is_tangent(node) else "primal",
                "call_function": "call", "get_attr": "get_attr"}.get(node.op, node.op)
        mutable = isinstance(node.target, OpOverload) and \
            node.target._schema.is_mutable
        tag = node.meta.get("partitioner_tag")
        proto = _Proto(
            name=node.name, kind=kind, raw=tuple(self._raw(t) for t in tensors),
            nbytes=tuple(t.untyped_storage().nbytes() for t in tensors),
            single=self._raw(single) if single is not None else None,
            tuple_valued=isinstance(value, (tuple, list)), symbolic=is_sym_node(node),
            impure=node.is_impure(self._impure_random),
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

    def _twin(self, item: int, level: str) -> tuple[list[tuple[_Proto, tuple]], int]:
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
                 inplace: bool = True, kinds: bool = False) -> Simulated:
        """The step of mirror counts m(v) = 1 for the nodes named in `mirrored`, 2 for
        those also in `twice` (memopt.planner.Mirror), with or without in-place
        rewrites; with `kinds`, each interval's timeline kind too (Simulated.kinds, for
        a plan's timeline: the search does without)."""
        run = _Candidate(self)
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


class _Candidate:
    """One candidate's graphs as index lists over the model's nodes and its own mirror
    nodes (ids from len(model.protos) on)."""

    def __init__(self, model: StepModel) -> None:
        self.m = model
        # per node id: its proto, its input nodes and its top-level arguments (the
        # model's nodes' first, a backward node's replaced where it reads mirror nodes)
        self.P: list[_Proto] = list(model.protos)
        self.I: list[tuple[int, ...]] = list(model.inputs)
        self.A: list[tuple[Any, ...]] = list(model.args)
        self.order: list[int] = []                # every non-placeholder node, placed
        self.bw_outputs = list(model.bw_outputs)
        self.recomputed: set[int] = set()

    def proto(self, i: int) -> _Proto:
        return self.P[i]

    def inputs_of(self, i: int) -> tuple[int, ...]:
        return self.I[i]

    def args_of(self, i: int) -> tuple[Any, ...]:
        return self.A[i]

    def _new(self, proto: _Proto, inputs: tuple[int, ...], args: tuple[Any, ...]) -> int:
        self.P.append(proto)
        self.I.append(inputs)
        self.A.append(args)
        self.recomputed.add(len(self.P) - 1)
        return len(self.P) - 1

    # Step 2: passes.recompute.add_mirror_nodes and place_recomputation.
    def add_mirror_nodes(self, mirrored: frozenset[str], twice: frozenset[str]) -> None:
        m = self.m
        mirror = {i for i, n in m.mirrorable.items() if n.name in mirrored}
        doubled = {i for i in mirror if m.protos[i].name in twice}

        def level(reader: str, i: int) -> str:
            if i not in doubled:
                return "S"
            return "B" if reader in ("B", "bw") else "A"

        needed: set[tuple[int, str]] = set()
        stack = [(a, level("bw", a)) for _, a in m.read_by_backward if a in mirror]
        while stack:
            i, lvl = stack.pop()
            if (i, lvl) not in needed:
                needed.add((i, lvl))
                stack.extend((a, level(lvl, a)) for a in m.sources[i] if a in mirror)
        clones: dict[tuple[int, str], int] = {}
        ops: dict[str, dict[Any, int]] = {lvl: {} for lvl in _LEVELS}
        for i, lvl in sorted(needed, key=lambda pair: (pair[0], _LEVELS.index(pair[1]))):

            def env(a: int, lvl: str = lvl) -> int:
                return clones[(a, level(lvl, a))] if a in mirror else a

            how = m.made_by[i]
            if how == "twin":
                clones[(i, lvl)] = self._emit_twin(i, lvl, env, ops[lvl])
            elif how == "getitem":
                op = m.getitem_of[i]
                if op not in ops[lvl]:
                    ops[lvl][op] = self._copy(op, env)
                clones[(i, lvl)] = self._copy(i, lambda a, o=ops[lvl]: o.get(a, a))
            else:
                clones[(i, lvl)] = self._copy(i, env)
        for b in {b for b, a in m.read_by_backward if a in mirror}:
            self.I[b] = tuple(clones[(a, level("bw", a))] if a in mirror else a
                              for a in m.inputs[b])
            self.A[b] = tuple(clones[(a, level("bw", a))] if a in mirror else a
                              for a in m.args[b])
        # place_recomputation: each mirror node just before its first use
        inputs = self.I
        emitted = set(m.placeholders)
        # every joint node but the output (the last), mirror nodes where first read
        order = placement_order(range(len(m.protos) - 1), inputs.__getitem__, emitted)
        self.order = order
        self.recomputed &= emitted

    def _copy(self, i: int, env: Callable[[int], int]) -> int:
        return self._new(self.m.protos[i], tuple(env(a) for a in self.m.inputs[i]),
                         tuple(env(a) if a is not None else None for a in self.m.args[i]))

    def _emit_twin(self, item: int, lvl: str, env: Callable[[int], int],
                   shared: dict[tuple[int, int], int]) -> int:
        """passes.twins.emit_twin: the twin's nodes `item` needs, each made once per op
        and level (`shared`: (op, template position) -> mirror node)."""
        protos, position = self.m._twin(item, lvl)
        op = self.m.index[self.m._nodes[item].args[0]]

        def make(k: int) -> int:
            if (op, k) not in shared:
                proto, inputs = protos[k]
                mapped = tuple(make(a[1]) if a[0] == "t" else env(a[1]) for a in inputs)
                shared[(op, k)] = self._new(proto, mapped, mapped)
            return shared[(op, k)]

        return make(position)

    # Step 3: passes.partition.find_cut, passes.gradients, AOTAutograd's extraction.
    def partition(self) -> tuple["_Graph", "_Graph", list[int]]:
        m = self.m
        joint = len(m.protos)

        def in_region(i: int) -> bool:
            return i < joint and m.region[i]

        read_outside = {a for i in self.order if not in_region(i) for a in self.I[i]}
        cut = [i for i in m.placeholders + self.order if in_region(i) and i in read_outside]
        saved = [i for i in cut if not self.P[i].symbolic and not self.P[i].tuple_valued]
        symbols = [i for i in cut if self.P[i].symbolic]
        order = list(self.order)
        if m.existing_grads is not None:
            order, saved = self._accumulate(order, saved)
        graph = m.placeholders + order
        # the backward: saved values, symbols and tangents in, gradients out
        bw_in = symbols + saved + m.tangents
        bw_body = self._extract(graph, set(bw_in), self.bw_outputs, forward=False)
        used = {a for i in bw_body for a in self.I[i]} | \
            {i for i in self.bw_outputs if i is not None}
        saved = [i for i in saved if i in used]
        symbols = [i for i in symbols if i in used]
        bw = _Graph(symbols + saved + m.tangents, bw_body, self.bw_outputs)
        fw_out = m.fw_outputs + saved + symbols
        fw = _Graph(list(m.primals), self._extract(graph, set(m.primals), fw_out, forward=True),
                    fw_out)
        return fw, bw, saved

    def _accumulate(self, order: list[int], saved: list[int]) -> tuple[list[int], list[int]]:
        """passes.gradients: save the parameters, and add each parameter's gradient into
        its `.grad` right after it is produced (after the inputs, for a tangent)."""
        m = self.m
        params = frozenset(m.existing_grads)
        names = {self.P[i].name for i in saved}
        saved = saved + sorted((m.by_name[p] for p in params - names),
                               key=lambda i: m.protos[i].name)
        if len(self.bw_outputs) != len(m.primals):
            return order, saved
        after: dict[int, list[int]] = {}
        for k, (primal, grad) in enumerate(zip(m.primals, self.bw_outputs)):
            if m.protos[primal].name not in params or grad is None:
                continue
            where = -1 if self.P[grad].kind in ("primal", "tangent") else grad
            add = self._new(m.accumulate_proto(), (grad, primal), (grad, primal))
            self.recomputed.discard(add)
            after.setdefault(where, []).insert(0, add)
            self.bw_outputs[k] = add
        placed = after.get(-1, [])
        for i in order:
            placed.append(i)
            placed.extend(after.get(i, ()))
        return placed, saved

    def _extract(self, graph: list[int], inputs: set[int], outputs: list[int | None],
                 forward: bool) -> list[int]:
        """torch's _extract_graph_with_inputs_outputs: the nodes computable from
        `inputs` (and allowed in this graph), less those dead-code elimination removes;
        in `graph` order, inputs excluded."""
        valid: set[int] = set()
        for i in graph:
            if i in inputs:
                valid.add(i)
                continue
            p = self.P[i]
            if (p.in_backward if forward else p.in_forward) or p.kind in ("primal", "tangent"):
                continue
            if p.kind == "get_attr" or all(a in valid for a in self.I[i]):
                valid.add(i)
        live = {i for i in outputs if i is not None}
        live |= {i for i in valid if i not in inputs and self.P[i].impure}
        work = [i for i in live if i not in inputs]  # an input is a placeholder there
        while work:
            for a in self.I[work.pop()]:
                if a not in live and a in valid:
                    live.add(a)
                    if a not in inputs:
                        work.append(a)
        return [i for i in graph if i in live and i not in inputs and i in valid]

    # Step 4: passes.inplace.reinplace.
    def reinplace(self, graph: "_Graph", enabled: bool) -> dict[int, tuple[int, Any]]:
        """{node: (the input it writes into, its variant)}: ("inplace",) or ("out", k)
        for the k-th top-level argument."""
        if not enabled:
            return {}
        nodes = graph.inputs + graph.body
        order = {i: k for k, i in enumerate(nodes)}
        end = len(nodes)  # the output node
        key_of = {i: self.P[i].single for i in nodes if self.P[i].single is not None}
        last_read: dict[Any, int] = {}
        pinned = {key_of[i] for i in graph.inputs if i in key_of}
        for k, i in enumerate(graph.body, start=len(graph.inputs)):  # in order: k grows
            for a in self.I[i]:
                if a in key_of:
                    last_read[key_of[a]] = k
            if self.P[i].opaque_output and i in key_of:
                pinned.add(key_of[i])
        for a in graph.outputs:
            if a is not None and a in key_of:
                last_read[key_of[a]] = end
                pinned.add(key_of[a])
        merged: dict[Any, Any] = {}

        def storage(i: int) -> Any:
            key = key_of.get(i)
            while key in merged:
                key = merged[key]
            return key

        def may_overwrite(i: int, src: int, position: int) -> bool:
            if src not in key_of or i not in key_of or not self.P[i].arg_ok[position]:
                return False
            key = storage(src)
            return not (key in pinned or last_read.get(key) != order[i]
                        or any(storage(a) == key for a in self.I[i] if a != src))

        rewrites: dict[int, tuple[int, Any]] = {}
        for i in graph.body:
            p = self.P[i]
            if p.kind != "call" or i not in key_of:
                continue
            args = self.A[i]
            found = None
            if p.inplace_target is not None and may_overwrite(i, args[0], 0):
                found = (args[0], ("inplace",))
            elif p.out_variant is not None:
                found = next(((a, ("out", k)) for k, a in enumerate(args)
                              if a is not None and may_overwrite(i, a, k)), None)
            if found is None:
                continue
            src, variant = found
            rewrites[i] = (src, variant)
            merge_storage(storage(i), storage(src), merged, last_read, pinned)
        return rewrites

    def _workspaces(self, nodes: list[int], rewrites: dict[int, tuple[int, Any]]
                    ) -> dict[int, int]:
        """passes.workspace: each node's workspace for the variant that runs."""
        found: dict[int, int] = {}
        todo: list[tuple[int, _Proto, Any, Call]] = []
        for i in nodes:
            p = self.P[i]
            preset = preset_workspace_bytes(p.node)
            if preset is not None:
                found[i] = preset
                continue
            if not self.m.measures:
                continue
            variant = rewrites[i][1] if i in rewrites else ("fn",)
            if p.workspace is None:
                p.workspace = {}
            if variant in p.workspace:
                found[i] = p.workspace[variant]
                continue
            call = _variant_call(p, variant)
            if call is None:
                p.workspace[variant] = 0
                continue
            todo.append((i, p, variant, call))
        if todo:
            for (i, p, variant, _), nbytes in zip(todo, workspace_bytes_of([t[3] for t in todo])):
                p.workspace[variant] = nbytes
                found[i] = nbytes
        return {i: b for i, b in found.items() if b}

    def _flops(self, i: int) -> int:
        """passes.recompute.node_flops of node `i` as its inputs are in this candidate: a
        view of one of them costs nothing."""
        p = self.P[i]
        if p.single is None or any(self.P[a].single == p.single for a in self.I[i]):
            return 0
        return p.flops

    # Step 5: passes.liveness.analyze_liveness, and the peak.
    def liveness(self, fw: "_Graph", bw: "_Graph", saved_values: list[int],
                 with_kinds: bool = False) -> Simulated:
        m = self.m
        parent: dict[int, int] = {}   # storages an in-place rewrite merged into another
        nbytes: dict[int, int] = {}
        fresh = itertools.count(-1, -1)  # backward allocations (raw storages are >= 0)

        def find(k: int) -> int:
            while k in parent:
                k = parent[k]
            return k

        P, I = self.P, self.I
        # passes.liveness Steps 1 and 2 in one walk: each value's storage (Step 1), then
        # its reads and its write (Step 2). Steps only grow, so a touch is the last so far;
        # an in-place rewrite merges two storages and their lifetimes.
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        resident: set[int] = set()
        resident_kind: dict[int, str] = {}  # passes.liveness's kind of each primal's storage
        recomputed_keys: set[int] = set()  # allocated by a mirror node (Step 2)
        chain_keys: set[int] = set()  # where memopt's opaque ops hold their states
        steps = num_forward = 0
        workspaces: list[tuple[int, int, bool]] = []  # (bytes, step, of an opaque op)
        keys_fw: dict[int, tuple[int, ...]] = {}
        keys_bw: dict[int, tuple[int, ...]] = {}
        for graph, keys, backward in ((fw, keys_fw, False), (bw, keys_bw, True)):
            start = steps if backward else -1
            for i in graph.inputs:
                p = P[i]
                keys[i] = own = p.raw
                for key, size in zip(own, p.nbytes):
                    if key not in nbytes:
                        nbytes[key] = size
                    k = find(key)
                    if not backward:
                        resident.add(k)
                        resident_kind.setdefault(k, m.primal_kinds.get(p.name, "input"))
                    if k not in first:
                        first[k] = start
                    last[k] = start
            spaces = self._workspaces(graph.body, graph.rewrites)
            rewrites = graph.rewrites
            get = keys.get
            for i in graph.body:
                p = P[i]
                if backward:  # a backward op aliases an input only where its value is a view
                    alias: dict[int, int] = {}
                    for a in I[i]:
                        for raw, key in zip(P[a].raw, get(a, ())):
                            if raw not in alias:
                                alias[raw] = key
                    own = tuple(alias[raw] if raw in alias else next(fresh) for raw in p.raw)
                    if i in self.recomputed:
                        recomputed_keys.update(key for key in own if key < 0)
                else:
                    own = p.raw
                for key, size in zip(own, p.nbytes):
                    if key not in nbytes:
                        nbytes[key] = size
                if p.opaque:
                    for index, held in held_bytes(p.node).items():  # set by passes.chain_policy
                        if index < len(own):
                            nbytes[find(own[index])] = held
                            chain_keys.add(find(own[index]))
                if i in rewrites and own and rewrites[i][0] in keys:
                    ra, rb = find(own[0]), find(keys[rewrites[i][0]][0])
                    if ra != rb:
                        parent[ra] = rb
                        nbytes[rb] = max(nbytes[ra], nbytes[rb])
                        if ra in first:
                            first[rb] = min(first[ra], first.get(rb, first[ra]))
                            last[rb] = max(last.pop(ra), last.get(rb, -1))
                            del first[ra]
                keys[i] = own
                step = steps
                steps += 1
                for a in I[i]:
                    for key in get(a, ()):
                        k = find(key) if key in parent else key
                        if k not in first:
                            first[k] = step
                        last[k] = step
                if i in spaces:
                    workspaces.append((spaces[i], step, p.opaque))
                for key in own:
                    k = find(key) if key in parent else key
                    if k not in first:
                        first[k] = step
                    last[k] = step
            if not backward:
                num_forward = steps

        # Step 3: lifetimes the runtime imposes (allocator.lifetimes: liveness's too)
        shape = StepShape(num_forward=num_forward, num_steps=steps)
        kept = {find(k) for i in m.kept_outputs for k in keys_fw.get(i, ())}
        holds = Holds(
            resident=resident_kind, kept=kept,
            outputs={find(k) for i in fw.outputs[:m.num_fwd_outputs] if i is not None
                     for k in keys_fw.get(i, ())},
            gradients={find(k) for i in bw.outputs if i is not None
                       for k in keys_bw.get(i, ())},
            tangents={find(k) for i in m.tangents for k in keys_bw.get(i, ())},
            saved={find(k) for i in saved_values for k in keys_fw.get(i, ())})
        lifetimes = {key: (nbytes[key], s, holds.end(key, s, last[key], shape))
                     for key, s in first.items()}
        intervals = list(lifetimes.values())
        saved_bytes = sum(nbytes[key] for key, s in first.items()
                          if key in holds.saved and s < num_forward and not (
                              key in resident or key in holds.tangents
                              or key in holds.outputs))
        # (bytes, first, last, timeline kind) of what has no storage of its own
        extras = [(size, step, step, timeline_kind("activation", workspace=True, chain=opaque))
                  for size, step, opaque in workspaces]
        extras += [(h.nbytes, h.start, h.end, timeline_kind(h.kind)) for h in held_outside(
            shape, existing_grads=m.existing_grads, outside_bytes=m.outside,
            outside_grad_bytes=m.outside_grad_bytes, has_backward=True)]
        intervals += [extra[:3] for extra in extras]
        kinds: tuple[str, ...] = ()
        if with_kinds:  # passes.liveness Step 3's kinds, in that order
            kinds = tuple(timeline_kind(holds.kind_of(key, s, shape),
                                        recomputed=key in recomputed_keys,
                                        chain=key in chain_keys)
                          for key, s in first.items()) + tuple(extra[3] for extra in extras)
        flops = sum(self._flops(i) for i in bw.body if i in self.recomputed)
        # what memopt.oracle reads back: each storage's lifetime, each node's storages
        self.lifetimes, self.unkeyed = lifetimes, intervals[len(lifetimes):]
        self.keys = {**keys_fw, **keys_bw}
        self.find, self.num_forward = find, num_forward
        peak, runs = _peak(intervals, steps, m.granularity)
        at_peak = tuple(frozenset(m.mirrorable_of[k] for k, (_, s, e) in lifetimes.items()
                                  if s <= first_at and last_at <= e and k in m.mirrorable_of)
                        for first_at, last_at in runs)
        at = runs[0][0]
        peak_node = (fw.body + bw.body)[at] if 0 <= at < steps else None
        return Simulated(intervals=tuple(intervals), num_steps=steps, at_peak=at_peak,
                         peak_bytes=peak,
                         recompute_flops=flops, saved_bytes=saved_bytes, kinds=kinds,
                         peak_step="" if peak_node is None else
                         f"{'fw' if at < num_forward else 'bw'}.{P[peak_node].name}",
                         num_forward_steps=num_forward)


@dataclass
class _Graph:
    """A forward or backward graph: its placeholders, its nodes in order, its outputs."""

    inputs: list[int]
    body: list[int]
    outputs: list[int | None]
    rewrites: dict[int, tuple[int, Any]] = field(default_factory=dict)  # Step 4


def _variant_call(p: _Proto, variant: Any) -> Call | None:
    if variant[0] == "fn":
        return node_call(p.node)
    if variant[0] == "inplace":
        return node_call(p.node, target=p.inplace_target)
    target, out_name = p.out_variant
    src = p.node.args[variant[1]]
    return node_call(p.node, target=target, kwargs={**p.node.kwargs, out_name: src})


#: How many runs of peak steps `Simulated.at_peak` tells apart.
PEAK_RUNS = 8


def _peak(intervals: list[tuple[int, int, int]], num_steps: int, granularity: int
          ) -> tuple[int, list[tuple[int, int]]]:
    """allocator.peak_live_bytes of the intervals, each rounded up to `granularity`, and
    the runs of consecutive steps where it is reached, as (first, last) (at most
    PEAK_RUNS: the last run reaches to the last peak step)."""
    if num_steps <= 0:
        return 0, [(-1, -1)]
    diff = [0] * (num_steps + 1)
    g = granularity
    for size, start, end in intervals:
        s, e = max(start, 0), min(end, num_steps - 1)
        if s <= e:
            size = -(-size // g) * g
            diff[s] += size
            diff[e + 1] -= size
    peak = live = 0
    runs: list[tuple[int, int]] = [(0, 0)]
    for step, d in enumerate(diff[:num_steps]):
        live += d
        if live > peak:
            peak, runs = live, [(step, step)]
        elif live == peak:
            if runs[-1][1] == step - 1 or len(runs) == PEAK_RUNS:
                runs[-1] = (runs[-1][0], step)
            else:
                runs.append((step, step))
    return peak, runs
