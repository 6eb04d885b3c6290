"""Third-party models train under memopt.

Every family of the zoo (benchmarks/zoo.py: an encoder, two decoders, an
encoder-decoder, a state-space model (Mamba's sequential scan), a linear-attention
recurrence (RWKV's time-mixing loop), a vision transformer,
three CNNs, a model whose loss logs through
`logger.warning_once` and one that calls `.item()` between encoder and head) trains
through `memopt.compile` at budget=None and at a binding byte budget (below the
budget=None plan's predicted peak, so the plan must recompute): gradients equal eager's
after one step, and the allocated peak of the step after the first (which plans and
compiles) is within the budget and within 10% of the plan that ran it.

The default suite runs each family here but RWKV (12 s and 18 s: the Mamba is the
default suite's per-token loop of a language model); a case that another default test
already runs on the same model (Llama, ConvNeXt) or on one of the same family is
`-m slow`.

`MEMOPT_TEST_DEVICE=cuda` runs the same checks on a GPU (the peak read from
`max_memory_allocated`, cuDNN's TF32 off so that both sides compute in fp32):
`MEMOPT_TEST_DEVICE=cuda python -m pytest -m "slow or not slow" tests/test_zoo.py`.
"""

from __future__ import annotations

import copy
import os
import time
import warnings
from collections.abc import Iterator

import pytest
import torch
import transformers

import memopt
from benchmarks.zoo import ZOO, ZooCase, allocated_peak, build
from memopt.blocks import find_blocks
from support import offload_everywhere

pytest.importorskip("transformers")

#: Where the zoo trains: the CPU, or a GPU given by MEMOPT_TEST_DEVICE
DEVICE = os.environ.get("MEMOPT_TEST_DEVICE", "cpu")
if DEVICE.startswith("cuda") and not torch.cuda.is_available():
    pytest.skip("MEMOPT_TEST_DEVICE names CUDA, which is not available",
                allow_module_level=True)


@pytest.fixture(autouse=True)
def _fp32_convolutions() -> Iterator[None]:
    """cuDNN's convolutions in fp32 on a GPU (matmuls already are), scoped to each test."""
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        yield

#: The binding budget, as a fraction of the budget=None plan's predicted peak: low
#: enough to force recomputation. Where that is below the model's minimum (ResNet's
#: parameters and gradients are most of its step), halfway between the minimum memopt
#: names in its BudgetError and the budget=None plan.
BINDING = 0.85

#: How far above the allocated peak of a step inductor runs its plan may predict: the
#: ViT at a budget binding inductor's plan was predicted 8.6% above its measurement
#: (36,749,588 against 33,848,216 bytes) since memopt counts each C++ kernel's buffers live
#: over the whole kernel (memopt.kernels.KernelGroups; 7.1% before: memopt's model of
#: inductor's buffer pool holds more than inductor does there), every other single-graph
#: model within 2.7% before that change (docs/kernels.md)
INDUCTOR_PREDICTION = 0.09

#: The budget=None plan's predicted peak of each model and kernels, as the no-budget test
#: found it (the binding test plans it again when it runs alone). Under inductor the
#: binding budget is of inductor's no-budget plan, which fusion keeps well below the
#: op-by-op one (0.85 of the aten plan did not bind the Llama, GPT-2 or ConvNeXt there).
_NO_BUDGET_PEAK: dict[tuple[str, str], int] = {}


#: On CUDA, eager runs these models' attention as one fused kernel
#: (`_scaled_dot_product_efficient_attention`, which keeps no attention matrix), and the
#: traced graph, memopt's and torch.compile's alike, ran it as the decomposed softmax,
#: dropout and matmuls, which keep it: transformers 5.17 builds a constant all-True mask
#: under tracing where eager passes none, which SDPA's fused kernels refuse. Measured on
#: an H200 (2026-11-29), no budget: memopt / eager / aot_eager. memopt now drops that mask
#: (passes.constant_masks; on CPU with transformers 5.17 it drops every such mask, and the
#: traced graph of a mask-free SDPA call ran the fused kernel on the H200): expected to
#: pass, not yet run on a GPU; an xfail here says it did not.
_TRACED_ATTENTION_ON_CUDA = {
    "bert": "258,899,200 / 237,467,904 / 289,175,808 bytes",
    "distilbert_item": "92,328,016 / 79,265,360 / 91,934,800 bytes",
    "vit": "68,036,520 / 65,661,864 / 68,036,520 bytes",
}


