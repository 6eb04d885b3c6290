"""Measure the real peak memory of one training step.

Tests and benchmarks use this module to compare memopt's predicted peak with
what a step really costs.

What is measured
----------------
One training step is ``loss_fn(model(*args, **kwargs)).backward()``. The step
starts with every parameter gradient set to ``None`` (as after
``optimizer.zero_grad(set_to_none=True)``), or with ``grads="kept"`` with every
trainable parameter's ``.grad`` allocated and zeroed (``zero_grad(set_to_none=False)``,
every micro-step after the first of gradient accumulation); kept gradients count as
resident. The model's outputs stay alive
through backward, as in the usual loop ``out = model(x); loss = loss_fn(out);
loss.backward()`` (HF models return logits beside the loss), which is also
what memopt's plan assumes. A workload may bring its own step instead
(``Workload.step``: a hand-written chunked BPTT that calls backward once per
chunk, measured the same way).

The measured peak is the maximum, over forward, loss and backward, of all
tensor memory live at once:

* parameters, buffers and the input tensors (together, ``resident_bytes``),
* activations, temporaries and the saved tensors,
* the gradients that backward produces.

Optimizer state is not part of it. Tensors are counted by storage, so views
cost nothing extra.

How it is measured
------------------
* CUDA: in the calling process, ``torch.cuda.synchronize()`` and
  ``torch.cuda.reset_peak_memory_stats()``, run the step, then
  ``torch.cuda.max_memory_allocated()``. That counter already includes the
  resident tensors.
* CPU: PyTorch's CPU allocator keeps no counter, so the step runs in a fresh
  Python process (``python -m memopt.measure ... --json``) with
  ``MALLOC_MMAP_THRESHOLD_=4096`` so that every buffer of a page or more is
  mmap'd and goes back to the OS when freed. (DESIGN.md's 65536 works for
  large tensors, but on an LSTM whose states are exactly 64 KiB the heap
  fragments and RSS rose ~15% above the bytes allocated, eager and memopt
  alike; one page keeps RSS within a few percent of the allocated bytes.)
  After the warm-up steps (which include any compilation), the gradients
  are set to ``None``, ``gc.collect()`` runs, ``malloc_trim(0)`` hands free
  heap pages back to the OS (without it, a step that reuses heap memory
  freed during warm-up is under-counted), ``5`` is written to
  ``/proc/self/clear_refs`` (this resets VmHWM to the current RSS) and VmRSS
  is read. After the measured step,
  VmHWM is read::

      peak_bytes = (VmHWM - VmRSS_before) + resident_bytes

  The resident tensors are already in ``VmRSS_before``, so they are added
  back. Buffers smaller than a page come from malloc's heap, which may reuse
  memory that the warm-up steps already made resident; such buffers can be
  under-counted.

* Allocated bytes on CPU (``allocated_peak_bytes``): VmHWM counts the pages a step
  *touches*, not the bytes it allocates, and some kernels allocate buffers they
  write only in part (oneDNN's LSTM workspace: a 2-layer LSTM over 512 steps
  allocates 262 MiB for backward and its RSS rises by 109 MiB). A CUDA allocator
  charges the whole buffer, and so does memopt's plan. So the step runs once more,
  from the same clean start, under ``torch.profiler.profile(profile_memory=True)``,
  whose allocation events give the live bytes over time::

      allocated_peak_bytes = max over the step of (allocated - freed) + resident_bytes

  This is the CPU analogue of ``torch.cuda.max_memory_allocated`` and what a memopt
  budget counts. That step is not timed.

``step_seconds`` is the median wall time of the measured step and
``timed_steps`` more steps (each starting with gradients set to ``None``). On CPU
the timed steps run after the allocator is set back to glibc's steady state for large
buffers (``mallopt``: buffers under 32 MiB from the heap, trimmed past 64 MiB, what
its dynamic threshold settles at), after one untimed step, and the measured step is left
out of the median: with every page-sized buffer mmap'd, each allocation faults its pages
in again, which charged a plan of many small chunk calls up to 1.8x more time than the
same step in a plain process (an LSTM over 1000 steps in 63 chunks: 1.95x eager's time
measured there, 1.11x in a plain process).
``plan_seconds`` is the wall time of the first warm-up step (the compiling
one) minus ``step_seconds``; it is ``None`` in eager mode.

Workloads
---------
A workload is named ``"package.module:function"``; the function is a builder
``build(device: str) -> Workload``. The child process puts the caller's working
directory and any ``path`` entries on ``sys.path`` before importing it.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import importlib
import json
import logging
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

logger = logging.getLogger(__name__)

__all__ = ["Measurement", "Workload", "default_loss", "measure_step", "main"]

MALLOC_MMAP_THRESHOLD = 4096
"""Value of ``MALLOC_MMAP_THRESHOLD_`` in the child process (bytes)."""

_WORKLOAD_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
_MODES = ("eager", "memopt")
#: Peers measured side by side with memopt: "checkpoint_sequential:K" (an
#: nn.Sequential run through torch.utils.checkpoint.checkpoint_sequential with K
#: segments), "hf_checkpointing" (transformers' gradient_checkpointing_enable()),
#: "inductor:F" (torch.compile with activation_memory_budget = F).
_PEER_PREFIXES = ("checkpoint_sequential:", "inductor:")
_PEERS = ("hf_checkpointing",)
_STDERR_TAIL_LINES = 30


# --------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Measurement:
    """The result of measuring one training step (see the module docstring)."""

    peak_bytes: int
    """Peak of all tensor memory during forward + loss + backward."""
    resident_bytes: int
    """Distinct storages of parameters, buffers and inputs before the step."""
    step_seconds: float
    """Median wall time of the measured step and the extra timed steps."""
    predicted_peak_bytes: int | None
    """``compiled.memopt_plan.predicted_peak_bytes`` if exposed, else None."""
    plan_seconds: float | None
    """First (compiling) step's time minus ``step_seconds``; None for eager."""
    device: str
    recompute_flops_ratio: float | None = None
    """memopt's recomputed FLOPs over one forward pass (its plan's cost model)."""
    chains: list | None = None
    """``compiled.memopt_plan.chains``, each chain as a JSON-able dict; None if the plan
    lists none (or is not a memopt plan)."""
    heads: list | None = None
    """``compiled.memopt_plan.heads`` (language-model heads and their chunks), alike."""
    allocated_peak_bytes: int | None = None
    """Peak of the bytes PyTorch's allocator handed out during the step, resident
    tensors included: on CUDA the rise of ``max_memory_allocated`` over what was
    allocated before the step, plus the resident tensors (``peak_bytes`` is the raw
    counter, which also holds the library workspaces allocated once per process); on CPU
    read from the profiler's allocation events (see the module docstring)."""

    @property
    def budget_peak_bytes(self) -> int:
        """The peak a memopt budget counts: the allocated bytes (``peak_bytes`` for a
        measurement that did not record them)."""
        return self.peak_bytes if self.allocated_peak_bytes is None else self.allocated_peak_bytes

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Measurement:
        data = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING}
        if not isinstance(data, dict) or not required <= set(data) <= names:
            raise ValueError(f"not a Measurement: {text!r}")
        return cls(**data)


