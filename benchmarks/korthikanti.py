"""Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"),
Sec. 4: the activation bytes one transformer layer keeps for backward, against memopt's plan.

    python -m benchmarks.korthikanti                 # GPT-3 22B and 175B layers
    python -m benchmarks.korthikanti --configs 175B

Their layer (Megatron's GPT, no parallelism): LayerNorm, attention with the scores
computed explicitly (QK^T, softmax, dropout, times V), a projection and dropout, a residual
add; LayerNorm, a 4h MLP with GeLU, dropout, a residual add. In 16-bit activations with
1-byte dropout masks it keeps

    sbh (34 + 5 a s / h)  bytes                       (their Eq. 1)

(s tokens, b batch, h hidden, a heads): 11sbh + 5as^2b for attention (the LayerNorm's
output into QKV 2sbh, Q and K 4sbh, the softmax output 2as^2b, its dropout mask as^2b and
output 2as^2b, V 2sbh, the projection's input 2sbh, its dropout mask sbh), 19sbh for the MLP
(its input 2sbh, GeLU's input 8sbh and output 8sbh, the dropout mask sbh), 4sbh for the two
LayerNorms' inputs. Selective recomputation recomputes the attention core (QK^T, softmax,
dropout, times V) in backward and keeps 34sbh, for 4bs^2h more FLOPs per layer, 2.7% of a
forward on GPT-3 175B (their Table 4).

memopt plans a stack of `--layers` such layers (8) in bfloat16 on the meta device (no weights,
nothing runs), batch 8 (at batch 1 and no parallelism a layer's parameters and gradients, 24h^2
bytes, are as large as its activations and bind the step's peak before the activations can:
the paper's tensor and pipeline parallelism divide the parameters), with a float32 loss (the mean of the squared output) and sums the bytes of
the saved tensors its plan attributes to the middle layers (`MemoryPlan.saved`, by module),
per layer: once with no budget (memopt recomputes nothing), and at the byte budget (no
headroom: a plan of shapes), among a
sweep between its minimum and the unconstrained peak, whose recomputed FLOPs (its own cost
model: FlopCounterMode's formulas for matmuls, one per element otherwise) come closest to
selective recomputation's without exceeding them. The columns say what differs.
"""

from __future__ import annotations

import argparse
import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import memopt
from memopt.budget import format_bytes
from memopt.errors import BudgetError

#: Their Table 3 models: (hidden size h, heads a); s = 2048 for all.
CONFIGS = {"22B": (6144, 48), "175B": (12288, 96), "530B": (20480, 128), "1T": (25600, 160)}


