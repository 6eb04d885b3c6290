"""Kernel workspaces in the plan (passes/workspace.py).

What a kernel allocates for itself beyond its outputs is measured once per op and shape
on a real call while planning, and liveness charges it at that op. These tests check
that the charge is there and right where it matters (a depthwise convolution, whose CPU
backward computes in another layout and copies: a quarter of the step's peak in the
model below), that measuring is done once per key and moves no RNG, and that the
convolutional models of the third-party zoo measure within their budgets and within
10% of the plan at their named minimum and at 60% of eager.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt
from benchmarks.workloads import DepthwiseBlock
from benchmarks.zoo import CONV, ZOO, allocated_peak
from memopt.passes._torch_compat import aot_module_simplified, make_boxed
from memopt.measure import allocation_peak, measure_step
from memopt.passes import workspace


def _block() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return DepthwiseBlock(), torch.randn(16, 32, 32, 32)


def _measured_step(module: nn.Module, model: nn.Module, x: torch.Tensor) -> int:
    """Allocated peak of forward + backward, resident bytes included, grads None."""
    for p in model.parameters():
        p.grad = None
    resident = sum(t.untyped_storage().nbytes() for t in (*model.parameters(), x))
    with allocation_peak("cpu") as seen:
        out = module(x)
        out.sum().backward()
        del out
    return seen.peak + resident


def test_convolution_backward_workspace_is_charged_and_the_plan_holds() -> None:
    model, x = _block()
    compiled = memopt.compile(model)
    compiled(x).sum().backward()  # plans
    plan = compiled.memopt_plan
    charged = {s.name: s.nbytes for s in plan.storages if s.name.endswith(".workspace")}
    at_peak = sum(s.nbytes for s in plan.storages
                  if s.name.endswith(".workspace") and s.name.startswith(plan.peak_step))
    assert any(name.startswith("bw.convolution_backward") for name in charged), charged
    # The workspace decides the peak: without it the plan would be >10% low.
    assert at_peak > 0.10 * plan.predicted_peak_bytes, (at_peak, plan.predicted_peak_bytes)
    # Measured in a fresh process (DESIGN.md: CPU peaks are measured so), against that
    # process's own plan. Which oneDNN kernel the convolution's backward runs is process
    # state, and so is the workspace planning measures: for this block the CI machine
    # measured 0 B in a fresh process and 2 MiB or 4 MiB (reorders of the 2 MiB input and
    # of its gradient) in the test process after other tests, whose own step then ran
    # without them (docs/limits.md). So the step must not exceed its plan, and may fall
    # short of it by at most those two reorders.
    child = measure_step("benchmarks.workloads:depthwise_block", mode="memopt",
                         warmup=1, timed_steps=0)
    measured, predicted = child.budget_peak_bytes, child.predicted_peak_bytes
    reorders = 2 * x.nbytes
    assert predicted - reorders - 0.01 * measured <= measured <= 1.01 * predicted, (
        measured, predicted, reorders)


def _joint_graphs(model: nn.Module, x: torch.Tensor) -> list[torch.fx.GraphModule]:
    """The forward and backward graphs AOTAutograd builds for `model` (its own
    partitioner), with FakeTensors in node.meta["val"]."""
    graphs: list[torch.fx.GraphModule] = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return make_boxed(gm)

    def backend(gm, inputs):
        return aot_module_simplified(gm, inputs, fw_compiler=keep, bw_compiler=keep)

    torch.compile(model, backend=backend, fullgraph=True)(x).sum().backward()
    return graphs


def test_each_op_and_shape_is_measured_once_and_rng_is_untouched() -> None:
    def graphs() -> list[torch.fx.GraphModule]:
        block, x = _block()
        return _joint_graphs(nn.Sequential(block, nn.Dropout(0.5)), x)

    cache = workspace.WorkspaceCache()
    built = graphs()
    state = torch.get_rng_state()
    first = workspace.measure_workspaces(built, cache)
    assert torch.equal(state, torch.get_rng_state())  # dropout's RNG did not move
    assert first.measured > 0 and first.charged > 0
    # The same graphs built again (as every candidate plan rebuilds them): all cached.
    second = workspace.measure_workspaces(graphs(), cache)
    assert second.measured == 0 and second.hits > 0
    assert (second.charged, second.total_bytes) == (first.charged, first.total_bytes)


class _Sampler(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        picked = torch.multinomial(torch.softmax(x, -1), 1).squeeze(1)
        return torch.sin(x) * nn.functional.one_hot(picked, x.shape[1])


def test_an_op_that_refuses_zeros_is_measured_on_ones() -> None:
    """Workspaces are measured on zero-filled inputs; torch.multinomial refuses rows of
    zero probability, and was charged 0 where it allocates a copy of its input (a step
    at 0.7 measured 1.02x its budget; found from outside). It is measured on ones."""
    graphs = _joint_graphs(_Sampler(), torch.randn(2048, 64))
    workspace.measure_workspaces(graphs, workspace.WorkspaceCache())
    charged = [node.meta.get(workspace.WORKSPACE_BYTES, 0) for gm in graphs
               for node in gm.graph.nodes if node.target is torch.ops.aten.multinomial.default]
    assert charged and max(charged) >= 2048 * 64 * 4 // 2, charged


def test_a_workspace_that_follows_the_values_is_measured_on_ones_too() -> None:
    """linalg_matrix_exp's work follows its input's norm (none on zeros): the step of an
    nn.utils.parametrizations.orthogonal layer measured 1.49x an accepted budget (found
    from outside). Its workspace is measured on ones as well, the larger charged."""
    layer = torch.nn.utils.parametrizations.orthogonal(nn.Linear(128, 128))
    graphs = _joint_graphs(layer, torch.randn(256, 128))
    workspace.measure_workspaces(graphs, workspace.WorkspaceCache())
    charged = [node.meta.get(workspace.WORKSPACE_BYTES, 0) for gm in graphs
               for node in gm.graph.nodes
               if node.target is torch.ops.aten.linalg_matrix_exp.default]
    # the backward exponentiates a 256 x 256 block matrix: 4 of them on zeros, 12 on ones
    assert charged and max(charged) >= 8 * 256 * 256 * 4, charged


def test_a_workspace_that_follows_the_indices_is_measured_on_ones_too() -> None:
    """EmbeddingBag(mode="max")'s backward gathers the gradient by its max indices: 1.5
    MiB here, none on zero indices (a step recomputing it measured 1.16x an accepted
    budget; found from outside)."""
    class Bag(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bag = nn.EmbeddingBag(500, 64, mode="max")

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.bag(ids))

    graphs = _joint_graphs(Bag(), torch.randint(0, 500, (2048, 8)))
    workspace.measure_workspaces(graphs, workspace.WorkspaceCache())
    charged = [node.meta.get(workspace.WORKSPACE_BYTES, 0) for gm in graphs
               for node in gm.graph.nodes if "embedding_bag" in str(node.target)
               and "backward" in str(node.target)]
    assert charged and max(charged) >= 2048 * 64 * 8, charged


def test_views_are_never_measured() -> None:
    graph = torch.fx.Graph()
    a = graph.placeholder("a")
    view = graph.call_function(torch.ops.aten.view.default, (a, [-1]))
    graph.output(view)
    a.meta["val"] = torch.empty(1 << 16, device="meta")
    view.meta["val"] = torch.empty(1 << 16, device="meta")
    assert not workspace._eligible(view)


def _zoo_budget(name: str, which: str) -> int:
    """The minimum memopt names for zoo model `name`, or 60% of eager's measured peak."""
    case = ZOO[name]()
    if which == "60%":
        case.run_step()
        return int(0.6 * allocated_peak(case.model, case))
    with pytest.raises(memopt.BudgetError) as info:
        memopt.plan(case.model, *case.args, example_kwargs=case.kwargs, budget=1)
    return info.value.minimum_bytes


