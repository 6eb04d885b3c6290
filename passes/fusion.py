"""What TorchInductor's fused kernels do to a planned graph's buffers (`kernels="inductor"`).

The torch side of memopt.allocator.fusion: each node of a forward or backward graph as
the plain data that solver reads (what inductor makes of its op, its storage, its
layout), and the solver's answer for one graph. Both of memopt's liveness analyses read
it when the step's kernels fuse (passes.liveness for the exact build, passes.simulate_steps
for the budget search's candidates), so the search, the plan and its prediction count
the buffers inductor allocates rather than one per op.

Requires: FakeTensors in `node.meta["val"]`, a graph's nodes in the order they run.
Ensures: nothing is changed; `graph_fusion` returns which nodes have no buffer of their
own, what the realized nodes read once the unrealized ones are computed inside them,
and which write in place (memopt.allocator.fusion.Fusion, keyed by the caller's ids).
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import fx

from memopt.allocator.fusion import (EXTERN, INPUT, KERNEL, POINTWISE, VIEW, Fusion,
                                     FusionNode, Thresholds, fuse)

from ._torch_compat import OpOverload
from .meta import EXTERN_STRIDES, fake_value

aten = torch.ops.aten
prims = torch.ops.prims

#: Ops inductor lowers to a kernel of its own that realizes the output and computes its
#: inputs inline: reductions, scans, scatters, pooling, concatenation, copies into a
#: buffer (torch/_inductor/lowering.py).
_KERNELS = frozenset({
    aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default,
    aten.amax.default, aten.amin.default, aten.var_mean.correction, aten.var.correction,
    aten.prod.default, aten.prod.dim_int, aten.any.dim, aten.any.default, aten.all.dim,
    aten.argmax.default, aten.argmin.default, aten.max.dim, aten.min.dim,
    aten.cumsum.default, aten.cumprod.default, aten.logsumexp.default,
    aten.copy_.default, aten.scatter_add.default, aten.scatter.src, aten.scatter.value,
    aten.index_put.default, aten._unsafe_masked_index_put_accumulate.default,
    aten.index_put_.default, aten.cat.default, aten.avg_pool2d.default,
    aten.avg_pool2d_backward.default, prims._low_memory_max_pool_with_offsets.default,
    prims._low_memory_max_pool_offsets_to_indices.default,
    aten.max_pool2d_with_indices_backward.default})
#: Ops inductor lowers as pointwise (inlinable) beyond those tagged pointwise: constants,
#: indexing by index tensors, padding and slice writes (torch/_inductor/lowering.py).
_POINTWISE = frozenset({
    aten.full.default, aten.scalar_tensor.default, aten.zeros.default, aten.ones.default,
    aten.arange.start, aten.arange.default, aten.arange.start_step, prims.iota.default,
    aten.copy.default, aten.constant_pad_nd.default, aten.slice_scatter.default,
    aten.select_scatter.default, aten.index.Tensor, aten.embedding.default,
    aten.gather.default, aten.clone.default, aten._to_copy.default})
#: Ops tagged pointwise that inductor runs as eager's kernel (random draws with
#: `fallback_random`, memopt.kernels).
_FALLBACK = frozenset({aten.native_dropout.default, aten.bernoulli.p,
                       aten.bernoulli.default, aten.rand_like.default,
                       aten.randn_like.default})
#: Extern kernels inductor calls with an `out=` buffer its wrapper allocates
#: (ir.ExternKernelOut), which may be a freed buffer of its pool
_OUT_EXTERN = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default,
                         aten.baddbmm.default})
#: Pointwise ops inductor will not compute twice on CPU (ir.StorageBox
#: .should_realize_on_reuse's heavy ops)
_HEAVY = frozenset({"exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh"})


def kernel_kind(node: fx.Node) -> str:
    """What inductor makes of `node`'s op (memopt.allocator.fusion's kinds), before
    aliasing: a node whose value shares an input's storage is a view wherever its op is
    not a kernel that writes into it (`copy_`)."""
    if node.op == "placeholder":
        return INPUT
    target = node.target
    if node.op != "call_function":
        return EXTERN
    if target is operator.getitem:
        return VIEW
    if not isinstance(target, OpOverload) or target.namespace == "memopt" \
            or target in _FALLBACK:
        return EXTERN
    if target in _KERNELS:
        return KERNEL
    if target in _POINTWISE or torch.Tag.pointwise in target.tags:
        return POINTWISE
    return EXTERN


#: Extern kernels whose arguments inductor lays out anew (`relaid_args`)
RELAID_OPS = frozenset({aten.convolution_backward.default})


def relaid_args(node: fx.Node) -> tuple[int, ...]:
    """Positions of `node`'s tensor arguments that inductor passes its extern kernel in
    another layout than the graph's. Its convolution backward, with the weight's gradient
    asked for and channels-last layouts off (memopt.kernels), lays the gradient and the
    input out in the weight gradient's stride order (torch/_inductor/kernel/conv.py): a
    ConvNeXt's channels-last depthwise gradients measured a 12.3 MiB CPU workspace as
    the graph lays them out and 0.45 MiB as inductor does. Before inductor has chosen,
    the arguments that are not contiguous; after (`EXTERN_STRIDES`, memopt.kernels
    .scheduled_peak), those whose strides it changed."""
    chosen = node.meta.get(EXTERN_STRIDES)
    if chosen is not None:
        return tuple(k for k, stride in sorted(chosen.items())
                     if stride != tuple(fake_value(node.args[k]).stride()))
    if node.target not in RELAID_OPS or not node.args[10][1]:
        return ()
    return tuple(k for k in (0, 1) if isinstance(node.args[k], fx.Node)
                 and not fake_value(node.args[k]).is_contiguous())


def is_heavy(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, OpOverload) and target.__name__.split(".")[0] in _HEAVY


@dataclass(frozen=True)
class Traits:
    """What fusion reads of one node, the same for every candidate of a search: its
    kind, whether its value is one tensor, that tensor's bytes, layout (shape, strides,
    dtype) and wholeness (contiguous over its whole storage: read at the layout it was
    written in)."""

    kind: str
    single: bool = False
    nbytes: int = 0
    layout: Hashable | None = None
    whole: bool = False
    heavy: bool = False
    out: bool = False  # an extern kernel called with a buffer the wrapper allocates
    relaid: tuple[int, ...] = ()  # its arguments inductor lays out anew (relaid_args)
    keeps_order: bool = True  # as a view, its input's elements in their order (_keeps_order)


def traits(node: fx.Node) -> Traits:
    """`node`'s Traits."""
    value = fake_value(node)
    kind = kernel_kind(node)
    if not isinstance(value, torch.Tensor):
        return Traits(kind, heavy=is_heavy(node), relaid=relaid_args(node))
    whole = value.storage_offset() == 0 and value.is_contiguous() \
        and value.untyped_storage().nbytes() == value.numel() * value.element_size()
    return Traits(kind, True, nbytes=value.untyped_storage().nbytes(),
                  layout=(tuple(value.shape), tuple(value.stride()), value.dtype),
                  whole=whole, heavy=is_heavy(node), out=node.target in _OUT_EXTERN,
                  relaid=relaid_args(node), keeps_order=_keeps_order(node, value))


