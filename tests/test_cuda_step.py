"""The whole training step on a CUDA device: ``python -m pytest -q -m cuda``.

What tests/test_cuda.py does not run on the GPU, each against eager PyTorch on the same
device:

* the optimizer inside the budget (``optimizer=``): stepped inside the backward where the
  budget needs it (issue 26), and a foreach ``optimizer.step()`` (CUDA's default) run in
  chunks of parameters (memopt.optimizer_step): eager's parameters after three steps, the
  whole step (parameters, gradients, optimizer state, the step's temporaries) measured
  within the budget and near the plan;
* repeated blocks (``blocks=True``, issue 27), under ``kernels="aten"`` and
  ``"inductor"``: one graph run by every block, eager's parameters after four steps with
  dropout, every step after the first within the budget;
* the caching allocator's reserved peak (issue 26, item 5) on the corpus models, each
  measured from an emptied cache: within the budget (or, with none, the prediction) and a
  stated slack, RESERVED_SLACK, and within RESERVED_MODEL of memopt's model of the
  allocator (MemoryPlan.cuda_reserved_bytes); ``python -m benchmarks.reserved`` measures
  larger models.

A step that compiles inductor's kernels holds more than its plan on a GPU: the first run
of a Triton kernel with several candidate configurations benchmarks them
(``CachingAutotuner``), and inductor's benchmarker allocates a buffer of the GPU's L2 size
to flush the cache between runs (about 60 MiB on an H200). That is the first step, and,
with graph breaks or blocks, the step after it, which runs the re-planned graphs
(docs/limits.md); the test bounds those steps by the plan plus that buffer.

Measured peaks are read as tests/test_cuda.py reads them: the rise of
``max_memory_allocated`` over what was allocated before the step, plus the tensors that
lived before it and the budget counts.

``MEMOPT_TEST_DEVICE=cpu python -m pytest -m cuda tests/test_cuda_step.py`` runs the same
bodies on the CPU (allocated bytes from the profiler): the dry run of a GPU session's
script on a machine without one.
"""

from __future__ import annotations

import copy
import gc
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from test_blocks import Stack
from test_cuda import PEAK_MODELS
from test_optimizer import Blocks

import memopt
from memopt.memory_plan import StepPlan

DEVICE = os.environ.get("MEMOPT_TEST_DEVICE", "cuda")
ON_CUDA = DEVICE.startswith("cuda")

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(ON_CUDA and not torch.cuda.is_available(), reason="needs a CUDA device"),
]

#: fp32 on both sides; cuBLAS and fused kernels sum in another order (tests/test_cuda.py)
TOL = {"rtol": 1e-4, "atol": 1e-5}
INDUCTOR_TOL = {"rtol": 1e-3, "atol": 1e-4}
#: AdamW's default kind on the device: foreach on CUDA; the CPU dry run asks for it
FOREACH = None if ON_CUDA else True
#: measured above the plan at most this much (CUDA's headroom, README "What a budget counts")
OVER_PLAN = 1.03


@contextmanager
def step_peak(report: dict[str, Any]) -> Iterator[None]:
    """The block's allocated peak over what was allocated when it began (``report
    ["allocated"]``) and, on CUDA, the reserved peak less what was allocated outside the
    counted tensors (``report["reserved_raw"]``, ``report["before"]``)."""
    gc.collect()
    if not ON_CUDA:
        from memopt.measure import allocation_peak  # noqa: PLC0415

        with allocation_peak("cpu") as seen:
            yield
        report["allocated"] = seen.peak
        return
    torch.cuda.synchronize()
    report["before"] = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    yield
    torch.cuda.synchronize()
    report["allocated"] = torch.cuda.max_memory_allocated() - report["before"]
    report["reserved_raw"] = torch.cuda.max_memory_reserved()


