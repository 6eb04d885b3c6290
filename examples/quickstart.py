"""memopt in one page: compile a model, train it as usual, read the plan.

    python examples/quickstart.py [--budget 0.75] [--plot memopt_quickstart.png]

Trains a small CNN (BatchNorm, dropout, residual branch, in-place ReLU) for a
few steps with `memopt.compile`, checks that its gradients equal eager
PyTorch's on the first step, and prints the memory plan: what is saved for
backward and from which module, what was rewritten in place, the predicted
peak against the lower bound. Then draws the plan (`plan.plot`, with the `[plot]`
extra): bytes live over the step, memopt beside its baseline. README's picture is
`--budget 0.75 --plot docs/memory_plan.png`.
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

import memopt


class Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.relu(y + x)


class SmallNet(nn.Module):
    def __init__(self, channels: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels),
                                  nn.ReLU(inplace=True))
        self.blocks = nn.Sequential(Block(channels), Block(channels))
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.2), nn.Linear(channels * 16 * 16, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


def main() -> None:
    args = _arguments()
    torch.manual_seed(0)
    model = SmallNet()
    reference = copy.deepcopy(model)                 # eager twin, for the gradient check
    compiled = memopt.compile(model, budget=args.budget)  # None: in-place + sharing only
    optimizer = torch.optim.Adam(compiled.parameters(), lr=1e-3)
    x = torch.randn(16, 3, 16, 16)
    y = torch.randint(0, 10, (16,))

    for step in range(5):
        optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(step)                      # same dropout mask as the eager twin
        loss = nn.functional.cross_entropy(compiled(x), y)
        loss.backward()
        if step == 0:
            torch.manual_seed(step)
            ref_loss = nn.functional.cross_entropy(reference(x), y)
            ref_loss.backward()
            same = all(torch.allclose(p.grad, r.grad, rtol=1e-4, atol=1e-6)
                       for p, r in zip(model.parameters(), reference.parameters()))
            print(f"eager loss {ref_loss.item():.4f}; memopt gradients equal to eager: {same}")
            if not same:
                raise SystemExit("gradients differ from eager PyTorch")
        optimizer.step()
        print(f"step {step}: loss {loss.item():.4f}")

    plan = compiled.memopt_plan
    print()
    print(plan.summary(max_rows=10))
    print()
    print(f"{len(plan.inplace)} ops rewritten in place, e.g.:",
          ", ".join(f"{r.node} -> {r.inplace_op}" for r in plan.inplace[:3]))
    try:
        print(f"memory over the step, memopt beside its baseline: {plan.plot(args.plot)}")
    except memopt.OptionalDependencyError as err:
        print(f"no picture: {err}")


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=_budget, default=None,
                        help='a memory budget: a fraction of the baseline (0.75) or bytes ("6MB")')
    parser.add_argument("--plot", default="memopt_quickstart.png",
                        help="where to draw the plan's picture (default: %(default)s)")
    return parser.parse_args()


def _budget(text: str) -> float | str:
    """A fraction where the text is a number, else bytes for memopt to parse ("6MB")."""
    try:
        return float(text)
    except ValueError:
        return text


if __name__ == "__main__":
    main()
