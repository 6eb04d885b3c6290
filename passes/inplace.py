"""In-place rewriting: an op whose input storage dies at that op writes into it.

Chen et al. 2016, Sec. 3 and Fig. 2: "an inplace operation can happen when there
is no other pending operations that depend on its input". The liveness counter
of Fig. 2 is, per storage, the position of its last reader; an op may overwrite
an input when it is that last reader. Two rewrites do that:

* the in-place variant, which overwrites the first input (`aten.relu` ->
  `aten.relu_`);
* the `out=` variant writing into any input, for ops whose every output element
  depends only on input elements read before it is written: pointwise ops
  (`torch.Tag.pointwise`, e.g. `gelu_backward(grad, x, out=grad)`) and the
  row-wise softmax backward kernels in `ROW_SAFE`, which reduce a row before
  writing it. This is what lets backward reuse the dying incoming gradient,
  as in Chen's Fig. 1.

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
    Step 2: for each node in order, find a variant (in-place for the first
        argument, else `out=` for any tensor argument) and an argument it may
        overwrite: the output has the argument's shape, dtype and strides, the
        argument is a whole, dense storage that is not a graph input or output,
        no other argument aliases it, the op is not random, and this node is the
        storage's last reader; for a softmax's `out=` kernel, a target surely
        contiguous at run time (laid_out_as_traced).
    Step 3: rewrite the target (and add `out=`), record the overwritten argument
        in `memopt.inplace_of`. The output now lives in that storage, so later
        rewrites see the merged lifetime.
"""

from __future__ import annotations

import operator

from dataclasses import dataclass

import torch
from torch import fx

from ._torch_compat import OpOverload, storage_key

from .meta import inplace_source, set_inplace_source, tensor_value


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


_aten = torch.ops.aten

#: Non-pointwise ops whose kernels (CPU and CUDA) reduce each row before writing it,
#: so `out=` may alias an input; bit-exactness is tested in tests/test_passes.py.
ROW_SAFE = frozenset({
    _aten._log_softmax_backward_data.default,
    _aten._softmax_backward_data.default,
})


def _is_functional(op: object) -> bool:
    """A single-result aten op that neither mutates, returns a view, nor draws random numbers."""
    if not isinstance(op, OpOverload) or op.namespace != "aten":
        return False
    schema = op._schema
    return not (
        schema.is_mutable
        or len(schema.returns) != 1
        or any(r.alias_info is not None for r in schema.returns)
        or torch.Tag.nondeterministic_seeded in op.tags
    )


def out_overload(op: object) -> tuple[OpOverload, str] | None:
    """The `out=` overload of a pointwise or ROW_SAFE functional op, and its out name."""
    if not _is_functional(op) or not (torch.Tag.pointwise in op.tags or op in ROW_SAFE):
        return None
    names = [(a.name, str(a.type)) for a in op._schema.arguments]
    packet = getattr(_aten, op._opname)
    for overload_name in packet.overloads():
        candidate = getattr(packet, overload_name)
        args = candidate._schema.arguments
        written = [a for a in args if a.alias_info is not None and a.alias_info.is_write]
        rest = [(a.name, str(a.type)) for a in args if a not in written]
        if len(written) == 1 and written[0].kwarg_only and rest == names:
            return candidate, written[0].name
    return None


def inplace_overload(op: object) -> OpOverload | None:
    """The in-place overload `aten.<name>_.<overload>` of a functional aten op."""
    if not _is_functional(op):
        return None
    schema = op._schema
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


