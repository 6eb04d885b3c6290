"""A Python number the code after a graph break computes with.

`x / (1 + x.std().item())` breaks the graph at `.item()`, and the float is a constant of
the graph after the break (memopt captures with dynamic=False): as the parameters change
it changes at every step, and dynamo captures, and memopt plans, a new graph each step,
keeping every one (found from outside: 0.3 s a step on a 5-Linear model, host memory
up 1.2 MB a step). The step stays right; past dynamo's recompile_limit memopt says so,
once, naming the fix (memopt.plan_log.PlanLog.count_resumed).
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

import memopt


class _ScaledByItem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = h / (1 + h.std().item())  # a new constant every step
        return torch.tanh(self.b(h)).pow(2).mean()


def test_a_graph_captured_again_at_every_step_is_said_once_and_trains_as_eager():
    torch.manual_seed(0)
    eager = _ScaledByItem()
    model = copy.deepcopy(eager)
    compiled = memopt.compile(model, budget=None)
    x = torch.randn(8, 16)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (eager, model)]
    with warnings.catch_warnings(record=True) as caught, \
            torch._dynamo.config.patch(recompile_limit=2):
        warnings.simplefilter("always")
        for _ in range(5):
            for run, opt in ((eager, opts[0]), (compiled, opts[1])):
                opt.zero_grad()
                run(x).backward()
                opt.step()
    said = [w for w in caught if "captured the code after a graph break" in str(w.message)]
    assert len(said) == 1
    assert "recompile_limit = 2" in str(said[0].message)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, msg=name)
