"""The public API: `memopt.compile`, `memopt.plan`, budgets, errors, and the plan's invariants.

The plan invariants (STYLE.md section 7, tier 2) are checked here by code written
apart from memopt.allocator: it reads only the `MemoryPlan` data.
"""

from __future__ import annotations

import copy
import io
import itertools
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import memopt
from memopt.budget import Budget
from models import CASES, CORPUS, Case, ItemBranch
from support import FP32, assert_snapshot_equal, check_matches_eager, default_loss, snapshot

RESIDENT = ("parameter", "buffer", "input")
KINDS = {"parameter", "buffer", "input", "activation", "saved", "output", "tangent",
         "backward", "gradient", "outside"}


def build(case_name: str) -> tuple[nn.Module, tuple]:
    case = CASES[case_name]
    torch.manual_seed(0)
    model = case.make_model()
    torch.manual_seed(1)
    return model, case.make_inputs()


# --------------------------------------------------------------------------
# The namespace
# --------------------------------------------------------------------------


_NAMESPACE_CHECK = """
import sys
failures = []
for first in ("compile", "MemoryPlan", "CompiledModule", "parse_budget", "plan"):
    for name in [m for m in sys.modules if m == "memopt" or m.startswith("memopt.")]:
        del sys.modules[name]
    import memopt
    getattr(memopt, first)
    plan, compile_ = memopt.plan, memopt.compile
    import memopt.api
    if plan is not memopt.api.plan:
        failures.append(f"after memopt.{first}: memopt.plan is {plan!r}")
    if compile_ is not memopt.api.compile:
        failures.append(f"after memopt.{first}: memopt.compile is {compile_!r}")
assert not failures, failures
"""