def is_whole_dense(t: torch.Tensor) -> bool:
    return (
        t.storage_offset() == 0
        and t.is_contiguous()
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


#: memopt's own ops whose outputs are always fresh tensors, never kept behind a handle
#: (the language-model head's, memopt.lm_head): they may be written in place.
_FRESH_OUTPUTS = frozenset({"head_fwd", "head_bwd"})


def opaque_output(node: fx.Node) -> bool:
    """An output of one of memopt's own opaque ops (a recurrent chain): it may alias
    state the op keeps for its backward, so it is never written in place."""
    parent = node.args[0] if node.target is operator.getitem and node.args else node
    op = getattr(parent, "target", None)
    return isinstance(op, OpOverload) and op.namespace == "memopt" \
        and op._opname not in _FRESH_OUTPUTS


#: `out=` kernels that write `out` as if it were contiguous (the CPU's softmax family,
#: torch 2.13): handed a non-contiguous `out`, they write wrong values.
_CONTIGUOUS_OUT = frozenset({
    "aten._softmax.default", "aten._log_softmax.default",
    "aten._softmax_backward_data.default", "aten._log_softmax_backward_data.default"})


#: ops that alias their input at run time whose schema does not say so
_ALIASING = frozenset({_aten._unsafe_view.default})


def viewed(node: fx.Node) -> fx.Node | None:
    """The node whose storage `node`'s value is a view of, by the op (a view op's first
    argument; an output of a view op that returns several, such as split), or None."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    target = node.target
    if isinstance(target, OpOverload) and (target.is_view or target in _ALIASING) \
            and node.args and isinstance(node.args[0], fx.Node):
        return node.args[0]
    return None


def laid_out_as_traced(node: fx.Node, memo: dict[fx.Node, bool]) -> bool:
    """Whether `node`'s real output surely has the contiguous strides its FakeTensor
    has. A pointwise op's kernel lays its output out as its inputs are, while some of
    their FakeTensors say contiguous regardless (`native_dropout_backward` of a
    transposed gradient, torch 2.13), so a pointwise op (or one rewritten in place: it
    writes into what it reads) counts only where every tensor it reads does,
    recursively; so does a view, whose strides follow its base's (the FakeTensor of
    `native_batch_norm_backward` keeps its input's strides where the CPU kernel returns
    a contiguous gradient, so the transpose of it said contiguous and was not: a softmax
    gradient written there was wrong at no budget, found from outside); any other op is
    taken at its FakeTensor's word. For the
    `out=` kernels of _CONTIGUOUS_OUT: the gradients of an attention whose softmax's
    gradient came through dropout and a transpose were wrong with no budget (HF
    Longformer, found from outside)."""
    stack = [node]  # depth first without recursion: a residual stream is a chain of adds
    while stack:
        n = stack[-1]
        if n in memo:
            stack.pop()
            continue
        value = tensor_value(n)
        ok = value is not None and value.is_contiguous()
        if not (ok and n.op == "call_function" and isinstance(n.target, OpOverload)
                and (torch.Tag.pointwise in n.target.tags or n.target.is_view
                     or inplace_source(n))):
            memo[n] = ok
            stack.pop()
            continue
        read = [a for a in n.all_input_nodes
                if tensor_value(a) is not None and tensor_value(a).dim() > 0]
        unknown = [a for a in read if a not in memo]
        if unknown:  # a graph has no cycles: each is decided before `n` is seen again
            stack.extend(unknown)
            continue
        memo[n] = all(memo[a] for a in read)
        stack.pop()
    return memo[node]


def merge_storage(old: object, key: object, merged: dict, last_read: dict, pinned: set) -> None:
    """Step 3's bookkeeping: the output's storage `old` now lives in `key`; it is read as
    late as either was, and protected if either was."""
    merged[old] = key
    if old in last_read:
        last_read[key] = max(last_read[key], last_read.pop(old))
    if old in pinned:
        pinned.add(key)


def reinplace(gm: fx.GraphModule, protected: frozenset[str] = frozenset()) -> InplaceResult:
    """Rewrite ops to their in-place variants where the input storage dies there.

    `protected`: node names whose storage must never be written (beyond
    placeholders and returned values, which are always protected).
    """
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}

    # Step 1: storage groups and each storage's last reader. A view is its base's
    # storage by the graph's structure, not by FakeTensor identity: a node recomputed in
    # backward keeps its forward original's FakeTensor, and a dropout's twin (x * mask *
    # scale, passes.twins) gets new ones, so a recomputed transpose of a twin's output
    # looked like another storage, and an add was rewritten in place into that output
    # while a convolution's backward still read it through the transpose (HF Hubert's
    # positional convolution: wrong gradients, found from outside)
    key_of: dict[fx.Node, object] = {}
    for node in nodes:
        val = tensor_value(node)
        if val is not None:
            base = viewed(node)
            key_of[node] = key_of[base] if base in key_of else storage_key(val)
    last_read: dict[object, int] = {}
    pinned: set[object] = set()
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg in key_of:
                last_read[key_of[arg]] = max(last_read.get(key_of[arg], -1), order[node])
        if node.op == "placeholder" or node.name in protected or opaque_output(node):
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

    def may_overwrite(node: fx.Node, src: fx.Node) -> bool:
        if src not in key_of or node not in key_of:
            return False
        key = storage(src)
        out, inp = tensor_value(node), tensor_value(src)
        others = [a for a in node.all_input_nodes if a is not src]
        return not (
            key in pinned
            or last_read.get(key) != order[node]
            or any(storage(a) == key for a in others)
            or sum(a is src for a in node.args) != 1
            or out.shape != inp.shape
            or out.dtype != inp.dtype
            or out.device != inp.device
            or out.stride() != inp.stride()
            or not is_whole_dense(inp)
        )

    rewrites: list[InplaceRewrite] = []
    laid_out: dict[fx.Node, bool] = {}
    for node in nodes:
        if node.op != "call_function":
            continue
        # Step 2: a variant and an argument it may overwrite.
        functional = node.target
        src, kwargs = None, None
        inplace = inplace_overload(functional)
        if inplace is not None and node.args and isinstance(node.args[0], fx.Node) \
                and may_overwrite(node, node.args[0]):
            src, target = node.args[0], inplace
        elif (found := out_overload(functional)) is not None:
            target, out_name = found
            src = next((a for a in node.args if isinstance(a, fx.Node)
                        and may_overwrite(node, a)
                        and (str(functional) not in _CONTIGUOUS_OUT
                             or laid_out_as_traced(a, laid_out))), None)
            kwargs = {**node.kwargs, out_name: src}
        if src is None:
            continue
        # Step 3: rewrite, and merge the output's storage into the overwritten one.
        key = storage(src)
        rewrites.append(InplaceRewrite(
            node=node.name, op=str(functional), inplace_op=str(target),
            writes_into=src.name, nbytes=tensor_value(src).untyped_storage().nbytes(),
        ))
        node.target = target
        if kwargs is not None:
            node.kwargs = kwargs
        set_inplace_source(node, src)
        merge_storage(storage(node), key, merged, last_read, pinned)
    if rewrites:
        gm.recompile()
    return InplaceResult(rewrites=tuple(rewrites))
