"""Keep / recompute / offload: memopt with offload against recompute-only memopt, at the
same budgets, beside eager, in one run.

    python -m benchmarks.offload                    # CPU: a simulated 25 GB/s host link
    python -m benchmarks.offload --device cuda --models mlp gpt2 llama   # the measured link
    python -m benchmarks.offload --link-gbps 12 --budgets 0.8 0.6 0.5

Models: `mlp` (8 x (Linear(512, 512), GELU, Dropout), batch 1024: saved activations
dominate the step), and benchmarks.workloads' `gpt2` and `llama`. Per budget (a fraction
of the unoptimized peak), two plans: `offload=False` (Chen's recomputation only) and
offload on; beside them eager, HF gradient checkpointing where the model has it, and on a
GPU eager under `torch.autograd.graph.save_on_cpu` (every saved tensor offloaded).
Each configuration trains its own copy of the model (the same weights); they run
interleaved in one process, round after round in a rotating order, and a step's time is
divided by eager's in the same round (the median of those paired ratios is reported).

Measured peak: on CUDA `max_memory_allocated`; on CPU the bytes PyTorch's allocator hands
out (memopt.measure.allocation_peak) with `memopt.offload.CPU_HOST_COPIES` on, so that a
value copied to "host" memory (a bytearray outside PyTorch's allocator) leaves the count
as it would leave a GPU. On CPU the copies run on the one stream the step runs on (no
overlap), so the CPU's time column is an upper bound of what a GPU's side stream costs;
the predicted time is the planner's (memopt.allocator.offload), op roofline plus waits.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
from torch import nn

import memopt
from benchmarks import workloads
from benchmarks.run import markdown
from memopt import offload as runtime
from memopt.measure import Workload, allocation_peak
from memopt.measure.inprocess import run_step, storage_bytes, timed_step


def mlp_dropout(device: str) -> Workload:
    """8 x (Linear(512, 512), GELU, Dropout(0.1)) and a Linear(512, 1), batch 1024: saved
    activations dominate the step, and dropout's masks are saved values too."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.Dropout(0.1))
                            for _ in range(8)], nn.Linear(512, 1)).to(device).train()
    return Workload(model=model, args=(torch.randn(1024, 512, device=device),))


WORKLOADS = {"mlp": mlp_dropout, "gpt2": workloads.gpt2, "llama": workloads.llama}


def _zero(module: nn.Module) -> None:
    for p in module.parameters():
        p.grad = None


def peak(module: nn.Module, wl: Workload, device: str) -> int:
    """One step's allocated peak, resident tensors (parameters, inputs) included."""
    _zero(module)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        run_step(module, wl)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    resident = storage_bytes([*module.parameters(), *wl.args, *wl.kwargs.values()],
                             torch.device(device))
    with allocation_peak("cpu") as seen:
        run_step(module, wl)
    return seen.peak + resident


def timed(module: nn.Module, wl: Workload, device: str) -> float:
    _zero(module)
    return timed_step(module, wl, torch.device(device))


class _SaveOnCpu(nn.Module):
    """Eager with torch.autograd.graph.save_on_cpu: every saved tensor offloaded (the
    peer's offload option; on a GPU only)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            return self.inner(*args, **kwargs)


def configs_for(wl: Workload, device: str, budgets: list[float], link: object
                ) -> dict[str, nn.Module | None]:
    """Each configuration's own copy of the model (None: refused at that budget)."""
    configs: dict[str, nn.Module | None] = {"eager": copy.deepcopy(wl.model)}
    if hasattr(wl.model, "gradient_checkpointing_enable"):
        ckpt = copy.deepcopy(wl.model)
        ckpt.gradient_checkpointing_enable()
        configs["HF checkpointing"] = ckpt
    if device.startswith("cuda"):
        configs["eager + save_on_cpu"] = _SaveOnCpu(copy.deepcopy(wl.model))
    for b in budgets:
        for name, off in (("recompute", False), ("offload", link)):
            try:
                m = memopt.compile(copy.deepcopy(wl.model), budget=b, offload=off)
                run_step(m, wl)
                configs[f"memopt {name} {b:g}"] = m
            except memopt.BudgetError:
                configs[f"memopt {name} {b:g}"] = None  # below what this mode reaches
    return configs


def table(name: str, device: str, budgets: list[float], link: object, rounds: int
          ) -> list[list[str]]:
    wl = WORKLOADS[name](device)
    configs = configs_for(wl, device, budgets, link)
    names = [k for k, m in configs.items() if m is not None]
    peaks = {k: peak(configs[k], wl, device) for k in names}
    ratios: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        times = {k: timed(configs[k], wl, device) for k in order}
        for k in names:
            ratios[k].append(times[k] / times["eager"])
    rows = []
    for k, m in configs.items():
        if m is None:
            rows.append([name, k, "refused (below this mode's minimum)", "", "", "", "", ""])
            continue
        plan = getattr(m, "memopt_plan", None)
        rec = plan.link if plan is not None else None
        rows.append([
            name, k, f"{peaks[k] / peaks['eager']:.2f}x",
            "" if plan is None else f"{plan.predicted_peak_bytes / peaks['eager']:.2f}x",
            "" if plan is None else ("yes" if peaks[k] <= plan.budget_bytes else "NO"),
            f"{statistics.median(ratios[k]):.2f}x",
            "" if plan is None else f"{len(plan.recomputed)} / "
            f"{sum(o.nbytes for o in plan.offloaded) / 2**20:.1f} MiB",
            "" if rec is None else f"{(rec.compute_s + rec.wait_s) * 1e3:.1f} ms, "
            f"waits {rec.wait_s * 1e3:.1f} ms, link {rec.occupancy:.0%}"])
    rows.append([name, "(eager's peak)", f"{peaks['eager'] / 2**20:.1f} MiB", "", "", "", "",
                 ""])
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--models", nargs="+", default=["mlp"], choices=sorted(WORKLOADS))
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.8, 0.65, 0.5])
    ap.add_argument("--link-gbps", type=float, default=None,
                    help="plan with this host link (GB/s each way) instead of the measured "
                         "one (default on CPU: 25, a PCIe 4 x16 link)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    runtime.CPU_HOST_COPIES = args.device == "cpu"
    gbps = args.link_gbps if args.link_gbps is not None else (
        25.0 if args.device == "cpu" else None)
    link = True if gbps is None else memopt.Link(d2h_bytes_per_s=gbps * 1e9,
                                                  h2d_bytes_per_s=gbps * 1e9)
    rows = [row for name in args.models
            for row in table(name, args.device, args.budgets, link, args.rounds)]
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"on {device}; link {'measured' if gbps is None else f'{gbps:g} GB/s (simulated)'}; "
          f"median of {args.rounds} paired time ratios")
    print(markdown(rows, ["model", "config", "measured peak / eager", "predicted / eager",
                          "within budget", "time / eager", "recomputed ops / offloaded",
                          "predicted step (offload plans)"]))


if __name__ == "__main__":
    main()
