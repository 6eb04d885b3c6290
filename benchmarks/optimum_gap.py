"""How far memopt's budget search is from the optimum (issue 15): the gap table.

    python -m benchmarks.optimum_gap              # needs the [solver] extra (highspy)
    python -m benchmarks.optimum_gap --models mlp16 cnn --time-limit 60

For each model, at four budgets between memopt's minimum and the peak without
recomputation, the recomputed FLOPs of:
- memopt's default search (Chen et al. 2016, Alg. 3 + the Appendix A grid, Sec. 4.2's
  cheap-op plan, Sec. 4.4's recursion);
- memopt with `solver="milp"`: the same, plus the MILP's plan where it recomputes less;
- the optimum: Checkmate's MILP over memopt's plan space (memopt.oracle), with HiGHS's
  proof of optimality ("proved") or its lower bound when the time limit ran out.

Every plan is scored by memopt's step simulator with in-place rewrites off (what the
MILP models), so all columns count the same bytes; the budget is on that simulated
peak. Planning only: nothing is trained or measured here (benchmarks.run measures).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch import nn

import memopt
from memopt.budget import format_bytes

from .workloads import ResNet, mlp


def _cnn() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A stem and 3 residual blocks with BatchNorm, 8 channels, batch 8 of 3x16x16."""
    torch.manual_seed(0)
    return ResNet(channels=8, num_blocks=3).train(), (torch.randn(8, 3, 16, 16),)


def _transformer() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """torch's nn.TransformerEncoder, 2 pre-LayerNorm layers (d 64, 4 heads, FFN 128,
    dropout 0.1), batch 4 of 32 tokens."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True,
                                       norm_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    return model.train(), (torch.randn(4, 32, 64),)


def _mlp(layers: int) -> Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]:
    def build() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        w = mlp("cpu", layers=layers, width=32, batch=1024)  # activations dominate
        return w.model, w.args
    return build


MODELS: dict[str, Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]] = {
    "mlp16": _mlp(16), "mlp64": _mlp(64), "cnn": _cnn, "transformer2": _transformer}
FRACTIONS = (0.0, 0.25, 0.5, 0.75)  # of the way from memopt's minimum to the baseline


def _flops(plan: memopt.oracle.OraclePlan) -> str:
    if plan.fits:
        return f"{plan.recompute_flops:,}"
    return {"Infeasible": "none with m(v) <= 1", "Time limit reached": "none found in time"
            }.get(plan.status, "no plan")


def _gap(mine: memopt.oracle.OraclePlan, best: memopt.oracle.OraclePlan) -> str:
    if not (mine.fits and best.fits):
        return "-"
    if best.recompute_flops == 0:
        return "0%" if mine.recompute_flops == 0 else "inf"
    return f"{mine.recompute_flops / best.recompute_flops - 1:+.0%}"


def main(argv: list[str] | None = None) -> None:
    from memopt.oracle import Oracle, OraclePlan

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--time-limit", type=float, default=60.0,
                        help="seconds HiGHS may spend per solve")
    args = parser.parse_args(argv)
    header = ["model", "budget", "memopt (Alg. 3 + grid)", "gap", "memopt solver=milp",
              "gap", "optimum (MILP)", "proved", "solve s"]
    rows: list[list[str]] = []
    for name in args.models:
        model, inputs = MODELS[name]()
        oracle = Oracle(model, *inputs)
        lowest, base = oracle.memopt_minimum(), oracle.baseline_bytes
        for fraction in FRACTIONS:
            budget = int(lowest + fraction * (base - lowest))
            mine = oracle.memopt(budget)
            best = oracle.optimum(budget, time_limit=args.time_limit)
            try:
                plan = memopt.plan(model, *inputs, budget=budget, inplace=False,
                                   headroom=0.0, solver="milp",
                                   solver_seconds=args.time_limit)
                exact = OraclePlan(budget, plan.predicted_peak_bytes, plan.recompute_flops)
            except memopt.BudgetError:
                exact = OraclePlan(budget, None, None)
            proved = ("yes" if best.optimal or best.status == "Infeasible" else
                      "no: re-solved below the budget" if best.fits and not best.exact else
                      f"no (bound {best.bound_flops:,.0f})" if best.fits else "no")
            rows.append([name, f"{format_bytes(budget)} ({budget / base:.2f}x)", _flops(mine),
                         _gap(mine, best), _flops(exact), _gap(exact, best), _flops(best),
                         proved, f"{best.seconds:.1f}"])
            print(" | ".join(rows[-1]), flush=True)
    widths = [max(len(r[k]) for r in rows + [header]) for k in range(len(header))]
    print()
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")


if __name__ == "__main__":
    main()