def no_budget_over_eager(name: str) -> float:
    """How far above eager's peak a zoo model may measure with no budget: 0.1% for
    ResNet's 1.0001x (4,864 bytes, not diagnosed); every other model measures at or below
    eager, except the Llama under transformers 4.x (1.0019x measured, 0.3% allowed), which
    shifts its logits by a sliced copy before the loss: a head memopt's pattern does not
    take, so the returned logits keep their zero gradient (docs/limits.md), and the Mamba
    under transformers 4.x (1.0037x measured, 0.5% allowed; not diagnosed: 256,000 bytes;
    1.00003x under transformers 5; mamba_parallel is the same loop there), and RWKV under transformers 4.x (1.0098x measured,
    128,000 bytes, 1.1% allowed; 0.77x under transformers 5, where its head is memopt's
    one-chunk op: under 4.x its loss shifts the logits by a sliced copy, as the Llama's)."""
    if name == "efficientnet" and DEVICE.startswith("cuda"):
        return 1.002  # an H200: 48,023,712 bytes against eager's 47,962,272; not diagnosed
    if int(transformers.__version__.split(".")[0]) < 5:
        return {"llama": 1.003, "mamba": 1.005, "mamba_parallel": 1.005,
                "rwkv": 1.011}.get(name, 1.001)
    return 1.001


def _gradients(case: ZooCase) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in case.model.parameters()]


def _step(case: ZooCase, module: object, seed: int) -> None:
    for p in case.model.parameters():
        p.grad = None
    torch.manual_seed(seed)  # the same dropout masks in eager and compiled steps
    case.run_step(module)


