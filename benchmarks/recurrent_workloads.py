"""Workloads of the recurrent benchmarks (``python -m benchmarks.recurrent``).

Each builder is ``build(device: str) -> Workload`` for ``memopt.measure``, deterministic
(``torch.manual_seed(0)``), named ``"benchmarks.recurrent_workloads:<name>"`` with the
repository root as the working directory.

- ``lstm_T<T>``: ``nn.LSTM(256, 256)``, batch 64, T steps (Gruslys et al. 2016, Sec. 4);
  loss = MSE of the output sequence to a random target, computed inside the model
  (:class:`SequenceRegression`); the input needs no grad.
- ``wlm``: the forum's word-level LSTM LM with pytorch/examples' word_language_model
  defaults: Embedding(5508, 200) -> dropout 0.2 -> nn.LSTM(200, 200, 2 layers,
  dropout 0.2) -> dropout -> Linear(200, 5508), untied; batch 20, BPTT 512, on the
  WikiText-2 slice in examples/data/; full BPTT, mean cross-entropy over the 512 x 20
  next-word targets.
- ``wlm_two_chunk``: the same model and batch, trained with the forum's two-chunk BPTT
  (:class:`ChunkedBPTT`, chunk 256): the same gradients.
- ``wlm_tiny``, ``wlm_tiny_two_chunk``: the same with vocabulary 50, sizes 16, batch 3,
  BPTT 24, chunk 8, for tests.

- ``packed_tagger``, ``packed_tagger_bi``: a tagger over variable-length sequences packed
  with ``pack_padded_sequence`` (unsorted): nn.LSTM(128, 256, 2 layers, dropout 0.2; the
  second bidirectional) over T = 256, batch 32, lengths drawn uniformly from 64 to 256
  (a 4x spread, the longest 256), a Linear(., 16) head and the cross-entropy of the
  tokens' tags, both on the packed rows, inside the model.

- ``mamba_scan``, ``mamba_parallel``: transformers' MambaForCausalLM (2 layers, hidden 128,
  state 16, vocabulary 1000, batch 4 x 256 tokens) and its next-token loss, with the
  sequential scan (``use_associative_scan = False``: a Python loop over the tokens, which
  memopt runs as a chain) and with the parallel (associative) scan.

``lstm_T<T>`` exists for any T (``lstm_T1000``), through the module's ``__getattr__``.

The language model computes its loss inside ``forward`` (summed cross-entropy, as the
forum's code sums it and averages afterwards): the logits, 512 x 20 x 5508 floats
(216 MiB), are then a temporary of the step that a memory planner may free or recompute,
as the two-chunk method frees them chunk by chunk, rather than an output held through
backward.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.rnn import pack_padded_sequence

from memopt.measure import Workload

__all__ = ["ChunkedBPTT", "NextTokenLoss", "PackedTagger", "RNNModel", "SequenceRegression",
           "batchify", "gruslys_lstm", "load_corpus", "mamba", "mamba_parallel", "mamba_scan",
           "packed_tagger", "packed_tagger_bi", "wlm", "wlm_tiny", "wlm_tiny_two_chunk",
           "wlm_two_chunk", "word_lm"]

DATA = Path(__file__).resolve().parents[1] / "examples" / "data" / "wikitext-2-valid-slice.txt"
"""The WikiText-2 slice shipped with the examples (see examples/data/README.md)."""


# --------------------------------------------------------------------------
# Gruslys et al. 2016, Sec. 4: nn.LSTM(256, 256), batch 64, sequence length T
# --------------------------------------------------------------------------


class SequenceRegression(nn.Module):
    """An RNN and the MSE of its output sequence to a fixed target (a non-persistent
    buffer), the loss computed inside ``forward`` so that a memory planner sees the
    whole step. (A loss computed outside a compiled module is invisible to its plan,
    and eager's MSE keeps a T x batch x size difference for its backward.)"""

    def __init__(self, rnn: nn.Module, target: torch.Tensor) -> None:
        super().__init__()
        self.rnn = rnn
        self.register_buffer("target", target, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.rnn(x)[0], self.target)


def gruslys_lstm(device: str, *, T: int, batch: int = 64, size: int = 256) -> Workload:
    """``nn.LSTM(size, size)`` over T steps of a (T, batch, size) input that needs no grad;
    loss = MSE of the output sequence to a fixed random target, inside the model."""
    torch.manual_seed(0)
    rnn = nn.LSTM(size, size)
    x = torch.randn(T, batch, size)
    target = torch.randn(T, batch, size)
    model = SequenceRegression(rnn, target).to(device).train()
    return Workload(model=model, args=(x.to(device),))


class PackedTagger(nn.Module):
    """Tags of variable-length sequences: the padded batch packed (unsorted), an LSTM over
    the packed rows, a head and the tags' cross-entropy on the live tokens only."""

    def __init__(self, rnn: nn.LSTM, tags: int = 16) -> None:
        super().__init__()
        self.rnn = rnn
        self.head = nn.Linear(rnn.hidden_size * (2 if rnn.bidirectional else 1), tags)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor, tags: torch.Tensor
                ) -> torch.Tensor:
        y, _ = self.rnn(pack_padded_sequence(x, lengths, enforce_sorted=False))
        gold = pack_padded_sequence(tags, lengths, enforce_sorted=False).data
        return F.cross_entropy(self.head(y.data), gold)