class GPTLayer(nn.Module):
    """Megatron's GPT layer as Korthikanti et al. count it (the module docstring);
    activations are (s, b, h)."""

    def __init__(self, hidden: int, heads: int, p: float = 0.1) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
        self.attn_drop, self.drop1, self.drop2 = nn.Dropout(p), nn.Dropout(p), nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        a, d = self.heads, h // self.heads
        q, k, v = self.qkv(self.ln1(x)).view(s, b, 3, a, d).permute(2, 1, 3, 0, 4)  # (b,a,s,d)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d)
        probs = self.attn_drop(F.softmax(scores, dim=-1))
        context = torch.matmul(probs, v).permute(2, 0, 1, 3).reshape(s, b, h)
        x = x + self.drop1(self.proj(context))
        return x + self.drop2(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class GPTStack(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(GPTLayer(hidden, heads) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.float().square().mean()


def formula_bytes(s: int, b: int, h: int, a: int) -> tuple[int, int]:
    """Their per-layer bytes: (no recomputation, selective recomputation)."""
    return s * b * h * 34 + 5 * a * s * s * b, s * b * h * 34


def selective_flops_share(s: int, h: int) -> float:
    """Selective recomputation's extra FLOPs over one forward of a layer: 4bs^2h over
    24bsh^2 + 4bs^2h (their Sec. 5; the attention core's two matmuls again)."""
    return 4 * s / (24 * h + 4 * s)


@dataclass
class Row:
    config: str
    formula_none: int
    formula_selective: int
    memopt_none: int
    memopt_at: int
    share_at: float
    budget: int
    selective_share: float
    kept_none: dict[str, int]
    kept_at: dict[str, int]


def _per_layer(plan: memopt.MemoryPlan, layers: int) -> tuple[int, dict[str, int]]:
    """Bytes of the saved tensors of the layers, per layer, and by op (the first layer's
    input is the model's: resident, not saved; the loss keeps its own float copy of the
    last layer's output, so the last layer's output is not saved either)."""
    middle = [f"layers.{i}" for i in range(layers)]
    total, by_op = 0, {}
    for t in plan.saved:
        if t.decision == "saved" and any(t.module == m or t.module.startswith(m + ".")
                                         for m in middle):
            total += t.nbytes
            by_op[t.op] = by_op.get(t.op, 0) + t.nbytes
    n = len(middle)
    return total // n, {op: v // n for op, v in sorted(by_op.items(), key=lambda kv: -kv[1])}


def measure(config: str, layers: int = 8, seq: int = 2048, batch: int = 8,
            steps: int = 8, shape: tuple[int, int] | None = None) -> Row:
    """The row of `config` (CONFIGS' hidden size and heads, or `shape`)."""
    hidden, heads = shape or CONFIGS[config]
    with torch.device("meta"):
        model = GPTStack(layers, hidden, heads).to(torch.bfloat16)
    x = torch.empty(seq, batch, hidden, dtype=torch.bfloat16, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        free = memopt.plan(model, x, headroom=0)
        try:
            memopt.plan(model, x, budget=1, headroom=0)
        except BudgetError as err:
            lowest = err.minimum_bytes
        share = selective_flops_share(seq, hidden)
        best, low, high = None, lowest, free.predicted_peak_bytes
        for _ in range(steps):  # bisect: the smallest budget recomputing <= their FLOPs
            budget = (low + high) // 2
            try:
                plan = memopt.plan(model, x, budget=budget, headroom=0)
            except BudgetError:
                low = budget
                continue
            extra = plan.recompute_flops / plan.forward_flops if plan.forward_flops else 0.0
            if extra <= share:
                best, high = (plan, extra, budget), budget
            else:
                low = budget
        if best is None:
            best = (free, 0.0, free.predicted_peak_bytes)
    none, kept_none = _per_layer(free, layers)
    at, kept_at = _per_layer(best[0], layers)
    f_none, f_sel = formula_bytes(seq, batch, hidden, heads)
    return Row(config, f_none, f_sel, none, at, best[1], best[2], share, kept_none, kept_at)


def table(rows: list[Row]) -> str:
    gb = lambda n: f"{n / 1e9:.3f} GB"  # noqa: E731
    out = ["| model (s=2048, b=8), per layer | their no recomputation | memopt, no budget | ratio | "
           "their selective | memopt at a budget recomputing <= theirs | ratio | "
           "memopt's recomputed FLOPs (theirs) |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| GPT-3 {r.config} | {gb(r.formula_none)} | {gb(r.memopt_none)} | "
                   f"{r.memopt_none / r.formula_none:.3f} | {gb(r.formula_selective)} | "
                   f"{gb(r.memopt_at)} | {r.memopt_at / r.formula_selective:.3f} | "
                   f"{r.share_at:.1%} ({r.selective_share:.1%}) |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["22B", "175B"], choices=CONFIGS)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8, help="bisection steps")
    args = parser.parse_args(argv)
    rows = [measure(c, args.layers, batch=args.batch, steps=args.steps) for c in args.configs]
    print(table(rows))
    for r in rows:
        print(f"\nGPT-3 {r.config}, per layer, by op (bytes): no budget")
        print("  " + ", ".join(f"{op} {format_bytes(n)}" for op, n in r.kept_none.items()))
        print(f"  at {format_bytes(r.budget)}: " + ", ".join(
            f"{op} {format_bytes(n)}" for op, n in r.kept_at.items()))
    return rows


if __name__ == "__main__":
    main()