def test_public_names_do_not_depend_on_import_order() -> None:
    """`memopt.plan` is the function whichever public name a program touches first
    (memopt/plan.py is also a submodule called `plan`). Import state is per process,
    so the check runs in a fresh interpreter."""
    result = subprocess.run([sys.executable, "-c", _NAMESPACE_CHECK], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


# --------------------------------------------------------------------------
# The compiled module shares the model's state
# --------------------------------------------------------------------------


def test_compiled_shares_parameters_buffers_and_state_dict() -> None:
    model, _ = build("conv_bn")
    compiled = memopt.compile(model)
    assert isinstance(compiled, nn.Module)
    ours, theirs = list(compiled.parameters()), list(model.parameters())
    assert len(ours) == len(theirs)
    assert all(a is b for a, b in zip(ours, theirs))
    assert all(a is b for a, b in zip(compiled.buffers(), model.buffers()))
    sd_ours, sd_theirs = compiled.state_dict(), model.state_dict()
    assert list(sd_ours) == list(sd_theirs)
    for key in sd_theirs:
        assert sd_ours[key].data_ptr() == sd_theirs[key].data_ptr()
    assert compiled.memopt_plan is None and compiled.memopt_plans == ()
    # submodules and plain attributes are the model's
    assert compiled.bn1 is model.bn1 and compiled.fc is model.fc
    assert compiled.original_module is model


def test_load_state_dict_on_compiled_loads_into_model() -> None:
    model, _ = build("mlp")
    compiled = memopt.compile(model)
    other, _ = build("mlp")
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    compiled.load_state_dict(other.state_dict())
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(p, q), name


def test_optimizer_on_compiled_updates_original() -> None:
    model, (x,) = build("conv_bn")
    compiled = memopt.compile(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(compiled.parameters(), lr=0.1)
    default_loss(compiled(x)).backward()
    assert all(p.grad is not None for p in model.parameters())
    opt.step()
    for name, p in model.named_parameters():
        assert not torch.equal(p.detach(), before[name]), f"{name} not updated"
    assert int(model.bn1.num_batches_tracked) == 1


def test_keyword_arguments_match_eager() -> None:
    model, (x, mask) = build("input_grad")
    eager = copy.deepcopy(model)
    compiled = memopt.compile(model)
    x_e, x_o = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    out_e, out_o = eager(x_e, mask=mask), compiled(x_o, mask=mask)
    torch.testing.assert_close(out_o, out_e, **FP32)
    default_loss(out_e).backward()
    default_loss(out_o).backward()
    torch.testing.assert_close(x_o.grad, x_e.grad, **FP32)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **FP32, msg=name)


def test_train_eval_switch_the_original() -> None:
    model, _ = build("transformer")
    compiled = memopt.compile(model)
    compiled.eval()
    assert not model.training and not compiled.training
    compiled.train()
    assert model.training and compiled.training
    model.eval()
    assert not compiled.original_module.training


# --------------------------------------------------------------------------
# memopt.plan
# --------------------------------------------------------------------------


@pytest.mark.parametrize("case_name", ["conv_bn", "transformer", "input_grad", "frozen_lora"])
def test_plan_changes_no_parameter_buffer_or_grad(case_name: str) -> None:
    model, inputs = build(case_name)
    # some gradients set (from an eager step), and BatchNorm statistics already moved
    default_loss(model(*inputs)).backward()
    params = list(model.parameters())
    params[0].grad = None  # one None among the set ones
    before = snapshot(model)
    grad_objects = [p.grad for p in model.parameters()]
    input_grads = [None if x.grad is None else x.grad.clone() for x in inputs]
    rng = torch.get_rng_state()
    plan = memopt.plan(model, *inputs)
    assert torch.equal(torch.get_rng_state(), rng), "planning drew random numbers"
    assert plan.predicted_peak_bytes > 0
    assert_snapshot_equal(before, snapshot(model))
    assert all(p.grad is g for p, g in zip(model.parameters(), grad_objects))
    for x, g in zip(inputs, input_grads):
        assert (x.grad is None) if g is None else torch.equal(x.grad, g)


def test_plan_of_fresh_model_leaves_grads_none() -> None:
    model, (x,) = build("conv_bn")
    before = snapshot(model)
    memopt.plan(model, x)
    assert_snapshot_equal(before, snapshot(model))


@pytest.mark.parametrize("case_name", ["mlp", "conv_bn", "transformer", "tuple_outputs"])
def test_plan_predicts_what_compile_runs(case_name: str) -> None:
    model, inputs = build(case_name)
    planned = memopt.plan(model, *inputs)
    compiled = memopt.compile(model)
    out = compiled(*inputs)
    ran = compiled.memopt_plan  # as it runs, before the caller's loss is measured
    default_loss(out).backward()
    assert ran is not None
    assert planned.predicted_peak_bytes == ran.predicted_peak_bytes
    assert planned.baseline_peak_bytes == ran.baseline_peak_bytes
    assert [s.shape for s in planned.saved] == [s.shape for s in ran.saved]


def test_plan_accepts_a_compiled_module_and_kwargs() -> None:
    model, (x, mask) = build("input_grad")
    compiled = memopt.compile(model)
    by_args = memopt.plan(compiled, x, mask)
    by_kwargs = memopt.plan(model, x, example_kwargs={"mask": mask})
    assert by_args.predicted_peak_bytes == by_kwargs.predicted_peak_bytes


def test_plan_without_a_backward_is_a_value_error() -> None:
    model, (x,) = build("mlp")
    model.requires_grad_(False)
    with pytest.raises(ValueError):
        memopt.plan(model, x)


def test_plan_json_round_trip() -> None:
    model, (x,) = build("conv_bn")
    plan = memopt.plan(model, x, budget="100GB")
    text = plan.model_dump_json()
    again = memopt.MemoryPlan.model_validate_json(text)
    assert again == plan
    assert again.model_dump_json() == text


def test_plan_is_frozen() -> None:
    model, (x,) = build("mlp")
    plan = memopt.plan(model, x)
    with pytest.raises(Exception):
        plan.predicted_peak_bytes = 0  # type: ignore[misc]


def test_summary_names_peak_and_saved_modules() -> None:
    model, (x,) = build("mlp")
    plan = memopt.plan(model, x)
    text = plan.summary()
    assert memopt.format_bytes(plan.predicted_peak_bytes) in text
    assert memopt.format_bytes(plan.baseline_peak_bytes) in text
    linear_names = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert any(s.module in linear_names for s in plan.saved)
    assert len(plan.saved) <= 20  # every row is printed
    for s in plan.saved:
        assert s.name[:28] in text
        if s.module:
            assert f"{s.module} ({s.module_type})"[:32] in text


@pytest.mark.parametrize("case_name", ["mlp", "resnet", "transformer", "frozen_lora"])
def test_saved_tensors_carry_module_names(case_name: str) -> None:
    """Names come from nn_module_stack: qualified paths of the user's model."""
    model, inputs = build(case_name)
    plan = memopt.plan(model, *inputs)
    assert plan.saved
    named = dict(model.named_modules())
    with_module = [s for s in plan.saved if s.module]
    assert with_module, "no saved tensor names its module"
    for s in with_module:
        assert s.module in named, f"{s.name}: {s.module!r} is not a module of the model"
        assert type(named[s.module]).__name__ == s.module_type, (s.module, s.module_type)
    # submodules nested two levels deep are named by their full path
    if case_name in ("resnet", "transformer", "frozen_lora"):
        assert any("." in s.module for s in with_module), [s.module for s in with_module]


# --------------------------------------------------------------------------
# Budgets
# --------------------------------------------------------------------------


@pytest.mark.parametrize("value, expected", [
    (None, None),
    ("4GB", Budget(nbytes=4 * 10**9)),
    ("4GiB", Budget(nbytes=4 * 2**30)),
    ("512MB", Budget(nbytes=512 * 10**6)),
    ("1.5 GiB", Budget(nbytes=3 * 2**29)),
    (" 4GB ", Budget(nbytes=4 * 10**9)),
    (4096, Budget(nbytes=4096)),
    (1, Budget(nbytes=1)),
    (0.5, Budget(fraction=0.5)),
    (1.0, Budget(fraction=1.0)),
    (np.float32(0.5), Budget(fraction=0.5)),  # NumPy scalars: refused until 2026-12-01
    (np.int64(4096), Budget(nbytes=4096)),
])
def test_parse_budget_valid(value: object, expected: Budget | None) -> None:
    assert memopt.parse_budget(value) == expected


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=1, max_value=10**15))
def test_parse_budget_any_positive_byte_count(n: int) -> None:
    assert memopt.parse_budget(n) == Budget(nbytes=n)
    assert memopt.parse_budget(f"{n}B") == Budget(nbytes=n)
    assert memopt.parse_budget(f"{n}KiB") == Budget(nbytes=n * 1024)


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=0.0, max_value=1.0, exclude_min=True))
def test_parse_budget_any_fraction(f: float) -> None:
    assert memopt.parse_budget(f) == Budget(fraction=f)


