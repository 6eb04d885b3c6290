"""Bad input: each case either runs as eager does or raises a typed
memopt error, and an error leaves the user's model as it was (parameters, buffers,
`.grad`, requires_grad and train/eval flags).

Tests check error types and fields; only `test_messages_name_the_fix` reads messages.
README.md, "Bad input", is the table of these cases.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any, Callable

import pydantic
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import memopt
from memopt.budget import Budget
from models import MLP, ConvBN
from support import assert_snapshot_equal, snapshot

FP32 = {"rtol": 1e-5, "atol": 1e-6}


def state(model: nn.Module) -> dict[str, object]:
    """test_api's snapshot (parameters, buffers, .grad) plus the flags a call could flip."""
    flags = {f"training:{n}": torch.tensor(m.training) for n, m in model.named_modules()}
    flags |= {f"requires_grad:{n}": torch.tensor(p.requires_grad)
              for n, p in model.named_parameters()}
    return snapshot(model) | flags


def trained_conv_bn() -> tuple[nn.Module, torch.Tensor]:
    """A ConvBN after one eager step: gradients set, BatchNorm statistics moved, and one
    gradient None, so a changed or newly created `.grad` would show."""
    torch.manual_seed(0)
    model = ConvBN()
    x = torch.randn(4, 3, 16, 16)
    model(x).sum().backward()
    model.fc.bias.grad = None
    return model, x


def loss_of(out: torch.Tensor) -> torch.Tensor:
    """A loss whose gradient differs per element (a plain .sum() would hide errors)."""
    weights = torch.linspace(-1.0, 1.0, out.numel(), dtype=out.dtype).reshape(out.shape)
    return (out * weights).sum()


def assert_grads_match(model: nn.Module, eager: nn.Module, **tol: Any) -> None:
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert p.grad.dtype == q.grad.dtype, name
            torch.testing.assert_close(p.grad, q.grad, **tol, msg=name)


# --------------------------------------------------------------------------
# 1. Budget strings and values: BudgetFormatError at once
# --------------------------------------------------------------------------


def test_a_space_between_number_and_unit_is_accepted() -> None:
    """ "4 GB" means 4 * 10^9 bytes, as "4GB" does."""
    assert memopt.parse_budget("4 GB") == Budget(nbytes=4 * 10**9)
    assert memopt.parse_budget("4 GB") == memopt.parse_budget("4GB")
    assert memopt.parse_budget("1.5 GiB") == Budget(nbytes=3 * 2**29)
    model, x = MLP(), torch.randn(4, 32)
    assert memopt.plan(model, x, budget="4 GB").budget_bytes == 4 * 10**9


BAD_BUDGETS = ["-1GB", "4XB", "", "   ", "4 G B", "0GB", "1.5B", "0.4B", 0, -1, -(10**12),
               0.0, 1.5, -0.5,
               math.nan, math.inf, -math.inf, True, False, b"4GB", [4], {"GB": 4}]


@pytest.mark.parametrize("value", BAD_BUDGETS, ids=repr)
def test_bad_budget_is_a_budget_format_error(value: object) -> None:
    with pytest.raises(memopt.BudgetFormatError) as info:
        memopt.parse_budget(value)
    err = info.value
    assert isinstance(err, memopt.MemoptError)
    assert isinstance(err, ValueError)  # code written against the plain ValueError still works
    assert err.value is value


@pytest.mark.parametrize("value", ["-1GB", "4XB", 0, 1.5, math.nan, math.inf, True, "", -8],
                         ids=repr)
def test_compile_and_plan_refuse_a_bad_budget_before_touching_the_model(value: object) -> None:
    model, x = trained_conv_bn()
    before = state(model)
    with pytest.raises(memopt.BudgetFormatError):
        memopt.compile(model, budget=value)
    with pytest.raises(memopt.BudgetFormatError):
        memopt.plan(model, x, budget=value)
    assert_snapshot_equal(before, state(model))