def packed_tagger(device: str, *, bidirectional: bool = False, T: int = 256, batch: int = 32,
                  size: int = 128, hidden: int = 256) -> Workload:
    """``PackedTagger`` over T = 256 steps, lengths uniform in [T / 4, T] (the first T)."""
    torch.manual_seed(0)
    rnn = nn.LSTM(size, hidden, num_layers=2, dropout=0.2, bidirectional=bidirectional)
    lengths = torch.randint(T // 4, T + 1, (batch,))
    lengths[0] = T
    x = torch.randn(T, batch, size)
    tags = torch.randint(0, 16, (T, batch))
    model = PackedTagger(rnn).to(device).train()
    return Workload(model=model, args=(x.to(device), lengths, tags.to(device)),
                    loss=lambda out: out)


packed_tagger_bi = partial(packed_tagger, bidirectional=True)


# --------------------------------------------------------------------------
# State-space scans: transformers' Mamba, its sequential and its parallel scan
# --------------------------------------------------------------------------


class NextTokenLoss(nn.Module):
    """A causal LM and the mean cross-entropy of its next-token predictions, inside
    ``forward`` (the logits a temporary of the step, as in the word LM)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.lm(input_ids=ids).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def mamba(device: str, *, associative: bool, T: int = 256, batch: int = 4) -> Workload:
    """transformers' MambaForCausalLM, 2 layers, hidden 128, state 16, expand 2 (an inner
    width of 256), vocabulary 1000, batch 4 x T tokens: the selective scan's states,
    ``dA`` and ``dBu`` (batch x 256 x T x 16 floats each, 16 MiB at T = 256) are most of
    the step. ``associative``: the parallel scan torch.compile takes by default in
    transformers 5 (``config.use_associative_scan``), else the sequential loop eager runs."""
    from transformers import MambaConfig, MambaForCausalLM  # noqa: PLC0415  (bench extra)

    torch.manual_seed(0)
    config = MambaConfig(vocab_size=1000, hidden_size=128, state_size=16, num_hidden_layers=2,
                         expand=2, conv_kernel=4, use_cache=False)
    config.use_associative_scan = associative
    model = NextTokenLoss(MambaForCausalLM(config)).to(device).train()
    ids = torch.randint(0, config.vocab_size, (batch, T))
    return Workload(model=model, args=(ids.to(device),), loss=lambda out: out)


mamba_scan = partial(mamba, associative=False)
mamba_parallel = partial(mamba, associative=True)

_LSTM_NAME = re.compile(r"lstm_T([1-9]\d*)")


def __getattr__(name: str) -> Callable[[str], Workload]:
    """``lstm_T<T>`` builders for any sequence length (PEP 562)."""
    match = _LSTM_NAME.fullmatch(name)
    if match is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return partial(gruslys_lstm, T=int(match.group(1)))


# --------------------------------------------------------------------------
# The forum's word-level language model (pytorch/examples word_language_model)
# --------------------------------------------------------------------------


def load_corpus(path: Path = DATA) -> tuple[torch.Tensor, list[str]]:
    """Token ids of a WikiText file and its vocabulary (ids in order of first appearance).

    As pytorch/examples' ``data.Corpus``: whitespace-split words, ``<eos>`` after each line.
    """
    index: dict[str, int] = {}
    ids: list[int] = []
    with open(path, encoding="utf8") as f:
        for line in f:
            for word in [*line.split(), "<eos>"]:
                ids.append(index.setdefault(word, len(index)))
    return torch.tensor(ids, dtype=torch.long), list(index)


def batchify(ids: torch.Tensor, batch: int) -> torch.Tensor:
    """(N,) -> (N // batch, batch): column j is the j-th contiguous stretch of the corpus."""
    rows = ids.numel() // batch
    return ids[: rows * batch].view(batch, rows).t().contiguous()


class RNNModel(nn.Module):
    """Encoder, LSTM, decoder: pytorch/examples' word_language_model ``RNNModel`` (LSTM).

    ``forward(tokens, hidden, targets=None)`` with tokens (T, B) and hidden ``(h, c)`` of
    shape (layers, B, hidden) (None: zeros). Without targets it returns ``(logits, hidden)``;
    with targets (T, B) it returns ``(summed cross-entropy, hidden)``, so that chunks'
    losses add up to the whole sequence's (divide by the token count for the mean).
    """

    def __init__(self, vocab: int, emsize: int, nhid: int, nlayers: int, dropout: float = 0.2,
                 tie_weights: bool = False) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(vocab, emsize)
        self.rnn = nn.LSTM(emsize, nhid, nlayers, dropout=dropout if nlayers > 1 else 0.0)
        self.decoder = nn.Linear(nhid, vocab)
        if tie_weights:
            if nhid != emsize:
                raise ValueError("tied weights need emsize == nhid")
            self.decoder.weight = self.encoder.weight
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)
        self.vocab, self.nhid, self.nlayers = vocab, nhid, nlayers

    def init_hidden(self, batch: int, device: str | torch.device = "cpu"):
        zeros = torch.zeros(self.nlayers, batch, self.nhid, device=device)
        return zeros, zeros.clone()

    def forward(self, tokens: torch.Tensor, hidden=None, targets: torch.Tensor | None = None):
        emb = self.drop(self.encoder(tokens))
        output, hidden = self.rnn(emb, hidden)
        logits = self.decoder(self.drop(output)).view(-1, self.vocab)
        if targets is None:
            return logits, hidden
        return F.cross_entropy(logits, targets.reshape(-1), reduction="sum"), hidden