@pytest.mark.parametrize("value", [
    "4 apples", "", "GB", "-1GB", "0GB", "four GB", -1, 0, 1.5, 0.0, -0.25, math.nan,
    math.inf, True, False, [1], {"bytes": 1}, b"4GB",
])
def test_parse_budget_invalid(value: object) -> None:
    with pytest.raises(ValueError):
        memopt.parse_budget(value)


@pytest.mark.parametrize("value", ["4 apples", -1, 0, 1.5, True, [1]])
def test_compile_rejects_bad_budget_at_once(value: object) -> None:
    model, _ = build("mlp")
    with pytest.raises(ValueError):
        memopt.compile(model, budget=value)


def test_budget_error_message_names_accepted_forms() -> None:
    # A human-facing message: the only test that reads one.
    with pytest.raises(ValueError) as info:
        memopt.parse_budget("4 apples")
    assert "4GB" in str(info.value)


def test_budget_below_minimum_raises_budget_error_at_first_call() -> None:
    model, (x,) = build("conv_bn")
    compiled = memopt.compile(model, budget=1)  # one byte: no error yet
    before = snapshot(model)
    with pytest.raises(memopt.BudgetError) as info:
        compiled(x)
    err = info.value
    assert isinstance(err, memopt.MemoptError)
    assert err.budget_bytes == 1
    assert err.minimum_bytes > err.budget_bytes
    assert err.baseline_bytes > 0
    assert 0 < err.minimum_bytes <= err.baseline_bytes
    # nothing ran: BatchNorm did not count a step
    assert_snapshot_equal(before, snapshot(model))
    # the minimum is the plan memopt makes without a budget
    # recomputation can go below the plan without a budget, never above it
    assert err.minimum_bytes <= memopt.plan(model, x).predicted_peak_bytes
    # the next call raises again (it does not fall back to running eagerly)
    with pytest.raises(memopt.BudgetError):
        compiled(x)
    assert_snapshot_equal(before, snapshot(model))


