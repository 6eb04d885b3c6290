"""memopt.compile(..., drop_outputs=True): a loop that keeps only the scalar loss past
the forward (``model(**batch).loss.backward()``, the HF Trainer) gets a plan that frees
the other outputs (a language model's logits) as the forward ends (passes.liveness), and
a warning at any backward where one is still alive (memopt.backend._DroppedOutputs)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import memopt
from memopt.measure import allocation_peak
from support import TinyLM


def _setup():
    torch.manual_seed(0)
    model = TinyLM(2000, 32, hidden=32, returns_logits=True)
    tokens, targets = torch.randint(0, 2000, (8, 64)), torch.randint(0, 2000, (8, 64))
    resident = sum(t.untyped_storage().nbytes() for t in (*model.parameters(), tokens, targets))
    return model, tokens, targets, resident


def _minimum(model, *inputs, example: torch.Tensor | None = None, **options) -> int:
    """memopt's smallest budget; ``example``: the input_ids (and labels) of an HF model."""
    kwargs = None if example is None else {"input_ids": example, "labels": example}
    with pytest.raises(memopt.BudgetError) as err:
        memopt.plan(model, *inputs, budget=1, example_kwargs=kwargs, **options)
    return err.value.minimum_bytes


def _step(model, compiled, tokens, targets, resident, keep: bool) -> tuple[int, list[str]]:
    """One step's allocated peak (resident bytes included) and memopt's warnings."""
    for p in model.parameters():
        p.grad = None
    with warnings.catch_warnings(record=True) as seen, allocation_peak("cpu") as peak:
        warnings.simplefilter("always")
        if keep:
            out = compiled(tokens, targets)
            out[0].backward()
            del out
        else:
            compiled(tokens, targets)[0].backward()
    return peak.peak + resident, [str(w.message) for w in seen if "memopt" in str(w.message)]


def test_dropped_logits_lower_the_minimum_and_the_step_stays_within_it():
    model, tokens, targets, resident = _setup()
    held_minimum = _minimum(model, tokens, targets)
    minimum = _minimum(model, tokens, targets, drop_outputs=True)
    # the logits must exist as the forward returns them: what dropping them saves is
    # what backward would have held beside them
    assert minimum < held_minimum, (minimum, held_minimum)

    expected = torch.autograd.grad(model(tokens, targets)[0], list(model.parameters()))
    compiled = memopt.compile(model, budget=minimum, drop_outputs=True)
    for p in model.parameters():
        p.grad = None
    compiled(tokens, targets)[0].backward()  # plans (not under the profiler: no nesting)
    for p, want in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=1e-6)
    measured, warned = _step(model, compiled, tokens, targets, resident, keep=False)
    plan = compiled.memopt_plan
    assert not warned, warned
    assert measured <= minimum, (measured, minimum)
    assert abs(measured - plan.predicted_peak_bytes) <= 0.02 * measured, (
        measured, plan.predicted_peak_bytes)

    # the loop keeps the logits after all: the step goes over the plan, and memopt says so
    measured, warned = _step(model, compiled, tokens, targets, resident, keep=True)
    assert measured > plan.predicted_peak_bytes
    assert len(warned) == 1 and "still alive as its backward starts" in warned[0], warned


def test_an_output_backward_reads_is_not_counted_as_held():
    """No budget: the head is eager's, whose backward reads what it saved; dropping the
    logits frees them and nothing is reported when the loop drops them."""
    model, tokens, targets, resident = _setup()
    compiled = memopt.compile(model, drop_outputs=True)
    compiled(tokens, targets)[0].backward()
    measured, warned = _step(model, compiled, tokens, targets, resident, keep=False)
    assert not warned, warned
    assert measured <= compiled.memopt_plan.predicted_peak_bytes * 1.02


def test_drop_outputs_must_be_a_flag():
    with pytest.raises(ValueError, match="drop_outputs must be True or False"):
        memopt.compile(TinyLM(2000, 32, hidden=32, returns_logits=True), drop_outputs="yes")


def test_dropped_outputs_simulate_as_they_build():
    """The step simulator frees dropped outputs where the exact liveness does (every
    candidate of the budget search built and compared, memopt.planner.verifying)."""
    from memopt.planner import verifying  # noqa: PLC0415

    model, tokens, targets, _ = _setup()
    planned = 0
    with verifying():
        for budget in (None, 0.7, 0.45):
            try:
                memopt.plan(model, tokens, targets, budget=budget, drop_outputs=True)
                planned += 1
            except memopt.BudgetError:
                pass
    assert planned >= 2


def test_a_transformers_model_drops_its_logits_and_accumulates_within_budget():
    """HF GPT-2 (its logits returned beside the loss, use_cache off) with drop_outputs, 2%
    above its minimum budget: eager's gradients, and every micro-step of gradient accumulation
    (the first with .grad set to None, the second adding into the kept .grad) measured
    within the budget and within 2% of the plan that ran it."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=3000, n_positions=64, n_embd=64, n_layer=2,
                                     n_head=2, use_cache=False)
    model = transformers.GPT2LMHeadModel(config).train()
    model.loss_type = "ForCausalLM"  # no warning inside forward (a graph break)
    batches = [torch.randint(0, 3000, (4, 64), generator=torch.Generator().manual_seed(s))
               for s in (1, 2)]
    eager = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # the step that adds into kept .grad needs more: its minimum binds both (2% above
        # it: compiling plans that step with the first one's measured head costs, which
        # moved its minimum by 9 KB under transformers 4.46)
        budget = int(1.02 * _minimum(model, example=batches[0], drop_outputs=True,
                                      existing_grads=True))
        compiled = memopt.compile(model, budget=budget, drop_outputs=True)
        for module in (eager, compiled):  # the first accumulation: plans both kinds of step
            for p in module.parameters():
                p.grad = None
            for ids in batches:
                torch.manual_seed(3)
                module(input_ids=ids, labels=ids).loss.backward()
    for (name, p), q in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)

    resident = sum(t.untyped_storage().nbytes() for t in (*model.parameters(), *batches))
    for p in model.parameters():
        p.grad = None
    for k, ids in enumerate(batches):
        kept = sum(p.grad.untyped_storage().nbytes() for p in model.parameters()
                   if p.grad is not None)
        with warnings.catch_warnings(record=True) as seen, allocation_peak("cpu") as peak:
            warnings.simplefilter("always")
            compiled(input_ids=ids, labels=ids).loss.backward()
        assert not [w for w in seen if "drop_outputs" in str(w.message)]
        measured = peak.peak + resident + kept
        predicted = compiled.memopt_plan.predicted_peak_bytes
        assert measured <= budget, (k, measured, budget)
        assert abs(measured - predicted) <= 0.02 * predicted, (k, measured, predicted)
