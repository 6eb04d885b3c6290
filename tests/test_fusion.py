"""Inductor's fused kernels as memopt's liveness counts them (kernels="inductor").

Tier 1: memopt.allocator.fusion.fuse on plain graphs, one rule of inductor's a case
(values computed inside their readers, realization, in-place writes, the wrapper's
pool, layout copies), and invariants on random graphs that any answer must keep.
Tier 3: passes.fusion on fx graphs (the order inductor's kernels run), and the planner's
prediction against the allocated peak inductor's step measures, on models whose peak
op-by-op counting got wrong (a GELU's decomposed gradient; a reordered backward).
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kernels import GeluStack, SquareMean
from torch import fx, nn

import memopt
from memopt.allocator.fusion import (EXTERN, INPUT, KERNEL, POINTWISE, VIEW, FusionNode,
                                     Thresholds, fuse)
from memopt.passes.allocated import allocation_peak
from memopt.passes.fusion import in_schedule_order, kernel_kind
from support import default_loss


def node(kind: str, *inputs: int, storage: int | None = None, nbytes: int = 100,
         **fields: object) -> FusionNode:
    """A node whose storage defaults to its own position (set by `graph`)."""
    return FusionNode(kind=kind, inputs=inputs, storage=storage, nbytes=nbytes,
                      layout=fields.pop("layout", "L"), key=fields.pop("key", ("f32", nbytes)),
                      **fields)


def graph(*nodes: FusionNode) -> list[FusionNode]:
    """`nodes` with each storage-less non-view node given a storage of its own."""
    out = []
    for k, n in enumerate(nodes):
        if n.storage is None and n.kind != VIEW:
            n = FusionNode(**{**n.__dict__, "storage": k})
        elif n.kind == VIEW and n.storage is None:
            n = FusionNode(**{**n.__dict__, "storage": out[n.inputs[0]].storage,
                              "whole": False})
        out.append(n)
    return out


# Tier 1: one rule a case ----------------------------------------------------------------

def test_a_pointwise_chain_between_two_matmuls_has_no_buffers() -> None:
    """x -> mm -> mul -> erf -> add -> mm: the pointwise values are computed inside the
    kernel... and the second matmul needs its input realized: only `add` is."""
    g = graph(node(INPUT), node(EXTERN, 0, pooled=True), node(POINTWISE, 1),
              node(POINTWISE, 2), node(POINTWISE, 3, 1), node(EXTERN, 4, output=True))
    fused = fuse(g)
    assert fused.virtual == {2, 3}
    assert fused.reads[4] == (1,)  # add reads the first matmul's buffer only


def test_what_the_graph_returns_is_realized() -> None:
    g = graph(node(INPUT), node(POINTWISE, 0), node(POINTWISE, 1, output=True))
    fused = fuse(g)
    assert fused.virtual == {1} and fused.reads[2] == (0,)


def test_a_reduction_reads_its_pointwise_inputs_inline() -> None:
    g = graph(node(INPUT), node(POINTWISE, 0), node(KERNEL, 1, nbytes=4, output=True))
    assert fuse(g).virtual == {1}


def test_a_view_of_an_unrealized_value_is_unrealized_and_an_extern_reader_realizes_it() -> None:
    g = graph(node(INPUT), node(POINTWISE, 0), node(VIEW, 1), node(POINTWISE, 2, output=True))
    assert fuse(g).virtual == {1, 2}
    g = graph(node(INPUT), node(POINTWISE, 0), node(VIEW, 1), node(EXTERN, 2, output=True))
    assert fuse(g).virtual == frozenset()


def test_a_value_read_twice_is_realized_when_recomputing_it_is_costly() -> None:
    """Two readers: inlined while it reads few buffers and is cheap; realized past
    `reads_threshold` buffers, and on CPU when it computes an exp (inductor's
    should_realize_on_reuse)."""
    inputs = [node(INPUT) for _ in range(6)]

    def twice(n_reads: int, heavy: bool) -> list[FusionNode]:
        return graph(*inputs, node(POINTWISE, *range(n_reads), heavy=heavy),
                     node(POINTWISE, 6, output=True), node(POINTWISE, 6, output=True))

    assert 6 in fuse(twice(2, False)).virtual
    assert 6 not in fuse(twice(5, False)).virtual
    assert 6 not in fuse(twice(2, True)).virtual
    assert 6 in fuse(twice(2, True), Thresholds(heavy_on_reuse=False)).virtual


def test_a_kernel_writes_into_a_buffer_read_for_the_last_time() -> None:
    """The GELU gradient takes the matmul's buffer (same layout and bytes, read there for
    the last time); not a resident input's, not one read later, not another layout's."""
    g = graph(node(INPUT), node(EXTERN, 0, pooled=True), node(POINTWISE, 1, 0, output=True))
    assert fuse(g).inplace == {2: 1}
    g = graph(node(INPUT), node(POINTWISE, 0, output=True))
    assert fuse(g).inplace == {}  # a resident input
    g = graph(node(INPUT, donated=True), node(POINTWISE, 0, output=True))
    assert fuse(g).inplace == {1: 0}  # a saved value donated to the backward
    g = graph(node(INPUT), node(EXTERN, 0), node(POINTWISE, 1), node(EXTERN, 1, 2,
                                                                     output=True))
    assert fuse(g).inplace == {}  # the extern reads it after
    g = graph(node(INPUT), node(EXTERN, 0), node(POINTWISE, 1, nbytes=200, output=True))
    assert fuse(g).inplace == {}  # a larger buffer


def test_a_kernel_writes_in_place_through_a_reshape_not_a_permute() -> None:
    """A saved value read through an unrealized reshape is read at the positions the
    kernel writes (the logits' gradient over the saved log-probabilities, another shape):
    its buffer is taken; through a permute, or where the kernel's output is not
    contiguous, it is not."""
    def through(keeps_order: bool, whole: bool = True) -> dict[int, int]:
        return fuse(graph(node(INPUT, donated=True, layout="(256, V)"),
                          node(POINTWISE, 0, layout="(256, V)"),
                          node(VIEW, 1, storage=1, layout="(4, 64, V)",
                               keeps_order=keeps_order),
                          node(POINTWISE, 2, layout="(4, 64, V)", whole=whole,
                               output=True))).inplace

    assert through(keeps_order=True) == {3: 0}
    assert through(keeps_order=False) == {}
    assert through(keeps_order=True, whole=False) == {}


def test_the_pool_holds_a_freed_buffer_until_a_later_allocation_takes_it() -> None:
    """A buffer freed after step 1 is taken by a same-key allocation at step 3 where the
    estimate allows it (it stays at or below its peak over the gap), not where holding
    it would raise the estimate's peak."""
    small = {"nbytes": 10, "key": ("f32", 10)}
    g = graph(node(INPUT), node(EXTERN, 0, pooled=True), node(EXTERN, 1, pooled=True, **small),
              node(EXTERN, 2, pooled=True, **small), node(EXTERN, 3, pooled=True),
              node(EXTERN, 4, output=True, pooled=True, **small))
    fused = fuse(g)
    assert fused.reuse.get(4) == 1  # mm 4 takes mm 1's buffer, freed after step 2
    big = {"nbytes": 1000, "key": ("f32", 1000)}
    g = graph(node(INPUT), node(EXTERN, 0, pooled=True), node(EXTERN, 1, pooled=True, **small),
              node(EXTERN, 2, pooled=True, **big), node(EXTERN, 3, pooled=True),
              node(EXTERN, 4, output=True, pooled=True, **small))
    assert 4 not in fuse(g).reuse  # held over the 1000-byte step it would raise the peak


def test_no_node_takes_a_buffer_freed_inside_its_own_kernel() -> None:
    """The same graph as above with mm 1 to mm 4 in one generated kernel (`group`, as on
    CPU one C++ kernel runs them all): the wrapper allocates all its buffers before the
    kernel runs, so mm 4 cannot take mm 1's buffer, freed inside it."""
    small = {"nbytes": 10, "key": ("f32", 10)}

    def nodes(group: int | None) -> list[FusionNode]:
        return graph(node(INPUT), node(EXTERN, 0, pooled=True, group=group),
                     node(EXTERN, 1, pooled=True, group=group, **small),
                     node(EXTERN, 2, pooled=True, group=group, **small),
                     node(EXTERN, 3, pooled=True, group=group),
                     node(EXTERN, 4, output=True, pooled=True, group=group, **small))

    assert fuse(nodes(None)).reuse.get(4) == 1
    assert 4 not in fuse(nodes(0)).reuse


def test_an_argument_laid_out_anew_is_a_copy_unless_a_kernel_writes_it() -> None:
    g = graph(node(INPUT), node(POINTWISE, 0), node(VIEW, 1),
              node(EXTERN, 2, 0, relaid=(2, 0), output=True))
    assert fuse(g).copies == {3: 100}  # the input is copied; the pointwise is laid out anew


# Tier 2: invariants on random graphs ----------------------------------------------------

@st.composite
def graphs(draw: st.DrawFn) -> list[FusionNode]:
    n_inputs = draw(st.integers(1, 3))
    nodes = [node(INPUT, donated=draw(st.booleans())) for _ in range(n_inputs)]
    for k in range(n_inputs, n_inputs + draw(st.integers(1, 14))):
        kind = draw(st.sampled_from([POINTWISE, POINTWISE, KERNEL, EXTERN, VIEW]))
        inputs = tuple(sorted(set(draw(st.lists(st.integers(0, k - 1), min_size=1,
                                                max_size=1 if kind == VIEW else 3)))))
        nodes.append(node(kind, *inputs, output=draw(st.booleans()) and kind != VIEW,
                          heavy=draw(st.booleans()), pooled=kind != VIEW,
                          layout=draw(st.sampled_from("LT"))))
    return graph(*nodes)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(g=graphs())
def test_any_graph_gets_an_answer_inductor_could_give(g: list[FusionNode]) -> None:
    fused = fuse(g)
    returned = {i for i, n in enumerate(g) if n.output}
    for i in fused.virtual:  # only pointwise values and their views, never returned
        assert g[i].kind in (POINTWISE, VIEW) and i not in returned
    for i, n in enumerate(g):
        if i in fused.virtual:
            continue
        reads = fused.reads.get(i, n.inputs)
        assert not set(reads) & fused.virtual  # a realized node reads realized buffers
        if n.kind == EXTERN:
            assert not set(n.inputs) & fused.virtual
    for i, a in fused.inplace.items():  # into a buffer nobody reads after
        later = [j for j in range(i + 1, len(g)) if j not in fused.virtual
                 and g[a].storage in {g[r].storage for r in fused.reads.get(j, g[j].inputs)}]
        assert not later and a not in returned and g[i].kind == POINTWISE
        assert g[a].kind != INPUT or g[a].donated


# Tier 3: fx graphs and measured steps ---------------------------------------------------

def test_a_graphs_nodes_follow_the_order_inductors_kernels_ran_them() -> None:
    def f(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.mm(x, w)
        b = torch.relu(x)
        return a.t(), b

    gm = fx.symbolic_trace(f)
    names = [n.name for n in gm.graph.nodes]
    reordered = in_schedule_order(gm, [("relu",), ("mm",)])
    order = [n.name for n in reordered.graph.nodes]
    assert order.index("relu") < order.index("mm") < order.index("t")  # t: before its reader
    assert order[:2] == names[:2] and order[-1] == "output"
    x, w = torch.randn(3, 3), torch.randn(3, 3)
    for got, want in zip(reordered(x, w), gm(x, w)):
        assert torch.equal(got, want)


def test_kernel_kinds_of_aten_ops() -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    nodes = {op: g.call_function(op, (x,)) for op in (
        torch.ops.aten.relu.default, torch.ops.aten.t.default,
        torch.ops.aten.native_dropout.default)}
    s = g.call_function(torch.ops.aten.sum.dim_IntList, (x, [0]))
    assert kernel_kind(x.node if hasattr(x, "node") else x) == INPUT
    assert kernel_kind(nodes[torch.ops.aten.relu.default]) == POINTWISE
    assert kernel_kind(nodes[torch.ops.aten.native_dropout.default]) == EXTERN  # eager's RNG
    assert kernel_kind(s) == KERNEL


def _measured(compiled: nn.Module, model: nn.Module, x: torch.Tensor) -> int:
    model.zero_grad(set_to_none=True)
    resident = sum(t.untyped_storage().nbytes() for t in (*model.parameters(), x))
    with allocation_peak("cpu") as seen:
        loss = compiled(x)
        loss.backward()
        del loss
    return seen.peak + resident


@pytest.mark.parametrize("budget", [None, 0.75])
def test_the_prediction_under_inductor_is_the_measured_peak(budget: object) -> None:
    """Counted op by op, a GELU-and-LayerNorm stack was predicted above its step (the
    GELU's decomposed pieces) and, once fusion was counted, below it (inductor runs a
    backward kernel before a matmul that precedes it in the graph): on inductor's order
    the prediction is the allocated peak within 1%."""
    torch.manual_seed(0)
    model = nn.Sequential(GeluStack(width=256, depth=4), SquareMean())
    x = torch.randn(512, 256)
    compiled = memopt.compile(copy.deepcopy(model), budget=budget, kernels="inductor")
    inner = compiled.original_module
    for _ in range(2):
        inner.zero_grad(set_to_none=True)
        compiled(x).backward()
    plan = compiled.memopt_plan
    measured = _measured(compiled, inner, x)
    assert plan.kernels == "inductor"
    assert abs(measured - plan.predicted_peak_bytes) <= 0.01 * measured, \
        (measured, plan.predicted_peak_bytes)
    if budget is not None:
        assert measured <= plan.budget_bytes


class GatherHead(nn.Module):
    """A language model's head whose loss is a gather of the log-probabilities of the
    flattened logits, returning the logits too: the backward's fused kernel writes the
    logits' gradient, (4, 64, V), over the saved log-probabilities, (256, V), it reads."""

    def __init__(self, width: int = 64, vocab: int = 2000) -> None:
        super().__init__()
        self.inp, self.proj = nn.Linear(width, width), nn.Linear(width, vocab)
        self.register_buffer("target", torch.randint(
            0, vocab, (256,), generator=torch.Generator().manual_seed(0)))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.proj(torch.tanh(self.inp(x)))
        log_probs = logits.view(-1, logits.shape[-1]).log_softmax(-1)
        return -log_probs.gather(1, self.target[:, None]).mean(), logits


@pytest.mark.slow  # compiles with inductor (~20 s); the rule's unit test runs by default
def test_a_saved_value_read_through_a_reshape_is_written_over() -> None:
    """Inductor writes a kernel's output over a buffer it reads for the last time at the
    positions it writes, through a reshape too: the prediction counted the logits'
    gradient beside the saved log-probabilities (30% above the step here, 14% on the
    zoo's Mamba); now it is above the measurement by less than that one buffer."""
    torch.manual_seed(0)
    model = GatherHead()
    x = torch.randn(4, 64, 64)
    compiled = memopt.compile(copy.deepcopy(model), kernels="inductor")
    inner = compiled.original_module
    for _ in range(2):
        inner.zero_grad(set_to_none=True)
        compiled(x)[0].backward()
    inner.zero_grad(set_to_none=True)
    resident = sum(t.untyped_storage().nbytes() for t in (*inner.parameters(),
                                                          *inner.buffers(), x))
    with allocation_peak("cpu") as seen:
        out = compiled(x)
        out[0].backward()
        del out
    measured, predicted = seen.peak + resident, compiled.memopt_plan.predicted_peak_bytes
    assert measured <= predicted < measured + 256 * 2000 * 4, (measured, predicted)


class ReturnsTwice(nn.Module):
    """Returns one tensor under two keys: dynamo hands memopt one graph output."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(48)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.relu(self.norm(torch.relu(x)))
        return {"a": h, "b": h}


@pytest.mark.parametrize("kernels", ["aten", "inductor"])
def test_a_tensor_returned_twice_is_counted_from_the_second_step(kernels: str) -> None:
    """Autograd sums the two returns' gradients outside the compiled backward: up to two
    more output-sized buffers, which only the returned value shows. memopt plans it again
    for the steps after the first; the step then measures within its prediction (the
    fuzzer found this model 32% above its plan under inductor), here by the one buffer
    autograd spares by adding in place."""
    torch.manual_seed(0)
    model = ReturnsTwice()
    x = torch.randn(128, 48)
    compiled = memopt.compile(model, kernels=kernels, watch_loss=False)  # loss: the caller's

    def loss(out: dict[str, torch.Tensor]) -> torch.Tensor:
        return default_loss(out)  # each return's gradient one buffer of its own

    loss(compiled(x)).backward()  # plans; the returns are seen as its forward ends
    first, again = compiled.memopt_plans  # planned again, counting them
    assert compiled.memopt_plan is again
    model.zero_grad(set_to_none=True)
    resident = sum(t.untyped_storage().nbytes() for t in (*model.parameters(),
                                                          *model.buffers(), x))
    # the loss's temporaries are the caller's (a loss outside the module is not planned)
    with allocation_peak("cpu") as forward:
        out = compiled(x)
    with allocation_peak("cpu") as loss_window:
        step_loss = loss(out)
    with allocation_peak("cpu") as backward:
        step_loss.backward()
    plan = compiled.memopt_plan
    measured = resident + max(forward.peak, forward.end + loss_window.end + backward.peak)
    assert plan is again and len(compiled.memopt_plans) == 2  # the second step: no new plan
    assert plan.predicted_peak_bytes >= first.predicted_peak_bytes
    assert measured <= plan.predicted_peak_bytes, (measured, plan.predicted_peak_bytes)
    if kernels == "inductor":  # counted as if autograd summed out of place: one h more
        assert plan.predicted_peak_bytes - measured <= 128 * 48 * 4 + 0.01 * measured, \
            (measured, plan.predicted_peak_bytes)