def default_loss(output: Any) -> torch.Tensor:
    """The loss of a model output when a workload names none.

    An object with a ``loss`` attribute that is not None (a HuggingFace
    ``ModelOutput`` called with labels) gives that loss. Otherwise the loss is
    the sum of every floating-point tensor leaf of the output (flattened with
    ``torch.utils._pytree``; mappings are flattened by value).
    """
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, Mapping) and type(output) not in pytree.SUPPORTED_NODES:
        output = dict(output)  # e.g. a ModelOutput type that pytree does not know
    leaves = [
        leaf
        for leaf in pytree.tree_leaves(output)
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()
    ]
    if not leaves:
        raise ValueError(
            f"default_loss: the model output ({type(output).__name__}) has no "
            "floating-point tensor; give the Workload a loss function"
        )
    total = leaves[0].sum()
    for leaf in leaves[1:]:
        total = total + leaf.sum()
    return total


@dataclass
class Workload:
    """A model and the inputs of one training step, built on a device."""

    model: torch.nn.Module
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    loss: Callable[[Any], torch.Tensor] = default_loss
    step: Callable[[Callable[..., Any], Workload], None] | None = None
    """A training step of the workload's own, ``step(module, workload)``, in place of
    ``loss(module(*args, **kwargs)).backward()`` (e.g. a hand-written chunked BPTT that
    calls backward several times). It must leave the parameter gradients as one step's
    and keep no tensor of the step alive after it returns. None: the standard step."""


