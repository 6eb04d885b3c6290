"""What the CUDA caching allocator reserves for memopt's step, beside what the budget counts.

    python -m benchmarks.reserved --device cuda                        # mlp64 resnet50 gpt2 llama
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python -m benchmarks.reserved --device cuda

A memopt budget counts allocated bytes: the tensors the step holds at its peak. What a GPU
runs out of is reserved memory, the segments the caching allocator took from the driver
and keeps: a free block of one segment cannot serve a larger request, and a segment cut
for one size stays cached for the next step (pytorch issue 123548: 14 GB reserved for
266 MB allocated). This benchmark measures both for each workload and budget (issue 26,
item 5), one configuration at a time in one process, everything of the last one freed and
the cache emptied (`torch.cuda.empty_cache()`) before the next is built:

- two warm-up steps (the first plans and compiles), then the measured step;
- `allocated`: the step's rise of `max_memory_allocated` plus the resident tensors, as
  memopt's CUDA tests read it;
- `reserved, steady`: `max_memory_reserved` during the measured step less what the
  process holds outside the step (the library workspaces: what was allocated before the
  step beyond the resident tensors), with the segments the warm-up steps left cached:
  what a training loop's later steps reserve;
- `reserved, fresh`: the same after `torch.cuda.empty_cache()` just before the step: the
  segments of one step on its own, without what the planning step left cached;
- `reserved, memopt's model`: `MemoryPlan.cuda_reserved_bytes()`, the allocator's policy
  replayed on the plan's storages (memopt.allocator.caching).

The allocator's settings come from `PYTORCH_CUDA_ALLOC_CONF`, read once when CUDA starts;
the table names them. On CPU there is no reserved memory: the columns are the allocated
peak (a dry run of the code path).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from typing import Any

import torch

import memopt
from benchmarks.run import markdown
from memopt.measure import load_workload
from memopt.measure.inprocess import run_step, storage_bytes

MODELS = ("mlp64", "resnet50", "gpt2", "llama")
BUDGETS = ("none", "0.7")
MIB = 2**20


def _step(compiled: Any, wl: Any) -> None:
    """One training step from no `.grad` (each step of a loop that zeroes to None)."""
    for p in wl.model.parameters():
        p.grad = None
    run_step(compiled, wl)


def _compile(model: torch.nn.Module, budget: float | None, kernels: str, wl: Any) -> Any:
    """memopt at `budget` (a fraction); below reach, at the smallest budget it accepts."""
    compiled = memopt.compile(model, budget=budget, kernels=kernels)
    try:
        _step(compiled, wl)
    except memopt.BudgetError as err:
        compiled = memopt.compile(model, budget=int(err.minimum_bytes / 0.96) + 1,
                                  kernels=kernels)
        _step(compiled, wl)
    return compiled


def _peaks(compiled: Any, wl: Any, resident: int, fresh: bool) -> tuple[int, int]:
    """(allocated, reserved) of one step, each as a budget counts: the step's own rise
    (allocated) or the reserved peak less what lives outside the step, plus `resident`."""
    for p in wl.model.parameters():
        p.grad = None
    gc.collect()
    if fresh and torch.cuda.is_available():
        torch.cuda.empty_cache()
    if not torch.cuda.is_available():  # the dry run: allocated bytes only
        from memopt.measure import allocation_peak  # noqa: PLC0415

        with allocation_peak("cpu") as seen:
            run_step(compiled, wl)
        return seen.peak + resident, seen.peak + resident
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run_step(compiled, wl)
    torch.cuda.synchronize()
    outside = before - resident  # library workspaces kept by the process
    return (torch.cuda.max_memory_allocated() - before + resident,
            torch.cuda.max_memory_reserved() - outside)


def measure(model_name: str, budget: str, kernels: str, device: str) -> dict[str, Any]:
    wl = load_workload(f"benchmarks.workloads:{model_name}")(device)
    compiled = _compile(wl.model, None if budget == "none" else float(budget), kernels, wl)
    _step(compiled, wl)  # the second warm-up step
    dev = torch.device(device)
    resident = storage_bytes([*wl.model.parameters(), *wl.model.buffers(),
                              *[t for t in (*wl.args, *wl.kwargs.values())
                                if isinstance(t, torch.Tensor)]], dev)
    allocated, steady = _peaks(compiled, wl, resident, fresh=False)
    _, fresh = _peaks(compiled, wl, resident, fresh=True)
    plan = compiled.memopt_plan
    row = {"model": model_name, "kernels": kernels, "budget": budget,
           "budget_bytes": plan.budget_bytes, "predicted": plan.predicted_peak_bytes,
           "allocated": allocated, "reserved_steady": steady, "reserved_fresh": fresh,
           "reserved_model": _modelled(plan),
           "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default"),
           "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"}
    del compiled, wl
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _modelled(plan: Any) -> int:
    """memopt's model of the allocator for the plan (MemoryPlan.cuda_reserved_bytes; the
    largest of a step's graphs)."""
    return max(g.cuda_reserved_bytes() for g in getattr(plan, "graphs", (plan,)))


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MIB:.1f}"


def table(rows: list[dict[str, Any]]) -> str:
    header = ["model", "kernels", "budget", "budget bytes", "predicted", "allocated",
              "reserved, steady", "reserved, fresh", "reserved, memopt's model",
              "steady / budget (or predicted)"]
    body = []
    for r in rows:
        limit = r["budget_bytes"] or r["predicted"]
        body.append([r["model"], r["kernels"], r["budget"], _mib(r["budget_bytes"]),
                     _mib(r["predicted"]), _mib(r["allocated"]), _mib(r["reserved_steady"]),
                     _mib(r["reserved_fresh"]), _mib(r.get("reserved_model")),
                     f"{r['reserved_steady'] / limit:.3f}"])
    return markdown(body, header) + "\n\n(MiB; allocator: " + rows[0]["allocator"] + ")"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--budgets", nargs="+", default=list(BUDGETS),
                        help="'none' or a fraction of the budget=None peak")
    parser.add_argument("--kernels", nargs="+", default=["aten"], choices=["aten", "inductor"])
    parser.add_argument("--log", help="append each row as a JSON line to this file")
    args = parser.parse_args(argv)
    rows = []
    for model_name in args.models:
        for kernels in args.kernels:
            for budget in args.budgets:
                try:
                    row = measure(model_name, budget, kernels, args.device)
                except Exception as err:  # one failure must not lose the other rows
                    print(f"{model_name} {kernels} {budget}: {type(err).__name__}: {err}",
                          file=sys.stderr)
                    continue
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
                if args.log:
                    with open(args.log, "a") as f:
                        f.write(json.dumps(row) + "\n")
    if rows:
        print(table(rows))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