# --------------------------------------------------------------------------
# 2. A budget below what memopt can reach: BudgetError at the first call
# --------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [1, "1KB", 0.01])
def test_impossible_budget_is_a_budget_error_and_changes_nothing(budget: object) -> None:
    model, x = trained_conv_bn()
    model.eval()
    compiled = memopt.compile(model, budget=budget)
    model.train()
    before = state(model)
    for _ in range(2):  # every call raises; none falls back to eager
        with pytest.raises(memopt.BudgetError) as info:
            compiled(x)
        assert_snapshot_equal(before, state(model))
    err = info.value
    assert isinstance(err, memopt.MemoptError)
    assert err.budget_bytes < err.minimum_bytes
    # baseline_bytes is memopt's predicted peak without recomputation or in-place rewrites
    # (the plan's baseline_peak_bytes), not a measurement of eager; the step planned is
    # the one with the .grad tensors the eager step left
    unplanned = memopt.plan(model, x, inplace=False, existing_grads=True)
    assert err.baseline_bytes == unplanned.baseline_peak_bytes == unplanned.predicted_peak_bytes
    assert compiled.memopt_plan is None


@pytest.mark.parametrize("budget", [1, 0.01])
def test_the_budgets_a_budget_error_names_are_accepted(budget: object) -> None:
    """Both ways out the error names fit, after a byte budget (which keeps headroom free)
    and after a fraction budget (which does not); a thousandth or a byte less does not."""
    model, x = trained_conv_bn()
    with pytest.raises(memopt.BudgetError) as info:
        memopt.plan(model, x, budget=budget)
    err = info.value
    assert err.smallest_fraction is not None and 0 < err.smallest_fraction <= 1
    by_bytes = memopt.plan(model, x, budget=err.smallest_byte_budget)
    assert by_bytes.predicted_peak_bytes <= by_bytes.budget_bytes - by_bytes.headroom_bytes
    by_fraction = memopt.plan(model, x, budget=err.smallest_fraction)
    assert by_fraction.predicted_peak_bytes <= by_fraction.budget_bytes
    if isinstance(budget, int):
        assert err.smallest_byte_budget == err.minimum_bytes
    with pytest.raises(memopt.BudgetError):
        memopt.plan(model, x, budget=err.smallest_byte_budget - 1)
    with pytest.raises(memopt.BudgetError):
        memopt.plan(model, x, budget=round(err.smallest_fraction - 0.001, 3))


# --------------------------------------------------------------------------
# 3. Weights on the meta device: InputError in compile; memopt.plan still plans them
# --------------------------------------------------------------------------


def meta_state(model: nn.Module) -> list[tuple[str, object, torch.device, tuple, bool]]:
    """Meta tensors hold no values: compare the objects, devices, shapes and flags."""
    return [(n, t, t.device, tuple(t.shape), getattr(t, "requires_grad", False))
            for n, t in [*model.named_parameters(), *model.named_buffers()]] + [
        (n, m, torch.device("cpu"), (), m.training) for n, m in model.named_modules()]


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.fc(x) * scale


def test_an_unknown_option_is_a_type_error_naming_the_options() -> None:
    """A misspelt option, and a model's keyword input given to memopt.plan as if it were
    an option (HF's input_ids=...): a TypeError that says what to pass, not one from
    memopt's internals."""
    with pytest.raises(TypeError, match=r"unknown option 'budgett'; its options are .*"
                                        r"blocks.*kernels"):
        memopt.compile(Scaled(), budgett=1)
    with pytest.raises(TypeError, match=r"unknown option 'kernel'; its options are .*"
                                        r"existing_grads"):
        memopt.plan(Scaled(), torch.randn(2, 4), kernel="inductor")
    with pytest.raises(TypeError, match=r"'scale', which is the model's forward argument.*"
                                        r"example_kwargs=dict\(scale=\.\.\.\)"):
        memopt.plan(Scaled(), torch.randn(2, 4), scale=2.0)
    plan = memopt.plan(Scaled(), torch.randn(2, 4), example_kwargs={"scale": 2.0})
    assert plan.predicted_peak_bytes > 0