def _counted(report: dict[str, Any], resident: int) -> tuple[int, int | None]:
    """(allocated, reserved) as a budget counts them, `resident` bytes lived before."""
    if "reserved_raw" not in report:
        return report["allocated"] + resident, None
    outside = report["before"] - resident  # cuBLAS's workspaces and the like
    return report["allocated"] + resident, report["reserved_raw"] - outside


def _report(**row: Any) -> None:
    path = os.environ.get("MEMOPT_CUDA_REPORT")
    if path:
        row["device"] = torch.cuda.get_device_name() if ON_CUDA else "cpu"
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def _bytes(tensors: Any) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def _minimum(model: torch.nn.Module, x: torch.Tensor, **options: Any) -> int:
    """The smallest budget memopt accepts for the whole step with AdamW (default kind)."""
    probe = copy.deepcopy(model)
    opt = torch.optim.AdamW(probe.parameters(), foreach=FOREACH)
    with pytest.raises(memopt.BudgetError) as err:
        memopt.plan(probe, x, budget=1, optimizer=opt, **options)
    return err.value.minimum_bytes


def _optimizer_steps(compiled: Callable, model: torch.nn.Module, opt: torch.optim.Optimizer,
                     x: torch.Tensor, steps: int) -> list[tuple[int, int | None]]:
    """(allocated, reserved) of each whole step: forward, backward, step, zero_grad."""
    compiled(x)  # plans outside the measurement
    resident = _bytes([*model.parameters(), x])
    seen = []
    for _ in range(steps):
        state = _bytes(t for st in opt.state.values() for t in st.values()
                       if isinstance(t, torch.Tensor) and t.device.type == x.device.type)
        report: dict[str, Any] = {}
        with step_peak(report):
            compiled(x).backward()
            opt.step()
            opt.zero_grad()
        seen.append(_counted(report, resident + state))
    return seen


def _eager_steps(model: torch.nn.Module, x: torch.Tensor, steps: int) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=FOREACH)
    for _ in range(steps):
        model(x).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("stepping", [True, False], ids=["step_in_backward", "chunked_step"])
def test_the_optimizer_inside_the_budget_on_cuda(stepping: bool) -> None:
    """At a budget below the smallest one the plain step needs: with `stepping`, the
    optimizer steps each parameter inside the backward and frees its gradient; without
    it, the foreach step runs in chunks of parameters. Three AdamW steps: eager's
    parameters, every whole step within the budget and within 3% above the plan."""
    torch.manual_seed(0)
    model = Blocks(width=1024, depth=4).to(DEVICE)
    x = torch.randn(512, 1024, device=DEVICE)
    eager = copy.deepcopy(model)
    if stepping:  # between the two minima: only the step in the backward reaches it
        plain = _minimum(model, x, step_in_backward=False)
        budget = (plain + _minimum(model, x)) // 2
    else:
        budget = _minimum(model, x, step_in_backward=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=FOREACH)
    compiled = memopt.compile(model, budget=budget, optimizer=opt, step_in_backward=stepping)
    seen = _optimizer_steps(compiled, model, opt, x, steps=3)
    _eager_steps(eager, x, steps=3)
    plan = compiled.memopt_plan
    if stepping:
        assert plan.steps_in_backward == len(list(model.parameters())), plan.summary()
    else:
        assert plan.optimizer_step_chunk_bytes > 0, plan.summary()
        assert compiled._memopt_backend.chunked_step.steps == 3
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=name, **TOL)
    _report(test="optimizer", stepping=stepping, budget_bytes=plan.budget_bytes,
            predicted=plan.predicted_peak_bytes, measured=[a for a, _ in seen],
            reserved=[r for _, r in seen])
    for allocated, _ in seen[1:]:  # the first step makes the optimizer's state
        assert allocated <= plan.budget_bytes, (seen, plan.budget_bytes)
        assert allocated <= OVER_PLAN * plan.predicted_peak_bytes, (
            seen, plan.predicted_peak_bytes)


def _batch(step: int) -> torch.Tensor:
    return torch.randn(2048, 32, generator=torch.Generator().manual_seed(step)).to(DEVICE)