def _check(name: str, budget_of: str, kernels: str = "aten", blocks: bool = False) -> None:
    """`name` trained through memopt.compile (`kernels`, `blocks`) at no budget or a
    binding one (below the flat no-budget plan's peak): eager's gradients, the measured
    peak within the budget and near the plan; with `blocks`, each block graph captured
    once and run by every block of its group (tests/test_blocks.py)."""
    eager_case = build(name, device=DEVICE)
    case = ZooCase(name, copy.deepcopy(eager_case.model), eager_case.args,
                   eager_case.kwargs, eager_case.loss)
    _step(eager_case, None, seed=1)
    expected = _gradients(eager_case)

    budget = None
    if budget_of == "binding":
        if (name, kernels) not in _NO_BUDGET_PEAK:
            probe = memopt.compile(copy.deepcopy(eager_case.model), kernels=kernels)
            probe_case = ZooCase(name, probe.original_module, case.args, case.kwargs,
                                 case.loss)
            _step(probe_case, probe, seed=1)
            _NO_BUDGET_PEAK[(name, kernels)] = probe.memopt_plan.predicted_peak_bytes
        budget = int(BINDING * _NO_BUDGET_PEAK[(name, kernels)])
    compiled = memopt.compile(case.model, budget=budget, kernels=kernels, blocks=blocks)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' own warnings about configs
        try:
            _step(case, compiled, seed=1)
        except memopt.BudgetError as err:  # raised before the step runs: nothing changed
            assert budget is not None and err.minimum_bytes > budget
            budget = (err.minimum_bytes + _NO_BUDGET_PEAK[(name, kernels)]) // 2
            compiled = memopt.compile(case.model, budget=budget, kernels=kernels,
                                      blocks=blocks)
            start = time.perf_counter()
            _step(case, compiled, seed=1)
    first_step_s = time.perf_counter() - start  # plans and, under inductor, compiles
    try:
        _compare_gradients(name, case, expected, kernels)
    except AssertionError as err:
        mismatch: AssertionError | None = err
    else:
        mismatch = None

    if DEVICE.startswith("cuda") and kernels == "inductor":
        # the second step runs the kernels of graphs re-planned at the first step's end
        # (graph breaks), whose Triton autotuning holds a buffer of the L2 cache's size
        # once (docs/kernels.md, "The budget under inductor"): measure the step after it
        _step(case, compiled, seed=2)
    plan = compiled.memopt_plan  # the plan the next step runs (a forward's end may re-plan)
    predicted = plan.predicted_peak_bytes
    if budget is None and not blocks:
        _NO_BUDGET_PEAK[(name, kernels)] = predicted
    measured = allocated_peak(compiled, case)
    graphs = getattr(plan, "graphs", (plan,))
    print(f"\nzoo[{name}, {budget_of}, {kernels}]: measured {measured} B, predicted "
          f"{predicted} B, budget {budget} B, recompute_flops "
          f"{sum(g.recompute_flops for g in graphs)}, kernels {[g.kernels for g in graphs]}, "
          f"first step "
          f"(plan + compile) {first_step_s:.1f} s, gradients "
          f"{'DIFFER' if mismatch else 'equal'}")
    if mismatch is not None:
        raise mismatch
    groups = find_blocks(case.model) if blocks else []
    if groups:  # each block graph captured once, run by every block of its group
        runs = [plan.graphs[i].graph_index for i in plan.runs]  # a twin: the same graph
        assert max(runs.count(i) for i in set(runs)) == max(len(g) for g in groups), runs
    if kernels == "inductor":  # every graph of the step (distilbert_item has two)
        assert all(g.kernels == "inductor" for g in graphs), [
            (g.kernels, g.kernels_note) for g in graphs]
    if budget is not None:
        assert plan.budget_bytes == budget and predicted <= budget
        # below the budget=None plan's peak: met by recomputation, by running a language
        # model's head as memopt's op (one chunk holds less than eager's head), or by
        # offloading saved values (memopt.offload)
        assert sum(g.recompute_flops for g in graphs) > 0 or any(g.heads for g in graphs) \
            or any(g.offloaded for g in graphs), "the budget does not bind"
        assert measured <= budget, (name, measured, budget)
    if budget is None and kernels == "aten" and not blocks:
        # memopt with no budget holds no more than eager (issue 28): a language model's
        # returned logits get no zero gradient (passes.lm_heads); no_budget_over_eager
        eager = allocated_peak(eager_case.model, eager_case)
        if measured > no_budget_over_eager(name) * eager and name in _TRACED_ATTENTION_ON_CUDA \
                and DEVICE.startswith("cuda"):
            pytest.xfail(f"{name} on CUDA: {measured} B against eager's {eager} B; the traced "
                         f"graph runs attention unfused ({_TRACED_ATTENTION_ON_CUDA[name]})")
        assert measured <= no_budget_over_eager(name) * eager, (name, measured, eager)
    if kernels == "inductor":
        # the plan counts the buffers inductor's fused kernels allocate, on the order they
        # run (passes.fusion, memopt.kernels.scheduled_peak): not below the measurement by
        # more than the CPU headroom, and above it by at most INDUCTOR_PREDICTION; a step
        # of several graphs only the first (docs/limits.md)
        assert measured <= (1 + _INDUCTOR_BELOW.get(name, 0.015)) * predicted, \
            (name, measured, predicted)  # the default: within the op-by-op CPU headroom
        if len(graphs) == 1:
            assert predicted <= (1 + INDUCTOR_PREDICTION) * measured, \
                (name, measured, predicted)
    else:
        assert abs(measured - predicted) <= 0.10 * predicted, (name, measured, predicted)


def _compare_gradients(name: str, case: ZooCase, expected: list[torch.Tensor | None],
                       kernels: str = "aten") -> None:
    # A gradient that is zero in exact arithmetic is float32 rounding noise of the size of
    # what feeds it: an attention key's bias (softmax is invariant to it), or a BatchNorm's
    # bias whose output reaches another BatchNorm through a 1x1 convolution (EfficientNet
    # under transformers 4.46: noise up to 7e-8 of the largest gradient, in eager's run
    # and memopt's alike). So the absolute tolerance has a floor of 1e-6 of the model's
    # largest gradient; every gradient above that is held to 1e-4 of its own size (1e-3
    # under inductor on CUDA, as tests/test_cuda.py's INDUCTOR_TOL: its fused reductions
    # and convolution layouts sum in another order there).
    # On CUDA op by op, cuDNN chooses each convolution backward's algorithm per call, and
    # eager's and memopt's calls can sum in another order: an H200 measured a ResNet weight
    # gradient 1.3e-5 of its largest off, so the absolute tolerance there is 1e-4 of it.
    rtol = 1e-3 if kernels == "inductor" and DEVICE.startswith("cuda") else 1e-4
    atol = rtol if DEVICE.startswith("cuda") else rtol / 10
    floor = 1e-1 * max(w.abs().max().item() for w in expected if w is not None)
    for (pname, p), want in zip(case.model.named_parameters(), expected, strict=True):
        if want is None:
            assert p.grad is None, pname
            continue
        scale = max(want.abs().max().item(), floor) or 1.0
        torch.testing.assert_close(p.grad, want, rtol=rtol, atol=atol * scale,
                                   msg=lambda m, n=pname: f"{name}: gradient of {n}: {m}")