@dataclass(frozen=True)
class ChunkedBPTT:
    """The forum's hand-written memory-efficient BPTT, as a training step.

    ``step(model, workload)`` for a workload whose args are ``(tokens, hidden, targets)``
    and whose model is an :class:`RNNModel`. It computes the gradients of full BPTT over
    the whole sequence (mean cross-entropy) while holding the autograd graph of one chunk
    at a time (Gruslys et al. 2016's BPTT-HSM with hidden states stored at fixed
    intervals; the forum post does it with two chunks of 256 for BPTT 512):

    1. Forward the sequence chunk by chunk under ``no_grad``, keeping only each chunk's
       initial hidden state (and the RNG state, so that dropout draws the same masks when
       the chunk is run again; the forum's code does not, and so differentiates other
       masks than the ones its stored states came from). The last chunk is not run here.
    2. For each chunk in reverse order: run it again with grad from its stored initial
       hidden state; backward its loss together with the gradient carried into its final
       hidden state (none for the last chunk); carry the gradient of its initial hidden
       state to the previous chunk.

    The parameter gradients accumulate over the chunks into one step's gradients.
    """

    chunk: int = 256

    def __call__(self, model: Callable[..., Any], wl: Workload) -> None:
        tokens, hidden, targets = wl.args
        count = targets.numel()
        starts = list(range(0, tokens.shape[0], self.chunk))
        device = tokens.device

        # Step 1: a forward pass without graph; each chunk's initial state and RNG state.
        stored, rng = {}, {}
        state = tuple(hidden)
        with torch.no_grad():
            for start in starts:
                stored[start], rng[start] = state, _rng_state(device)
                if start == starts[-1]:
                    break
                _, state = model(tokens[start:start + self.chunk], state)
        # Step 2: the chunks in reverse: forward with grad, backward, carry the state gradient.
        carried: tuple[torch.Tensor, ...] | None = None
        rng_after: Any = None
        for start in reversed(starts):
            _set_rng_state(device, rng[start])
            first = start == 0
            h0 = tuple(t.detach().requires_grad_(not first) for t in stored[start])
            piece = slice(start, start + self.chunk)
            loss, h_end = model(tokens[piece], h0, targets[piece])
            if rng_after is None:
                rng_after = _rng_state(device)
            loss = loss / count
            if carried is None:
                loss.backward()
            else:
                torch.autograd.backward((loss, *h_end), (None, *carried))
            del loss, h_end
            carried = None if first else tuple(t.grad for t in h0)
            del h0
        _set_rng_state(device, rng_after)  # as after one pass over the whole sequence


