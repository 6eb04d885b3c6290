"""Which values a fusing compiler never writes to memory, and which it writes in place.

memopt's liveness counts one buffer per op (Chen et al. 2016, Sec. 3), as the op-by-op
graphs run. Under `kernels="inductor"` TorchInductor computes the same graph with fused
kernels: a pointwise value is computed inside the kernel that reads it, so it never has
a buffer of its own, and a kernel whose input dies there may write its output into that
input's buffer. Counted op by op, the zoo's ViT was predicted 11.5% above its measured
peak (a GELU gradient's three decomposed pointwise temporaries) and ConvNeXt 31%.

`fuse` models inductor's decisions on one graph (forward or backward) as plain data:

    Step 1 (lowering, torch/_inductor/graph.py `run_node`): walk the nodes in order.
        A pointwise value stays unrealized (computed inside each reader's kernel) unless
        the graph returns it, a reader through views is an extern kernel (a matmul, a
        convolution, a fallback: they read buffers), it reads more than
        `acc_reads_threshold` buffers, it is very large (`opcount` > `max_opcount` ops
        inlined), or it has several readers and is expensive to duplicate (more than
        `reads_threshold` buffers read, more than `opcount_threshold` ops, or, on CPU, an
        `exp`/`log`/`sigmoid`/`tanh` inside: `ir.StorageBox.should_realize_on_reuse`). A
        view of an unrealized value is unrealized too. Every other op realizes its output
        and reads its unrealized inputs inside its kernel: a reduction, a scatter, a copy
        (a "kernel") reads them inline; an extern kernel forced them to be realized.
    Step 2: what each realized node reads: the realized values its unrealized inputs are
        computed from, transitively.
    Step 3 (the scheduler's `decide_inplace_update`, wrapper `can_match_buffer_size`):
        a realized pointwise value takes the buffer of a value it reads there for the last
        time, read whole at its own layout (same shape, strides and dtype) and of its size
        (0.95-1x), which the graph does not return and which is not resident (the forward's
        inputs; a backward reuses the saved values donated to it).
    Step 4 (codegen/wrapper.py `memory_plan_reuse`): the wrapper's pool of freed buffers,
        each held until a later allocation of its size takes it, where inductor's own
        estimate of the graph allows (`_pool`).
    Step 5 (a layout constraint, e.g. kernel/conv.py): an extern kernel's argument laid
        out anew is a copy while it runs, unless a kernel of the graph writes it.

The graph's order is the caller's: inductor runs a fused kernel where its first node
would, which memopt.kernels.scheduled_peak gives once inductor has scheduled a plan. Not
modelled: buffers that realized nodes fused into one kernel leave inside it, and
inductor's concatenation into slices of its output (the prediction stays above the step
there). A version of inductor with other heuristics decides otherwise. Plain data in,
plain data out: no torch.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

#: Node kinds (what inductor makes of an fx node; memopt.passes.fusion.kernel_kind).
INPUT = "input"          # a graph placeholder
POINTWISE = "pointwise"  # elementwise: inlined into its readers unless realized
KERNEL = "kernel"        # a generated kernel that realizes its output (a reduction,
#                          a scatter, a copy) and computes its inputs inline
EXTERN = "extern"        # a library or fallback kernel: realized output, realized inputs
VIEW = "view"            # an alias of its input's storage (views, getitems)
KINDS = (INPUT, POINTWISE, KERNEL, EXTERN, VIEW)


@dataclass(frozen=True)
class FusionNode:
    """One node of a graph, in order. `inputs` are positions of earlier nodes it reads;
    `output`: the graph returns it (or what shares its storage); `storage` identifies its
    buffer (a view has its base's; None: no single tensor); `whole`: a read of it reads
    its storage at the layout it was written in (a getitem, not a permute); `layout`
    (shape, strides, dtype, or any hashable) for the in-place match; `heavy`: an op
    inductor will not compute twice on CPU; `donated`: an input whose buffer the graph
    may reuse after its last read (a backward's saved value)."""

    kind: str
    inputs: tuple[int, ...] = ()
    output: bool = False
    storage: Hashable | None = None
    nbytes: int = 0
    whole: bool = True
    layout: Hashable | None = None
    heavy: bool = False
    donated: bool = False
    #: the wrapper allocates its buffer before the kernel runs (a generated kernel's, an
    #: `out=` extern's such as mm), so that it may take a freed buffer of the same `key`
    #: (dtype and bytes); a fallback op allocates its own outputs
    pooled: bool = False
    key: Hashable | None = None
    #: an input inductor's own estimate of the graph counts until its last read (a
    #: backward's saved values and tangents; not the resident primals)
    freeable: bool = False
    #: positions of the nodes an extern kernel is handed laid out anew (inductor's
    #: layout constraint): a copy while it runs, unless that node's buffer is one a
    #: kernel of this graph writes, which inductor lays out as asked
    relaid: tuple[int, ...] = ()
    #: the generated kernel that computes it where known (inductor's schedule, replayed:
    #: memopt.kernels.scheduled_peak): the wrapper allocates every buffer a kernel writes
    #: before the kernel runs, so no node takes a buffer freed by a node of its own kernel
    group: int | None = None
    #: a view that reads its input's elements in their order (a reshape of a contiguous
    #: value), so that a kernel reading through it reads at the positions it writes;
    #: False for a permute, a slice, an expand
    keeps_order: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")


@dataclass(frozen=True)
class Thresholds:
    """inductor's realization thresholds (torch/_inductor/config.py, torch 2.11-2.13)."""

    reads_threshold: int = 4         # realize_reads_threshold
    acc_reads_threshold: int = 8     # realize_acc_reads_threshold
    opcount_threshold: int = 30      # realize_opcount_threshold
    max_opcount: int = 100           # graph.py: a Pointwise too large to inline
    heavy_on_reuse: bool = True      # the CPU heuristic (should_realize_on_reuse)


@dataclass(frozen=True)
class Fusion:
    """`fuse`'s answer: the nodes with no buffer of their own (`virtual`), what each
    realized node reads once its unrealized inputs are computed inside it (`reads`,
    positions of realized nodes; only where that differs from its inputs), and the
    in-place writes (`inplace`: node -> the read node whose buffer it takes)."""

    virtual: frozenset[int] = frozenset()
    reads: dict[int, tuple[int, ...]] = field(default_factory=dict)
    inplace: dict[int, int] = field(default_factory=dict)
    #: node -> the earlier node whose freed buffer it takes from the wrapper's pool
    #: (held from that node's last read until this one writes it)
    reuse: dict[int, int] = field(default_factory=dict)
    #: inductor's own estimate of the graph's peak (memory.py `estimate_peak_memory`:
    #: its buffers and freeable inputs, no in-place writes, no pool) on this order;
    #: compared with the estimate of the order inductor chose, it tells what inductor's
    #: reordering of the kernels costs (memopt.kernels.schedule_peak)
    estimate: int = 0
    #: node -> bytes of the copies of its arguments inductor lays out anew, held while
    #: it runs (Step 5)
    copies: dict[int, int] = field(default_factory=dict)


def fuse(nodes: Sequence[FusionNode], thresholds: Thresholds = Thresholds()) -> Fusion:
    """inductor's fusion of one graph, `nodes` in execution order (the module docstring)."""
    t = thresholds
    readers: list[list[int]] = [[] for _ in nodes]  # non-view readers, through views
    returned = [n.output for n in nodes]
    for i in range(len(nodes) - 1, -1, -1):  # a view's readers and outputs are its base's
        n = nodes[i]
        for a in dict.fromkeys(n.inputs):
            if n.kind == VIEW:
                readers[a].extend(readers[i])
                returned[a] = returned[a] or returned[i]
            else:
                readers[a].append(i)

    # Steps 1 and 2: realized or not, and what computing each node reads
    virtual: set[int] = set()
    src: list[tuple[int, ...]] = []     # realized nodes a node's value is computed from
    ops = [0] * len(nodes)              # pointwise ops inlined in it
    heavy = [False] * len(nodes)
    reads: dict[int, tuple[int, ...]] = {}
    for i, n in enumerate(nodes):
        if n.kind == INPUT:
            src.append((i,))
            continue
        computed = tuple(dict.fromkeys(s for a in n.inputs for s in src[a]))
        inlined = [a for a in n.inputs if a in virtual]
        if n.kind == VIEW:
            if n.inputs and all(a in virtual for a in n.inputs):
                virtual.add(i)
                src.append(computed)
                ops[i] = sum(ops[a] for a in inlined)
                heavy[i] = any(heavy[a] for a in inlined)
            else:
                src.append((i,))
            continue
        if n.kind == POINTWISE:
            ops[i] = 1 + sum(ops[a] for a in inlined)
            heavy[i] = n.heavy or any(heavy[a] for a in inlined)
            distinct = len({nodes[s].storage if nodes[s].storage is not None else ("n", s)
                            for s in computed})
            users = len(set(readers[i]))
            realize = (returned[i] or not readers[i]
                       or any(nodes[r].kind == EXTERN for r in readers[i])
                       or distinct > t.acc_reads_threshold or ops[i] > t.max_opcount
                       or (users > 1 and (distinct > t.reads_threshold
                                          or ops[i] > t.opcount_threshold
                                          or (t.heavy_on_reuse and heavy[i]))))
            if not realize:
                virtual.add(i)
                src.append(computed)
                continue
        src.append((i,))
        if inlined:
            reads[i] = computed

    # Step 3: in-place writes into buffers read for the last time
    def read_by(i: int) -> tuple[int, ...]:
        return reads.get(i, nodes[i].inputs)

    parent: dict[Hashable, Hashable] = {}

    def find(key: Hashable) -> Hashable:
        while key in parent:
            key = parent[key]
        return key

    end = len(nodes)
    last: dict[Hashable, int] = {}
    for i, n in enumerate(nodes):
        if i in virtual:
            continue
        for a in read_by(i):
            if nodes[a].storage is not None:
                last[nodes[a].storage] = i
        if n.storage is not None:
            last.setdefault(n.storage, i)
    pinned = {n.storage for n in nodes if n.output} | \
        {n.storage for n in nodes if n.kind == INPUT and not n.donated}
    last.update({key: end for key in pinned})
    inplace: dict[int, int] = {}
    for i, n in enumerate(nodes):
        if n.kind != POINTWISE or i in virtual or n.storage is None:
            continue
        mine = find(n.storage)
        if any(find(nodes[a].storage) == mine for a in read_by(i)
               if nodes[a].storage is not None):
            continue  # writes an input's storage already
        for a in read_by(i):
            src_node = nodes[a]
            if src_node.storage is None or not src_node.whole:
                continue
            theirs = find(src_node.storage)
            if theirs in pinned or last.get(theirs) != i \
                    or not 0.95 * src_node.nbytes <= n.nbytes <= src_node.nbytes \
                    or (src_node.layout != n.layout
                        and not _same_positions(nodes, virtual, i, a)):
                continue
            inplace[i] = a
            parent[mine] = theirs
            last[theirs] = last.get(mine, i)
            if mine in pinned:
                pinned.add(theirs)
            break
    reuse, estimate = _pool(nodes, virtual, read_by, inplace)
    # Step 5: the arguments an extern kernel needs laid out anew
    copies: dict[int, int] = {}
    for i, n in enumerate(nodes):
        for a in n.relaid:
            base = a
            while nodes[base].kind == VIEW and nodes[base].inputs:
                base = nodes[base].inputs[0]
            made_here = nodes[base].kind in (POINTWISE, KERNEL) and not returned[base]
            if not made_here:
                copies[i] = copies.get(i, 0) + nodes[a].nbytes
    return Fusion(virtual=frozenset(virtual), reads=reads, inplace=inplace, reuse=reuse,
                  estimate=estimate, copies=copies)


def _same_positions(nodes: Sequence[FusionNode], virtual: set[int], i: int, a: int) -> bool:
    """Whether node `i` reads node `a`, of another shape, at the positions it writes
    (inductor's `can_inplace`: the read's index is the write's once its loops are merged):
    both contiguous, of one dtype and size, and every unrealized node between them keeps
    the elements' order (a reshape, not a permute). A backward's fused kernel writes the
    logits' gradient, (batch, tokens, V), over the saved (batch x tokens, V)
    log-probabilities it reads."""
    n, src = nodes[i], nodes[a]
    if not (n.whole and src.whole and n.key is not None and n.key == src.key):
        return False
    memo: dict[int, bool | None] = {}

    def in_order(k: int) -> bool | None:  # None: no path to `a`; False: one reorders
        if k == a:
            return True
        if k not in virtual:
            return None
        if k not in memo:
            found = [in_order(x) for x in nodes[k].inputs]
            memo[k] = None if all(f is None for f in found) \
                else nodes[k].keeps_order and False not in found
        return memo[k]

    found = [in_order(x) for x in n.inputs]
    return True in found and False not in found


def _pool(nodes: Sequence[FusionNode], virtual: set[int], read_by, inplace: dict[int, int]
          ) -> tuple[dict[int, int], int]:
    """Step 4 (codegen/wrapper.py `memory_plan_reuse`): the wrapper's buffer pool. A
    buffer freed after its last read (not a graph input's: those are freed outright) goes
    to a pool; a later allocation of the same key takes the most recently freed one, and
    the buffer stays allocated in between. The wrapper allows it where the buffer's
    bytes, held over that gap, keep inductor's own estimate of the graph
    (memory.py `estimate_peak_memory`: no in-place writes, inputs from the start) at or
    below its overall peak, or where the gap is empty; each reuse raises the estimate
    over its gap. Also the estimate's peak without the graph's non-freeable inputs
    (`Fusion.estimate`)."""
    kernels = [i for i, n in enumerate(nodes)
               if i not in virtual and n.kind in (POINTWISE, KERNEL, EXTERN)]
    step = {i: k for k, i in enumerate(kernels)}
    if not kernels:
        return {}, 0
    # each storage's first and last step in the estimate, and the node that makes it
    born: dict[Hashable, int] = {}
    maker: dict[Hashable, int] = {}
    dies: dict[Hashable, int] = {}
    size: dict[Hashable, int] = {}
    end = len(kernels) - 1
    for i, n in enumerate(nodes):
        if i in virtual or n.storage is None:
            continue
        if n.storage not in born:
            at = 0 if n.kind == INPUT else step.get(i, step.get(n.inputs[0], 0)
                                                    if n.inputs else 0)
            born[n.storage], maker[n.storage], size[n.storage] = at, i, n.nbytes
        if i in step:
            for a in read_by(i):
                s = nodes[a].storage
                if s is not None and s in born:
                    dies[s] = max(dies.get(s, 0), step[i])
        if n.output:
            dies[n.storage] = end + 1
    estimate = [0] * (len(kernels) + 1)
    counted = [0] * (len(kernels) + 1)  # less the inputs it does not count
    for s, b in born.items():
        first = nodes[maker[s]]
        for curve in (estimate, counted) if first.kind != INPUT or first.freeable \
                else (estimate,):
            curve[b] += size[s]
            e = dies.get(s, b)
            if e <= end:
                curve[e + 1] -= size[s]
    for k in range(1, len(estimate)):
        estimate[k] += estimate[k - 1]
        counted[k] += counted[k - 1]
    overall = max(estimate[:-1])
    # the walk: buffers (by the node that first allocated one) and what occupies them
    buffer_of: dict[Hashable, int] = {}
    freed_at: dict[int, list[Hashable]] = {}
    for s, e in dies.items():
        if e <= end and nodes[maker[s]].kind != INPUT:
            freed_at.setdefault(e, []).append(s)
    pool: dict[Hashable, list[tuple[int, int]]] = {}
    reuse: dict[int, int] = {}
    for k, i in enumerate(kernels):
        n = nodes[i]
        mine = n.storage
        if mine is not None and maker.get(mine) == i:
            if i in inplace:
                buffer_of[mine] = buffer_of.get(nodes[inplace[i]].storage, inplace[i])
            elif n.pooled and pool.get(n.key):
                buffer, f = pool[n.key].pop()
                gap = estimate[f + 1:k]
                if n.group is not None and nodes[kernels[f]].group == n.group:
                    pool[n.key].append((buffer, f))  # freed inside this node's own kernel
                elif f + 1 == k or n.nbytes + max(gap, default=0) <= overall:
                    reuse[i] = buffer
                    buffer_of[mine] = buffer
                    for j in range(f + 1, k):
                        estimate[j] += n.nbytes
                else:
                    pool[n.key].append((buffer, f))
            buffer_of.setdefault(mine, i)
        taken = nodes[inplace[i]].storage if i in inplace else None
        for s in freed_at.get(k, ()):
            key = nodes[maker[s]].key
            if s != taken and key is not None:  # (taken: it goes on as this node's output)
                pool.setdefault(key, []).append((buffer_of.get(s, maker[s]), k))
    return reuse, max(counted[:-1])