def _train_blocks(module: Callable, model: torch.nn.Module, steps: int
                  ) -> list[tuple[int, int | None]]:
    resident = _bytes(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        x = _batch(step)
        torch.manual_seed(step)  # CUDA's generator too: dropout draws eager's masks
        report: dict[str, Any] = {}
        with step_peak(report):
            module(x).backward()
        seen.append(_counted(report, resident + _bytes([x])))
        opt.step()
    return seen


@pytest.mark.parametrize("kernels", ["aten", "inductor"])
def test_blocks_on_cuda(kernels: str) -> None:
    """blocks=True at 80% of its budget=None plan: one graph for the six blocks, eager's
    parameters after four SGD steps with dropout, every step after the first (which
    plans) within the budget and within 3% above the plan."""
    torch.manual_seed(0)
    eager = Stack().to(DEVICE)
    model = copy.deepcopy(eager)
    probe = memopt.compile(copy.deepcopy(eager), blocks=True, kernels=kernels)
    torch.manual_seed(0)
    probe(_batch(0)).backward()
    budget = int(0.8 * probe.memopt_plan.predicted_peak_bytes)
    compiled = memopt.compile(model, budget=budget, blocks=True, kernels=kernels)
    seen = _train_blocks(compiled, model, steps=4)
    _train_blocks(eager, eager, steps=4)
    tol = INDUCTOR_TOL if kernels == "inductor" else TOL
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=name, **tol)
    plan = compiled.memopt_plan
    # one captured graph for the six blocks; a second plan of it for the later runs
    # (memopt.run_plans) is a twin entry with the same graph_index
    runs = ([plan.graphs[i].graph_index for i in plan.runs] if isinstance(plan, StepPlan)
            else [0] * len(model.blocks))
    assert max(runs.count(i) for i in set(runs)) == len(model.blocks), runs
    _report(test="blocks", kernels=kernels, budget_bytes=budget,
            predicted=plan.predicted_peak_bytes, measured=[a for a, _ in seen],
            reserved=[r for _, r in seen])
    compiling = 2 if kernels == "inductor" else 1  # the steps that ran new kernels
    for allocated, _ in seen[1:compiling]:
        assert allocated <= OVER_PLAN * plan.predicted_peak_bytes + _autotune_bytes(), (
            seen, plan.predicted_peak_bytes)
    for allocated, _ in seen[compiling:]:
        assert allocated <= budget, (seen, budget)
        assert allocated <= OVER_PLAN * plan.predicted_peak_bytes, (
            seen, plan.predicted_peak_bytes)


def _autotune_bytes() -> int:
    """What inductor's autotuner may hold on top of a compiling step: its L2-flushing
    buffer (the device's L2 size) and a margin for clones of the mutated arguments."""
    if not ON_CUDA:
        return 0
    return int(1.1 * torch.cuda.get_device_properties(DEVICE).L2_cache_size)


#: Reserved over the budget (or the prediction, with none) at most RESERVED_SLACK[0] times
#: it plus RESERVED_SLACK[1] bytes: the most python -m benchmarks.reserved measured on an
#: H200 was 1.39x a 78 MiB Llama's budget (+31 MiB) and +141 MiB over GPT-2's 2.3 GiB.
RESERVED_SLACK = (1.15, 48 * 2**20)
#: MemoryPlan.cuda_reserved_bytes against the measured reserved peak, at most this apart
#: (the H200 run's worst on the corpus models: 12%)
RESERVED_MODEL = 0.15


