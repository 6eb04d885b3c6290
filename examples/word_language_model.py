"""A word-level LSTM language model trained with BPTT 512 under a memory budget.

    python examples/word_language_model.py                  # small model, ~1 minute on 2 CPU cores
    python examples/word_language_model.py --full           # pytorch/examples' sizes, batch 20
    python examples/word_language_model.py --budget 300MB --steps 60 --tied

The model is pytorch/examples' word_language_model (Embedding -> dropout -> nn.LSTM ->
dropout -> Linear decoder, optionally tied to the embedding), trained on a slice of
WikiText-2 (examples/data/, CC BY-SA, see its README). Backpropagation through 512 time
steps keeps every step's LSTM state for backward; the forum post in DESIGN.md wrote a
two-chunk BPTT loop by hand to halve that. Here the training loop is the usual one:
`memopt.compile(model, budget=...)` splits the LSTM into a chain of chunks and chooses
which states to keep (Gruslys et al. 2016) and what else to recompute under the budget.

It prints the loss curve, checks the first steps' gradients against an eager copy of the
model (the same dropout masks: both run after the same `torch.manual_seed`), and prints
memopt's plan.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import time

# On a shared CPU, OpenMP threads that spin while they wait slow every kernel down many
# times over when another process is busy (17 s instead of 0.3 s a step was seen here).
# Sleeping threads avoid that; this must be set before torch starts OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import memopt  # noqa: E402
from memopt.measure import budget_from_arg  # noqa: E402
from wikitext import DATA, batchify, load_corpus  # noqa: E402


class RNNModel(nn.Module):
    """Encoder, LSTM, decoder. With targets, forward returns the summed cross-entropy (so the
    512 x batch x vocabulary logits are a temporary memopt may free) and the final state."""

    def __init__(self, vocab: int, emsize: int, nhid: int, nlayers: int, dropout: float,
                 tied: bool) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(vocab, emsize)
        self.rnn = nn.LSTM(emsize, nhid, nlayers, dropout=dropout if nlayers > 1 else 0.0)
        self.decoder = nn.Linear(nhid, vocab)
        if tied:
            if nhid != emsize:
                raise SystemExit("--tied needs --emsize equal to --nhid")
            self.decoder.weight = self.encoder.weight
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)
        self.vocab, self.nhid, self.nlayers = vocab, nhid, nlayers

    def init_hidden(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.zeros(self.nlayers, batch, self.nhid),
                torch.zeros(self.nlayers, batch, self.nhid))

    def forward(self, tokens, hidden, targets=None):
        output, hidden = self.rnn(self.drop(self.encoder(tokens)), hidden)
        logits = self.decoder(self.drop(output)).view(-1, self.vocab)
        if targets is None:
            return logits, hidden
        return F.cross_entropy(logits, targets.reshape(-1), reduction="sum"), hidden


def gradients_match(model: nn.Module, reference: nn.Module) -> bool:
    return all(torch.allclose(p.grad, r.grad, rtol=1e-4, atol=1e-6)
               for p, r in zip(model.parameters(), reference.parameters()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--emsize", type=int, default=64)
    parser.add_argument("--nhid", type=int, default=64)
    parser.add_argument("--nlayers", type=int, default=2)
    parser.add_argument("--dropout", type=float, default=0.2)
    parser.add_argument("--tied", action="store_true", help="decoder weight = embedding weight")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--bptt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--lr", type=float, default=20.0)
    parser.add_argument("--budget", default="0.7",
                        help='memopt budget: "300MB", bytes, or a fraction of the unoptimized '
                             'peak (default 0.7: the LSTM is split into chunks)')
    parser.add_argument("--check-steps", type=int, default=2,
                        help="steps whose gradients are compared with an eager copy")
    parser.add_argument("--full", action="store_true",
                        help="pytorch/examples' sizes: emsize = nhid = 200, 2 layers, batch 20")
    parser.add_argument("--eager", action="store_true", help="train without memopt, to compare")
    args = parser.parse_args()
    if args.full:
        args.emsize = args.nhid = 200
        args.nlayers, args.batch = 2, 20

    ids, words = load_corpus(DATA)
    split = int(0.9 * ids.numel())
    train, held_out = batchify(ids[:split], args.batch), batchify(ids[split:], 10)
    windows = (train.shape[0] - 1) // args.bptt  # whole windows only: one shape, one plan
    if windows < 1:
        raise SystemExit(f"the slice has {train.shape[0]} rows at batch {args.batch}; "
                         f"lower --batch or --bptt")
    torch.manual_seed(0)
    model = RNNModel(len(words), args.emsize, args.nhid, args.nlayers, args.dropout, args.tied)
    model.train()
    reference = copy.deepcopy(model)  # eager PyTorch, to check memopt's gradients against
    budget = budget_from_arg(args.budget)
    compiled = model if args.eager else memopt.compile(model, budget=budget)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    print(f"vocabulary {len(words)}, {ids.numel()} tokens; model {args.emsize}/{args.nhid} x "
          f"{args.nlayers} layers{' (tied)' if args.tied else ''}, batch {args.batch}, "
          f"BPTT {args.bptt}, {windows} windows per epoch; "
          f"{'eager' if args.eager else f'memopt budget {args.budget}'}")

    hidden = model.init_hidden(args.batch)
    start = time.perf_counter()
    for step in range(args.steps):
        i = (step % windows) * args.bptt
        if i == 0:
            hidden = model.init_hidden(args.batch)  # a new epoch starts from zero states
        tokens, targets = train[i:i + args.bptt], train[i + 1:i + 1 + args.bptt]
        optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(step)  # the reference below draws the same dropout masks
        loss_sum, new_hidden = compiled(tokens, hidden, targets)
        loss = loss_sum / targets.numel()
        loss.backward()
        if step < args.check_steps:
            reference.load_state_dict(model.state_dict())
            reference.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            ref_sum, _ = reference(tokens, hidden, targets)
            (ref_sum / targets.numel()).backward()
            same = gradients_match(model, reference)
            print(f"step {step}: gradients equal eager PyTorch's: {same}")
            if not same:
                raise SystemExit("memopt's gradients differ from eager PyTorch's")
        nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        optimizer.step()
        hidden = tuple(h.detach() for h in new_hidden)  # truncated BPTT across windows
        print(f"step {step:3d}  loss {loss.item():6.3f}  ppl {math.exp(loss.item()):8.1f}  "
              f"{time.perf_counter() - start:6.1f} s", flush=True)

    model.eval()
    with torch.no_grad():
        state = model.init_hidden(10)
        nll, count = 0.0, 0
        for i in range(0, held_out.shape[0] - 1, args.bptt):
            tokens, targets = held_out[i:i + args.bptt], held_out[i + 1:i + 1 + args.bptt]
            tokens = tokens[: targets.shape[0]]
            piece, state = model(tokens, state, targets)
            nll, count = nll + piece.item(), count + targets.numel()
    print(f"held-out loss {nll / count:.3f}, ppl {math.exp(nll / count):.1f} "
          f"(uniform over the vocabulary: {math.log(len(words)):.3f})")

    if not args.eager:
        plan = compiled.memopt_plan
        print()
        print(plan.summary(max_rows=5))
        for chain in getattr(plan, "chains", ()) or ():
            print(f"chain: {chain}")


if __name__ == "__main__":
    main()
