"""The recurrent benchmarks' workloads, and the forum's two-chunk BPTT baseline.

The baseline (``ChunkedBPTT``) is hand-written in the benchmark, so it gets its own check:
on a tiny language model it must give the gradients of plain full BPTT.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks import recurrent_workloads as rw
from memopt.measure import measure_step
from memopt.measure.inprocess import run_step


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)


def _tiny(dropout: float, chunk: int | None) -> rw.Workload:
    return rw.word_lm("cpu", emsize=16, nhid=16, batch=3, bptt=24, dropout=dropout,
                      corpus=rw._tiny_corpus(), vocab=50,
                      step=None if chunk is None else rw.ChunkedBPTT(chunk))


@pytest.mark.parametrize("chunk", [8, 12, 24, 5])
def test_chunked_bptt_gives_full_bptt_gradients(chunk: int) -> None:
    full, chunked = _tiny(0.0, None), _tiny(0.0, chunk)
    run_step(full.model, full)        # loss(model(tokens, hidden, targets)).backward()
    run_step(chunked.model, chunked)  # the forum's method
    _assert_same(_grads(full.model), _grads(chunked.model))
    assert all(p.grad.abs().sum() > 0 for p in chunked.model.parameters())


def test_chunked_bptt_replays_dropout_masks() -> None:
    """With dropout, each chunk runs again with the masks of its no-grad pass: the gradients
    are those of the same chunks run in sequence with grad, and the RNG ends where that
    sequence leaves it."""
    reference, chunked = _tiny(0.3, None), _tiny(0.3, 8)
    tokens, hidden, targets = reference.args
    torch.manual_seed(7)
    total, state = 0.0, hidden
    for start in range(0, 24, 8):
        piece = slice(start, start + 8)
        loss, state = reference.model(tokens[piece], state, targets[piece])
        total = total + loss
    (total / targets.numel()).backward()
    after_reference = torch.rand(4)
    torch.manual_seed(7)
    run_step(chunked.model, chunked)
    _assert_same(_grads(reference.model), _grads(chunked.model))
    torch.testing.assert_close(torch.rand(4), after_reference)


def test_gruslys_builders() -> None:
    wl = rw.lstm_T12("cpu")
    assert isinstance(wl.model.rnn, torch.nn.LSTM) and wl.args[0].shape == (12, 64, 256)
    assert wl.model.target.shape == (12, 64, 256) and "target" not in wl.model.state_dict()
    assert not wl.args[0].requires_grad
    run_step(wl.model, wl)
    assert all(p.grad is not None for p in wl.model.parameters())
    with pytest.raises(AttributeError):
        rw.lstm_T0  # noqa: B018


def test_language_model_on_the_wikitext_slice() -> None:
    ids, words = rw.load_corpus()
    assert len(words) == 5508 and ids.numel() == 37359
    wl = rw.word_lm("cpu", emsize=8, nhid=8, batch=20, bptt=32)
    tokens, (h0, c0), targets = wl.args
    assert tokens.shape == targets.shape == (32, 20)
    assert torch.equal(tokens[1:], targets[:-1])
    loss = wl.loss(wl.model(*wl.args))
    assert abs(loss.item() - torch.log(torch.tensor(5508.0)).item()) < 0.5  # near uniform


def test_two_chunk_workload_is_measured() -> None:
    """The forum's method runs as a Workload's own step under memopt.measure."""
    m = measure_step("benchmarks.recurrent_workloads:wlm_tiny_two_chunk", timed_steps=0,
                     isolate=True)
    assert m.peak_bytes >= m.resident_bytes > 0
    assert m.chains is None
