"""One command for memopt's benchmarks: eager and memopt side by side, measured.

    python -m benchmarks.run                      # all models, CPU
    python -m benchmarks.run --models mlp64 lstm  # a subset
    python -m benchmarks.run --device cuda
    python -m benchmarks.run --budgets            # budget sweep against the peers
    python -m benchmarks.run --speed --rounds 3   # how fast at how much memory (speed.py)
    python -m benchmarks.run --zoo                # third-party models (benchmarks/zoo.py)

Every number comes from a fresh process per measurement (memopt.measure): the
peak memory of one training step (parameters, buffers, inputs, activations,
temporaries and gradients; see memopt/budget.py), memopt's predicted peak, and
the step time as a ratio to eager measured in the same run. The peak compared is
the allocated one (``Measurement.budget_peak_bytes``: what a budget counts, and
what a CUDA allocator charges); on CPU the RSS peak is shown beside it. On CPU,
absolute times on a shared 2-core machine mean little; ratios are what to read.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass

from benchmarks.speed import SPEED_HEADER, SPEED_MODELS, default_models, describe_device, run_speed
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
        peak = m.budget_peak_bytes
        err = (pred - peak) / peak * 100 if peak else float("nan")
        return [
            self.model,
            format_bytes(e.budget_peak_bytes),
            format_bytes(pred),
            format_bytes(peak),
            f"{peak / e.budget_peak_bytes:.2f}x",
            f"{err:+.1f}%",
            rss_cell(e), rss_cell(m),
            f"{m.step_seconds / e.step_seconds:.2f}x",
            f"{m.plan_seconds:.1f} s" if m.plan_seconds is not None else "-",
        ]


HEADER = ["model", "eager peak", "memopt predicted", "memopt measured", "measured / eager",
          "predicted vs measured", "eager process peak", "memopt process peak",
          "time / eager", "plan time"]


def rss_cell(m: Measurement) -> str:
    """The process's peak: the RSS peak on CPU, the raw ``max_memory_allocated`` on CUDA
    (library workspaces kept for the process included)."""
    return format_bytes(m.peak_bytes)


def markdown(rows: list[list[str]], header: list[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def run_core(models: list[str], device: str,
             timed_steps: int) -> tuple[list[Row], dict[str, str]]:
    """Eager and memopt (budget=None) per model; a model whose measurement fails is
    reported in the second result (model -> the error's last line) and the rest go on."""
    rows, failed = [], {}
    for model in models:
        spec = f"benchmarks.workloads:{model}"
        t0 = time.perf_counter()
        try:
            eager = measure_step(spec, mode="eager", device=device, timed_steps=timed_steps,
                                 isolate=True)
            compiled = measure_step(spec, mode="memopt", device=device,
                                    timed_steps=timed_steps, isolate=True)
        except RuntimeError as err:
            failed[model] = str(err).strip().splitlines()[-1]
            print(f"# {model}: failed: {err}", file=sys.stderr, flush=True)
            continue
        rows.append(Row(model, eager, compiled))
        print(f"# {model}: done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return rows, failed


BUDGET_MODELS = ("mlp64", "resnet50", "gpt2")
FRACTIONS = (1.0, 0.5, 0.25, 0.1)
#: Peers measured in the same run as memopt's budgets.
PEERS = {"mlp64": ("checkpoint_sequential:8",), "gpt2": ("hf_checkpointing",)}


def minimum_budget(spec: str, device: str, grads: str = "none") -> int:
    """The smallest budget memopt accepts for workload `spec` ("module:builder"), planned
    on FakeTensors, not run; `grads="kept"`: for the step that finds `.grad` kept."""
    import memopt
    from memopt.measure import load_workload

    wl = load_workload(spec)(device)
    try:
        memopt.plan(wl.model, *wl.args, example_kwargs=wl.kwargs, budget=1,
                    existing_grads=grads == "kept")
    except memopt.BudgetError as err:
        return err.minimum_bytes
    raise AssertionError("a 1-byte budget was met")


def _measured_cells(m, eager, budget: int | None) -> list[str]:
    """predicted, measured, measured / eager, measured <= budget, RSS, time / eager."""
    peak = m.budget_peak_bytes
    fits = "-" if budget is None else ("yes" if peak <= budget else "**no**")
    return [format_bytes(m.predicted_peak_bytes) if m.predicted_peak_bytes else "-",
            format_bytes(peak), f"{peak / eager.budget_peak_bytes:.2f}x", fits, rss_cell(m),
            f"{m.step_seconds / eager.step_seconds:.2f}x"]


def run_budgets(models: list[str], device: str, timed_steps: int) -> list[list[str]]:
    """Chen et al. 2016 Alg. 3 budgets: measured against eager and the peers."""
    rows = []
    for model in models:
        spec = f"benchmarks.workloads:{model}"
        eager = measure_step(spec, mode="eager", device=device, timed_steps=timed_steps,
                             isolate=True)
        lowest = minimum_budget(spec, device)
        configs = [(f"memopt {f:.0%}", "memopt", int(f * eager.budget_peak_bytes))
                   for f in FRACTIONS]
        configs.append(("memopt minimum", "memopt", lowest))
        configs += [(peer, peer, None) for peer in PEERS.get(model, ())]
        configs += [(peer, "memopt at", peer) for peer in PEERS.get(model, ())]
        # torch.compile's knob is a fraction of the activation memory, not of the peak
        configs += [(f"inductor activation_memory_budget={f}", f"inductor:{f}", None)
                    for f in FRACTIONS]
        rows.append([model, "eager", "-", "-", format_bytes(eager.budget_peak_bytes), "1.00x",
                     "-", rss_cell(eager), "1.00x", "-"])
        peaks: dict[str, int] = {}
        for label, mode, budget in configs:
            if mode == "memopt at":  # memopt with a peer's measured peak as its budget
                label, mode, budget = f"memopt at {budget}'s peak", "memopt", peaks.get(budget)
                if budget is None:
                    continue
            try:
                m = measure_step(spec, mode=mode, budget=budget, device=device,
                                 timed_steps=timed_steps, isolate=True)
            except RuntimeError as err:
                reason = "BudgetError" if "BudgetError" in str(err) else "failed"
                rows.append([model, label, format_bytes(budget) if budget else "-",
                             reason, "-", "-", "-", "-", "-", "-"])
                continue
            peaks[label] = m.budget_peak_bytes
            rows.append([
                model, label, format_bytes(budget) if budget else "-",
                *_measured_cells(m, eager, budget),
                f"{1 + m.recompute_flops_ratio:.2f}x" if m.recompute_flops_ratio is not None
                else "-",
            ])
        print(f"# {model}: budgets done", file=sys.stderr, flush=True)
    return rows


BUDGET_HEADER = ["model", "config", "budget", "predicted", "measured", "measured / eager",
                 "measured <= budget", "RSS peak (CPU)", "time / eager",
                 "forward FLOPs / eager"]


ZOO_FRACTION = 0.6


def run_zoo(models: list[str], device: str, timed_steps: int) -> list[list[str]]:
    """Third-party models (benchmarks/zoo.py) in the two states a step can find the
    gradients in: set to None, and kept (zeroed in place; gradient accumulation). Per
    state: eager, memopt with no budget, at 60% of eager's measured peak, at the minimum
    memopt names, and transformers' gradient checkpointing where the model has it."""
    from benchmarks.zoo import ZOO

    rows = []
    for model in models:
        spec = f"benchmarks.zoo:{model}"
        checkpointing = getattr(ZOO[model]().model, "supports_gradient_checkpointing", False)
        for grads in ("none", "kept"):
            def measure(mode: str, budget: int | None = None):
                return measure_step(spec, mode=mode, budget=budget, device=device,
                                    timed_steps=timed_steps, isolate=True, grads=grads,
                                    warmup=2)
            eager = measure("eager")
            rows.append([model, grads, "eager", "-", "-", format_bytes(eager.budget_peak_bytes),
                         "1.00x", "-", rss_cell(eager), "1.00x", "-"])
            configs = [("memopt, no budget", None),
                       (f"memopt {ZOO_FRACTION:.0%} of eager",
                        int(ZOO_FRACTION * eager.budget_peak_bytes)),
                       ("memopt minimum", minimum_budget(spec, device, grads))]
            configs += [("hf_checkpointing", "hf_checkpointing")] if checkpointing else []
            for label, budget in configs:
                mode = "hf_checkpointing" if budget == "hf_checkpointing" else "memopt"
                budget = None if mode != "memopt" else budget
                try:
                    m = measure(mode, budget)
                except RuntimeError as err:
                    reason = "BudgetError" if "BudgetError" in str(err) else "failed"
                    rows.append([model, grads, label, format_bytes(budget), reason,
                                 *["-"] * 6])
                    continue
                pred = m.predicted_peak_bytes
                rows.append([model, grads, label, format_bytes(budget) if budget else "-",
                             *_measured_cells(m, eager, budget),
                             f"{m.budget_peak_bytes / pred:.3f}" if pred else "-"])
            print(f"# {model} ({grads}): done", file=sys.stderr, flush=True)
    return rows


ZOO_HEADER = ["model", ".grad", "config", "budget", "predicted", "measured", "measured / eager",
              "measured <= budget", "RSS peak (CPU)", "time / eager", "measured / predicted"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=None,
                        choices=sorted(set(MODELS) | set(SPEED_MODELS) | {"tiny_mlp"}),
                        help=f"default: {' '.join(MODELS)}; with --speed: "
                             f"{' '.join(SPEED_MODELS)} (llama where transformers has it)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--timed-steps", type=int, default=None,
                        help="timed steps per measurement (default 2; 5 with --speed)")
    parser.add_argument("--budgets", action="store_true",
                        help="the budget sweep (Chen Alg. 3) against eager and the peers")
    parser.add_argument("--speed", action="store_true",
                        help="how fast at how much memory: eager, torch.compile, inductor's "
                             "memory knob, HF checkpointing and memopt (aten and inductor "
                             "kernels) at several budgets, timed in interleaved rounds")
    parser.add_argument("--rounds", type=int, default=3,
                        help="--speed: rounds of every configuration (default 3)")
    parser.add_argument("--configs", nargs="+", default=None, metavar="LABEL",
                        help="--speed: only these configurations (their table labels, e.g. "
                             "'memopt inductor'; eager always runs)")
    parser.add_argument("--log", default=None, metavar="PATH",
                        help="--speed: append each finished run to this JSON-lines file")
    parser.add_argument("--zoo", nargs="*", default=None, metavar="MODEL",
                        help="third-party models (benchmarks/zoo.py; all when none named) "
                             "with gradients set to None and kept, at several budgets")
    args = parser.parse_args(argv)
    if args.timed_steps is None:
        args.timed_steps = 5 if args.speed else 2
    logging.basicConfig(level=logging.WARNING)
    if args.zoo is not None:
        from benchmarks.zoo import ZOO

        unknown = sorted(set(args.zoo) - set(ZOO))
        if unknown:
            parser.error(f"unknown zoo models {unknown}; the zoo has {sorted(ZOO)}")
        rows = run_zoo(args.zoo or list(ZOO), args.device, args.timed_steps)
        print(f"\nThird-party models, device={args.device} (one fresh process per cell; "
              f"a step finds .grad set to None, or kept and zeroed)\n")
        print(markdown(rows, ZOO_HEADER))
        return 0
    if args.speed:
        if args.rounds < 1:
            parser.error("--rounds must be >= 1")
        models = args.models or default_models()
        print(f"# speed: {' '.join(models)} on {describe_device(args.device)}, "
              f"{args.rounds} rounds", file=sys.stderr, flush=True)
        rows = run_speed(models, args.device, args.rounds, timed_steps=args.timed_steps,
                         only=tuple(args.configs) if args.configs else None, log=args.log)
        print(f"\nSpeed at memory, device={describe_device(args.device)}, {args.rounds} "
              f"round(s); time and peak: median over rounds of the ratio to the same "
              f"round's eager run; first step: the warm-up (compiling) step, empty "
              f"inductor cache\n")
        print(markdown(rows, SPEED_HEADER))
        return 1 if any(row[3] == "failed" for row in rows) else 0
    args.models = args.models or list(MODELS)
    if args.budgets:
        models = [m for m in args.models if m in BUDGET_MODELS] or list(BUDGET_MODELS)
        rows = run_budgets(models, args.device, args.timed_steps)
        print(f"\nBudgets, device={args.device} (one fresh process per cell)\n")
        print(markdown(rows, BUDGET_HEADER))
        return 0
    rows, failed = run_core(args.models, args.device, args.timed_steps)
    print(f"\nCore pipeline, budget=None, device={args.device} (one fresh process per cell)\n")
    print(markdown([r.cells() for r in rows], HEADER))
    for model, reason in failed.items():
        print(f"\n{model}: measurement failed: {reason}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