def test_small_fraction_budget_raises_budget_error() -> None:
    model, (x,) = build("mlp")
    compiled = memopt.compile(model, budget=0.01)
    with pytest.raises(memopt.BudgetError) as info:
        compiled(x)
    err = info.value
    assert err.budget_bytes == int(0.01 * err.baseline_bytes)


def test_large_budget_trains_and_is_recorded() -> None:
    case = CASES["conv_bn"]
    run = check_matches_eager(case.make_model, case.make_inputs, budget="100GB", steps=2,
                              make_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    plan = run.compiled.memopt_plan
    assert plan.budget_bytes == 100 * 10**9
    assert plan.predicted_peak_bytes <= plan.budget_bytes


def test_fraction_one_budget_works() -> None:
    case = CASES["transformer"]
    run = check_matches_eager(case.make_model, case.make_inputs, budget=1.0)
    plan = run.compiled.memopt_plan
    assert plan.budget_bytes == plan.baseline_peak_bytes
    assert plan.predicted_peak_bytes <= plan.budget_bytes


def test_budget_is_reported_by_memopt_plan() -> None:
    model, (x,) = build("mlp")
    assert memopt.plan(model, x).budget_bytes is None
    assert memopt.plan(model, x, budget="512MB").budget_bytes == 512 * 10**6


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


def test_a_graph_break_is_a_capture_error_with_fullgraph_and_in_plan() -> None:
    """memopt.compile plans graph breaks (tests/test_graph_breaks.py); fullgraph=True
    refuses them, as memopt.plan must (it never runs the code between graphs)."""
    torch.manual_seed(0)
    compiled = memopt.compile(ItemBranch(), fullgraph=True)
    x = torch.randn(4, 8)
    with pytest.raises(memopt.CaptureError) as info:
        compiled(x)
    assert isinstance(info.value, memopt.MemoptError)
    with pytest.raises(memopt.CaptureError):
        memopt.plan(ItemBranch(), x)


@pytest.mark.parametrize("not_a_module", [object(), lambda x: x, "model", None])
def test_compile_rejects_non_modules(not_a_module: object) -> None:
    with pytest.raises(TypeError):
        memopt.compile(not_a_module)


def test_compile_rejects_a_compiled_module() -> None:
    model, _ = build("mlp")
    with pytest.raises(TypeError):
        memopt.compile(memopt.compile(model))


# --------------------------------------------------------------------------
# torch.compile(backend="memopt")
# --------------------------------------------------------------------------


@pytest.mark.parametrize("case_name", ["mlp", "conv_bn", "transformer"])
def test_torch_compile_backend_name(case_name: str) -> None:
    case = CASES[case_name]
    check_matches_eager(
        case.make_model, case.make_inputs, steps=2,
        make_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05),
        compile_fn=lambda m: torch.compile(m, backend="memopt"),
    )


