"""Measure one training step in this process (on CPU: the child memopt.measure.child starts).

``measure_in_process`` lays the measurement out in four steps, each marked ``# Step N:``
in the code (memopt.measure's docstring says what is counted and why):

1. Build the workload, wrap the model for the mode (eager, a peer of
   memopt.measure.peers, or ``memopt.compile``), run the warm-up steps (the first one
   compiles) and read the plan's prediction.
2. A clean start: the gradients as ``grads`` says, the garbage collected, the resident
   tensors counted.
3. The measured step: on CUDA the allocator's counters, on CPU the VmHWM rise (then one
   more step under the profiler for the allocated bytes).
4. More timed steps; ``step_seconds`` is their median.

``run_step`` is the step itself, which a test may call to check a workload's own step.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .child import read_status_kib, reset_hwm, steady_allocator, trim_heap
from .peers import is_peer, wrap_peer
from .records import Measurement, Workload, check_device, load_workload

logger = logging.getLogger(__name__)

__all__ = ["allocated_step_peak", "measure_in_process", "module_for_mode", "prepare_grads",
           "run_step", "scalar_fields", "storage_bytes", "timed_step"]


# --------------------------------------------------------------------------
# The step and its memory
# --------------------------------------------------------------------------


def _tensors_of(wl: Workload, modules: Sequence[Any]) -> list[torch.Tensor]:
    from ..passes._torch_compat import pytree  # noqa: PLC0415 (loads AOTAutograd: not at start)

    tensors: list[torch.Tensor] = []
    seen: set[int] = set()
    for module in modules:
        if isinstance(module, torch.nn.Module) and id(module) not in seen:
            seen.add(id(module))
            tensors.extend(module.parameters())
            tensors.extend(module.buffers())
    for leaf in pytree.tree_leaves((wl.args, wl.kwargs)):
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
    return tensors


def storage_bytes(tensors: Sequence[torch.Tensor], device: torch.device) -> int:
    """Bytes of the distinct storages of ``tensors`` that live on ``device``."""
    sizes: dict[Any, int] = {}
    for t in tensors:
        if t.device.type != device.type:
            continue
        if device.index is not None and t.device.index != device.index:
            continue
        try:
            storage = t.untyped_storage()
            key: Any = (str(t.device), storage.data_ptr())
            nbytes = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # sparse, nested, ...
            key, nbytes = ("id", id(t)), t.numel() * t.element_size()
        sizes[key] = max(nbytes, sizes.get(key, 0))
    return sum(sizes.values())


def prepare_grads(modules: Sequence[Any], wl: Workload, grads: str = "none") -> None:
    """Put every parameter's ``.grad`` in the state the measured step starts from
    (``grads``: one of memopt.measure.records.GRADS)."""
    for t in _tensors_of(wl, modules):
        if grads == "none" or not t.requires_grad:
            if t.grad is not None:
                t.grad = None
        elif t.grad is None:
            t.grad = torch.zeros_like(t)
        else:
            t.grad.zero_()


def _grad_tensors(modules: Sequence[Any], wl: Workload) -> list[torch.Tensor]:
    return [t.grad for t in _tensors_of(wl, modules) if t.grad is not None]


def run_step(module: Callable[..., Any], wl: Workload) -> None:
    """One training step of ``module`` on the workload: the workload's own ``step``, else
    ``wl.loss(module(*wl.args, **wl.kwargs)).backward()``."""
    own_step = getattr(wl, "step", None)
    if own_step is not None:
        own_step(module, wl)
        return
    out = module(*wl.args, **wl.kwargs)
    loss = wl.loss(out)
    loss.backward()  # `out` stays alive through backward, as in a usual training loop
    del out, loss


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(module: Callable[..., Any], wl: Workload, device: torch.device) -> float:
    """``run_step``'s wall time in seconds (synchronized on CUDA)."""
    _sync(device)
    start = time.perf_counter()
    run_step(module, wl)
    _sync(device)
    return time.perf_counter() - start


def allocated_step_peak(module: Callable[..., Any], wl: Workload, modules: Sequence[Any],
                        grads: str = "none") -> int:
    """The most bytes the CPU allocator had handed out at once during one step, over
    what was allocated when it started (a step under the profiler, from a clean start)."""
    from ..passes.allocated import allocation_peak  # noqa: PLC0415

    prepare_grads(modules, wl, grads)
    gc.collect()
    with allocation_peak("cpu") as seen:
        run_step(module, wl)
    return seen.peak


