"""Liveness analysis over the schedule of a whole training step (Chen et al. 2016, Sec. 3).

Requires: the forward and backward GraphModules of one partition, FakeTensors in
`node.meta['val']` (so no real memory is touched), and `memopt.inplace_of` on
nodes an in-place rewrite produced. Run after partitioning and after the
in-place pass; the allocator and the planners read the result.

Ensures: a `StepSchedule`: the steps in execution order (every forward node, then
every backward node) and, for every storage (views share their base's storage),
its size in bytes, the first and last step at which it is live, and its kind.

Algorithm:
    Step 1: give every tensor value a storage identity: the FakeTensor's storage
        (views share it), merged with the input storage for in-place rewrites.
    Step 2: walk the schedule; a storage is born at the first step that produces
        it and dies after the last step that produces or reads it. Chen's Fig. 2
        counts pending reads per value; the last-use step is the same information.
    Step 3: extend lifetimes the runtime imposes: graph inputs (parameters,
        buffers, the user's inputs) are live for the whole step, the forward's
        outputs are held by the caller until the step ends, and so are the
        gradients the backward returns (autograd accumulates them into `.grad`).
        Saved tensors die at their last backward use (the boxed backward frees
        them as it goes). Parameter gradients that already exist before the step
        (`existing_grads`: `.grad` kept between steps, memopt.grads) are resident for
        the whole step; the new gradients added into them die at their last reader.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import fx

from memopt.allocator.lifetimes import RESIDENT_KINDS, Holds, StepShape, held_outside

from ._torch_compat import OpOverload, is_tangent, storage_key

from memopt.allocator.fusion import EXTERN, Fusion

from .fusion import Traits, graph_fusion, kernel_kind, traits
from .meta import (KERNEL_GROUP, fake_value, held_bytes, inplace_source, recomputed_from,
                   value_tensors, workspace_bytes)

#: Storage kinds, in the order a plan lists them.
KINDS = ("parameter", "buffer", "input", "existing_grad", "activation", "saved", "output",
         "tangent", "backward", "gradient", "outside")


#: Each storage kind as a timeline of the step counts it (allocator.timeline.KINDS).
TIMELINE_KINDS = {"parameter": "parameters", "buffer": "parameters", "input": "inputs",
                  "existing_grad": "gradients", "gradient": "gradients",
                  "activation": "temporaries", "saved": "saved", "output": "temporaries",
                  "tangent": "temporaries", "backward": "temporaries",
                  "outside": "other_graphs"}



def kept_by_caller(value: object) -> bool:
    """With outputs dropped (memopt.compile's drop_outputs), whether the caller still
    holds a forward output through backward: a scalar, the loss that ``.backward()`` is
    called on (it takes no gradient argument only for a scalar)."""
    return isinstance(value, torch.Tensor) and value.dim() == 0


def timeline_kind(kind: str, *, workspace: bool = False, recomputed: bool = False,
                  chain: bool = False) -> str:
    """The timeline kind (allocator.timeline.KINDS) of a storage of `kind` (KINDS):
    an op's workspace is "workspace", or "chain_states" for memopt's chain and
    reversible ops, as are the states they hold behind their outputs (`chain`); a
    backward allocation of a recomputed node (Chen Alg. 2's mirror) is "recomputed"."""
    if workspace:
        return "chain_states" if chain else "workspace"
    if chain and kind not in RESIDENT_KINDS:
        return "chain_states"
    if recomputed and kind == "backward":
        return "recomputed"
    return TIMELINE_KINDS[kind]


def timeline_kinds(schedule: StepSchedule, fw: fx.GraphModule, bw: fx.GraphModule | None
                   ) -> tuple[str, ...]:
    """`timeline_kind` of each of `schedule.storages` (analyze_liveness of `fw` and `bw`),
    read from the node that first produced it: its name ("bw.mm", "fw.op[1]",
    "bw.op.workspace") names the node and output."""
    graphs = [("fw", fw)] + ([("bw", bw)] if bw is not None else [])
    nodes = {f"{prefix}.{n.name}": n for prefix, gm in graphs for n in gm.graph.nodes}
    kinds = []
    for s in schedule.storages:
        workspace = s.name.endswith(".workspace")
        name, index = _output_of(s.name.removesuffix(".workspace"))
        node = nodes.get(name)
        opaque = node is not None and isinstance(node.target, OpOverload) \
            and node.target.namespace == "memopt"
        kinds.append(timeline_kind(
            s.kind, workspace=workspace,
            chain=opaque and (workspace or index in held_bytes(node)),
            recomputed=node is not None and recomputed_from(node) is not None))
    return tuple(kinds)


def _output_of(name: str) -> tuple[str, int]:
    """("fw.op", 1) for the storage name "fw.op[1]"; ("bw.mm", 0) for "bw.mm"."""
    match = re.fullmatch(r"(.*)\[(\d+)\]", name)
    return (match[1], int(match[2])) if match else (name, 0)


@dataclass(frozen=True)
class StorageLife:
    """One storage's lifetime over the step schedule (steps are indices into `steps`)."""

    name: str                 # "fw.addmm" or "fw.native_layer_norm[1]": the graph and node
                              # (and output index) that first produced it; unique per step
    nodes: tuple[str, ...]    # every node whose value lives in this storage
    nbytes: int
    start: int                # -1: live before the step begins
    end: int                  # inclusive
    kind: str


@dataclass(frozen=True)
class StepSchedule:
    steps: tuple[str, ...]            # "fw.<node>" then "bw.<node>", execution order
    num_forward_steps: int
    storages: tuple[StorageLife, ...]
    #: with fused kernels: inductor's own estimate of the forward's and the backward's
    #: peak on this order (memopt.allocator.fusion.Fusion.estimate), else (0, 0)
    fusion_estimates: tuple[int, int] = (0, 0)

    @property
    def last_step(self) -> int:
        return len(self.steps) - 1


class _Storages:
    """Step 1: storage identities, merged by a small union-find."""

    def __init__(self) -> None:
        self.parent: dict[object, object] = {}
        self.nbytes: dict[object, int] = {}

    def find(self, key: object) -> object:
        while self.parent.get(key, key) is not key:
            key = self.parent[key]
        return key

    def add(self, tensor: torch.Tensor, key: object = None) -> object:
        """The storage of `tensor`: its FakeTensor's storage, or `key` when given."""
        if key is None:
            key = storage_key(tensor)
        if key not in self.parent:
            self.parent[key] = key
            self.nbytes[key] = tensor.untyped_storage().nbytes()
        return self.find(key)

    def union(self, a: object, b: object) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra is not rb:
            self.parent[ra] = rb
            self.nbytes[rb] = max(self.nbytes[ra], self.nbytes[rb])


def analyze_liveness(
    fw: fx.GraphModule,
    bw: fx.GraphModule | None,
    *,
    saved: frozenset[str],
    num_user_outputs: int,
    primal_kinds: dict[str, str] | None = None,
    existing_grads: dict[str, int] | None = None,
    outside_grad_bytes: int = 0,
    outside_bytes: tuple[int, ...] = (0, 0),
    outputs_dropped: bool = False,
    fused: bool = False,
) -> StepSchedule:
    """Lifetimes of every storage of a training step. `saved`: names of saved values;
    the forward returns `num_user_outputs` outputs for the caller, then the saved values
    (AOTAutograd's convention). A value can be both: the caller still holds it.
    `existing_grads`: bytes of the `.grad` each parameter primal already holds.
    `outside_grad_bytes`: gradients autograd holds at once outside the compiled
    backward just before it starts (one per output beyond the first that aliases
    another output or an input; autograd sums them into the one tangent the compiled
    backward reads), charged at the first backward step. `outside_bytes`: (forward,
    backward) bytes the rest of the step holds while this graph's forward, and its
    backward, run (memopt.steps), one storage over each part of the schedule, and
    optionally a third, bytes allocated as the backward ends on top of what is live then
    (FSDP2's reduce-scatter), charged at its last step, and a fourth, the graph's own
    earlier runs in the forward, each holding its saved storages (allocator.lifetimes). `outputs_dropped`: the caller
    keeps only its scalar outputs (the loss it calls backward on) past the forward
    (memopt.compile's drop_outputs); the others die as the forward ends, unless backward
    reads them. `fused`: inductor runs the graphs (kernels="inductor"); what its fused
    kernels compute inside their readers has no storage, what they write in place shares
    its input's, and only extern kernels have workspaces (passes.fusion)."""
    primal_kinds = primal_kinds or {}
    stores = _Storages()
    node_keys: dict[tuple[str, str], list[object]] = {}
    node_raw: dict[tuple[str, str], list[object]] = {}
    steps: list[str] = []
    first: dict[object, int] = {}
    last: dict[object, int] = {}
    members: dict[object, list[str]] = {}
    resident_kind: dict[object, str] = {}
    tangent_keys: set[object] = set()
    graphs = [("fw", fw)] + ([("bw", bw)] if bw is not None else [])

    # Step 1: storage identity of every node's value. Forward: the FakeTensor's
    # storage (views share it). Backward: inputs keep the forward identity; views and
    # getitems take their source's; every other op allocates a new storage. A node
    # recomputed in backward shares its FakeTensor with the forward original but
    # allocates its own memory, so FakeTensor identity cannot be trusted there.
    fusions = _fusions(fw, bw, num_user_outputs) if fused else {}
    for prefix, gm in graphs:
        # inductor's kernels: outputs written into an input, or into a pooled buffer
        takes = {**fusions[prefix].inplace, **fusions[prefix].reuse} if fused else {}
        for node in gm.graph.nodes:
            if node.op not in ("placeholder", "call_function", "get_attr"):
                continue
            tensors = value_tensors(fake_value(node))
            node_raw[(prefix, node.name)] = [storage_key(t) for t in tensors]
            if prefix == "fw" or node.op == "placeholder":
                keys = [stores.add(t) for t in tensors]
            else:
                keys = [stores.add(t, key) for t, key in
                        zip(tensors, _backward_keys(node, tensors, node_keys, node_raw))]
            for index, nbytes in held_bytes(node).items():  # an opaque op's stored state
                if index < len(keys):
                    stores.nbytes[stores.find(keys[index])] = nbytes
            src = takes[node].name if node in takes else inplace_source(node)
            if src is not None and keys and (prefix, src) in node_keys:
                stores.union(keys[0], node_keys[(prefix, src)][0])
            node_keys[(prefix, node.name)] = keys

    def keys_of(prefix: str, node: fx.Node) -> list[object]:
        return [stores.find(k) for k in node_keys.get((prefix, node.name), [])]

    def touch(key: object, step: int, name: str | None = None) -> None:
        first.setdefault(key, step)
        last[key] = max(last.get(key, step), step)
        if name is not None:
            members.setdefault(key, [])
            if name not in members[key]:
                members[key].append(name)

    # Step 2: walk the schedule.
    num_forward = 0
    for prefix, gm in graphs:
        bw_start = len(steps)
        virtual = fusions[prefix].virtual if fused else frozenset()
        reads = fusions[prefix].reads if fused else {}
        copies = fusions[prefix].copies if fused else {}
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                for key in keys_of(prefix, node):
                    if prefix == "fw":
                        resident_kind.setdefault(key, primal_kinds.get(node.name, "input"))
                        touch(key, -1, f"{prefix}.{node.name}")
                    elif is_tangent(node):
                        tangent_keys.add(key)
                        touch(key, bw_start, f"{prefix}.{node.name}")
                    else:
                        touch(key, bw_start, f"{prefix}.{node.name}")
            elif node.op in ("call_function", "get_attr"):
                step = len(steps)
                steps.append(f"{prefix}.{node.name}")
                if node in virtual:  # computed inside the kernels that read it
                    continue
                for arg in reads.get(node, node.all_input_nodes):
                    for key in keys_of(prefix, arg):
                        touch(key, step)
                space = workspace_bytes(node)
                if fused:  # inductor's own kernels have none; copies it lays out anew
                    space = space + copies.get(node, 0) if kernel_kind(node) == EXTERN else 0
                if space:
                    ws = ("workspace", prefix, node.name)
                    stores.parent[ws], stores.nbytes[ws] = ws, space
                    touch(ws, step, f"{prefix}.{node.name}.workspace")
                keys = keys_of(prefix, node)
                multi = isinstance(fake_value(node), (tuple, list))
                for i, key in enumerate(keys):
                    # A multi-output op names each output storage by index, so that
                    # names stay unique ("fw.native_layer_norm[1]").
                    touch(key, step, f"{prefix}.{node.name}[{i}]" if multi else
                          f"{prefix}.{node.name}")
        if prefix == "fw":
            num_forward = len(steps)

    # Step 3: lifetimes the runtime imposes (allocator.lifetimes: the simulator's too).
    fw_out = next(iter(fw.graph.find_nodes(op="output")))
    user_outputs: set[object] = set()
    kept_outputs: set[object] = set()  # what the caller holds until the step ends
    for arg in fw_out.args[0][:num_user_outputs]:
        if isinstance(arg, fx.Node):
            user_outputs.update(keys_of("fw", arg))
            if not outputs_dropped or kept_by_caller(fake_value(arg)):
                kept_outputs.update(keys_of("fw", arg))
    gradients: set[object] = set()
    if bw is not None:
        bw_out = next(iter(bw.graph.find_nodes(op="output")))
        for arg in bw_out.all_input_nodes:
            gradients.update(keys_of("bw", arg))
    holds = Holds(resident=resident_kind, kept=kept_outputs, outputs=user_outputs,
                  gradients=gradients, tangents=tangent_keys,
                  saved={stores.find(k) for name in saved for k in node_keys.get(("fw", name), [])})
    shape = StepShape(num_forward=num_forward, num_steps=len(steps))
    lives: list[StorageLife] = []
    for key, start in first.items():
        names = tuple(members.get(key, ()))
        lives.append(StorageLife(
            name=names[0] if names else "?", nodes=names, nbytes=stores.nbytes[key],
            start=-1 if key in resident_kind else start,
            end=holds.end(key, start, last[key], shape), kind=holds.kind_of(key, start, shape)))
    saved_bytes = sum(s.nbytes for s in lives if s.kind == "saved")  # MemoryPlan.held_bytes
    lives += [StorageLife(name=h.name, nodes=(), nbytes=h.nbytes, start=h.start, end=h.end,
                          kind=h.kind)
              for h in held_outside(shape, existing_grads=existing_grads,
                                    outside_bytes=outside_bytes,
                                    outside_grad_bytes=outside_grad_bytes,
                                    has_backward=bw is not None, saved_bytes=saved_bytes)]
    lives.sort(key=lambda s: (s.start, s.name))
    return StepSchedule(steps=tuple(steps), num_forward_steps=num_forward, storages=tuple(lives),
                        fusion_estimates=(fusions["fw"].estimate, fusions["bw"].estimate)
                        if fused and bw is not None else (0, 0))


def _fusions(fw: fx.GraphModule, bw: fx.GraphModule | None, num_user_outputs: int
             ) -> dict[str, Fusion]:
    """passes.fusion's answer for each graph ("fw", "bw"): a backward may reuse a saved
    value's buffer unless it is resident (a primal's) or an output to the caller."""
    def raw(node: fx.Node) -> tuple:
        return tuple(storage_key(t) for t in value_tensors(fake_value(node)))

    fw_out = next(iter(fw.graph.find_nodes(op="output")))
    resident = {r for n in fw.graph.find_nodes(op="placeholder") for r in raw(n)}
    kept = resident | \
        {r for a in fw_out.args[0][:num_user_outputs] if isinstance(a, fx.Node) for r in raw(a)}
    devices = {t.device.type for gm in (fw, bw) if gm is not None for n in gm.graph.nodes
               for t in value_tensors(fake_value(n))[:1]}
    known: dict[fx.Node, Traits] = {}

    def traits_of(node: fx.Node) -> Traits:
        if node not in known:
            known[node] = traits(node)
        return known[node]

    answers = {}
    for prefix, gm in (("fw", fw), ("bw", bw)):
        if gm is None:
            continue
        nodes = [n for n in gm.graph.nodes if n.op in ("placeholder", "call_function", "get_attr")]
        out = next(iter(gm.graph.find_nodes(op="output")))

        def donated(node: fx.Node, backward: bool = prefix == "bw") -> bool:
            return backward and not is_tangent(node) and not kept.intersection(raw(node))

        answers[prefix] = graph_fusion(
            [n for n in nodes if n.op == "placeholder"],
            [n for n in nodes if n.op != "placeholder"], out.all_input_nodes,
            read=lambda n: n.all_input_nodes, traits_of=traits_of, raw=raw, donated=donated,
            arg=lambda n, k: n.args[k],
            freeable=lambda n, b=prefix == "bw": b and not resident.intersection(raw(n)),
            cpu=devices == {"cpu"}, group=lambda n: n.meta.get(KERNEL_GROUP))
    return answers


def _backward_keys(node: fx.Node, tensors: list[torch.Tensor],
                   node_keys: dict[tuple[str, str], list[object]],
                   node_raw: dict[tuple[str, str], list[object]]) -> list[object]:
    """Storage keys of a backward node's outputs (see Step 1): an output whose
    FakeTensor storage is one of its inputs' aliases that input (a view, an
    `_unsafe_view`, a getitem); any other output is a new allocation."""
    inputs: dict[object, object] = {}
    for arg in node.all_input_nodes:
        for raw, key in zip(node_raw.get(("bw", arg.name), []), node_keys.get(("bw", arg.name), [])):
            inputs.setdefault(raw, key)
    keys = []
    for i, t in enumerate(tensors):
        raw = storage_key(t)
        keys.append(inputs.get(raw, ("bw", node.name, i)))
    return keys