# --------------------------------------------------------------------------
# Validation at the edge
# --------------------------------------------------------------------------


def _check_workload_name(workload: str) -> None:
    if not isinstance(workload, str) or not _WORKLOAD_RE.match(workload):
        raise ValueError(
            f"workload must be 'package.module:function' naming a builder "
            f"build(device) -> Workload, got {workload!r}"
        )


def _check_mode(mode: str) -> None:
    if mode in _MODES or mode in _PEERS or mode.startswith(_PEER_PREFIXES):
        return
    raise ValueError(f"mode must be one of {_MODES + _PEERS}, or start with one of "
                     f"{_PEER_PREFIXES}; got {mode!r}")


class _CheckpointSequential(torch.nn.Module):
    def __init__(self, model: torch.nn.Sequential, segments: int) -> None:
        super().__init__()
        self.model, self.segments = model, segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint_sequential

        return checkpoint_sequential(self.model, self.segments, x, use_reentrant=False)


class _InductorWithBudget(torch.nn.Module):
    """torch.compile (inductor) with functorch's ``activation_memory_budget``, set only
    while this module runs (where it compiles), through the config's scoped ``patch``."""

    def __init__(self, model: torch.nn.Module, budget: float) -> None:
        super().__init__()
        self.model, self.budget = model, budget
        self.compiled = torch.compile(model)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        import torch._functorch.config as functorch_config  # noqa: PLC0415

        with functorch_config.patch(activation_memory_budget=self.budget):
            return self.compiled(*args, **kwargs)


def _check_device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"bad device {device!r}: {exc}") from exc
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
    return dev


def parse_budget(text: str | None) -> int | float | str | None:
    """Turn a command-line budget back into a value.

    Digit strings become ints, float literals ("0.5", "1e9") become floats,
    anything else ("4GB") stays a string for ``memopt.compile`` to parse.
    """
    if text is None:
        return None
    if re.fullmatch(r"[+-]?\d+", text.strip()):
        return int(text)
    try:
        value = float(text)
    except ValueError:
        return text
    return value if math.isfinite(value) else text


def load_workload(workload: str) -> Callable[[str], Workload]:
    """Import the builder named by ``"package.module:function"``."""
    _check_workload_name(workload)
    module_name, func_name = workload.split(":")
    module = importlib.import_module(module_name)
    try:
        builder = getattr(module, func_name)
    except AttributeError:
        raise ValueError(
            f"workload {workload!r}: module {module_name!r} has no {func_name!r}"
        ) from None
    if not callable(builder):
        raise ValueError(f"workload {workload!r}: {func_name!r} is not callable")
    return builder


# --------------------------------------------------------------------------
# The step and its memory
# --------------------------------------------------------------------------


def _tensors_of(wl: Workload, modules: Sequence[Any]) -> list[torch.Tensor]:
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


def _storage_bytes(tensors: Sequence[torch.Tensor], device: torch.device) -> int:
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


#: How a measured step finds the parameters' gradients: "none" (set to None, as after
#: ``zero_grad(set_to_none=True)``) or "kept" (allocated and zeroed in place, as after
#: ``zero_grad(set_to_none=False)`` and in every micro-step after the first of gradient
#: accumulation).
GRADS = ("none", "kept")


def _prepare_grads(modules: Sequence[Any], wl: Workload, grads: str = "none") -> None:
    """Put every parameter's ``.grad`` in the state the measured step starts from."""
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


def _step(module: Callable[..., Any], wl: Workload) -> None:
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


def _timed_step(module: Callable[..., Any], wl: Workload, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    _step(module, wl)
    _sync(device)
    return time.perf_counter() - start


def _read_status_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field_name}")


