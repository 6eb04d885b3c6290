"""Where a training step's time goes, per way of running it:
``python -m benchmarks.profile_step --model llama --device cuda``.

For each configuration (eager, ``torch.compile``, memopt with either kernels and a
budget), one process runs warm-up steps, then times ``--steps`` steps (synchronized on
CUDA) and profiles one more with ``torch.profiler``. The table answers whether a gap
between two configurations is the GPU's work or the host's:

- ``step``: the median synchronized step time;
- ``host``: the median time until the step returns to Python, unsynchronized (on CUDA,
  the host's own work: dispatch, launches, memopt's and dynamo's Python; where it is
  close to ``step``, the step is launch-bound);
- ``device``: the summed time of the step's GPU kernels (CUDA only);
- ``kernels``: the number of GPU kernels one step launches (CUDA), or aten calls (CPU).

Below the table, each configuration's kernels (or aten ops on CPU) with the most time,
and with ``--host-top N`` the N Python functions with the most own time in one step.
A configuration is ``eager``, ``torch_compile``, ``inductor:<knob>`` (functorch's
``activation_memory_budget``), or ``memopt:<kernels>[:<budget>]`` (a budget as
``memopt.compile`` takes it: ``"92MiB"``, ``0.6``).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import statistics
import sys
import time
from typing import Any

import torch

from memopt.measure.inprocess import module_for_mode, prepare_grads, run_step
from memopt.measure.records import load_workload

DEFAULT_CONFIGS = ("eager", "torch_compile", "memopt:aten", "memopt:inductor")


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


def profile_config(model: str, config: str, device: str, warmup: int, steps: int,
                   top: int, host_top: int = 0) -> dict[str, Any]:
    """One configuration's row (the module docstring) and its top kernels or ops."""
    torch._dynamo.reset()
    wl = load_workload(model if ":" in model else f"benchmarks.workloads:{model}")(device)
    mode, options, budget = parse_config(config)
    module = module_for_mode(wl.model, mode, budget, options)
    modules = (wl.model, module)
    cuda = device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    for _ in range(warmup):
        prepare_grads(modules, wl, "none")
        run_step(module, wl)
    host, wall = [], []
    for _ in range(steps):
        prepare_grads(modules, wl, "none")
        sync()
        start = time.perf_counter()
        run_step(module, wl)
        host.append(time.perf_counter() - start)
        sync()
        wall.append(time.perf_counter() - start)
    prepare_grads(modules, wl, "none")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync()
    with torch.profiler.profile(activities=activities) as prof:
        run_step(module, wl)
        sync()
    host_lines = _host_profile(module, modules, wl, sync, host_top) if host_top else []
    per_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    device_us, launched = 0.0, 0
    for event in prof.events():
        on_device = cuda and event.device_type == torch.autograd.DeviceType.CUDA
        if cuda and not on_device:
            continue
        if not cuda and not event.name.startswith("aten::"):
            continue
        time_us = event.device_time_total if on_device else event.self_cpu_time_total
        per_name[event.name][0] += 1
        per_name[event.name][1] += time_us
        device_us += time_us if on_device else 0.0
        launched += 1
    plan = getattr(module, "memopt_plan", None)
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"config": config, "step_ms": 1e3 * statistics.median(wall),
            "host_ms": 1e3 * statistics.median(host), "device_ms": device_us / 1e3 if cuda
            else None, "kernels": launched,
            "predicted": None if plan is None else plan.predicted_peak_bytes,
            "top": [(name[:70], int(n), us / 1e3) for name, (n, us) in ranked],
            "host": host_lines}


def _host_profile(module: Any, modules: tuple, wl: Any, sync: Any, top: int) -> list[str]:
    """The Python functions with the most own time over one step (cProfile), as lines."""
    prepare_grads(modules, wl, "none")
    sync()
    profiler = cProfile.Profile()
    profiler.enable()
    run_step(module, wl)
    profiler.disable()
    sync()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    lines = text.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    return [line[:150] for line in lines[start:] if line.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--host-top", type=int, default=0,
                        help="also list the Python functions with the most own time over "
                             "one step (cProfile), this many")
    args = parser.parse_args(argv)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"# {args.model} on {name}, torch {torch.__version__}")
    rows = []
    for config in args.configs:
        rows.append(profile_config(args.model, config, args.device, args.warmup, args.steps,
                                   args.top, args.host_top))
        r = rows[-1]
        print(f"{r['config']:<28} step {r['step_ms']:8.2f} ms  host {r['host_ms']:8.2f} ms  "
              f"device {r['device_ms'] or 0:8.2f} ms  kernels {r['kernels']:6d}", flush=True)
    for r in rows:
        print(f"\n## {r['config']}: the {len(r['top'])} kernels (aten ops on CPU) with the "
              f"most time")
        for kernel, count, ms in r["top"]:
            print(f"  {ms:8.3f} ms  {count:5d}x  {kernel}")
        if r["host"]:
            print(f"\n## {r['config']}: host functions (cProfile, one step)")
            print("\n".join(r["host"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
