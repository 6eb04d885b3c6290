"""How many bytes PyTorch's allocator hands out while a block of code runs.

    with allocation_peak(device) as seen:
        run_something()
    seen.peak   # the most bytes live at once during the block, over those live at its start
    seen.end    # bytes live at its end, over those live at its start

On CUDA this reads the caching allocator's counters (``memory_allocated``, and
``max_memory_allocated`` after ``reset_peak_memory_stats``). On CPU PyTorch keeps no
counter, so the block runs under ``torch.profiler.profile(profile_memory=True)`` and
the allocation and free events are summed in time order. Both count bytes handed out,
not pages touched: what a CUDA allocator charges and what a memopt budget counts.

Used by memopt.measure (a whole training step) and by passes.chains (one chunk of a
recurrent chain, measured while planning).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from ._torch_compat import cpu_allocation_events, profiler_active


@dataclass
class AllocationPeak:
    """Filled in when the ``allocation_peak`` block exits."""

    peak: int = 0
    end: int = 0


def can_track(device: torch.device | str) -> bool:
    """False where the counters are unavailable: another profiler is recording on
    CPU (profilers do not nest), or a device that is neither CPU nor CUDA."""
    kind = torch.device(device).type
    if kind == "cuda":
        return True
    return kind == "cpu" and not profiler_active()


@contextmanager
def allocation_peak(device: torch.device | str) -> Iterator[AllocationPeak]:
    """Track the block's allocations on ``device`` (see the module docstring).
    Raises RuntimeError where ``can_track`` is False."""
    device = torch.device(device)
    if not can_track(device):
        raise RuntimeError(f"cannot track allocations on {device} here (a profiler is "
                           f"already recording, or the device is neither CPU nor CUDA)")
    seen = AllocationPeak()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield seen
        torch.cuda.synchronize(device)
        seen.peak = torch.cuda.max_memory_allocated(device) - start
        seen.end = torch.cuda.memory_allocated(device) - start
        return
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():
        prof.start()
    try:
        yield seen
    finally:
        with _quiet_stderr():
            prof.stop()
    live = 0
    for _, nbytes in cpu_allocation_events(prof):
        live += nbytes
        seen.peak = max(seen.peak, live)
    seen.end = live


@contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null: the profiler's C++ side prints a line to it at
    every start and stop, which planning must not spill into a user's training log."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def maybe_allocation_peak(device: torch.device | str, tracked: bool):
    """``allocation_peak(device)`` when ``tracked``, else a block whose AllocationPeak
    stays at zero (the caller checked ``can_track`` and warned)."""
    return allocation_peak(device) if tracked else nullcontext(AllocationPeak())