#: glibc mallopt parameters, and the values its dynamic mmap threshold settles at on a
#: 64-bit machine (DEFAULT_MMAP_THRESHOLD_MAX; the trim threshold is then twice it).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_STEADY_MMAP_THRESHOLD = 32 << 20


def _steady_allocator() -> bool:
    """Set glibc's allocator back from the page-sized mmap threshold of the measuring
    child (``MALLOC_MMAP_THRESHOLD_``) to its steady state for large buffers, for the
    timed steps; False where this process does not run under that threshold, or is not
    on glibc."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != str(MALLOC_MMAP_THRESHOLD):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, _STEADY_MMAP_THRESHOLD)
                    and libc.mallopt(_M_TRIM_THRESHOLD, 2 * _STEADY_MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False


def _trim_heap() -> None:
    """Return free heap pages to the OS (glibc `malloc_trim`), so that a step reusing
    memory freed during warm-up faults those pages in again and is counted."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the measurement may under-count
        logger.warning("malloc_trim unavailable; small buffers may be under-counted")


def _reset_hwm() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as exc:
        raise RuntimeError(
            "cannot reset VmHWM through /proc/self/clear_refs; CPU peak "
            f"measurement needs Linux >= 4.0 and write access there: {exc}"
        ) from exc


def _compile(model: torch.nn.Module, mode: str, budget: Any, options: dict | None):
    if mode == "eager":
        return model
    if mode.startswith("checkpoint_sequential:"):
        if not isinstance(model, torch.nn.Sequential):
            raise ValueError("checkpoint_sequential needs an nn.Sequential model")
        return _CheckpointSequential(model, int(mode.split(":", 1)[1]))
    if mode == "hf_checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model
    if mode.startswith("inductor:"):
        return _InductorWithBudget(model, float(mode.split(":", 1)[1]))
    import memopt  # noqa: PLC0415 (the package may be partly written)

    return memopt.compile(model, budget=budget, **(options or {}))


def _measure_here(
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
    """Run the whole measurement in this process."""
    dev = _check_device(device)
    builder = load_workload(workload)
    wl = builder(device)
    for name in ("model", "args", "kwargs", "loss"):
        if not hasattr(wl, name):
            raise TypeError(
                f"workload {workload!r} returned {type(wl).__name__}, "
                f"which has no {name!r}; return a memopt.measure.Workload"
            )
    compiled = _compile(wl.model, mode, budget, options)
    modules = (wl.model, compiled)

    # Step 1: warm-up steps; the first one compiles.
    warmup_seconds = []
    for _ in range(warmup):
        _prepare_grads(modules, wl, grads)
        warmup_seconds.append(_timed_step(compiled, wl, dev))

    predicted: int | None = None
    plan = getattr(compiled, "memopt_plan", None)
    if plan is not None:
        value = getattr(plan, "predicted_peak_bytes", None)
        predicted = None if value is None else int(value)
    flops_ratio = None
    if plan is not None and getattr(plan, "forward_flops", 0):
        flops_ratio = plan.recompute_flops / plan.forward_flops
    chains = [_jsonable(c) for c in getattr(plan, "chains", None) or ()] or None
    heads = [_jsonable(h) for h in getattr(plan, "heads", None) or ()] or None

    # Step 2: a clean start: gradients as `grads` says (kept ones are resident), no garbage.
    _prepare_grads(modules, wl, grads)
    gc.collect()
    resident = _storage_bytes(_tensors_of(wl, modules) + _grad_tensors(modules, wl), dev)

    # Step 3: the measured step.
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        seconds = _timed_step(compiled, wl, dev)
        peak = int(torch.cuda.max_memory_allocated(dev))
    else:
        _trim_heap()
        _reset_hwm()
        rss_before = _read_status_kib("VmRSS")
        seconds = _timed_step(compiled, wl, dev)
        hwm = _read_status_kib("VmHWM")
        peak = (hwm - rss_before) * 1024 + resident
    # On CUDA the step's own rise over what was allocated before it, plus the resident
    # tensors: the counter also holds what libraries allocate once and keep (cuBLAS's
    # per-handle workspaces, about 66 MiB with torch 2.11 on an H100), which no step
    # allocates and no plan can lower; ``peak_bytes`` keeps the raw counter.
    allocated = peak - before + resident if dev.type == "cuda" else (
        _allocated_peak(compiled, wl, modules, grads) + resident)
    logger.info("%s (%s) peak %d bytes, allocated %d, resident %d", workload, mode, peak,
                allocated, resident)

    # Step 4: more timed steps for a steadier time, on CPU under the allocator's
    # steady state rather than the page-sized mmap threshold set for the RSS reading
    times = [seconds]
    if timed_steps and dev.type == "cpu" and _steady_allocator():
        _prepare_grads(modules, wl, grads)
        _timed_step(compiled, wl, dev)  # its pages faulted in once, as in any loop
        times = []
    for _ in range(timed_steps):
        _prepare_grads(modules, wl, grads)
        times.append(_timed_step(compiled, wl, dev))
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
    )