def test_compile_refuses_a_meta_model() -> None:
    with torch.device("meta"):
        model = ConvBN()
    before = meta_state(model)
    with pytest.raises(memopt.InputError) as info:
        memopt.compile(model)
    assert isinstance(info.value, memopt.MemoptError)
    assert isinstance(info.value, ValueError)
    after = meta_state(model)
    assert [(n, d, s, f) for n, _, d, s, f in after] == [(n, d, s, f) for n, _, d, s, f in before]
    assert all(a[1] is b[1] for a, b in zip(after, before))


def test_compile_refuses_one_parameter_on_meta() -> None:
    torch.manual_seed(0)
    model = MLP()
    model.fc2.weight = nn.Parameter(torch.empty(64, 64, device="meta"))
    with pytest.raises(memopt.InputError):
        memopt.compile(model)


@pytest.mark.parametrize("layer", [nn.Embedding(100, 16, sparse=True),
                                   nn.EmbeddingBag(100, 16, sparse=True)],
                         ids=["embedding", "embedding_bag"])
def test_compile_refuses_a_sparse_gradient_by_name(layer: nn.Module) -> None:
    """A sparse=True embedding's gradient is sparse, with no storage for a plan: its
    first step failed deep inside the step model (a PassError over torch's
    NotImplementedError, at every budget; found from outside)."""
    model = nn.Sequential(nn.Sequential(layer), nn.Linear(16, 4))
    with pytest.raises(memopt.InputError, match=r"^0\.0 has sparse=True"):
        memopt.compile(model)
    layer.sparse = False
    compiled = memopt.compile(model)
    ids = torch.randint(0, 100, (8, 5))
    out = compiled(ids if isinstance(layer, nn.EmbeddingBag) else ids[:, 0])
    out.square().mean().backward()
    assert not layer.weight.grad.is_sparse


class _FunctionalSparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(100, 16))
        self.head = nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(F.embedding(ids, self.weight, sparse=True))


def test_a_sparse_gradient_made_by_a_function_is_refused_by_name() -> None:
    """``F.embedding(..., sparse=True)`` has no module to find: the graph's sparse
    gradient is refused by name as it is planned, the model unchanged (a PassError over
    torch's "Cannot access storage of SparseTensorImpl" before, found from outside)."""
    model = _FunctionalSparse()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(memopt.InputError, match="sparse"):
        memopt.compile(model, budget=0.5)(torch.randint(0, 100, (8,)))
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