@pytest.mark.parametrize("budget", [None, 0.7])
@pytest.mark.parametrize("name", sorted(PEAK_MODELS))
def test_reserved_memory_within_the_budget_and_a_stated_slack(name: str, budget: Any) -> None:
    """The caching allocator's reserved peak of a steady step (two warm-up steps, the
    cache emptied before the model was built) less what the process holds outside the
    step, against the budget or the budget=None prediction."""
    model, inputs = _fresh(name)
    compiled = memopt.compile(model, budget=budget)
    try:
        _plain_step(compiled, model, inputs)
    except memopt.BudgetError as err:  # below reach: the smallest budget memopt accepts
        compiled = memopt.compile(model, budget=int(err.minimum_bytes / 0.96) + 1)
        _plain_step(compiled, model, inputs)
    allocated, reserved = _steady_step(compiled, model, inputs)
    plan = compiled.memopt_plan
    limit = plan.budget_bytes or plan.predicted_peak_bytes
    modelled = plan.cuda_reserved_bytes()
    _report(test="reserved", model=name, budget=budget, budget_bytes=plan.budget_bytes,
            predicted=plan.predicted_peak_bytes, measured=allocated, reserved=reserved,
            reserved_model=modelled)
    assert allocated <= OVER_PLAN * plan.predicted_peak_bytes, (allocated, plan)
    if reserved is not None:
        assert reserved <= RESERVED_SLACK[0] * limit + RESERVED_SLACK[1], (reserved, limit)
        # memopt.allocator.caching's model: within 12% of the H200's on these (worst 1.12x)
        assert abs(modelled - reserved) <= RESERVED_MODEL * reserved, (modelled, reserved)


@pytest.mark.parametrize("name", sorted(PEAK_MODELS))
def test_reserved_true_holds_reserved_memory_within_the_budget(name: str) -> None:
    """`reserved=True` (memopt.planner.plan, Step 6b) at 85% of the budget=None plan's
    modelled reserved bytes, or the smallest budget it accepts: the steady step's
    measured reserved peak within the budget, up to the model's error (RESERVED_MODEL).
    Not yet run on a GPU."""
    model, inputs = _fresh(name)
    budget = int(0.85 * memopt.plan(model, *inputs).cuda_reserved_bytes())
    try:
        memopt.plan(model, *inputs, budget=budget, reserved=True)
    except memopt.BudgetError as err:
        budget = err.minimum_bytes
    compiled = memopt.compile(model, budget=budget, reserved=True)
    _plain_step(compiled, model, inputs)
    allocated, reserved = _steady_step(compiled, model, inputs)
    plan = compiled.memopt_plan
    _report(test="reserved_true", model=name, budget_bytes=plan.budget_bytes,
            predicted=plan.predicted_peak_bytes, measured=allocated, reserved=reserved,
            reserved_model=plan.cuda_reserved_bytes())
    assert plan.reserved_bounded and allocated <= plan.budget_bytes, (allocated, plan)
    if reserved is not None:
        assert reserved <= (1 + RESERVED_MODEL) * plan.budget_bytes, (reserved, plan)


def _fresh(name: str) -> tuple[torch.nn.Module, tuple]:
    """PEAK_MODELS[name] on DEVICE, built after the allocator's cache was emptied."""
    gc.collect()
    if ON_CUDA:
        torch.cuda.empty_cache()
    torch.manual_seed(0)
    model, inputs = PEAK_MODELS[name]()
    return model.to(DEVICE), tuple(x.to(DEVICE) for x in inputs)


def _steady_step(compiled: Callable, model: torch.nn.Module, inputs: tuple
                 ) -> tuple[int, int | None]:
    """A step after one more warm-up: (allocated, reserved) as _counted reads them."""
    _plain_step(compiled, model, inputs)
    for p in model.parameters():  # freed before the measurement, not inside it
        p.grad = None
    report: dict[str, Any] = {}
    with step_peak(report):
        _plain_step(compiled, model, inputs)
    return _counted(report, _bytes([*model.parameters(), *model.buffers(), *inputs]))


def _plain_step(compiled: Callable, model: torch.nn.Module, inputs: tuple) -> None:
    """One step from no .grad: forward, the sum of the output, backward."""
    for p in model.parameters():
        p.grad = None
    compiled(*inputs).sum().backward()
