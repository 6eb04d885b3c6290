"""memopt's per-step overhead outside its graphs, against torch.compile's, on many parameters.

    python -m benchmarks.overhead                    # 400 x Linear(8, 8): 800 parameter tensors
    python -m benchmarks.overhead --layers 26        # 52 parameter tensors
    python -m benchmarks.overhead --profile 25       # and cProfile's top lines of memopt's step
    python -m benchmarks.overhead --kernels inductor --layers 26 --no-kept   # beside torch.compile

A model of many parameter tensors and almost no compute (a batch of 4 through
`layers` x Linear(8, 8)), so that a training step's time is the Python work around the
compiled graphs: what a compiler does per call for every parameter (dynamo's guards,
AOTAutograd's runtime wrappers, memopt's step bookkeeping). Each configuration trains
its own copy of the model (the same weights); they run interleaved in one process, round
after round, each round `steps` full training steps (`zero_grad(set_to_none=True)`,
forward, `loss.backward()`) per configuration, in a rotating order. The table gives, per
configuration, the median over rounds of its time per step divided by `aot_eager`'s and by
eager's in the same round (paired ratios: the 2-core machines are shared, and a slow round
slows every configuration in it), and cProfile's count of Python function calls per step.

The `kept` rows run the same steps without `zero_grad`, as gradient accumulation does:
the parameters' `.grad` stay allocated from the first step on, which memopt runs with its
existing-gradients plan (memopt.grads).

On CPU absolute times on a shared machine mean little; the ratios are what to read.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import memopt
from benchmarks.run import markdown


def build(layers: int, batch: int) -> tuple[nn.Module, torch.Tensor]:
    """`layers` x Linear(8, 8) (2 parameter tensors each) and a randn(batch, 8) input,
    deterministic."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(layers))).train()
    return model, torch.randn(batch, 8)


@dataclass
class Config:
    """One way to run the step: `run` is the module called; `model` holds its parameters."""

    name: str
    grads: str  # "none": zero_grad(set_to_none=True) every step; "kept": never zeroed
    model: nn.Module
    run: Callable

    def step(self, x: torch.Tensor) -> None:
        if self.grads == "none":
            self.model.zero_grad(set_to_none=True)
        self.run(x).sum().backward()


#: The compiler memopt is set beside: the same dynamo and AOTAutograd without memopt, per
#: `--kernels` (aten: op by op, torch.compile's aot_eager; inductor: torch.compile's default)
REFERENCE = {"aten": "aot_eager", "inductor": "torch.compile"}


def _budget(budget: str, model: nn.Module, batch: int, grads: str) -> float | int:
    """`budget` as memopt takes it: a fraction, or for "minimum" the smallest budget memopt
    accepts for this step (planned, not run), which makes it recompute what it can."""
    if budget != "minimum":
        return float(budget)
    try:
        memopt.plan(model, torch.randn(batch, 8), budget=1, existing_grads=grads == "kept")
    except memopt.BudgetError as err:
        return err.minimum_bytes
    raise AssertionError("a 1-byte budget was met")


def configs(layers: int, batch: int, budget: str, kept: bool,
            kernels: str = "aten") -> list[Config]:
    """Every configuration, each on its own copy of the model (so `.grad` stays its own)."""
    made = []
    for grads in ("none", "kept") if kept else ("none",):
        for name in ("eager", REFERENCE[kernels], "memopt", "memopt budget"):
            model, _ = build(layers, batch)
            if name == "eager":
                run = model
            elif name == "aot_eager":
                run = torch.compile(model, backend="aot_eager")
            elif name == "torch.compile":
                run = torch.compile(model)
            elif name == "memopt":
                run = memopt.compile(model, kernels=kernels)
            else:
                run = memopt.compile(model, budget=_budget(budget, model, batch, grads),
                                     kernels=kernels)
            made.append(Config(f"{name} ({grads})" if kept else name, grads, model, run))
    return made


def warm_up(config: Config, x: torch.Tensor, steps: int = 3) -> str:
    """Compile and run a few steps; "" or why the configuration is left out."""
    try:
        for _ in range(steps):
            config.step(x)
    except memopt.BudgetError as err:
        return f"BudgetError ({str(err).splitlines()[0][:80]})"
    return ""