def _rng_state(device: torch.device) -> Any:
    if device.type == "cuda":
        return torch.get_rng_state(), torch.cuda.get_rng_state(device)
    return torch.get_rng_state(), None


def _set_rng_state(device: torch.device, state: Any) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def _mean_loss(count: int) -> Callable[[Any], torch.Tensor]:
    return lambda out: out[0] / count


def word_lm(device: str, *, emsize: int = 200, nhid: int = 200, nlayers: int = 2,
            dropout: float = 0.2, batch: int = 20, bptt: int = 512,
            step: Callable[[Callable[..., Any], Workload], None] | None = None,
            corpus: Sequence[int] | None = None, vocab: int | None = None) -> Workload:
    """The language model on the first BPTT window of the batchified corpus.

    Args: ``(tokens, (h0, c0), targets)`` with zero initial states (no grad), as the
    first batch of an epoch; ``corpus``/``vocab`` default to the WikiText-2 slice.
    """
    if corpus is None:
        ids, words = load_corpus()
        vocab = len(words)
    else:
        ids = torch.as_tensor(corpus, dtype=torch.long)
        vocab = vocab or int(ids.max()) + 1
    data = batchify(ids, batch)
    if data.shape[0] < bptt + 1:
        raise ValueError(f"the corpus has {data.shape[0]} rows at batch {batch}; "
                         f"BPTT {bptt} needs {bptt + 1}")
    torch.manual_seed(0)
    model = RNNModel(vocab, emsize, nhid, nlayers, dropout).to(device).train()
    tokens = data[:bptt].to(device)
    targets = data[1:bptt + 1].to(device)
    hidden = model.init_hidden(batch, device)
    return Workload(model=model, args=(tokens, hidden, targets),
                    loss=_mean_loss(targets.numel()), step=step)


def wlm(device: str) -> Workload:
    """The forum's setting, full BPTT 512."""
    return word_lm(device)


def wlm_two_chunk(device: str) -> Workload:
    """The forum's setting with its two-chunk BPTT (2 x 256)."""
    return word_lm(device, step=ChunkedBPTT(256))


def _tiny_corpus() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randint(0, 50, (3 * 40,))


def wlm_tiny(device: str) -> Workload:
    """A tiny language model for tests: vocabulary 50, sizes 16, batch 3, BPTT 24."""
    return word_lm(device, emsize=16, nhid=16, batch=3, bptt=24, corpus=_tiny_corpus(),
                   vocab=50)


def wlm_tiny_two_chunk(device: str) -> Workload:
    """``wlm_tiny`` trained with :class:`ChunkedBPTT` in chunks of 8 (three chunks)."""
    return word_lm(device, emsize=16, nhid=16, batch=3, bptt=24, corpus=_tiny_corpus(),
                   vocab=50, step=ChunkedBPTT(8))
