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
  resident tensors. ``reserved_peak_bytes`` is ``torch.cuda.max_memory_reserved()``
  over the same step, less what the process had allocated outside the counted
  tensors: the segments the caching allocator held, what a GPU runs out of.
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
one) minus ``step_seconds``; it is ``None`` in eager mode. ``warmup_seconds`` is that
first step's whole wall time, in every mode (eager's too, for a comparison).

Workloads
---------
A workload is named ``"package.module:function"``; the function is a builder
``build(device: str) -> Workload``. The child process puts the caller's working
directory and any ``path`` entries on ``sys.path`` before importing it.

The package
-----------
This module is the public API: ``measure_step``, its command line (``main``,
``python -m memopt.measure``) and the names below. The rest is split by what it does:

* ``memopt.measure.records``: ``Workload``, ``Measurement`` and the checks of a
  workload's name and device;
* ``memopt.measure.inprocess``: the step and its measurement in this process;
* ``memopt.measure.child``: the fresh CPU process and what it reads from the OS;
* ``memopt.measure.peers``: what memopt is compared with (checkpoint_sequential,
  HF gradient checkpointing, inductor with an activation memory budget).

``allocation_peak``, ``AllocationTracker``, ``AllocationPeak`` and ``can_track`` (bytes
handed out while a block runs) are memopt.passes.allocated's, loaded on first use.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import math
import os
import re
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .child import MALLOC_MMAP_THRESHOLD, measure_in_child
from .inprocess import measure_in_process
from .peers import PEER_PREFIXES, PEERS, is_peer
from .records import (
    GRADS,
    Measurement,
    Workload,
    check_device,
    check_workload_name,
    default_loss,
    load_workload,
)

if TYPE_CHECKING:
    from collections.abc import Iterator

    from ..passes.allocated import AllocationPeak, AllocationTracker, can_track

logger = logging.getLogger(__name__)

__all__ = ["GRADS", "MALLOC_MMAP_THRESHOLD", "AllocationPeak", "AllocationTracker",
           "Measurement", "Workload", "allocation_peak", "budget_from_arg", "can_track",
           "default_loss", "load_workload", "main", "measure_step"]

_MODES = ("eager", "memopt")

#: Names of memopt.passes.allocated, loaded on first use (module ``__getattr__``).
_ALLOCATED = ("AllocationPeak", "AllocationTracker", "can_track")


def __getattr__(name: str) -> Any:
    if name in _ALLOCATED:
        value = getattr(importlib.import_module("..passes.allocated", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@contextlib.contextmanager
def allocation_peak(device: Any, collect: bool = True, own_only: bool = False
                    ) -> Iterator[AllocationPeak]:
    """Track the block's allocations on ``device`` (memopt.passes.allocated.allocation_peak:
    ``.peak`` and ``.end``, bytes over what was live as it began). As it closes, a memopt
    module that planned inside it, where kernel workspaces cannot be measured (profilers
    do not nest on CPU), plans again measured, for its next step
    (passes.allocated.when_trackable): a loop that measures every step stays within the
    budget from its second step on."""
    from ..passes.allocated import allocation_peak as track  # noqa: PLC0415
    from ..passes.allocated import run_when_trackable  # noqa: PLC0415

    with track(device, collect, own_only) as seen:
        yield seen
    run_when_trackable()


def _check_mode(mode: str) -> None:
    if mode in _MODES or is_peer(mode):
        return
    raise ValueError(f"mode must be one of {_MODES + PEERS}, or start with one of "
                     f"{PEER_PREFIXES}; got {mode!r}")


def budget_from_arg(text: str | None) -> int | float | str | None:
    """Turn a command-line budget back into the value ``memopt.compile`` takes.

    Digit strings become ints, float literals ("0.5", "1e9") become floats,
    anything else ("4GB") stays a string for ``memopt.compile`` to parse
    (with ``memopt.parse_budget``).
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
            as ``str(budget)`` and is parsed back by :func:`budget_from_arg`.
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
    check_workload_name(workload)
    _check_mode(mode)
    dev = check_device(device)
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
        return measure_in_child(workload, path=path, timeout=timeout, **kwargs)
    if dev.type == "cpu":
        logger.warning(
            "measuring CPU memory in this process: freed heap memory and other "
            "threads can distort the peak; prefer isolate=True"
        )
    for entry in path:
        if entry not in sys.path:
            sys.path.insert(0, entry)
    return measure_in_process(workload, **kwargs)


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

    result = measure_in_process(
        ns.workload,
        mode=ns.mode,
        budget=budget_from_arg(ns.budget),
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
            + (f"reserved {result.reserved_peak_bytes / mib:.1f} MiB, "
               if result.reserved_peak_bytes is not None else "")
            + f"step {result.step_seconds:.3f} s\n"
        )
    sys.stdout.flush()
    return 0