def time_rounds(runs: list[Config], x: torch.Tensor, rounds: int,
                steps: int) -> dict[str, list[float]]:
    """Seconds per step of every configuration, per round, interleaved in a rotating order."""
    times: dict[str, list[float]] = {c.name: [] for c in runs}
    for r in range(rounds):
        order = runs[r % len(runs):] + runs[:r % len(runs)]
        for config in order:
            start = time.perf_counter()
            for _ in range(steps):
                config.step(x)
            times[config.name].append((time.perf_counter() - start) / steps)
    return times


def calls_per_step(config: Config, x: torch.Tensor, steps: int = 10,
                   top: int = 0) -> tuple[float, str]:
    """cProfile's count of Python function calls per step, and its `top` lines by own time
    (tottime) when `top` > 0."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        config.step(x)
    profile.disable()
    stats = pstats.Stats(profile)
    text = ""
    if top:
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(top)
        text = out.getvalue()
    return stats.total_calls / steps, text


def paired(times: dict[str, list[float]], name: str, reference: str) -> float:
    return statistics.median(a / b for a, b in zip(times[name], times[reference]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=400,
                        help="Linear(8, 8) layers: twice as many parameter tensors")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=5, help="training steps per round")
    parser.add_argument("--budget", default="minimum",
                        help="memopt's binding budget: a fraction of the unoptimized peak, or "
                             "'minimum' (the least memopt accepts; the default: parameters and "
                             "gradients leave a fraction little room)")
    parser.add_argument("--no-kept", action="store_true",
                        help="leave out the gradient-accumulation rows (.grad kept)")
    parser.add_argument("--kernels", choices=sorted(REFERENCE), default="aten",
                        help="memopt's kernels, and the compiler it is set beside: aten "
                             "against aot_eager, inductor against torch.compile")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="print cProfile's top N lines of memopt's step (budget=None)")
    args = parser.parse_args(argv)

    _, x = build(args.layers, args.batch)
    runs, skipped, recomputed = [], {}, {}
    reference = REFERENCE[args.kernels]
    for config in configs(args.layers, args.batch, args.budget, not args.no_kept, args.kernels):
        t0 = time.perf_counter()
        why = warm_up(config, x)
        plan = getattr(config.run, "memopt_plan", None)
        recomputed[config.name] = str(len(plan.recomputed)) if plan is not None else "-"
        print(f"# {config.name}: compiled in {time.perf_counter() - t0:.1f} s"
              f"{f', left out: {why}' if why else ''}", file=sys.stderr, flush=True)
        if why:
            skipped[config.name] = why
        else:
            runs.append(config)
    times = time_rounds(runs, x, args.rounds, args.steps)
    rows = []
    for config in runs:
        suffix = config.name[len(config.name.split(" (")[0]):]
        calls, _ = calls_per_step(config, x)
        rows.append([config.name, f"{statistics.median(times[config.name]) * 1e3:.2f} ms",
                     f"{paired(times, config.name, reference + suffix):.3f}x",
                     f"{paired(times, config.name, 'eager' + suffix):.3f}x", f"{calls:,.0f}",
                     recomputed[config.name]])
    params = sum(1 for _ in runs[0].model.parameters())
    print(f"\nPer-step overhead: {args.layers} x Linear(8, 8) ({params} parameter tensors), "
          f"batch {args.batch}, memopt budget {args.budget}; "
          f"{args.rounds} interleaved rounds of {args.steps} steps, memopt kernels "
          f"{args.kernels}, torch {torch.__version__}, CPU\n")
    print(markdown(rows, ["config", "median step", f"step / {reference} (median of paired)",
                          "step / eager (median of paired)", "Python calls per step",
                          "memopt ops recomputed"]))
    for name, why in skipped.items():
        print(f"\n{name}: {why}")
    if args.profile:
        memopt_run = next(c for c in runs if c.name.split(" (")[0] == "memopt")
        _, text = calls_per_step(memopt_run, x, steps=20, top=args.profile)
        print(f"\ncProfile of {memopt_run.name}, 20 steps, by own time:\n")
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
