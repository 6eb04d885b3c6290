"""Training under a memory budget: what memopt recomputes, and what it refuses.

    python examples/budget.py

A small transformer-style stack (Linear, GELU, LayerNorm, dropout, residual adds).
First `memopt.plan` shows, without running anything, how the predicted peak falls
as the budget falls, and what a too-small budget raises. Then the model trains
under half of its unoptimized peak with `memopt.compile`: same gradients as eager
PyTorch (dropout masks included), and the plan lists each recomputed op, the
extra forward work, and the budgets Chen et al.'s Alg. 3 search tried.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import memopt


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.mlp(self.norm(x)))


def make_model(width: int = 128, depth: int = 12) -> nn.Module:
    return nn.Sequential(*[Block(width) for _ in range(depth)], nn.Linear(width, 1))


def main() -> None:
    torch.manual_seed(0)
    model = make_model()
    x = torch.randn(512, 128)

    print("budget -> predicted peak (planned on FakeTensors, nothing runs):")
    for fraction in (1.0, 0.75, 0.5):
        plan = memopt.plan(model, x, budget=fraction)
        print(f"  {fraction:>4.0%} of {memopt.format_bytes(plan.baseline_peak_bytes)}: "
              f"{memopt.format_bytes(plan.predicted_peak_bytes):>10}, "
              f"{len(plan.recomputed):3d} ops recomputed, "
              f"+{plan.recompute_flops / plan.forward_flops:.0%} forward FLOPs")
    try:
        memopt.plan(model, x, budget=0.05)
    except memopt.BudgetError as err:
        print(f"\n5%: BudgetError: {err}\n")

    reference = copy.deepcopy(model)
    compiled = memopt.compile(model, budget=0.5)
    optimizer = torch.optim.SGD(compiled.parameters(), lr=1e-2)
    for step in range(3):
        torch.manual_seed(step)                      # the same dropout masks as the reference
        loss = compiled(x).square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if step == 0:
            torch.manual_seed(step)
            reference(x).square().mean().backward()
            same = all(torch.allclose(p.grad, r.grad, rtol=1e-4, atol=1e-6)
                       for p, r in zip(model.parameters(), reference.parameters()))
            print(f"memopt gradients under a 50% budget equal eager's: {same}")
            if not same:
                raise SystemExit("gradients differ from eager PyTorch")
        optimizer.step()
        print(f"step {step}: loss {loss.item():.4f}")

    plan = compiled.memopt_plan
    print()
    print(plan.summary(max_rows=5))
    print("\nrecomputed (first 6):")
    for r in plan.recomputed[:6]:
        print(f"  {r.op:<34} {r.module:<14} {memopt.format_bytes(r.nbytes):>10}  {r.flops:>12,} FLOPs")
    print("\nAlg. 3 search (segment budget B -> predicted peak, recomputed FLOPs):")
    for c in plan.search:
        print(f"  B = {memopt.format_bytes(c.segment_budget_bytes):>10}: "
              f"{memopt.format_bytes(c.predicted_peak_bytes):>10} "
              f"{c.recompute_flops:>14,} FLOPs  {'fits' if c.fits else 'over budget'}")


if __name__ == "__main__":
    main()
