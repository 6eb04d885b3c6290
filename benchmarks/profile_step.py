"""Where a training step's time goes, per way of running it, all in one process:
``python -m benchmarks.profile_step --model llama --device cuda --rounds 15``.

Every configuration is built and warmed up first (eager, ``torch.compile``, memopt with
either kernels and a budget), each on its own copy of the workload. Then ``--rounds``
rounds, each timing ``--steps`` synchronized steps of every configuration in a shuffled
order; a configuration's time is the median over rounds of its step time over eager's in
the same round. Interleaving in one process is what makes a small model's step
comparable: such a step is bound by the host (Python, dispatch, launches), and the same
configuration measured 5.7 and 9.3 ms in two processes on one H100 machine, while the
GPU's own time stayed at 1.39 ms.

The table:

- ``step/eager``: the median of the per-round ratios; ``step``: the median step time;
- ``host``: the median time until the step returns to Python, unsynchronized (on CUDA,
  the host's own work; where it is close to ``step``, the step is launch-bound);
- ``device``: the summed time of one step's GPU kernels (CUDA only);
- ``kernels``: GPU kernels one step launches (CUDA), or aten calls (CPU);
- ``peak``: CUDA only, the step's allocated peak as ``benchmarks.run --speed`` counts it
  (the rise of ``max_memory_allocated`` over what was allocated before the step, plus
  this configuration's parameters, buffers and inputs), and memopt's prediction.

Below it, each configuration's kernels (aten ops on CPU) with the most time, and with
``--host-top N`` the N Python functions with the most own time over one step (cProfile).
A configuration is ``eager``, ``torch_compile``, ``inductor:<knob>`` (functorch's
``activation_memory_budget``), or ``memopt:<kernels>[:<budget>]`` (a budget as
``memopt.compile`` takes it: ``92MiB``, ``0.6``).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from memopt.errors import BudgetError
from memopt.measure.inprocess import (_tensors_of, module_for_mode, prepare_grads, run_step,
                                      storage_bytes)
from memopt.measure.records import load_workload

DEFAULT_CONFIGS = ("eager", "torch_compile", "memopt:aten", "memopt:inductor")
#: How many graphs dynamo may compile per code object here: every configuration compiles
#: the same model class's forward (dynamo's default of 8 would run the rest eagerly).
RECOMPILE_LIMIT = 64


def parse_config(text: str) -> tuple[str, dict[str, Any] | None, Any]:
    """(mode for module_for_mode, memopt options, budget) of one configuration."""
    if not text.startswith("memopt:"):
        return text, None, None
    parts = text.split(":", 2)
    budget: Any = parts[2] if len(parts) > 2 else None
    if budget is not None:
        try:
            budget = float(budget)
        except ValueError:
            pass
    return "memopt", {"kernels": parts[1]}, budget


@dataclass
class Run:
    """One configuration, built and warmed up, and what was measured of it."""

    config: str
    wl: Any
    module: Any
    device: torch.device
    wall: list[float] = field(default_factory=list)
    host: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    peak: int | None = None

    @property
    def modules(self) -> tuple:
        return (self.wl.model, self.module)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time_steps(self, steps: int) -> float:
        """`steps` timed steps; their median wall time."""
        wall = []
        for _ in range(steps):
            prepare_grads(self.modules, self.wl, "none")
            self.sync()
            start = time.perf_counter()
            run_step(self.module, self.wl)
            self.host.append(time.perf_counter() - start)
            self.sync()
            wall.append(time.perf_counter() - start)
        self.wall += wall
        return statistics.median(wall)

    def measure_peak(self) -> None:
        """The allocated peak of one step (CUDA; the module docstring)."""
        if self.device.type != "cuda":
            return
        prepare_grads(self.modules, self.wl, "none")
        self.sync()
        resident = storage_bytes(_tensors_of(self.wl, self.modules), self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        run_step(self.module, self.wl)
        self.sync()
        self.peak = torch.cuda.max_memory_allocated(self.device) - before + resident


def build(model: str, config: str, device: str, warmup: int) -> Run:
    wl = load_workload(model if ":" in model else f"benchmarks.workloads:{model}")(device)
    mode, options, budget = parse_config(config)
    run = Run(config, wl, module_for_mode(wl.model, mode, budget, options),
              torch.device(device))
    for _ in range(warmup):
        prepare_grads(run.modules, wl, "none")
        run_step(run.module, wl)
    run.sync()
    return run


def interleave(runs: list[Run], rounds: int, steps: int, seed: int = 0) -> None:
    """`rounds` rounds of every run in a shuffled order; each run's ratio to the first
    run's (eager's) time in the same round."""
    order = random.Random(seed)
    for _ in range(rounds):
        shuffled = runs[:]
        order.shuffle(shuffled)
        times = {id(r): r.time_steps(steps) for r in shuffled}
        for r in runs:
            r.ratios.append(times[id(r)] / times[id(runs[0])])


def kernel_profile(run: Run, top: int) -> dict[str, Any]:
    """One step under torch.profiler: GPU kernels (CUDA) or aten ops (CPU), their count,
    time, and the `top` with the most time."""
    cuda = run.device.type == "cuda"
    prepare_grads(run.modules, run.wl, "none")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    run.sync()
    with torch.profiler.profile(activities=activities) as prof:
        run_step(run.module, run.wl)
        run.sync()
    per_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    device_us, launched = 0.0, 0
    for event in prof.events():
        on_device = cuda and event.device_type == torch.autograd.DeviceType.CUDA
        if (cuda and not on_device) or (not cuda and not event.name.startswith("aten::")):
            continue
        time_us = event.device_time_total if on_device else event.self_cpu_time_total
        per_name[event.name][0] += 1
        per_name[event.name][1] += time_us
        device_us += time_us if on_device else 0.0
        launched += 1
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"device_ms": device_us / 1e3 if cuda else None, "kernels": launched,
            "top": [(name[:70], int(n), us / 1e3) for name, (n, us) in ranked]}


def host_profile(run: Run, top: int) -> list[str]:
    """The Python functions with the most own time over one step (cProfile), as lines."""
    prepare_grads(run.modules, run.wl, "none")
    run.sync()
    profiler = cProfile.Profile()
    profiler.enable()
    run_step(run.module, run.wl)
    profiler.disable()
    run.sync()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    lines = text.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    return [line[:150] for line in lines[start:] if line.strip()]


def _mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS),
                        help="the first is the reference the ratios divide by")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--host-top", type=int, default=0,
                        help="also list the Python functions with the most own time over "
                             "one step (cProfile), this many")
    args = parser.parse_args(argv)
    inductor_peers = [c for c in args.configs if c == "torch_compile" or c.startswith("inductor:")]
    if len(inductor_peers) > 1:
        parser.error(f"{' and '.join(inductor_peers)} share dynamo's cache in one process (the "
                     f"same backend, the same forward: the second reuses the first's graphs); "
                     f"measure them in separate runs")
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"# {args.model} on {name}, torch {torch.__version__}; {args.rounds} rounds of "
          f"{args.steps} steps, interleaved; ratios to {args.configs[0]}", flush=True)
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        runs = []
        for config in args.configs:
            start = time.perf_counter()
            try:
                runs.append(build(args.model, config, args.device, args.warmup))
            except BudgetError as err:  # a budget memopt refuses: said, and left out
                print(f"{config}: refused ({str(err).splitlines()[0][:120]})", flush=True)
                continue
            print(f"built {config} in {time.perf_counter() - start:.1f} s", flush=True)
        for run in runs:
            run.measure_peak()
        interleave(runs, args.rounds, args.steps)
        kernels = [kernel_profile(r, args.top) for r in runs]
        hosts = [host_profile(r, args.host_top) if args.host_top else [] for r in runs]
    print("\n| config | step/eager | step ms | host ms | device ms | kernels | peak MiB "
          "| predicted MiB |\n|---|---|---|---|---|---|---|---|")
    for r, k in zip(runs, kernels):
        plan = getattr(r.module, "memopt_plan", None)
        predicted = None if plan is None else plan.predicted_peak_bytes
        device_ms = "-" if k["device_ms"] is None else f"{k['device_ms']:.2f}"
        print(f"| {r.config} | {statistics.median(r.ratios):.2f} | "
              f"{1e3 * statistics.median(r.wall):.2f} | {1e3 * statistics.median(r.host):.2f} "
              f"| {device_ms} | {k['kernels']} | {_mib(r.peak)} | {_mib(predicted)} |")
    for r, k, host in zip(runs, kernels, hosts):
        print(f"\n## {r.config}: the {len(k['top'])} kernels (aten ops on CPU) with the most "
              f"time")
        for kernel, count, ms in k["top"]:
            print(f"  {ms:8.3f} ms  {count:5d}x  {kernel}")
        if host:
            print(f"\n## {r.config}: host functions (cProfile, one step)")
            print("\n".join(host))
    return 0


if __name__ == "__main__":
    sys.exit(main())