#: ConvNeXt at 60% runs by default (its depthwise convolutions have the largest
#: workspaces); every model at both budgets with -m slow.
CONV_CASES = [pytest.param("convnext", "60%", id="convnext-60%")] + [
    pytest.param(name, which, id=f"{name}-{which}", marks=pytest.mark.slow)
    for name in CONV for which in ("minimum", "60%") if (name, which) != ("convnext", "60%")
]


@pytest.mark.parametrize("name, which", CONV_CASES)
def test_convolution_models_hold_their_budgets(name: str, which: str) -> None:
    """A third-party convolution model at its named minimum and at 60% of eager: measured
    <= budget and within 10% of the prediction (ConvNeXt measured 1.23x its budget when
    convolution backward's workspace was left to the headroom). A budget below the
    minimum is refused, not overshot."""
    budget = _zoo_budget(name, which)
    case = ZOO[name]()
    eager = copy.deepcopy(case.model)
    compiled = memopt.compile(case.model, budget=budget)
    try:
        case.run_step(compiled)
    except memopt.BudgetError as err:
        assert which == "60%" and err.minimum_bytes > budget
        pytest.skip(f"60% of eager is below {name}'s minimum ({err.minimum_bytes} B)")
    measured = allocated_peak(compiled, case)
    plan = compiled.memopt_plan
    assert measured <= budget, (measured, budget)
    assert abs(measured - plan.predicted_peak_bytes) <= 0.10 * plan.predicted_peak_bytes, (
        measured, plan.predicted_peak_bytes)
    # and eager's gradients (same seed, same dropout masks)
    for p in case.model.parameters():
        p.grad = None
    torch.manual_seed(7)
    case.run_step(compiled)
    torch.manual_seed(7)
    case.run_step(eager)
    for (pname, p), q in zip(case.model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=pname)