def test_torch_compile_backend_object_with_budget() -> None:
    case = CASES["mlp"]
    backend = memopt.MemoptBackend(budget="100GB")
    check_matches_eager(case.make_model, case.make_inputs,
                        compile_fn=lambda m: torch.compile(m, backend=backend))
    assert len(backend.plans) == 1
    assert backend.plans[0].budget_bytes == 100 * 10**9


# --------------------------------------------------------------------------
# Plan invariants, checked apart from memopt.allocator
# --------------------------------------------------------------------------


def check_plan_invariants(plan: memopt.MemoryPlan, model: nn.Module, inputs: tuple) -> None:
    # the headline numbers are ordered
    # (what the rest of the step holds, the caller's loss among it, is beside the arena)
    outside = sum(s.nbytes for s in plan.storages if s.kind == "outside")
    assert 0 < plan.lower_bound_bytes <= plan.arena_bytes + outside
    assert plan.lower_bound_bytes <= plan.predicted_peak_bytes
    assert plan.predicted_peak_bytes <= plan.no_reuse_bytes
    assert plan.predicted_peak_bytes <= plan.baseline_peak_bytes, "in-place raised the peak"
    assert plan.resident_bytes <= plan.lower_bound_bytes
    assert plan.resident_bytes <= plan.sharing_bytes

    storages = plan.storages
    assert storages
    for s in storages:
        assert s.kind in KINDS, s
        assert s.nbytes >= 0
        assert s.start <= s.end, s
        assert (s.start == -1) == (s.kind in RESIDENT), s

    # resident bytes: the model's parameters and buffers and the inputs, per storage
    def storage_bytes(tensors) -> int:
        seen: dict[int, int] = {}
        for t in tensors:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(seen.values())

    kind_bytes = {k: sum(s.nbytes for s in storages if s.kind == k) for k in RESIDENT}
    params = storage_bytes(model.parameters())
    buffers = storage_bytes(model.buffers())
    tensor_inputs = storage_bytes(x for x in inputs if isinstance(x, torch.Tensor))
    assert kind_bytes == {"parameter": params, "buffer": buffers, "input": tensor_inputs}
    assert plan.resident_bytes == params + buffers + tensor_inputs

    # the arena: no two storages live at the same step share a byte
    dynamic = [s for s in storages if s.kind not in RESIDENT and s.kind != "outside"]
    for s in dynamic:
        assert s.offset is not None and s.offset >= 0, s
        assert s.offset + s.nbytes <= plan.arena_bytes - plan.resident_bytes, s
    for a, b in itertools.combinations(dynamic, 2):
        if a.nbytes == 0 or b.nbytes == 0:
            continue
        live_together = a.start <= b.end and b.start <= a.end
        share_bytes = a.offset < b.offset + b.nbytes and b.offset < a.offset + a.nbytes
        assert not (live_together and share_bytes), (
            f"{a.name} [{a.start},{a.end}] @[{a.offset},{a.offset + a.nbytes}) and "
            f"{b.name} [{b.start},{b.end}] @[{b.offset},{b.offset + b.nbytes}) overlap"
        )

    # in-place rewrites: never into a parameter, buffer, input or tangent, and never over
    # a value the backward reads (a saved tensor) -- the storage may hold a saved value
    # only if the rewritten node (or a later one) produced it
    saved_names = {s.name for s in plan.saved}
    home = {node: s for s in storages for node in s.nodes}
    for r in plan.inplace:
        assert r.graph in ("fw", "bw")
        node = f"{r.graph}.{r.node}"
        assert node in home, f"in-place node {node} lives in no storage"
        target = home[node]
        assert home.get(f"{r.graph}.{r.writes_into}") is target, (
            f"{node} writes into {r.writes_into}, which is not in its storage")
        assert target.kind not in (*RESIDENT, "tangent"), (
            f"in-place {node} ({r.inplace_op}) writes into a {target.kind} storage "
            f"{target.name}")
        earlier = target.nodes[: target.nodes.index(node)]
        overwritten = [n for n in earlier if n.split(".", 1)[1] in saved_names]
        assert not overwritten, (
            f"in-place {node} ({r.inplace_op}) overwrites saved value(s) {overwritten}")
        assert r.writes_into not in saved_names, (
            f"in-place {node} overwrites saved value {r.writes_into}")

    # tag sharing (Chen Fig. 2): storages with one tag never live at the same step, the
    # tag's block holds the largest, and every tag used more than once is a SharingGroup
    by_tag: dict[int, list] = {}
    for s in dynamic:
        assert s.tag is not None, s
        by_tag.setdefault(s.tag, []).append(s)
    groups = {g.tag: g for g in plan.sharing}
    assert len(groups) == len(plan.sharing)
    for tag, members in by_tag.items():
        for a, b in itertools.combinations(members, 2):
            assert a.end < b.start or b.end < a.start, (tag, a, b)
        if len(members) > 1:
            assert tag in groups, f"tag {tag} is shared but has no SharingGroup"
            assert groups[tag].nbytes >= max(m.nbytes for m in members)
            assert sorted(groups[tag].storages) == sorted(m.name for m in members)
    assert set(groups) <= set(by_tag)
    assert plan.sharing_bytes - plan.resident_bytes == sum(
        max(m.nbytes for m in members) for members in by_tag.values())

    # saved tensors are forward values with their bytes counted at most once
    assert sum(s.nbytes for s in plan.saved) == plan.saved_bytes
    assert plan.num_forward_steps > 0 and plan.num_backward_steps > 0