class _Routed(nn.Module):
    """Top-1 routing by ``torch.where``: sizes known only when the step runs."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.expert = nn.Linear(16, 2), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, = torch.where(self.gate(x).argmax(-1) == 0)
        return x.index_add(0, rows, self.expert(x[rows]))


@pytest.mark.parametrize("how", ["plan", "fullgraph"])
def test_sizes_that_depend_on_the_data_are_a_capture_error(how: str) -> None:
    """A graph captured whole with a size known only at run time (an unbacked ``u0``)
    is a CaptureError that says why and what to do, not a PassError over torch's
    GuardOnDataDependentSymNode (found from outside on a top-2 MoE)."""
    x = torch.randn(32, 16)
    with pytest.raises(memopt.CaptureError, match="depend on tensor values"):
        if how == "plan":
            memopt.plan(_Routed(), x, budget=0.5)
        else:
            memopt.compile(_Routed(), budget=0.5, fullgraph=True)(x).sum().backward()


class _SavedThenChanged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        y = h.sigmoid()
        y.add_(1)  # sigmoid's backward reads the output it saved: eager raises too
        return y


def test_a_backend_failure_says_what_it_raised() -> None:
    """A failure inside the backend (AOTAutograd tracing the user's forward) names what
    was raised: dynamo's message ends in "raised:" and the error on its next line was
    cut off (found from outside)."""
    with pytest.raises(memopt.CaptureError, match="modified by an inplace operation"):
        memopt.compile(_SavedThenChanged(), fullgraph=True)(torch.randn(4, 8)).sum().backward()


class _BrokenConvBN(nn.Module):
    """BatchNorm and dropout on both sides of a graph break."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                               nn.Dropout(0.2))
        self.b = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                               nn.Dropout(0.2), nn.Flatten(), nn.Linear(8 * 16 * 16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        torch._dynamo.graph_break()
        return self.b(h)


def test_a_call_refused_after_its_graphs_ran_leaves_the_model_as_it_was() -> None:
    """With graph breaks the whole step is checked as the forward ends, after its graphs
    ran: a refused first call left BatchNorm's statistics updated and the generator
    moved (a Segformer, found from outside). memopt.first_call puts them back."""
    torch.manual_seed(0)
    model = _BrokenConvBN()
    x = torch.randn(4, 3, 16, 16)
    before = snapshot(model)
    rng = torch.get_rng_state()
    with pytest.raises(memopt.BudgetError):
        memopt.compile(model, budget=1000)(x)
    assert_snapshot_equal(before, snapshot(model))
    assert torch.equal(rng, torch.get_rng_state())


def test_an_integer_tensor_into_a_float_layer_is_an_input_error() -> None:
    """An int64 tensor where the model computes in float32: InputError naming both (torch's
    bare RuntimeError came from 35 frames inside the compiled graph; found from outside)."""
    compiled = memopt.compile(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    with pytest.raises(memopt.InputError, match="int64 tensors.*float32"):
        compiled(torch.arange(48).reshape(6, 8))


def test_a_numpy_array_is_warned_about() -> None:
    """Eager's layers raise TypeError for a NumPy input; dynamo converted it and memopt
    trained on it silently, hiding a data pipeline's bug (found from outside). A forward
    may convert it itself, so it runs, with a warning."""
    np = pytest.importorskip("numpy")
    compiled = memopt.compile(nn.Linear(8, 4))
    with pytest.warns(UserWarning, match="numpy.ndarray.*torch.from_numpy"):
        compiled(np.zeros((6, 8), dtype=np.float32))


def test_a_shape_error_says_what_torch_said_and_where() -> None:
    """A wrong input width: the CaptureError quotes the op's own error and the user's line,
    not only dynamo's "RuntimeError when making fake tensor call" at torch's linear.py."""
    class Narrow(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    with pytest.raises(memopt.CaptureError, match=r"same reduction dim.*test_bad_input\.py"):
        memopt.compile(Narrow())(torch.randn(6, 9))


def test_plan_plans_a_meta_model_on_meta_inputs() -> None:
    """benchmarks/chen_resnet.py plans ResNets on the meta device: that keeps working, and
    predicts what the materialized model's plan predicts."""
    with torch.device("meta"):
        meta_model = MLP()
    planned = memopt.plan(meta_model, torch.empty(4, 32, device="meta"))
    torch.manual_seed(0)
    real = memopt.plan(MLP(), torch.randn(4, 32))
    assert planned.predicted_peak_bytes == real.predicted_peak_bytes > 0
    assert planned.device == "meta"
    # (a convolution's CPU workspace is measured on real tensors only, so a meta ConvBN
    # plans lower than a CPU one; it plans all the same)
    with torch.device("meta"):
        meta_conv = ConvBN()
    assert memopt.plan(meta_conv, torch.empty(4, 3, 16, 16, device="meta")).saved


def test_plan_of_a_meta_model_on_real_inputs_is_an_input_error() -> None:
    with torch.device("meta"):
        model = MLP()
    with pytest.raises(memopt.InputError):
        memopt.plan(model, torch.randn(4, 32))


def test_a_materialized_meta_model_compiles_and_matches_eager() -> None:
    with torch.device("meta"):
        model = MLP()
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.load_state_dict(MLP().state_dict())
    eager = copy.deepcopy(model)
    x = torch.randn(4, 32)
    out = memopt.compile(model)(x)
    torch.testing.assert_close(out, eager(x), **FP32)
    loss_of(out).backward()
    loss_of(eager(x)).backward()
    assert_grads_match(model, eager, **FP32)


# --------------------------------------------------------------------------
# 4. New shapes and dtypes between calls; inputs on another device or dtype
# --------------------------------------------------------------------------


def test_new_shapes_and_dtypes_between_calls_give_eager_gradients() -> None:
    """Each new shape and dtype is planned again; the gradients stay eager's."""
    torch.manual_seed(0)
    model = MLP()
    eager = copy.deepcopy(model)
    compiled = memopt.compile(model)
    calls = [(4, torch.float32), (7, torch.float32), (7, torch.float64), (3, torch.float64),
             (4, torch.float32)]
    for batch, dtype in calls:
        model.to(dtype)
        eager.to(dtype)
        model.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
        x = torch.randn(batch, 32, dtype=dtype)
        out = compiled(x)
        assert out.dtype == dtype
        expected = eager(x)
        torch.testing.assert_close(out, expected, **FP32)
        loss_of(out).backward()
        loss_of(expected).backward()
        assert_grads_match(model, eager, **FP32)
        assert compiled.memopt_plan is not None
    assert len(compiled.memopt_plans) == 4  # (4, 7) x float32, (7, 3) x float64; then cached


class CastsItsInput(nn.Module):
    """A model that casts its input itself: float64 inputs are fine here."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x.to(self.fc.weight.dtype)))


def test_a_model_that_casts_its_input_takes_any_dtype() -> None:
    torch.manual_seed(0)
    model = CastsItsInput()
    eager = copy.deepcopy(model)
    compiled = memopt.compile(model)
    for dtype in (torch.float32, torch.float64, torch.float16):
        x = torch.randn(5, 8, dtype=dtype)
        out, expected = compiled(x), eager(x)
        torch.testing.assert_close(out, expected, **FP32)
        loss_of(out).backward()
        loss_of(expected).backward()
        assert_grads_match(model, eager, **FP32)


def test_float64_input_to_a_float32_model_is_an_input_error() -> None:
    """Eager fails here too (a RuntimeError from deep inside the first op); memopt names
    both dtypes, and the model keeps its state, the compiled module its plans."""
    model, x = trained_conv_bn()
    compiled = memopt.compile(model)
    loss_of(compiled(x)).backward()  # a float32 step first: one plan, gradients accumulated
    plans = compiled.memopt_plans
    before = state(model)
    with pytest.raises(memopt.InputError) as info:
        compiled(x.double())
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value.cause, RuntimeError)  # what eager raises too
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert_snapshot_equal(before, state(model))
    assert compiled.memopt_plans == plans
    with pytest.raises(memopt.InputError):
        memopt.plan(model, x.double())
    assert_snapshot_equal(before, state(model))
    # and float32 still runs
    loss_of(compiled(x)).backward()


def test_input_on_another_device_is_an_input_error() -> None:
    """On a CPU-only machine the other device is "meta"."""
    model, x = trained_conv_bn()
    compiled = memopt.compile(model)
    before = state(model)
    other = x.to("meta")
    with pytest.raises(memopt.InputError):
        compiled(other)
    with pytest.raises(memopt.InputError):
        memopt.plan(model, other)
    assert_snapshot_equal(before, state(model))
    assert compiled.memopt_plan is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_input_to_a_cpu_model_is_an_input_error() -> None:
    model, x = trained_conv_bn()
    compiled = memopt.compile(model)
    before = state(model)
    with pytest.raises(memopt.InputError):
        compiled(x.cuda())
    assert_snapshot_equal(before, state(model))


class BranchesOnAValue(nn.Module):
    """A BatchNorm, then a Python branch on a tensor's value: a graph break."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(x)
        return h * 2 if h.sum().item() > 0 else h


def test_a_capture_error_changes_nothing() -> None:
    """With fullgraph=True a graph break is refused while tracing, before anything runs:
    BatchNorm counts no step. (Without it, memopt plans the graphs: test_graph_breaks.)"""
    torch.manual_seed(0)
    model = BranchesOnAValue()
    before = state(model)
    with pytest.raises(memopt.CaptureError):
        memopt.compile(model, fullgraph=True)(torch.randn(4, 8))
    with pytest.raises(memopt.CaptureError):
        memopt.plan(model, torch.randn(4, 8).requires_grad_())
    assert_snapshot_equal(before, state(model))


# --------------------------------------------------------------------------
# 5. Nothing requires grad: the forward runs as eager's, with no plan
# --------------------------------------------------------------------------


def frozen(model: nn.Module) -> nn.Module:
    return model.requires_grad_(False)


@pytest.mark.parametrize("mode", ["frozen", "no_grad", "inference_mode"])
def test_nothing_to_differentiate_runs_like_eager(mode: str) -> None:
    torch.manual_seed(0)
    model = ConvBN()  # train mode: BatchNorm updates its statistics, as in eager
    if mode == "frozen":
        frozen(model)
    eager = copy.deepcopy(model)
    compiled = memopt.compile(model)
    x = torch.randn(4, 3, 16, 16)
    context = {"frozen": torch.enable_grad, "no_grad": torch.no_grad,
               "inference_mode": torch.inference_mode}[mode]
    for _ in range(2):
        with context():
            out, expected = compiled(x), eager(x)
        torch.testing.assert_close(out, expected, **FP32)
        assert not out.requires_grad
        for (name, b), c in zip(model.named_buffers(), eager.buffers()):
            torch.testing.assert_close(b, c, **FP32, msg=name)
    assert compiled.memopt_plan is None and compiled.memopt_plans == ()
    assert all(p.grad is None for p in model.parameters())
    before = state(model)
    with pytest.raises(memopt.InputError):  # and memopt.plan says there is nothing to plan
        with context():
            memopt.plan(model, x)
    assert_snapshot_equal(before, state(model))  # without running the forward


def test_an_inference_call_after_training_keeps_the_training_plan() -> None:
    """memopt_plan is the plan of the training graph that ran last; an inference call
    has none and does not replace it."""
    torch.manual_seed(0)
    model = MLP()
    compiled = memopt.compile(model)
    x = torch.randn(4, 32)
    loss_of(compiled(x)).backward()
    plan = compiled.memopt_plan
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), **FP32)
    assert compiled.memopt_plan is plan and compiled.memopt_plans == (plan,)


# --------------------------------------------------------------------------
# 6. A forward that returns no tensor: harmless, runs as eager's
# --------------------------------------------------------------------------


class Returns(nn.Module):
    """Runs a Linear and a BatchNorm (which updates its statistics), then returns `what`."""

    def __init__(self, what: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.what = what

    def forward(self, x: torch.Tensor) -> Any:
        return self.what(self.bn(self.fc(x)))


RETURNS = {
    "None": lambda y: None,
    "int": lambda y: 3,
    "str": lambda y: "done",
    "dict_without_tensors": lambda y: {"steps": 1, "name": "x"},
    "tuple_of_none": lambda y: (None, 2),
    "integer_tensor": lambda y: y.argmax(dim=1),  # a tensor, but nothing to differentiate
}


@pytest.mark.parametrize("what", list(RETURNS))
def test_a_forward_returning_no_differentiable_tensor_runs_like_eager(what: str) -> None:
    torch.manual_seed(0)
    model = Returns(RETURNS[what])
    eager = copy.deepcopy(model)
    compiled = memopt.compile(model)
    x = torch.randn(6, 8)
    out, expected = compiled(x), eager(x)
    if isinstance(expected, torch.Tensor):
        assert torch.equal(out, expected)
    else:
        assert out == expected
    for (name, b), c in zip(model.named_buffers(), eager.buffers()):
        torch.testing.assert_close(b, c, **FP32, msg=name)
    assert int(model.bn.num_batches_tracked) == 1  # the forward ran once
    assert compiled.memopt_plan is None
    assert all(p.grad is None for p in model.parameters())
    before = state(model)
    with pytest.raises(memopt.InputError):  # nothing to plan: return the loss or a tensor
        memopt.plan(model, x)
    assert_snapshot_equal(before, state(model))


# --------------------------------------------------------------------------
# 7. A plan JSON edited by hand: pydantic.ValidationError, never half-read
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plan_json() -> str:
    torch.manual_seed(0)
    return memopt.plan(ConvBN(), torch.randn(4, 3, 16, 16), budget="1GB").to_json()


def test_an_untouched_plan_round_trips(plan_json: str) -> None:
    plan = memopt.MemoryPlan.from_json(plan_json)
    assert plan.to_json() == plan_json
    assert memopt.MemoryPlan.model_validate_json(plan_json) == plan
    assert memopt.MemoryPlan.from_json(plan.to_json(indent=2)) == plan


def _edit(text: str, change: Callable[[dict], None]) -> str:
    data = json.loads(text)
    change(data)
    return json.dumps(data)


def _set(path: tuple, value: object) -> Callable[[dict], None]:
    def change(data: dict) -> None:
        *parents, last = path
        for key in parents:
            data = data[key]
        data[last] = value
    return change


def _pop(key: str) -> Callable[[dict], None]:
    return lambda data: data.pop(key)


#: Edits that any validation refuses (lax mode too: MemoryPlan.model_validate_json).
EDITS = {
    "field_removed": _pop("predicted_peak_bytes"),
    "bytes_lots": _set(("predicted_peak_bytes",), "lots"),
    "extra_key": _set(("comment",), "edited by hand"),
    "negative_bytes": _set(("baseline_peak_bytes",), -1),
    "negative_nested_bytes": _set(("storages", 0, "nbytes"), -4096),
    "extra_nested_key": _set(("storages", 0, "pinned"), True),
    "shape_not_ints": _set(("saved", 0, "shape"), ["batch", 8]),
    "budget_as_list": _set(("budget_bytes",), [1, 2]),
    "storages_not_a_list": _set(("storages",), "none"),
}

#: Edits that only strict validation (MemoryPlan.from_json) refuses: lax mode coerces them.
STRICT_EDITS = {
    "bytes_as_numeric_string": _set(("predicted_peak_bytes",), "12345"),
    "bytes_as_float": _set(("predicted_peak_bytes",), 12345.0),
    "count_as_bool": _set(("num_forward_steps",), True),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_a_hand_edited_plan_is_a_validation_error(plan_json: str, edit: str) -> None:
    text = _edit(plan_json, EDITS[edit])
    with pytest.raises(pydantic.ValidationError):
        memopt.MemoryPlan.from_json(text)
    with pytest.raises(pydantic.ValidationError):
        memopt.MemoryPlan.model_validate_json(text)


@pytest.mark.parametrize("edit", list(STRICT_EDITS))
def test_from_json_is_strict_about_types(plan_json: str, edit: str) -> None:
    with pytest.raises(pydantic.ValidationError):
        memopt.MemoryPlan.from_json(_edit(plan_json, STRICT_EDITS[edit]))


def test_not_json_is_a_validation_error(plan_json: str) -> None:
    for text in ("", plan_json[: len(plan_json) // 2], "[]", "null"):
        with pytest.raises(pydantic.ValidationError):
            memopt.MemoryPlan.from_json(text)


# --------------------------------------------------------------------------
# Messages: the one test that reads them
# --------------------------------------------------------------------------


def test_messages_name_the_fix() -> None:
    """Each error's message names the bad value and what to do instead."""
    with pytest.raises(memopt.BudgetFormatError) as bad_format:
        memopt.parse_budget("4XB")
    assert "'4XB'" in str(bad_format.value) and '"4GB"' in str(bad_format.value)

    model, x = trained_conv_bn()
    with pytest.raises(memopt.BudgetError) as too_small:
        memopt.plan(model, x, budget=1)
    text = str(too_small.value)
    assert f"budget={too_small.value.smallest_byte_budget}" in text
    assert "not a measurement of eager PyTorch" in text

    with torch.device("meta"):
        meta_model = MLP()
    with pytest.raises(memopt.InputError) as meta:
        memopt.compile(meta_model)
    assert "to_empty" in str(meta.value)

    with pytest.raises(memopt.InputError) as device:
        memopt.compile(model)(x.to("meta"))
    assert "meta" in str(device.value) and "cpu" in str(device.value)

    with pytest.raises(memopt.InputError) as dtype:
        memopt.compile(model)(x.double())
    assert "float64" in str(dtype.value) and "float32" in str(dtype.value)

    model.requires_grad_(False)
    with pytest.raises(memopt.InputError) as nothing:
        memopt.plan(model, x)
    assert "return the loss" in str(nothing.value)


def test_plan_of_a_hf_model_on_meta_with_its_default_cache() -> None:
    """A Hugging Face model's default config builds a key/value cache in every forward,
    which dynamo cannot capture on meta (transformers 5's DynamicCache): memopt.plan plans
    it with use_cache=False and says so, the same plan as use_cache=False passed."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100,
                                     n_positions=64)
    assert config.use_cache
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 100, (1, 16), device="meta")
    with pytest.warns(UserWarning, match="planned this model with use_cache=False"):
        meta = memopt.plan(model, example_kwargs={"input_ids": ids, "labels": ids})
    explicit = memopt.plan(model, example_kwargs={"input_ids": ids, "labels": ids,
                                                  "use_cache": False})
    assert meta.predicted_peak_bytes == explicit.predicted_peak_bytes > 0


class _Residual(nn.Module):
    """A physics-informed residual: the forward differentiates its network's output with
    create_graph=True (u_t + u u_x), so the loss's backward is a double backward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, xt: torch.Tensor) -> torch.Tensor:
        u = self.net(xt)
        du = torch.autograd.grad(u.sum(), xt, create_graph=True)[0]
        return du[:, 1:] + u * du[:, :1]


@pytest.mark.parametrize("budget", [None, 0.95])
def test_a_double_backward_is_refused_by_name(budget: object) -> None:
    """Gradients of gradients through a compiled graph: AOTAutograd's backward cannot be
    differentiated, and torch raised a bare RuntimeError from inside the step (a
    physics-informed net, found from outside). memopt refuses it by name where the
    create_graph=True backward starts, inside the forward or in the caller's loop (a
    gradient penalty), and leaves the model as it was."""
    torch.manual_seed(0)
    xt = torch.rand(64, 2, requires_grad=True)
    model = _Residual()
    _Residual()(xt).square().mean().backward()  # eager runs it
    before = state(model)
    with pytest.raises(memopt.InputError, match="create_graph=True"):
        memopt.compile(model, budget=budget)(xt).square().mean().backward()
    assert_snapshot_equal(before, state(model))
    critic = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 1))
    compiled = memopt.compile(critic, budget=budget)
    x = torch.rand(64, 2, requires_grad=True)
    with pytest.raises(memopt.InputError, match="gradients of gradients"):
        torch.autograd.grad(compiled(x).sum(), x, create_graph=True)
    compiled(x).sum().backward()  # a plain backward still runs
