"""memopt.allocator.caching: PyTorch's CUDA caching allocator as memopt models it (the
segments a step makes it reserve, what a GPU runs out of; issue 26, item 5). Each rule of
the module docstring is checked on a hand-made sequence whose segments are worked out
here; the -m cuda test (tests/test_cuda_step.py) checks the model against the GPU."""

from __future__ import annotations

import copy

import pytest
import torch

import memopt
from memopt.allocator.caching import (
    CachingAllocator,
    reserved_for,
    round_size,
    segment_size,
)
from test_cuda import PEAK_MODELS

MiB = 1 << 20


def test_sizes_round_and_pick_their_pool_and_segment() -> None:
    assert [round_size(n) for n in (1, 512, 513, 4000)] == [512, 512, 1024, 4096]
    assert segment_size(MiB) == 2 * MiB  # the small pool
    assert segment_size(MiB + 512) == 20 * MiB  # large, under 10 MiB: a 20 MiB segment
    assert segment_size(11 * MiB + 1) == 12 * MiB  # its own, rounded up to 2 MiB


def test_requests_share_segments_and_freed_blocks_merge() -> None:
    cache = CachingAllocator()
    small = [cache.malloc(1000) for _ in range(3)]  # one 2 MiB small segment
    a, b = cache.malloc(4 * MiB), cache.malloc(4 * MiB)  # one 20 MiB segment, split
    assert cache.reserved == 22 * MiB and {s for s, _ in small} == {0} and a[0] == b[0] == 1
    cache.free(a)
    cache.free(b)  # merged with `a` and the segment's rest: 20 MiB free again
    cache.malloc(15 * MiB)  # fits there: no new segment
    assert cache.reserved == 22 * MiB


def test_fragmentation_reserves_a_new_segment() -> None:
    """8 + 8 MiB in a 20 MiB segment, the first freed: 8 and 4 MiB free but not together,
    so 9 MiB takes a new segment: 40 MiB reserved for 17 MiB allocated."""
    cache = CachingAllocator()
    first = cache.malloc(8 * MiB)
    cache.malloc(8 * MiB)
    cache.free(first)
    cache.malloc(9 * MiB)
    assert (cache.reserved, cache.allocated) == (40 * MiB, 17 * MiB)