def _allocated_peak(module: Callable[..., Any], wl: Workload, modules: Sequence[Any],
                    grads: str = "none") -> int:
    """The most bytes the CPU allocator had handed out at once during one step, over
    what was allocated when it started (a step under the profiler, from a clean start)."""
    from ..allocation import allocation_peak  # noqa: PLC0415

    _prepare_grads(modules, wl, grads)
    gc.collect()
    with allocation_peak("cpu") as seen:
        _step(module, wl)
    return seen.peak


def _jsonable(record: Any) -> dict:
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
# The child process
# --------------------------------------------------------------------------


def _tail(text: str, lines: int = _STDERR_TAIL_LINES) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _measure_in_child(
    workload: str,
    *,
    mode: str,
    budget: Any,
    device: str,
    warmup: int,
    timed_steps: int,
    options: dict | None,
    path: Sequence[str],
    timeout: float,
    grads: str = "none",
) -> Measurement:
    repo_root = str(Path(__file__).resolve().parents[2])
    cwd = os.getcwd()
    cmd = [
        sys.executable, "-m", "memopt.measure",
        "--workload", workload,
        "--mode", mode,
        "--device", device,
        "--warmup", str(warmup),
        "--timed-steps", str(timed_steps),
        "--grads", grads,
        "--json",
    ]  # fmt: skip
    if budget is not None:
        cmd += ["--budget", str(budget)]
    if options:
        try:
            cmd += ["--options", json.dumps(options)]
        except TypeError as exc:
            raise ValueError(f"options must be JSON-serializable: {exc}") from exc
    for entry in [cwd, *path]:
        cmd += ["--path", str(Path(entry).resolve())]

    env = dict(os.environ)
    env["MALLOC_MMAP_THRESHOLD_"] = str(MALLOC_MMAP_THRESHOLD)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (repo_root, env.get("PYTHONPATH", "")) if p
    )
    logger.debug("running %s", cmd)
    # A new session, so that a timeout kills the child and anything it started.
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            stdout, stderr = "", ""
        raise RuntimeError(
            f"measuring {workload!r} ({mode}) timed out after {timeout} s; "
            f"child stderr ends with:\n{_tail(stderr or '')}"
        ) from None
    if proc.returncode != 0:
        raise RuntimeError(
            f"measuring {workload!r} ({mode}) failed (exit status "
            f"{proc.returncode}); child stderr ends with:\n{_tail(stderr)}"
        )
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            try:
                return Measurement.from_json(line)
            except (ValueError, TypeError):
                continue
    raise RuntimeError(
        f"measuring {workload!r} ({mode}): the child printed no result line; "
        f"stdout ends with:\n{_tail(stdout)}\nstderr ends with:\n{_tail(stderr)}"
    )


# --------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------


