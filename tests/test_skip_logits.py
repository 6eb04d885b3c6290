"""memopt.compile(..., skip_logits=True): in a call that records gradients, a language-model
head whose loss the model computes and whose logits it only returns (an HF model given
`labels`) computes the loss chunk by chunk and never forms the logits; the caller gets a
memoryless placeholder (memopt.markers.SkippedLogits) that raises LogitsSkippedError when
read. Eager's loss and gradients; real logits under no_grad; the smallest budget falls by
the logits' bytes and the measured step stays within it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt
from memopt.errors import InputError
from memopt.markers import LogitsSkippedError, SkippedLogits
from memopt.measure import allocation_peak
from support import TinyLM

VOCAB = 2000


def _setup(**kwargs):
    torch.manual_seed(0)
    model = TinyLM(VOCAB, 32, hidden=32, returns_logits=True, **kwargs)
    tokens = torch.randint(0, VOCAB, (8, 64))
    targets = torch.randint(0, VOCAB, (8, 64))
    return model, tokens, targets


def _minimum(model, *inputs, **options) -> int:
    with pytest.raises(memopt.BudgetError) as err:
        memopt.plan(model, *inputs, budget=1, **options)
    return err.value.minimum_bytes


@pytest.mark.parametrize("budget", [None, 0.5])
def test_skipped_logits_keep_eagers_loss_and_gradients(budget):
    model, tokens, targets = _setup(dropout=0.1)
    eager = copy.deepcopy(model)
    torch.manual_seed(1)
    loss, logits = eager(tokens, targets)
    loss.backward()

    compiled = memopt.compile(model, budget=budget, skip_logits=True)
    torch.manual_seed(1)
    got, placeholder = compiled(tokens, targets)
    got.backward()
    torch.testing.assert_close(got, loss, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    # the placeholder: the logits' metadata, no memory, an error naming the option
    assert isinstance(placeholder, SkippedLogits)
    assert (placeholder.shape, placeholder.dtype, placeholder.device) == (
        logits.shape, logits.dtype, logits.device)
    with pytest.raises(LogitsSkippedError, match="skip_logits=True") as err:
        placeholder.argmax(-1)
    assert isinstance(err.value, InputError)
    assert "no logits formed" in compiled.memopt_plan.summary()
    # evaluation computes them
    compiled.eval(), eager.eval()
    with torch.no_grad():
        _, real = compiled(tokens, targets)
        torch.testing.assert_close(real, eager(tokens, targets)[1])
    assert not isinstance(real, SkippedLogits)


def test_skipping_the_logits_lowers_the_minimum_and_the_step_stays_within_it():
    model, tokens, targets = _setup()
    dropped = _minimum(model, tokens, targets, drop_outputs=True)
    minimum = _minimum(model, tokens, targets, skip_logits=True)
    logits_bytes = 8 * 64 * VOCAB * 4
    assert minimum <= dropped - logits_bytes // 2, (minimum, dropped, logits_bytes)

    compiled = memopt.compile(model, budget=minimum, skip_logits=True)
    compiled(tokens, targets)[0].backward()  # plans (not under the profiler)
    for p in model.parameters():
        p.grad = None
    resident = sum(t.untyped_storage().nbytes() for t in (*model.parameters(), tokens, targets))
    with allocation_peak("cpu") as seen:
        out = compiled(tokens, targets)  # the loop keeps the output: the placeholder is free
        out[0].backward()
    measured, plan = seen.peak + resident, compiled.memopt_plan
    assert measured <= minimum, (measured, minimum)
    assert abs(measured - plan.predicted_peak_bytes) <= 0.02 * measured, (
        measured, plan.predicted_peak_bytes)


class _ReadsLogits(nn.Module):
    """Returns (loss, logits) and also reads the logits inside its forward (an accuracy)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, 32), nn.Linear(32, VOCAB)

    def forward(self, tokens, targets):
        logits = self.head(self.embed(tokens))
        loss = F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
        hits = (logits.detach().argmax(-1) == targets).float().mean()
        return loss, logits, hits


def test_logits_read_inside_the_model_are_computed():
    torch.manual_seed(0)
    model = _ReadsLogits()
    tokens, targets = torch.randint(0, VOCAB, (4, 16)), torch.randint(0, VOCAB, (4, 16))
    want_loss, want_logits, want_hits = model(tokens, targets)
    loss, logits, hits = memopt.compile(model, budget=0.95, skip_logits=True)(tokens, targets)
    assert not isinstance(logits, SkippedLogits)
    torch.testing.assert_close(logits, want_logits)
    torch.testing.assert_close(hits, want_hits)
    torch.testing.assert_close(loss, want_loss)


def test_skip_logits_must_be_a_bool():
    with pytest.raises(ValueError, match="skip_logits must be True or False"):
        memopt.compile(nn.Linear(2, 2), skip_logits="yes")


def test_skipped_logits_with_gradients_kept_between_micro_steps():
    """Gradient accumulation: a micro-step after the first finds `.grad` kept (memopt's
    kept-gradient step) and skips the logits too; eager's summed gradients, and that step
    measured within its plan and the budget."""
    model, tokens, targets = _setup()
    eager = copy.deepcopy(model)
    for _ in range(3):
        eager(tokens, targets)[0].backward()
    compiled = memopt.compile(model, budget=0.6, skip_logits=True)
    for _ in range(2):  # plans both steps outside the measurement
        compiled(tokens, targets)[0].backward()
    resident = sum(t.untyped_storage().nbytes() for t in
                   (*model.parameters(), *(p.grad for p in model.parameters()), tokens, targets))
    with allocation_peak("cpu") as seen:
        loss, placeholder = compiled(tokens, targets)
        loss.backward()
    assert isinstance(placeholder, SkippedLogits)
    plan = compiled.memopt_plan
    assert plan.existing_grad_bytes > 0  # the kept-gradient step's own plan
    measured = seen.peak + resident
    assert measured <= plan.budget_bytes and measured <= plan.predicted_peak_bytes * 1.02, (
        measured, plan.predicted_peak_bytes, plan.budget_bytes)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