#: -m slow at budget=None (seconds on one core of the 2-core machine), and the default
#: test that trains the same model.
_SLOW_AT_NO_BUDGET = {
    "convnext": "4 s; tests/test_workspace.py trains it at 60% of eager's peak",
    "bert": "4 s; distilbert_item, a BERT encoder, at both budgets",
    "distilbert_item": "4 s; the same model at a binding budget",
    "mamba": "4 s; the same model at a binding budget, and tests/test_scans.py at no budget "
             "(both scan paths)",
    "t5": "4 s; the same model at a binding budget",
    "efficientnet": "5 s; resnet at both budgets, and ConvNeXt in tests/test_workspace.py",
    "rwkv": "12 s; the mamba here: another per-token loop of a language model, at no "
            "budget and at a binding one",
    "mamba_parallel": "7 s; tests/test_scans.py trains the same model's parallel path at no "
                      "budget, as a chain, with eager's gradients (and under inductor)",
}
#: -m slow at the binding budget, and the default test that covers it: the same model at
#: a binding budget, or the family's other model here. Those also in _SLOW_AT_NO_BUDGET
#: run only under -m slow (the default suite's time; tests/README's limit).
_SLOW_AT_A_BINDING_BUDGET = {
    "bert": "4 s; distilbert_item, a BERT encoder",
    "convnext": "3 s; tests/test_workspace.py at 60% of eager's peak, a lower budget",
    "efficientnet": "5 s; resnet, and ConvNeXt in tests/test_workspace.py",
    "gpt2": "3 s; tests/test_drop_outputs.py: GPT-2 2% above its minimum, eager's gradients",
    "rwkv": "18 s; the mamba here: another per-token loop of a language model at a binding budget",
    "llama": "3 s; tests/test_training_loops.py: two micro-batches at 0.85, eager's gradients",
    "mamba_parallel": "6 s; the mamba here: the same chain at a binding budget",
}


def _names(slow: dict[str, str]) -> list:
    return [pytest.param(n, marks=pytest.mark.slow) if n in slow else n for n in sorted(ZOO)]


@pytest.mark.parametrize("name", _names(_SLOW_AT_NO_BUDGET))
def test_zoo_model_trains_with_eager_gradients_at_no_budget(name: str) -> None:
    _check(name, "none")


@pytest.mark.parametrize("name", _names(_SLOW_AT_A_BINDING_BUDGET))
def test_zoo_model_trains_within_a_binding_budget(name: str) -> None:
    _check(name, "binding")


#: TorchInductor's own gradients differ from eager's here, as much under plain
#: torch.compile(backend="inductor") as under memopt: EfficientNet's top_bn.bias, a
#: gradient of cancelling terms, is 0.0113 at most in eager and about 1e-7 under both
#: (memopt's and torch.compile's agree to 1.1e-7). Measured, not a plan's doing.
_INDUCTOR_DIFFERS = {"efficientnet": "inductor's fused kernels give another top_bn.bias "
                                     "gradient than eager's, as torch.compile does"}


#: Where inductor's schedule of a graph would exceed the budget, memopt runs that graph op
#: by op and says so in plan.kernels_note (memopt.compiled_graph): measured, the budget
#: held, but the test's "the plan ran inductor" does not. (The Mamba's binding budget
#: did until memopt counted inductor's fused kernels: its plan ran op by op, 87.9 MiB of
#: schedule above a 56.5 MiB budget.)
_INDUCTOR_FALLS_BACK: dict[tuple[str, str], str] = {
    ("rwkv", "binding"): "inductor's order of the unrolled time-mixing loop's kernels holds "
                         "709 KiB above the plan (a 7.0 MiB budget), also when planned again "
                         "with that kept free: memopt runs that graph op by op",
}