@pytest.mark.parametrize("case", CORPUS, ids=lambda c: c.name)
def test_plan_invariants(case: Case) -> None:
    torch.manual_seed(0)
    model = case.make_model()
    torch.manual_seed(1)
    inputs = case.make_inputs()
    check_plan_invariants(memopt.plan(model, *inputs), model, inputs)


@pytest.mark.parametrize("case_name", ["conv_bn", "transformer"])
def test_storage_names_are_unique(case_name: str) -> None:
    """A storage's name identifies it: SharingGroup.storages refers to storages by name."""
    model, inputs = build(case_name)
    plan = memopt.plan(model, *inputs)
    names = [s.name for s in plan.storages]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    assert not duplicates, f"{len(duplicates)} storage names name several storages: {duplicates}"


@pytest.mark.parametrize("case_name", ["mlp", "inplace_views"])
def test_plan_invariants_of_compiled_run(case_name: str) -> None:
    model, inputs = build(case_name)
    compiled = memopt.compile(model)
    default_loss(compiled(*inputs)).backward()
    check_plan_invariants(compiled.memopt_plan, model, inputs)


def test_inplace_option_off() -> None:
    model, inputs = build("mlp")
    plan = memopt.plan(model, *inputs, inplace=False)
    assert plan.inplace == ()
    assert plan.predicted_peak_bytes == plan.baseline_peak_bytes
    check_plan_invariants(plan, model, inputs)
    case = CASES["mlp"]
    check_matches_eager(case.make_model, case.make_inputs,
                        compile_fn=lambda m: memopt.compile(m, inplace=False))


def test_invariant_checker_catches_broken_plans() -> None:
    """The checker above is not vacuous: it rejects an overlapping arena and an
    in-place rewrite over a saved value."""
    model, inputs = build("mlp")
    plan = memopt.plan(model, *inputs)
    check_plan_invariants(plan, model, inputs)

    dynamic = [s for s in plan.storages if s.kind not in RESIDENT and s.nbytes > 0]
    a, b = next((a, b) for a, b in itertools.combinations(dynamic, 2)
                if a.start <= b.end and b.start <= a.end)
    moved = tuple(s.model_copy(update={"offset": a.offset}) if s is b else s
                  for s in plan.storages)
    with pytest.raises(AssertionError, match="overlap"):
        check_plan_invariants(plan.model_copy(update={"storages": moved}), model, inputs)

    assert plan.inplace
    rewrite = plan.inplace[0]
    fake_saved = plan.saved[0].model_copy(update={"name": rewrite.writes_into})
    broken = plan.model_copy(update={"saved": (*plan.saved, fake_saved)})
    with pytest.raises(AssertionError, match="overwrites saved"):
        check_plan_invariants(broken, model, inputs)