def scalar_fields(record: Any) -> dict:
    """The scalar fields of a plan record (pydantic model or dataclass) as a JSON-able dict;
    sequences (a chain's whole schedule) are left out to keep the result line short."""
    if hasattr(record, "model_dump"):
        data = record.model_dump(mode="json")
    elif dataclasses.is_dataclass(record) and not isinstance(record, type):
        data = {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
    else:
        return {"repr": repr(record)}
    return {k: v for k, v in data.items() if v is None or isinstance(v, (bool, int, float, str))}


# --------------------------------------------------------------------------
# The measurement
# --------------------------------------------------------------------------


def module_for_mode(model: torch.nn.Module, mode: str, budget: Any,
                    options: dict | None) -> Any:
    """What the measured steps call: ``model`` itself (``"eager"``), a peer's wrapping of
    it, or ``memopt.compile(model, budget=budget, **options)``."""
    if mode == "eager":
        return model
    if is_peer(mode):
        return wrap_peer(model, mode)
    import memopt  # noqa: PLC0415 (the package may be partly written)

    return memopt.compile(model, budget=budget, **(options or {}))


def measure_in_process(
    workload: str,
    *,
    mode: str,
    budget: Any,
    device: str,
    warmup: int,
    timed_steps: int,
    options: dict | None,
    grads: str = "none",
) -> Measurement:
    """Run the whole measurement in this process (the module docstring lists its steps)."""
    dev = check_device(device)
    builder = load_workload(workload)
    wl = builder(device)
    for name in ("model", "args", "kwargs", "loss"):
        if not hasattr(wl, name):
            raise TypeError(
                f"workload {workload!r} returned {type(wl).__name__}, "
                f"which has no {name!r}; return a memopt.measure.Workload"
            )
    compiled = module_for_mode(wl.model, mode, budget, options)
    modules = (wl.model, compiled)

    # Step 1: warm-up steps; the first one compiles.
    warmup_seconds = []
    for _ in range(warmup):
        prepare_grads(modules, wl, grads)
        warmup_seconds.append(timed_step(compiled, wl, dev))

    predicted: int | None = None
    plan = getattr(compiled, "memopt_plan", None)
    if plan is not None:
        value = getattr(plan, "predicted_peak_bytes", None)
        predicted = None if value is None else int(value)
    flops_ratio = None
    if plan is not None and getattr(plan, "forward_flops", 0):
        flops_ratio = plan.recompute_flops / plan.forward_flops
    chains = [scalar_fields(c) for c in getattr(plan, "chains", None) or ()] or None
    heads = [scalar_fields(h) for h in getattr(plan, "heads", None) or ()] or None

    # Step 2: a clean start: gradients as `grads` says (kept ones are resident), no garbage.
    prepare_grads(modules, wl, grads)
    gc.collect()
    resident = storage_bytes(_tensors_of(wl, modules) + _grad_tensors(modules, wl), dev)

    # Step 3: the measured step.
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        seconds = timed_step(compiled, wl, dev)
        peak = int(torch.cuda.max_memory_allocated(dev))
        reserved = int(torch.cuda.max_memory_reserved(dev)) - (before - resident)
    else:
        reserved = None
        trim_heap()
        reset_hwm()
        rss_before = read_status_kib("VmRSS")
        seconds = timed_step(compiled, wl, dev)
        hwm = read_status_kib("VmHWM")
        peak = (hwm - rss_before) * 1024 + resident
    # On CUDA the step's own rise over what was allocated before it, plus the resident
    # tensors: the counter also holds what libraries allocate once and keep (cuBLAS's
    # per-handle workspaces, about 66 MiB with torch 2.11 on an H100), which no step
    # allocates and no plan can lower; ``peak_bytes`` keeps the raw counter.
    allocated = peak - before + resident if dev.type == "cuda" else (
        allocated_step_peak(compiled, wl, modules, grads) + resident)
    logger.info("%s (%s) peak %d bytes, allocated %d, resident %d", workload, mode, peak,
                allocated, resident)

    # Step 4: more timed steps for a steadier time, on CPU under the allocator's
    # steady state rather than the page-sized mmap threshold set for the RSS reading
    times = [seconds]
    if timed_steps and dev.type == "cpu" and steady_allocator():
        prepare_grads(modules, wl, grads)
        timed_step(compiled, wl, dev)  # its pages faulted in once, as in any loop
        times = []
    for _ in range(timed_steps):
        prepare_grads(modules, wl, grads)
        times.append(timed_step(compiled, wl, dev))
    step_seconds = statistics.median(times)
    plan_seconds = None
    if mode != "eager" and warmup_seconds:
        plan_seconds = max(0.0, warmup_seconds[0] - step_seconds)

    return Measurement(
        peak_bytes=int(peak),
        resident_bytes=int(resident),
        step_seconds=float(step_seconds),
        predicted_peak_bytes=predicted,
        plan_seconds=plan_seconds,
        device=str(dev),
        recompute_flops_ratio=flops_ratio,
        chains=chains,
        heads=heads,
        allocated_peak_bytes=int(allocated),
        reserved_peak_bytes=reserved,
        warmup_seconds=float(warmup_seconds[0]) if warmup_seconds else None,
    )