def measure_step(
    workload: str,
    *,
    mode: str = "eager",
    budget: Any = None,
    device: str = "cpu",
    warmup: int = 1,
    timed_steps: int = 3,
    options: dict | None = None,
    timeout: float = 1800,
    isolate: bool | None = None,
    path: Sequence[str] = (),
    grads: str = "none",
) -> Measurement:
    """Measure the peak memory and time of one training step.

    Args:
        workload: ``"package.module:function"`` naming ``build(device) -> Workload``.
        mode: ``"eager"`` runs the model as is; ``"memopt"`` runs
            ``memopt.compile(model, budget=budget, **options)``.
        budget: passed to ``memopt.compile``. In a child process it travels
            as ``str(budget)`` and is parsed back by :func:`parse_budget`.
        device: ``"cpu"`` or ``"cuda[:N]"``.
        warmup: steps before the measured one (at least 1 unless eager).
        timed_steps: extra steps after the measured one; ``step_seconds`` is
            the median over all of them.
        options: more keyword arguments for ``memopt.compile`` (JSON-able).
        timeout: seconds before a child process is killed.
        isolate: run in a fresh child process. Default: yes on CPU (the only
            way to measure there), no on CUDA. ``False`` on CPU measures in
            this process, which is only as good as this process's heap.
        path: more ``sys.path`` entries for the child (the working directory
            is always added).
        grads: ``"none"``: every step starts with the gradients set to None;
            ``"kept"``: with every trainable parameter's ``.grad`` allocated and
            zeroed in place (``zero_grad(set_to_none=False)``, a micro-step of
            gradient accumulation); the kept ``.grad`` tensors count as resident.

    Raises:
        ValueError: a malformed workload name, mode, device or count.
        RuntimeError: the measurement failed or timed out; the message ends
            with the child's last stderr lines.
    """
    _check_workload_name(workload)
    _check_mode(mode)
    dev = _check_device(device)
    if grads not in GRADS:
        raise ValueError(f"grads must be one of {GRADS}, got {grads!r}")
    if warmup < 0 or timed_steps < 0:
        raise ValueError(f"warmup and timed_steps must be >= 0, got {warmup}, {timed_steps}")
    if mode != "eager" and warmup < 1:
        raise ValueError(f"mode {mode!r} needs warmup >= 1 so compilation is not measured")
    if isolate is None:
        isolate = dev.type == "cpu"
    kwargs = dict(
        mode=mode, budget=budget, device=device, warmup=warmup,
        timed_steps=timed_steps, options=options, grads=grads,
    )  # fmt: skip
    if isolate:
        return _measure_in_child(workload, path=path, timeout=timeout, **kwargs)
    if dev.type == "cpu":
        logger.warning(
            "measuring CPU memory in this process: freed heap memory and other "
            "threads can distort the peak; prefer isolate=True"
        )
    for entry in path:
        if entry not in sys.path:
            sys.path.insert(0, entry)
    return _measure_here(workload, **kwargs)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m memopt.measure --workload mod:fn [--json]``."""
    parser = argparse.ArgumentParser(
        prog="python -m memopt.measure",
        description="Measure the peak memory of one training step in this process.",
    )
    parser.add_argument("--workload", required=True, help="package.module:function")
    parser.add_argument("--mode", default="eager")
    parser.add_argument("--budget", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timed-steps", type=int, default=3)
    parser.add_argument("--options", default=None, help="JSON object of compile options")
    parser.add_argument("--grads", default="none", choices=GRADS,
                        help="gradients at the start of each step: set to None, or kept")
    parser.add_argument("--path", action="append", default=[], help="add to sys.path")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--log-level", default="WARNING")
    ns = parser.parse_args(argv)

    logging.basicConfig(level=ns.log_level.upper(), stream=sys.stderr)
    for entry in reversed([os.getcwd(), *ns.path]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    options = json.loads(ns.options) if ns.options else None
    if options is not None and not isinstance(options, dict):
        parser.error("--options must be a JSON object")
    if ns.mode != "eager" and ns.warmup < 1:
        parser.error(f"mode {ns.mode!r} needs --warmup >= 1")

    result = _measure_here(
        ns.workload,
        mode=ns.mode,
        budget=parse_budget(ns.budget),
        device=ns.device,
        warmup=ns.warmup,
        timed_steps=ns.timed_steps,
        options=options,
        grads=ns.grads,
    )
    if ns.json:
        sys.stdout.write(result.to_json() + "\n")
    else:
        mib = 2.0**20
        sys.stdout.write(
            f"{ns.workload} [{ns.mode}] on {result.device}: "
            f"peak {result.peak_bytes / mib:.1f} MiB, "
            f"resident {result.resident_bytes / mib:.1f} MiB, "
            f"step {result.step_seconds:.3f} s\n"
        )
    sys.stdout.flush()
    return 0