def test_too_many_shapes_gives_a_clear_error() -> None:
    compiled = memopt.compile(nn.Linear(4, 4))
    with torch._dynamo.config.patch(recompile_limit=2), \
            pytest.raises(memopt.CaptureError, match="recompile_limit"):
        for n in range(1, 5):
            compiled(torch.randn(n, 4)).sum().backward()


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.fc(x))


def test_a_code_torch_compile_gave_up_on_is_planned_by_a_new_module() -> None:
    """Nine modules of one class under memopt.compile, then one under
    torch.compile(backend="memopt"), which hits dynamo's recompile limit on the class's
    forward: dynamo runs that code eagerly for good, and the next memopt.compile planned
    nothing, with a warning that blamed a graph break in a loop (found from outside)."""
    x = torch.randn(2, 4)
    for _ in range(9):
        memopt.compile(_Twice())(x).sum().backward()
    torch.compile(_Twice(), backend="memopt")(x).sum().backward()
    compiled = memopt.compile(_Twice(), budget="1GB")
    compiled(x).sum().backward()
    assert compiled.memopt_plan is not None


class _Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        self.calls += 1
        return self.fc(x) * (1.0 + 0.01 * self.calls)


def test_a_python_counter_read_in_the_forward_is_named_past_the_limit() -> None:
    """A step counter the forward reads is a constant of each graph, so every step is
    captured again; past the limit the error blamed shapes, dtypes or train/eval mode
    while none changed (found from outside). It names dynamo's failed guard and the fix."""
    compiled = memopt.compile(_Counting())
    x = torch.randn(2, 4)
    with torch._dynamo.config.patch(recompile_limit=2), \
            pytest.raises(memopt.CaptureError, match=r"self\.calls == \d.*pass it as a tensor"):
        for _ in range(4):
            compiled(x).sum().backward()


def test_recursion_limit_in_compilation_names_the_fix(monkeypatch) -> None:
    import memopt.compiled_graph

    def deep(*_a, **_k):
        raise RecursionError("maximum recursion depth exceeded during compilation")

    monkeypatch.setattr(memopt.compiled_graph, "plan_joint", deep)
    with pytest.raises(memopt.CaptureError, match="setrecursionlimit"):
        memopt.plan(nn.Linear(4, 4), torch.randn(2, 4))


@pytest.mark.parametrize("loss", ["mse_loss", "smooth_l1_loss", "binary_cross_entropy",
                                  "soft_margin_loss"])
def test_losses_hold_only_their_scalar(loss) -> None:
    """Eager's kernels for these losses return the reduced scalar as a view of the whole
    elementwise buffer (a 4-byte tensor on a (64, 256) float storage), which the plan's
    FakeTensors do not show; memopt decomposes them, so the loss it returns holds 4
    bytes, and the gradients stay eager's."""
    torch.manual_seed(0)

    class Regression(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(32, 256)

        def forward(self, x, y):
            return getattr(nn.functional, loss)(torch.sigmoid(self.lin(x)), y)

    model = Regression()
    x, y = torch.randn(64, 32), torch.rand(64, 256)
    assert model(x, y).untyped_storage().nbytes() == 64 * 256 * 4  # the quirk, in eager
    out = memopt.compile(model)(x, y)
    assert out.untyped_storage().nbytes() == 4
    torch.testing.assert_close(out, model(x, y))
    got = torch.autograd.grad(out, list(model.parameters()))
    ref = torch.autograd.grad(model(x, y), list(model.parameters()))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("progress", [True, False])
def test_a_long_plan_shows_progress_on_a_terminal_unless_asked_not_to(progress, monkeypatch):
    """tqdm's bar on stderr for a budget search (after PROGRESS_DELAY seconds; 0 here), on
    a terminal only, and never with progress=False."""
    import memopt.planner.plan as planning

    monkeypatch.setattr(planning, "PROGRESS_DELAY", 0.0)
    stderr = _Terminal()
    monkeypatch.setattr(sys, "stderr", stderr)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
                            for _ in range(6)])
    plan = memopt.plan(model, torch.randn(256, 64), budget=0.7, progress=progress)
    assert plan.search
    assert ("memopt: planning" in stderr.getvalue()) == progress


