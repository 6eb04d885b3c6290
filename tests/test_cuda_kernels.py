"""``kernels="inductor"`` on a CUDA device: ``python -m pytest -q -m cuda``.

memopt plans the step and TorchInductor generates its kernels (memopt/kernels.py). On
the GPU that means Triton kernels, fused, where the CPU runs C++ ones; these tests
check there what tests/test_kernels.py checks on the CPU: eager's gradients (dropout's
masks included: random ops stay whole, ``fallback_random``), and the step's measured
peak (``max_memory_allocated``'s rise plus the resident tensors, as tests/test_cuda.py
reads it) within 10% of the plan's prediction and within an accepted budget. Every
measurement is appended to ``MEMOPT_CUDA_REPORT`` when it is set.

The corpus under inductor is tests/test_cuda.py's corpus test, parametrized.

Tolerances: inductor's fused reductions sum in another order than eager's kernels
(fp32 reassociation), so gradients compare at rtol 1e-3 / atol 1e-4 of the largest
gradient, looser than tests/test_cuda.py's aten graphs. The ResNet is compared with exact
(float64) gradients instead: on an H100 eager fp32's own ResNet gradients were 9.3e-4 of
the largest exact gradient away from them (cuDNN's algorithms), memopt's under inductor
9.3e-4, so an eager-to-memopt comparison at 1e-4 failed on noise both sides share
(``python -m benchmarks.gradient_error --device cuda``). memopt under inductor must be
within twice the worse of eager fp32's and torch.compile's error.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from test_cuda import (
    DEVICE,
    PEAK_MODELS,
    _compile_within_reach,
    _projection_loss,
    _report,
    _step,
    cuda_step_peak,
    peak_case,
)

from benchmarks.gradient_error import errors

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _check_against_eager(eager: torch.nn.Module, model: torch.nn.Module,
                         compiled: torch.nn.Module, inputs: tuple[Any, ...]) -> None:
    """Outputs, gradients and buffers of one step equal eager's (same seed)."""
    for m in (eager, model):
        m.zero_grad(set_to_none=True)
    out_e = _step(eager, inputs, 7)
    out_o = _step(compiled, inputs, 7)
    scale = max(p.grad.abs().max().item() for p in eager.parameters())
    torch.testing.assert_close(out_o, out_e, rtol=1e-3, atol=1e-4)
    for (name_p, p), q in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-4 * scale,
                                   msg=lambda m, n=name_p: f"{n}: {m}")
    for (name_b, b), c in zip(eager.named_buffers(), model.buffers()):
        torch.testing.assert_close(c, b, rtol=1e-3, atol=1e-5,
                                   msg=lambda m, n=name_b: f"buffer {n}: {m}")


@pytest.mark.parametrize("budget", [None, 0.7])
@pytest.mark.parametrize("name", sorted(PEAK_MODELS))
def test_inductor_kernels_on_cuda(name: str, budget: Any) -> None:
    eager, inputs = peak_case(name)
    model = copy.deepcopy(eager)
    compiled = _compile_within_reach(model, inputs, budget, kernels="inductor")
    plan = compiled.memopt_plan
    # Under a budget memopt may run aten instead, saying why: inductor's own schedule
    # would hold more than the budget leaves (memopt.kernels.schedule_excess).
    assert plan.kernels == "inductor" or (
        budget is not None and "inductor's schedule holds" in plan.kernels_note), plan.kernels_note
    model.load_state_dict(eager.state_dict())  # the planning step moved BatchNorm's stats

    if name == "resnet":
        worst = {run: err for run, _param, err in errors("resnet", DEVICE)}
        assert worst["memopt inductor"] <= 2 * max(worst["eager fp32"],
                                                   worst["torch.compile"]), worst
    else:
        _check_against_eager(eager, model, compiled, inputs)

    torch.manual_seed(1)
    step_peak, raw = cuda_step_peak(compiled, inputs, _projection_loss)
    predicted = plan.predicted_peak_bytes
    _report(test="inductor_peak", model=name, budget=budget, budget_bytes=plan.budget_bytes,
            baseline=plan.baseline_peak_bytes, predicted=predicted, measured=step_peak,
            raw_max_memory_allocated=raw, schedule_excess=plan.schedule_excess_bytes,
            recompute_flops=plan.recompute_flops, forward_flops=plan.forward_flops)
    assert abs(step_peak - predicted) <= 0.10 * predicted, (step_peak, predicted)
    if plan.budget_bytes is not None:
        assert step_peak <= plan.budget_bytes, (step_peak, plan.budget_bytes)