def test_measurement_blocks_pause_the_garbage_collector() -> None:
    """A collection inside a workspace measurement frees memory that was live before the
    op ran, and `peak - end` counted it as the op's workspace (plans that depended on the
    tests before them): the planner's blocks (collect=False) run with the collector
    paused, and leave it as they found it."""
    import gc  # noqa: PLC0415

    from memopt.passes.allocated import allocation_peak as peak_of  # noqa: PLC0415

    assert gc.isenabled()
    with peak_of("cpu", collect=False):
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with peak_of("cpu", collect=False):
            pass
        assert not gc.isenabled()  # a caller's own pause is kept
    finally:
        gc.enable()


def test_a_loop_that_measures_every_step_holds_its_budget_from_the_first() -> None:
    """Planning inside the user's `allocation_peak` cannot measure kernel workspaces (CPU
    profilers do not nest): they are estimated (workspace.estimated_workspace), and the
    graphs are planned again, measured, as that measurement closes. A depthwise CNN at
    0.5 measured 1.16x its budget at every step of such a loop before (the plan made
    again only at a step outside the profiler, which never came), 1.105x at its first
    step with the re-plan alone."""
    torch.manual_seed(0)

    def block(c: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(c, c, 3, padding=1, groups=c), nn.BatchNorm2d(c),
                             nn.GELU(), nn.Conv2d(c, c, 1), nn.ReLU())
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), *[block(32) for _ in range(3)],
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
    x = torch.randn(8, 3, 32, 32)
    compiled = memopt.compile(model, budget=0.5)
    peaks = [_measured_step(compiled, model, x) for _ in range(3)]
    plan = compiled.memopt_plan
    assert max(peaks) <= plan.budget_bytes, (peaks, plan.budget_bytes)
    assert not compiled._memopt_backend.plan_log.untracked  # planned again, measured