def test_a_repeated_step_reuses_what_the_first_one_cut() -> None:
    step = [(6 * MiB, 0, 1), (6 * MiB, 1, 2), (3 * MiB, 2, 3)]
    one = reserved_for([(MiB // 2, -1, 3), *step], repeats=1)
    assert reserved_for([(MiB // 2, -1, 3), *step], repeats=5) == one == 22 * MiB


def test_a_plans_reserved_bytes_are_its_peak_and_the_segments_around_it() -> None:
    """The corpus MLP (8 x 1024, batch 512): its plan's storages replayed through the model
    reserve more than the plan's peak, by less than one large segment per layer."""
    torch.manual_seed(0)
    model, inputs = PEAK_MODELS["mlp"]()
    plan = memopt.plan(model, *inputs)
    reserved = plan.cuda_reserved_bytes()
    assert plan.predicted_peak_bytes < reserved < plan.predicted_peak_bytes + 8 * 20 * MiB
    assert "reserved (model)" not in plan.summary()  # a CPU plan: no caching allocator


def _gelu_mlp() -> tuple[torch.nn.Module, torch.Tensor]:
    """Six Linear 512 + GELU layers at batch 2048: 4 MiB activations, each a 20 MiB
    segment's tenant in the model, so reserved runs well above allocated."""
    torch.manual_seed(0)
    layers = [m for _ in range(6) for m in (torch.nn.Linear(512, 512), torch.nn.GELU())]
    return torch.nn.Sequential(*layers, torch.nn.Linear(512, 1)), torch.randn(2048, 512)


def test_reserved_true_fits_the_budget_in_modelled_reserved_bytes() -> None:
    """`reserved=True` (memopt.planner.plan, Step 6b): at a budget the plain plan meets in
    allocated bytes but not in reserved ones, the plan fits both, recomputing more; it
    says so in summary(); the smallest budget it refuses with is one it then accepts."""
    model, x = _gelu_mlp()
    free = memopt.plan(model, x)
    budget = int(0.9 * free.predicted_peak_bytes)
    plain = memopt.plan(model, x, budget=budget)
    fits = plain.budget_bytes - plain.headroom_bytes
    assert plain.predicted_peak_bytes <= fits < plain.cuda_reserved_bytes()
    bounded = memopt.plan(model, x, budget=budget, reserved=True)
    assert bounded.reserved_bounded and not plain.reserved_bounded
    assert bounded.cuda_reserved_bytes() <= fits
    assert bounded.recompute_flops > plain.recompute_flops
    # the aim is bisected back towards the budget: the bounded plan keeps more than the
    # plain plan at a budget of its modelled reserved bytes would
    assert bounded.predicted_peak_bytes > 0.75 * plain.predicted_peak_bytes
    assert "the budget counts reserved bytes too" in bounded.summary()
    with pytest.raises(memopt.BudgetError, match="reserved=True") as err:
        memopt.plan(model, x, budget=int(0.7 * free.predicted_peak_bytes), reserved=True)
    smallest = memopt.plan(model, x, budget=err.value.minimum_bytes, reserved=True)
    assert smallest.cuda_reserved_bytes() <= smallest.budget_bytes - smallest.headroom_bytes


def test_reserved_must_be_a_bool() -> None:
    model, x = _gelu_mlp()
    with pytest.raises(ValueError, match="reserved must be True or False"):
        memopt.plan(model, x, budget=0.9, reserved="yes")


@pytest.mark.slow  # 19 s; the reserved=True budget itself: the GELU MLP test above
def test_reserved_true_trains_a_transformers_model_with_gradients_kept() -> None:
    """`reserved=True` on the zoo's Llama at 1.05x its no-budget plan's peak (or the
    smallest budget its step with .grad kept accepts), which the plain plan's modelled
    segments exceed: both kinds of step
    (the first, and the next finding .grad kept, as gradient accumulation does) fit the
    budget in modelled reserved bytes, measure within it in allocated ones, and give
    eager's accumulated gradients."""
    pytest.importorskip("transformers")
    from benchmarks.zoo import build, resident_bytes
    from memopt.measure import allocation_peak

    eager = build("llama")
    case = copy.deepcopy(eager)
    free = memopt.plan(copy.deepcopy(case.model), example_kwargs=case.kwargs)
    for _ in range(2):  # two micro-batches, gradients accumulated in .grad
        eager.run_step()
    # the step that finds .grad kept holds more: at least its smallest reserved budget
    with pytest.raises(memopt.BudgetError) as err:
        memopt.plan(copy.deepcopy(case.model), example_kwargs=case.kwargs, budget=1,
                    existing_grads=True, reserved=True)
    budget = max(int(1.05 * free.predicted_peak_bytes), err.value.minimum_bytes)
    plain = memopt.plan(copy.deepcopy(case.model), example_kwargs=case.kwargs, budget=budget,
                        existing_grads=True)
    # the segments bind, not the allocated peak
    assert plain.cuda_reserved_bytes() > budget - plain.headroom_bytes
    compiled = memopt.compile(case.model, budget=budget, reserved=True)
    measured = []
    for _ in range(2):
        with allocation_peak("cpu") as seen:
            case.run_step(compiled)
        measured.append(seen.peak + resident_bytes(case))
    plan = compiled.memopt_plan  # the step that found .grad kept
    assert plan.reserved_bounded and plan.existing_grad_bytes > 0, plan
    assert plan.cuda_reserved_bytes() <= budget - plan.headroom_bytes
    assert max(measured) <= budget, (measured, budget)
    for p, q in zip(case.model.parameters(), eager.model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
