"""How far each way of running a step is from exact gradients:
``python -m benchmarks.gradient_error [--device cuda] [--models resnet ...]``.

The reference is eager PyTorch in float64; each row is one fp32 run (eager,
``torch.compile``, memopt with ``kernels="aten"`` and ``kernels="inductor"``) and
its worst parameter-gradient error, as a fraction of that parameter's largest exact
gradient. A row far from eager fp32's shows a numerics change; where torch.compile's
row shows the same, the change is inductor's kernels, not memopt's plan.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
from torch import nn

import memopt
from benchmarks.workloads import ResNet


def _resnet() -> tuple[nn.Module, torch.Tensor]:
    return ResNet(channels=32, num_blocks=4), torch.randn(32, 3, 32, 32)


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(256, 256), nn.GELU()]
    return nn.Sequential(*layers), torch.randn(64, 256)


MODELS = {"resnet": _resnet, "mlp": _mlp}
RUNS = {
    "eager fp32": lambda m: m,
    "torch.compile": lambda m: torch.compile(m),
    "memopt aten": lambda m: memopt.compile(m, kernels="aten"),
    "memopt inductor": lambda m: memopt.compile(m, kernels="inductor"),
}


def _grads(module: nn.Module, params: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    params.zero_grad(set_to_none=True)
    out = module(x)
    torch.manual_seed(1)
    proj = torch.randn(out.shape, device="cpu").to(out.device, out.dtype)
    (out * proj).sum().backward()
    return {n: p.grad.detach().double().clone() for n, p in params.named_parameters()}


def errors(name: str, device: str) -> list[tuple[str, str, float]]:
    """(run, worst parameter, its error over its largest exact gradient) per run."""
    torch.manual_seed(0)
    model, x = MODELS[name]()
    model, x = model.to(device), x.to(device)
    exact_model = copy.deepcopy(model).double()
    exact = _grads(exact_model, exact_model, x.double())
    rows = []
    limit = sys.getrecursionlimit()
    for label, wrap in RUNS.items():
        ours = copy.deepcopy(model)
        try:
            got = _grads(wrap(ours), ours, x)
        finally:  # torch.compile's inductor raises it to 2000 and keeps it (compile_fx)
            sys.setrecursionlimit(limit)
        worst = max(((n, ((got[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item())
                     for n, g in exact.items()), key=lambda t: t[1])
        rows.append((label, *worst))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models", nargs="+", default=sorted(MODELS), choices=sorted(MODELS))
    args = parser.parse_args(argv)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        print("| model | run | worst parameter | error / largest exact gradient |")
        print("|---|---|---|---|")
        for name in args.models:
            for label, param, err in errors(name, args.device):
                print(f"| {name} | {label} | {param} | {err:.2e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