def test_estimated_workspaces_follow_the_largest_argument() -> None:
    """The estimate for a convolution's backward is twice its largest tensor argument,
    an ``out=`` variant's twice, an op with mixed dtypes once, an add nothing (each with
    a small margin)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    graph = torch.fx.Graph()
    with FakeTensorMode() as mode:
        big, small = torch.empty(4, 8, 16, 16), torch.empty(8, 1, 3, 3)
        mask = torch.empty(4, 8, 16, 16, dtype=torch.bool)
    nodes = {}
    for name, value in (("g", big), ("w", small), ("m", mask)):
        nodes[name] = graph.placeholder(name)
        nodes[name].meta["val"] = value
    aten = torch.ops.aten
    call = workspace.Call(aten.convolution_backward.default, (nodes["g"], nodes["g"], nodes["w"]),
                          {}, ())
    margin = workspace._ESTIMATE_MARGIN
    assert workspace.estimated_workspace(call) == 2 * big.nbytes + margin
    call = workspace.Call(aten.mul.Tensor, (nodes["g"], nodes["m"]), {}, ())
    assert workspace.estimated_workspace(call) == big.nbytes + margin
    call = workspace.Call(aten.add.Tensor, (nodes["g"], nodes["g"]), {}, ())
    assert workspace.estimated_workspace(call) == margin
    call = workspace.Call(aten.add.out, (nodes["g"], nodes["g"]), {"out": nodes["g"]}, ())
    assert workspace.estimated_workspace(call) == 2 * big.nbytes + margin
    del mode


@pytest.mark.parametrize("shape", [(8, 320, 2, 2), (8, 160, 4, 4), (4, 80, 8, 8),
                                   (8, 40, 16, 16), (2, 64, 32, 32)])
@pytest.mark.parametrize("grad_layout", ["channels_last", "contiguous"])
def test_estimated_workspace_of_a_channels_last_depthwise_backward_covers_it(shape,
                                                                              grad_layout):
    """A 7x7 depthwise convolution's backward over a channels-last input, measured, is
    within its estimate and the estimate within 3x of it: over a ConvNeXt's late
    (8, 320, 2, 2) maps it allocated 16 MB, 8x its unfolded columns, where half the
    columns were charged, and a first step planned under the profiler measured 1.31x an
    accepted budget (found from outside, 2026-12-02)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memopt.measure import allocation_peak

    b, c, h, w = shape
    x = torch.randn(shape).to(memory_format=torch.channels_last)
    weight = torch.randn(c, 1, 7, 7)
    grad = torch.randn(shape)
    if grad_layout == "channels_last":
        grad = grad.to(memory_format=torch.channels_last)
    args = ([c], [1, 1], [3, 3], [1, 1], False, [0, 0], c, [True, True, True])
    with allocation_peak("cpu") as seen:
        grads = torch.ops.aten.convolution_backward(grad, x, weight, *args)
    measured = seen.peak - sum(t.nbytes for t in grads)
    graph = torch.fx.Graph()
    nodes = []
    with FakeTensorMode() as mode:
        for name, value in (("g", grad), ("x", x), ("w", weight)):
            node = graph.placeholder(name)
            node.meta["val"] = mode.from_tensor(value)
            nodes.append(node)
    estimate = workspace.estimated_workspace(workspace.Call(
        torch.ops.aten.convolution_backward.default, (*nodes, *args), {}, ()))
    assert measured <= estimate <= 3 * measured + workspace._ESTIMATE_MARGIN, \
        (measured, estimate)


def test_estimated_workspaces_of_indexed_and_attention_ops() -> None:
    """Indices are read as they are (a scatter_add by an int64 index over a large zeros:
    nothing; a DGCNN's minimum named inside the profiler was 1.84x eager's peak, charged
    the zeros), an EmbeddingBag's backward sorts its index (6x), an expanded view counts
    what it spans, CPU's flash attention is charged in units of its queries, and a
    LayerNorm's backward copies each permuted argument (found from outside, 2026-12-01)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    graph = torch.fx.Graph()
    with FakeTensorMode() as mode:
        values = {"zeros": torch.empty(4, 64, 64, 8), "index": torch.empty(4, 64, 16, 8,
                                                                           dtype=torch.long),
                  "src": torch.empty(4, 64, 16, 8), "grad": torch.empty(256, 16),
                  "bag": torch.empty(1024, dtype=torch.long),
                  "q": torch.empty(2, 1, 64, 32), "kv": torch.empty(2, 1, 2048, 32),
                  "wide": torch.empty(64, 1, 8).expand(64, 64, 8),
                  "mask": torch.empty(64, 64, 8, dtype=torch.bool),
                  "perm": torch.empty(4, 16, 8).transpose(1, 2), "w": torch.empty(16)}
    nodes = {}
    for name, value in values.items():
        nodes[name] = graph.placeholder(name)
        nodes[name].meta["val"] = value
    aten, margin = torch.ops.aten, workspace._ESTIMATE_MARGIN

    def estimate(op: Any, *names: str) -> int:
        args = tuple(nodes[n] if n in nodes else int(n) for n in names)
        return workspace.estimated_workspace(workspace.Call(op, args, {}, ())) - margin

    assert estimate(aten.scatter_add.default, "zeros", "2", "index", "src") == 0
    assert estimate(aten._embedding_bag_backward.default, "grad", "bag", "bag", "bag",
                    "bag") == 6 * values["bag"].nbytes
    assert estimate(aten.mul.Tensor, "wide", "mask") == values["mask"].numel() * 4
    assert estimate(aten.mul.Tensor, "wide", "w") == 0  # one dtype: nothing to convert
    threads = max(1, torch.get_num_threads() // 2)
    assert estimate(aten._scaled_dot_product_flash_attention_for_cpu.default, "q", "kv",
                    "kv") == threads * values["q"].nbytes
    assert estimate(aten.native_layer_norm_backward.default, "perm", "perm") \
        == 2 * values["perm"].nbytes
    del mode


def test_a_plan_made_again_as_the_measurement_closes_keeps_the_autocast_it_was_captured_in():
    """A step planned inside memopt.measure.allocation_peak is planned again as it closes,
    after the user's `torch.autocast` region has ended: traced there in float32, the bf16
    graph's next backward raised (`mm` of BFloat16 and float, found from outside).
    CompiledGraph.replan enters the regions the graph was captured in."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                          nn.Linear(64, 100))
    eager = copy.deepcopy(model)
    compiled = memopt.compile(model, budget=0.9)
    x, y = torch.randn(256, 64), torch.randint(0, 100, (256,))

    def step(module: nn.Module) -> None:
        for p in module.parameters():
            p.grad = None
        with allocation_peak("cpu"):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(module(x).float(), y)
            loss.backward()

    for _ in range(3):
        step(compiled)
    step(eager)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-2, atol=1e-3)