def _keeps_order(node: fx.Node, value: torch.Tensor) -> bool:
    """Whether `value`, read as a view of `node`'s first argument, has that tensor's
    elements in their order: both contiguous, of one size, at one offset (a reshape)."""
    first = node.args[0] if node.args else None
    base = fake_value(first) if isinstance(first, fx.Node) else None
    return not isinstance(base, torch.Tensor) or (
        value.is_contiguous() and base.is_contiguous() and value.numel() == base.numel()
        and value.storage_offset() == base.storage_offset())


T = TypeVar("T", bound=Hashable)


def graph_fusion(inputs: Sequence[T], body: Sequence[T], outputs: Iterable[T | None], *,
                 read: Callable[[T], Sequence[T]], traits_of: Callable[[T], Traits],
                 raw: Callable[[T], tuple[Hashable, ...]], donated: Callable[[T], bool],
                 freeable: Callable[[T], bool], arg: Callable[[T, int], T | None],
                 cpu: bool, group: Callable[[T], int | None] = lambda n: None) -> Fusion:
    """inductor's fusion (memopt.allocator.fusion.fuse) of one graph whose placeholders
    are `inputs` and whose other nodes, in order, are `body`; `outputs` are what it
    returns, `read(n)` the nodes `n` reads, `raw(n)` the storage identities of its
    tensors (passes.liveness's keys), `donated(n)` whether an input's buffer may be
    reused after its last read (a backward's saved value, not resident), `freeable(n)`
    whether inductor's own estimate counts an input (not a resident primal's), `arg(n, k)`
    the node at `n`'s k-th positional argument, `group(n)` the generated kernel that
    computes it where inductor's schedule is known (else None). Storages as
    passes.liveness keys a backward's: an input keeps its own, a node whose tensor is
    one of its inputs' storages aliases it, any other allocates a new one. The answer
    is keyed by the caller's ids."""
    order = list(inputs) + list(body)
    position = {n: k for k, n in enumerate(order)}
    returned = {n for n in outputs if n is not None}
    ids: dict[T, tuple[int, ...]] = {}
    fresh = iter(range(1 << 62))
    of_input: dict[Hashable, int] = {}
    nodes: list[FusionNode] = []
    for k, n in enumerate(order):
        t = traits_of(n)
        reads = tuple(position[a] for a in read(n) if a in position)
        relaid = tuple(position[a] for k in t.relaid if (a := arg(n, k)) in position)
        if k < len(inputs):  # inputs that share a storage (a saved value and its view) share it
            ids[n] = tuple(of_input.setdefault(r, next(fresh)) for r in raw(n))
            kind = INPUT
        else:
            alias = {r: key for a in read(n) if a in ids for r, key in zip(raw(a), ids[a])}
            own = raw(n)
            ids[n] = tuple(alias[r] if r in alias else next(fresh) for r in own)
            kind = t.kind
            if kind not in (KERNEL, VIEW) and any(r in alias for r in own):
                kind = VIEW
        nodes.append(FusionNode(
            kind=kind, inputs=reads, output=n in returned,
            storage=ids[n][0] if t.single and ids[n] else None, nbytes=t.nbytes,
            whole=t.whole, layout=t.layout, heavy=t.heavy,
            donated=kind == INPUT and donated(n), freeable=kind == INPUT and freeable(n),
            relaid=relaid, group=group(n), keeps_order=t.keeps_order,
            pooled=kind in (POINTWISE, KERNEL) or (kind == EXTERN and t.out),
            key=(t.layout[2], t.nbytes) if t.single else None))
    fused = fuse(nodes, Thresholds(heavy_on_reuse=cpu))
    return Fusion(virtual=frozenset(order[k] for k in fused.virtual),
                  reads={order[k]: tuple(order[a] for a in v) for k, v in fused.reads.items()},
                  inplace={order[k]: order[a] for k, a in fused.inplace.items()},
                  reuse={order[k]: order[a] for k, a in fused.reuse.items()},
                  estimate=fused.estimate,
                  copies={order[k]: v for k, v in fused.copies.items()})



