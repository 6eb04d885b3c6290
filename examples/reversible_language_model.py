"""A word-level RevGRU language model trained next to the same model with nn.GRU.

    python examples/reversible_language_model.py                 # about a minute on 2 CPU cores
    python examples/reversible_language_model.py --steps 600 --nhid 256 --nlayers 2

The model is Embedding -> RNN -> Linear decoder, mean cross-entropy of the next word, on
the WikiText-2 slice in examples/data/ (CC BY-SA, see its README). It is built twice,
once with `memopt.nn.RevGRU` (MacKay et al. 2018, at most 3 bits forgotten per unit and
step, their choice for language modelling) and once with `nn.GRU`, with the same
embedding and decoder weights, and both are trained on the same windows in the same order
with the same optimizer and learning rate. Each window starts from a zero state, so that
`forward(tokens, targets)` is the whole training step's loss.

The RevGRU's backward stores no hidden states: it rebuilds them from the final one and an
information buffer holding the bits the forget gates discarded. The script prints

1. one batch's gradients, reversible backward against plain autograd through the same
   fixed-point forward (`rnn.autograd_forward`), and the same model compiled by
   `memopt.compile` against eager, with the plan's line for the RevGRU (a reversible
   stack: no hidden-state slots, its buffers counted at their bound); the compiled model
   is the one trained;
2. both loss curves side by side, and whether the RevGRU's tracks the GRU's: both
   smoothed final losses well below the untrained model's ln(vocabulary), and within 10%
   of each other;
3. the held-out loss and perplexity of both on the last 10% of the slice;
4. the RevGRU's buffer against the hidden states an nn.GRU's backward keeps.

It exits non-zero if the gradients differ or the curves do not track. The RevGRU's
forward and backward step through time in Python, in 64-bit fixed point, so a step takes
2-3 times as long as with nn.GRU's fused kernels on CPU. The slice is small (33,623
training tokens): by the default 150 steps (3 epochs) the training loss still falls while
the held-out loss has levelled off near 6.8-7.0.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import time

# On a shared CPU, OpenMP threads that spin while they wait slow every kernel down many
# times over when another process is busy. Sleeping threads avoid that; this must be set
# before torch starts OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import memopt  # noqa: E402
import memopt.nn  # noqa: E402
from memopt.budget import format_bytes  # noqa: E402
from wikitext import DATA, batchify, load_corpus  # noqa: E402

SMOOTH = 20  # the smoothed loss is the mean of the last SMOOTH steps' losses
TRACK_RTOL = 0.10  # final smoothed losses within 10% of each other
LEARNED = 0.8  # "well below ln(vocabulary)": under 0.8 ln(vocabulary)


class LanguageModel(nn.Module):
    """Encoder, RNN (anything with nn.GRU's call signature), decoder. With targets,
    ``forward`` returns the mean cross-entropy; without, the (T * batch, vocab) logits."""

    def __init__(self, vocab: int, emsize: int, rnn: nn.Module) -> None:
        super().__init__()
        self.encoder = nn.Embedding(vocab, emsize)
        self.rnn = rnn
        self.decoder = nn.Linear(rnn.hidden_size, vocab)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        self.vocab = vocab

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        output, _ = self.rnn(self.encoder(tokens))
        logits = self.decoder(output).view(-1, self.vocab)
        if targets is None:
            return logits
        return F.cross_entropy(logits, targets.reshape(-1))


class AutogradForward(nn.Module):
    """A reversible RNN run by ``autograd_forward``: the same fixed-point forward under
    ordinary autograd, every step's graph held (the reference for its gradients)."""

    def __init__(self, rnn: memopt.nn.ReversibleRNN) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x: torch.Tensor, hx: torch.Tensor | None = None):
        return self.rnn.autograd_forward(x, hx)


def gradients_match(model: nn.Module, reference: nn.Module) -> bool:
    return all(torch.allclose(p.grad, r.grad, rtol=1e-5, atol=1e-6)
               for p, r in zip(model.parameters(), reference.parameters(), strict=True))


