"""In-place rewriting: an op whose input storage dies at that op writes into it.

Chen et al. 2016, Sec. 3 and Fig. 2: "an inplace operation can happen when there
is no other pending operations that depend on its input". The liveness counter
of Fig. 2 is, per storage, the position of its last reader; an op may overwrite
its first input when it is that last reader.

Requires: a forward or backward GraphModule from passes.partition, with
FakeTensors in `node.meta['val']`. Run before passes.liveness (which reads the
`memopt.inplace_of` key this pass writes).

Ensures: the module computes the same values; each rewritten node calls the
in-place variant of its op (`aten.relu` -> `aten.relu_`) and carries
`memopt.inplace_of`. Never written into: graph inputs (parameters, the user's
inputs, tensors saved for backward when they reach the backward graph), values
the graph returns (forward outputs and saved tensors), and any storage another
node still reads.

Algorithm:
    Step 1: group nodes by storage (a view shares its base's storage) and find each
        storage's last reader, in graph order.
    Step 2: for each node in order, check the rules in `_can_rewrite` for its first
        argument: an in-place overload with the same name exists, the output has
        the input's shape, dtype and strides, the input is a whole, dense,
        non-view storage, no other argument aliases it, the op is not random,
        and this node is the storage's last reader.
    Step 3: rewrite the target and record the source in `memopt.inplace_of`. The
        output now lives in the input's storage, so later rewrites see the merged
        lifetime.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from memopt._torch_compat import storage_key

from .meta import set_inplace_source, tensor_value


@dataclass(frozen=True)
class InplaceRewrite:
    node: str      # the rewritten node
    op: str        # the functional op it called
    inplace_op: str
    writes_into: str  # the input node whose storage it overwrites
    nbytes: int


@dataclass(frozen=True)
class InplaceResult:
    rewrites: tuple[InplaceRewrite, ...]

    @property
    def count(self) -> int:
        return len(self.rewrites)


def _inplace_overload(op: object) -> torch._ops.OpOverload | None:
    """The in-place overload `aten.<name>_.<overload>` of a functional aten op."""
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
        return None
    schema = op._schema
    if schema.is_mutable or any(r.alias_info is not None for r in schema.returns):
        return None  # already mutating, or a view
    if len(schema.returns) != 1 or torch.Tag.nondeterministic_seeded in op.tags:
        return None
    packet = getattr(torch.ops.aten, f"{op._opname}_", None)
    if packet is None:
        return None
    candidate = getattr(packet, op._overloadname, None)
    if candidate is None:
        return None
    first = candidate._schema.arguments[0]
    if first.alias_info is None or not first.alias_info.is_write:
        return None
    if [a.name for a in candidate._schema.arguments] != [a.name for a in schema.arguments]:
        return None
    return candidate


def _is_whole_dense(t: torch.Tensor) -> bool:
    return (
        t.storage_offset() == 0
        and t.is_contiguous()
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


def reinplace(gm: fx.GraphModule, protected: frozenset[str] = frozenset()) -> InplaceResult:
    """Rewrite ops to their in-place variants where the input storage dies there.

    `protected`: node names whose storage must never be written (beyond
    placeholders and returned values, which are always protected).
    """
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}

    # Step 1: storage groups and each storage's last reader.
    key_of: dict[fx.Node, object] = {}
    for node in nodes:
        val = tensor_value(node)
        if val is not None:
            key_of[node] = storage_key(val)
    last_read: dict[object, int] = {}
    pinned: set[object] = set()
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg in key_of:
                last_read[key_of[arg]] = max(last_read.get(key_of[arg], -1), order[node])
        if node.op == "placeholder" or node.name in protected:
            if node in key_of:
                pinned.add(key_of[node])
        if node.op == "output":
            pinned.update(key_of[a] for a in node.all_input_nodes if a in key_of)

    # Step 2 and 3: rewrite where the rules hold. `merged` maps a rewritten
    # output's storage to the storage it now lives in.
    merged: dict[object, object] = {}

    def storage(n: fx.Node) -> object | None:
        key = key_of.get(n)
        while key in merged:
            key = merged[key]
        return key

    rewrites: list[InplaceRewrite] = []
    for node in nodes:
        if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        inplace = _inplace_overload(node.target)
        src = node.args[0]
        if inplace is None or src not in key_of or node not in key_of:
            continue
        key = storage(src)
        out, inp = tensor_value(node), tensor_value(src)
        others = [a for a in node.all_input_nodes if a is not src]
        if (
            key in pinned
            or last_read.get(key) != order[node]
            or any(storage(a) == key for a in others)
            or out.shape != inp.shape
            or out.dtype != inp.dtype
            or out.device != inp.device
            or out.stride() != inp.stride()
            or not _is_whole_dense(inp)
        ):
            continue
        rewrites.append(InplaceRewrite(
            node=node.name, op=str(node.target), inplace_op=str(inplace),
            writes_into=src.name, nbytes=inp.untyped_storage().nbytes(),
        ))
        node.target = inplace
        set_inplace_source(node, src)
        # The output now lives in `src`'s storage: its readers extend that lifetime.
        old = storage(node)
        merged[old] = key
        if old in last_read:
            last_read[key] = max(last_read[key], last_read.pop(old))
        if old in pinned:
            pinned.add(key)
    if rewrites:
        gm.recompile()
    return InplaceResult(rewrites=tuple(rewrites))