def test_a_refusal_made_as_the_measurement_closes_names_the_autocast_steps_minimum():
    """A plan made again as the user's allocation_peak closes that misses its budget is
    refused, naming the smallest budget (CompiledGraph.budget_error), after the user's
    `torch.autocast` region has ended: traced there in float32, it named a bf16 CNN's
    float32 minimum, 1.91x what the step needed (found from outside). It is traced in the
    regions the graph was captured in: it names what it names inside them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                          nn.Linear(256, 100))
    compiled = memopt.compile(model, budget=0.9)
    x, y = torch.randn(512, 64), torch.randint(0, 100, (512,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.cross_entropy(compiled(x).float(), y)
    loss.backward()
    backend = compiled._memopt_backend
    graph = backend.plan_log.graphs_built[0]
    backend.budget = memopt.parse_budget(1000)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = graph.budget_error()
    outside = graph.budget_error()  # as the profiler closes, after the user's autocast
    assert inside is not None and outside is not None
    assert (outside.minimum_bytes, outside.baseline_bytes) \
        == (inside.minimum_bytes, inside.baseline_bytes)


def _named_minimum_holds(model: nn.Module, step: Any) -> None:
    """The minimum a refusal names inside the profiler (each `step(module)` measured in
    allocation_peak) holds at every step there, the first included."""
    with pytest.raises(memopt.BudgetError) as refused:
        step(memopt.compile(copy.deepcopy(model), budget=0.01))
    named = refused.value.minimum_bytes
    compiled = memopt.compile(model, budget=named)
    peaks = [step(compiled) for _ in range(3)]
    assert max(peaks) <= named, (peaks, named)


class _Orthogonal(nn.Module):
    """A Linear whose weight is kept orthogonal (``matrix_exp`` of a skew matrix; its
    backward runs ``matrix_exp`` on a matrix twice the size)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.utils.parametrizations.orthogonal(nn.Linear(32, 32))
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.a(x)))


def test_a_minimum_named_inside_the_profiler_holds_a_matrix_exponential() -> None:
    """Inside the user's allocation_peak planning estimates kernel workspaces; a
    ``matrix_exp`` was charged nothing, 12x its input measured: an orthogonal
    parametrization's minimum named there was 4.2x too low, its first step ran 3.07x it
    and the next refused it (found from outside, 2026-12-01). The minimum named inside
    the profiler holds at every step there, the first included."""
    torch.manual_seed(0)
    model = _Orthogonal()
    x, y = torch.randn(8, 32), torch.randint(0, 4, (8,))
    resident = sum(t.untyped_storage().nbytes() for t in (*model.parameters(), x))

    def step(module: nn.Module) -> int:
        for p in module.parameters():
            p.grad = None
        with allocation_peak("cpu") as seen:
            F.cross_entropy(module(x), y).backward()
        return seen.peak + resident

    _named_minimum_holds(model, step)


