"""One command for memopt's benchmarks: eager and memopt side by side, measured.

    python -m benchmarks.run                      # all models, CPU
    python -m benchmarks.run --models mlp64 lstm  # a subset
    python -m benchmarks.run --device cuda

Every number comes from a fresh process per measurement (memopt.measure): the
peak memory of one training step (parameters, buffers, inputs, activations,
temporaries and gradients; see memopt/budget.py), memopt's predicted peak, and
the step time as a ratio to eager measured in the same run. On CPU, absolute
times on a shared 2-core machine mean little; ratios are what to read.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass

from memopt.budget import format_bytes
from memopt.measure import Measurement, measure_step

MODELS = ("mlp64", "resnet50", "gpt2", "lstm", "lstm_sum")


@dataclass(frozen=True)
class Row:
    model: str
    eager: Measurement
    memopt: Measurement

    def cells(self) -> list[str]:
        e, m = self.eager, self.memopt
        pred = m.predicted_peak_bytes or 0
        err = (pred - m.peak_bytes) / m.peak_bytes * 100 if m.peak_bytes else float("nan")
        return [
            self.model,
            format_bytes(e.peak_bytes),
            format_bytes(pred),
            format_bytes(m.peak_bytes),
            f"{m.peak_bytes / e.peak_bytes:.2f}x",
            f"{err:+.1f}%",
            f"{m.step_seconds / e.step_seconds:.2f}x",
            f"{m.plan_seconds:.1f} s" if m.plan_seconds is not None else "-",
        ]


HEADER = ["model", "eager peak", "memopt predicted", "memopt measured", "measured / eager",
          "predicted vs measured", "time / eager", "plan time"]


def markdown(rows: list[list[str]], header: list[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def run_core(models: list[str], device: str, timed_steps: int) -> list[Row]:
    rows = []
    for model in models:
        spec = f"benchmarks.workloads:{model}"
        t0 = time.perf_counter()
        eager = measure_step(spec, mode="eager", device=device, timed_steps=timed_steps,
                             isolate=True)
        compiled = measure_step(spec, mode="memopt", device=device, timed_steps=timed_steps,
                                isolate=True)
        rows.append(Row(model, eager, compiled))
        print(f"# {model}: done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--timed-steps", type=int, default=2)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    rows = run_core(args.models, args.device, args.timed_steps)
    print(f"\nCore pipeline, budget=None, device={args.device} (one fresh process per cell)\n")
    print(markdown([r.cells() for r in rows], HEADER))
    return 0


if __name__ == "__main__":
    sys.exit(main())