def in_schedule_order(gm: fx.GraphModule, kernels: Sequence[Iterable[str]]) -> fx.GraphModule:
    """A copy of `gm` with its nodes in the order inductor's kernels run them (`kernels`:
    per kernel, in order, the names of the nodes it computes: passes._inductor_compat
    ._schedule_order). A view or a getitem no kernel names runs right after what it
    aliases (a late getitem of an extern kernel's tuple would hold all its outputs), any
    other node no kernel names just before its first reader; placeholders stay first,
    the output last, and every node still follows its inputs."""
    nodes = list(gm.graph.nodes)
    position = {n.name: k for k, n in enumerate(nodes)}
    key: dict[fx.Node, float] = {}
    by_name = {n.name: n for n in nodes}
    for group in kernels:
        for name in sorted((n for n in group if n in position), key=position.__getitem__):
            key.setdefault(by_name[name], len(key))
    last = float(len(key))

    def aliases(n: fx.Node) -> bool:  # a view or a getitem: reads nothing, allocates nothing
        return n.target is operator.getitem or (isinstance(n.target, OpOverload)
                                                and n.target.is_view)

    for n in reversed(nodes):  # unnamed: where its first reader runs
        if n.op == "placeholder":
            key[n] = -1.0
        elif n.op == "output":
            key[n] = last + 1
        elif n not in key and not aliases(n):
            key[n] = min((key[u] for u in n.users if u in key), default=last) - 0.5
    for n in nodes:  # an unnamed view or getitem: right after what it aliases
        if n not in key:
            key[n] = max((key[a] for a in n.all_input_nodes), default=-1.0) + 0.25
    indegree = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [(key[n], position[n.name], n.name) for n in nodes if indegree[n] == 0]
    heapq.heapify(ready)
    order: list[fx.Node] = []
    while ready:
        node = by_name[heapq.heappop(ready)[2]]
        order.append(node)
        for user in node.users:
            indegree[user] -= 1
            if indegree[user] == 0:
                heapq.heappush(ready, (key[user], position[user.name], user.name))
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in order:
        env[node] = graph.node_copy(node, env.__getitem__)
    return fx.GraphModule(gm, graph)