#: Where memopt's inductor plan predicts more than INDUCTOR_PREDICTION above the measured
#: peak (on the budget's safe side, but not the prediction the test asks for). None since
#: 2026-11-29: the Mamba's four plans were 13.9-17.6% above, one (256, 8000) buffer: a
#: backward kernel writes the logits' gradient over the saved log-probabilities it reads
#: through a reshape, which memopt's model of inductor's in-place writes did not take
#: (memopt.allocator.fusion._same_positions); now 0.4-0.9% above.
_INDUCTOR_OVER: dict[tuple[str, str], str] = {}

#: How far below the allocated peak a zoo model's inductor plan may predict, where more
#: than the op-by-op CPU headroom (inductor's is 2.5%: memopt.budget.INDUCTOR_HEADROOM):
#: ConvNeXt at its binding budget 2.0% (inside a depthwise convolution's backward, not
#: diagnosed: docs/kernels.md). (The Mamba's unrolled 256-step scan measured 1.52% above
#: its prediction until it ran as a chain.)
_INDUCTOR_BELOW = {"convnext": 0.025}


def _inductor_cases() -> list:
    cases = []
    for name in sorted(ZOO):
        for budget_of in ("none", "binding"):
            why = (_INDUCTOR_DIFFERS.get(name) or _INDUCTOR_FALLS_BACK.get((name, budget_of))
                   or _INDUCTOR_OVER.get((name, budget_of)))
            marks = pytest.mark.xfail(reason=why, strict=True) if why else ()
            cases.append(pytest.param(name, budget_of, marks=marks, id=f"{name}-{budget_of}"))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize(("name", "budget_of"), _inductor_cases())
def test_zoo_model_trains_under_inductor_kernels(name: str, budget_of: str) -> None:
    """kernels="inductor": memopt plans, TorchInductor compiles the partitioned graphs.
    The same checks as the aten tests (the binding budget is 0.85 of the inductor
    budget=None plan's predicted peak): eager's gradients, the plan
    ran inductor, the allocated peak within the budget and near the prediction."""
    _check(name, budget_of, kernels="inductor")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert", "gpt2", "llama", "t5"])
def test_zoo_language_model_under_bf16_autocast(name: str) -> None:
    """The zoo's language models under torch.autocast (bf16) at 1.02x memopt's smallest
    budget there (heads chunked under autocast: passes.lm_heads): every gradient within
    bf16 rounding of eager's under the same autocast and dropout masks (3% of its size; a gradient that is zero in exact arithmetic, as an attention key's bias, against
    the floor of 1% of the model's largest), and the measured step within the budget and
    within 1% of the plan."""
    from memopt.errors import BudgetError

    eager_case = build(name)
    case = ZooCase(name, copy.deepcopy(eager_case.model), eager_case.args,
                   eager_case.kwargs, eager_case.loss)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(BudgetError) as err:
            memopt.plan(case.model, *case.args, example_kwargs=case.kwargs, budget=1)
    budget = int(1.02 * err.value.minimum_bytes)
    compiled = memopt.compile(case.model, budget=budget)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _step(eager_case, None, seed=1)
        _step(case, compiled, seed=1)  # plans
    expected = _gradients(eager_case)
    got = _gradients(case)
    plan = compiled.memopt_plan
    assert plan.heads and plan.fits
    floor = 1e-2 * max(w.abs().max().item() for w in expected if w is not None)
    for (pname, _), want, have in zip(case.model.named_parameters(), expected, got):
        if want is None:
            assert have is None, pname
            continue
        scale = max(want.abs().max().item(), floor)
        # 2% held on this project's CPUs; the H200 machine's 16-core host measured T5's
        # first query weight 2.3% off (bf16 kernels of another instruction set)
        assert (have - want).abs().max().item() <= 3e-2 * scale, (name, pname)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        peak = allocated_peak(compiled, case)
    assert peak <= budget, (name, peak, budget)
    assert abs(peak - plan.predicted_peak_bytes) <= 0.01 * peak, (name, peak, plan)


@pytest.mark.parametrize("name", ["gpt2"])
def test_zoo_model_with_offload_within_a_binding_budget(name: str, monkeypatch) -> None:
    """A transformers model with offload on (memopt.offload), copies real and outside
    PyTorch's allocator: every check of the binding budget (eager's gradients, the
    measured peak within the budget and near the plan), and values offloaded."""
    from memopt import offload as runtime  # noqa: PLC0415

    made = offload_everywhere(monkeypatch, DEVICE)
    _check(name, "binding")
    assert any(p.offloaded for c in made for p in c.memopt_plans), "nothing offloaded"
    assert runtime.pending() == 0