def test_the_plan_reports_capture_and_planning_time() -> None:
    plan = memopt.plan(nn.Sequential(nn.Linear(16, 16), nn.ReLU()), torch.randn(4, 16))
    assert plan.capture_seconds > 0 and plan.plan_seconds > 0
    assert "s capture (dynamo + AOTAutograd)" in plan.summary()


def test_fraction_budget_never_refuses_a_step_needing_fewer_bytes():
    """A fraction budget that a step accepted is not refused at a shape that needs fewer
    bytes: TinyLM at 0.3 trains at 96 tokens a row; at 8 tokens its own smallest fraction
    is 0.68 (its fixed bytes, the weights, are most of it), so 0.3 of that step's baseline
    was refused. That step is given the bytes the fraction gave the step already accepted
    (plan.budget_bytes), and measures within them; a larger shape keeps its own fraction."""
    from memopt.errors import BudgetError
    from memopt.measure import allocation_peak
    from support import TinyLM, V

    torch.manual_seed(0)
    model = TinyLM(V, dropout=0.0)

    def tokens(n):
        return torch.randint(0, V, (8, n)), torch.randint(0, V, (8, n))

    with pytest.raises(BudgetError):
        memopt.plan(model, *tokens(8), budget=0.3)  # alone, the small step is refused
    compiled = memopt.compile(model, budget=0.3)
    compiled(*tokens(96)).backward()
    accepted = compiled.memopt_plan.budget_bytes
    assert accepted == int(0.3 * compiled.memopt_plan.baseline_peak_bytes)
    small = tokens(8)
    model.zero_grad(set_to_none=True)
    compiled(*small)  # plans, outside the measurement
    resident = sum(t.untyped_storage().nbytes() for t in (*model.parameters(), *small))
    model.zero_grad(set_to_none=True)
    with allocation_peak("cpu") as seen:
        compiled(*small).backward()
    plan = compiled.memopt_plan
    assert plan.budget_bytes == accepted and plan.fits
    assert seen.peak + resident <= accepted
    model.zero_grad(set_to_none=True)
    compiled(*tokens(192)).backward()
    big = compiled.memopt_plan
    assert big.budget_bytes == int(0.3 * big.baseline_peak_bytes) > accepted


def test_the_smallest_budget_a_plan_names_is_accepted_by_compile():
    """memopt.plan counts what the step holds outside its graph as memopt.compile does (a
    buffer the forward never reads, as a Llama's rotary table can be): the smallest budget
    its BudgetError names compiles and trains. (They were 136 bytes apart on the benchmark
    Llama, and compile refused the plan's minimum.)"""
    from memopt.errors import BudgetError

    class WithTable(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
            self.register_buffer("table", torch.zeros(1000))  # never read by forward

        def forward(self, x):
            return self.body(x).square().mean()

    torch.manual_seed(0)
    model, x = WithTable(), torch.randn(128, 64)
    with pytest.raises(BudgetError) as err:
        memopt.plan(model, x, budget=1)
    minimum = err.value.minimum_bytes
    compiled = memopt.compile(model, budget=minimum)
    compiled(x).backward()
    assert compiled.memopt_plan.fits
    model.zero_grad(set_to_none=True)
    assert memopt.plan(model, x, budget=minimum).predicted_peak_bytes == \
        compiled.memopt_plan.predicted_peak_bytes