@torch.no_grad()
def held_out_loss(model: nn.Module, data: torch.Tensor, bptt: int) -> float:
    """Mean cross-entropy over ``data`` (rows, batch) in windows of ``bptt``, each from a
    zero state as in training."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, data.shape[0] - 1, bptt):
        targets = data[i + 1:i + 1 + bptt]
        tokens = data[i:i + targets.shape[0]]
        total += model(tokens, targets).item() * targets.numel()
        count += targets.numel()
    model.train()
    return total / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate")
    parser.add_argument("--batch", type=int, default=20)
    parser.add_argument("--bptt", type=int, default=35)
    parser.add_argument("--emsize", type=int, default=128)
    parser.add_argument("--nhid", type=int, default=128, help="hidden size (even)")
    parser.add_argument("--nlayers", type=int, default=1)
    parser.add_argument("--max-forget-bits", type=int, default=3)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    began = time.perf_counter()

    ids, words = load_corpus(DATA)
    vocab = len(words)
    split = int(0.9 * ids.numel())
    train, held_out = batchify(ids[:split], args.batch), batchify(ids[split:], 10)
    windows = (train.shape[0] - 1) // args.bptt
    if windows < 1:
        raise SystemExit(f"the slice has {train.shape[0]} rows at batch {args.batch}; "
                         f"lower --batch or --bptt")

    torch.manual_seed(args.seed)
    gru = LanguageModel(vocab, args.emsize, nn.GRU(args.emsize, args.nhid, args.nlayers))
    rev = LanguageModel(vocab, args.emsize, memopt.nn.RevGRU(
        args.emsize, args.nhid, args.nlayers, max_forget_bits=args.max_forget_bits))
    # Only the recurrent layers differ: the RevGRU model starts from the GRU's embedding and
    # decoder (the cells cannot share weights: a RevGRU half sees only the other half).
    rev.encoder.load_state_dict(gru.encoder.state_dict())
    rev.decoder.load_state_dict(gru.decoder.state_dict())
    models = {"GRU": gru, "RevGRU": rev}
    optimizers = {name: torch.optim.Adam(m.parameters(), lr=args.lr) for name, m in models.items()}
    print(f"vocabulary {vocab}, {ids.numel()} tokens ({split} to train on); emsize "
          f"{args.emsize}, hidden {args.nhid} x {args.nlayers} layers, batch {args.batch}, "
          f"BPTT {args.bptt} ({windows} windows per epoch); Adam lr {args.lr}; RevGRU "
          f"max_forget_bits={args.max_forget_bits}")
    print(f"parameters: GRU {sum(p.numel() for p in gru.rnn.parameters())}, RevGRU "
          f"{sum(p.numel() for p in rev.rnn.parameters())} (recurrent layers only)")

    # 1. The reversible backward against autograd through the same forward, on one batch.
    tokens, targets = train[:args.bptt], train[1:1 + args.bptt]
    reference = copy.deepcopy(rev)
    reference.rnn = AutogradForward(reference.rnn)
    loss, ref_loss = rev(tokens, targets), reference(tokens, targets)
    loss.backward()
    ref_loss.backward()
    same_loss, same = torch.equal(loss, ref_loss), gradients_match(rev, reference)
    rev.zero_grad(set_to_none=True)
    print(f"RevGRU loss equal to autograd_forward's: {same_loss}; "
          f"gradients equal to autograd's: {same}")
    if not (same_loss and same):
        raise SystemExit("the reversible backward differs from autograd's")
    # memopt.compile plans the RevGRU as a reversible stack: no hidden-state slots, its
    # buffers counted at their bound. The compiled model trains below.
    compiled = memopt.compile(rev)
    eager_grads = [p.grad for p in reference.parameters()]
    compiled_loss = compiled(tokens, targets)
    compiled_loss.backward()
    same_compiled = torch.equal(compiled_loss, loss) and all(
        torch.allclose(p.grad, g, rtol=1e-5, atol=1e-6)
        for p, g in zip(rev.parameters(), eager_grads, strict=True))
    rev.zero_grad(set_to_none=True)
    (line,) = [ln for ln in compiled.memopt_plan.summary().splitlines()
               if ln.strip().startswith("reversible")]
    print(f"memopt.compile: {line.strip()}")
    print(f"compiled RevGRU gradients equal to eager's: {same_compiled}")
    if not same_compiled:
        raise SystemExit("the compiled model's gradients differ from eager's")
    models["RevGRU"] = compiled

    # 2. Training, the same windows in the same order for both.
    losses: dict[str, list[float]] = {name: [] for name in models}
    seconds = dict.fromkeys(models, 0.0)
    print(f"\n{'step':>5}  {'GRU loss':>9}  {'RevGRU loss':>11}   (mean of the last "
          f"{SMOOTH} steps; ln(vocabulary) = {math.log(vocab):.3f})")
    for step in range(args.steps):
        i = (step % windows) * args.bptt
        tokens, targets = train[i:i + args.bptt], train[i + 1:i + 1 + args.bptt]
        for name, model in models.items():
            start = time.perf_counter()
            optimizers[name].zero_grad(set_to_none=True)
            loss = model(tokens, targets)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizers[name].step()
            seconds[name] += time.perf_counter() - start
            losses[name].append(loss.item())
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            smoothed = {name: sum(curve[-SMOOTH:]) / len(curve[-SMOOTH:])
                        for name, curve in losses.items()}
            print(f"{step + 1:5d}  {smoothed['GRU']:9.3f}  {smoothed['RevGRU']:11.3f}",
                  flush=True)
    buffer = rev.rnn.buffer_size  # of the last training step (evaluation runs forward again)
    print("seconds per step: " + ", ".join(f"{name} {s / args.steps:.3f}"
                                            for name, s in seconds.items()))

    # 3. Held-out loss and perplexity.
    for name, model in models.items():
        nll = held_out_loss(model, held_out, args.bptt)
        print(f"{name:>6} held-out loss {nll:.3f}, ppl {math.exp(nll):.1f}")

    # 4. Memory: the RevGRU's buffer after the last training step's forward (what its backward
    # held) against the hidden states a GRU's backward keeps, one float32 (T, batch, hidden)
    # per layer.
    states = args.bptt * args.batch * args.nhid * 4 * args.nlayers
    per_step = buffer.ideal_bits / buffer.units / args.bptt
    print(f"\nRevGRU information buffer: {format_bytes(buffer.nbytes)} ({buffer.nbytes} bytes, "
          f"{buffer.nbytes / 8 / buffer.units:.1f} int64 words per unit); eq. 17's ideal "
          f"{buffer.ideal_bits / 8:.0f} bytes ({per_step:.2f} bits forgotten per unit and step)")
    print(f"hidden states a GRU stores: {format_bytes(states)} ({states} bytes = {args.bptt} x "
          f"{args.batch} x {args.nhid} x 4 bytes x {args.nlayers} layers): "
          f"{states / buffer.nbytes:.1f}x the buffer, {8 * states / buffer.ideal_bits:.1f}x "
          f"the ideal")

    final = {name: sum(curve[-SMOOTH:]) / len(curve[-SMOOTH:]) for name, curve in losses.items()}
    learned = all(v < LEARNED * math.log(vocab) for v in final.values())
    close = abs(final["RevGRU"] - final["GRU"]) <= TRACK_RTOL * final["GRU"]
    tracks = learned and close
    print(f"\nRevGRU tracks GRU (final smoothed losses {final['RevGRU']:.3f} vs "
          f"{final['GRU']:.3f}: within {TRACK_RTOL:.0%}, both under {LEARNED} ln(vocabulary) "
          f"= {LEARNED * math.log(vocab):.3f}): {tracks}")
    print(f"total {time.perf_counter() - began:.0f} s")
    if not tracks:
        raise SystemExit("the RevGRU's loss curve does not track the GRU's")


if __name__ == "__main__":
    main()