class _LayerNorm2d(nn.LayerNorm):
    """timm's channels LayerNorm: permute, normalize, permute back (channels-last out)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape,
                                     self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class _ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.gamma * self.down(nn.functional.gelu(self.up(self.norm(y))))
        return x + y.permute(0, 3, 1, 2)


@pytest.mark.parametrize("fraction", [0.8, 0.9])
def test_a_channels_last_depthwise_convolution_planned_unmeasured_holds_its_first_step(
        fraction: float) -> None:
    """A depthwise convolution after timm's LayerNorm2d gets a channels-last input, whose
    backward on CPU allocates far more than its tensors (1.6 MB over 64 KB ones), and the
    LayerNorm a contiguous copy of its permuted input: planned inside the user's
    allocation_peak, where workspaces are estimated, a ConvNeXt's first step measured
    1.08x (0.8) and 1.013x (0.9) its budget (found from outside). The estimates now
    charge both."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 32, 4, 4), _LayerNorm2d(32, eps=1e-6),
                          _ConvNeXtBlock(32), _ConvNeXtBlock(32), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(32, 10))
    x = torch.randn(8, 3, 32, 32)
    compiled = memopt.compile(model, budget=fraction)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = _measured_step(compiled, model, x)  # planned inside the measurement
    assert first <= compiled.memopt_plan.budget_bytes, (first, compiled.memopt_plan.budget_bytes)


class _Recommender(nn.Module):
    """DLRM's shape (Naumov et al. 2019): EmbeddingBags summed per sample, a dense MLP,
    pairwise dot products."""

    def __init__(self, tables: int = 8, rows: int = 1000, d: int = 16) -> None:
        super().__init__()
        self.embs = nn.ModuleList(nn.EmbeddingBag(rows, d, mode="sum") for _ in range(tables))
        self.bottom = nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, d), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(d + (tables + 1) * tables // 2, 64), nn.ReLU(),
                                 nn.Linear(64, 1))

    def forward(self, dense: torch.Tensor, idx: torch.Tensor, offsets: torch.Tensor
                ) -> torch.Tensor:
        z = self.bottom(dense)
        t = torch.stack([z] + [e(idx[i], offsets[i]) for i, e in enumerate(self.embs)], 1)
        pairs = torch.bmm(t, t.transpose(1, 2))
        li, lj = torch.triu_indices(t.shape[1], t.shape[1], offset=1)
        return self.top(torch.cat([z, pairs[:, li, lj]], 1)).squeeze(1)


def test_a_minimum_named_inside_the_profiler_holds_an_embedding_bags_sort() -> None:
    """An EmbeddingBag's backward sorts its index into buffers of its own (49,160 bytes
    over an index of 8,192), which planning inside the user's allocation_peak charged
    nothing: the minimum named there ran its first step at 1.0076x and was refused at
    the second (found from outside, 2026-12-01). Charged (workspace._SORTS), it holds
    at every step, each measured inside allocation_peak."""
    torch.manual_seed(0)
    model = _Recommender()
    g = torch.Generator().manual_seed(0)
    dense, y = torch.randn(256, 13, generator=g), torch.randint(0, 2, (256,), generator=g)
    idx = torch.randint(0, 1000, (8, 1024), generator=g)
    cuts = torch.sort(torch.randint(0, 1024, (8, 255), generator=g), 1).values
    offsets = torch.cat([torch.zeros(8, 1, dtype=torch.long), cuts], 1)

    def step(module: nn.Module) -> int:
        for p in model.parameters():
            p.grad = None
        resident = sum(t.untyped_storage().nbytes()
                       for t in (*model.parameters(), dense, idx, offsets))
        with allocation_peak("cpu") as seen:
            F.binary_cross_entropy_with_logits(module(dense, idx, offsets), y.float()).backward()
        return seen.peak + resident

    _named_minimum_holds(model, step)
