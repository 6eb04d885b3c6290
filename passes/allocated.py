"""Allocated bytes, measured: how many bytes PyTorch's allocator hands out while a
block of code runs.

    with allocation_peak(device) as seen:
        run_something()
    seen.peak   # the most bytes live at once during the block, over those live at its start
    seen.end    # bytes live at its end, over those live at its start

On CUDA this reads the caching allocator's counters (``memory_allocated``, and
``max_memory_allocated`` after ``reset_peak_memory_stats``). On CPU PyTorch keeps no
counter, so the block runs under ``torch.profiler.profile(profile_memory=True)`` and
the allocation and free events are summed in time order. Both count bytes handed out,
not pages touched: what a CUDA allocator charges and what a memopt budget counts.

The garbage collector runs first (``collect=True``, the default): tensors kept only by
reference cycles that the collector would free in the middle of the block would lower
what is live below what was live at its start, and the peak with it. The planner's own
measurements of one op or one chunk (passes.workspace, passes.chain_policy) pass
``collect=False``: they run many times, on fresh tensors, where the collector's time would
show; the collector is paused for their block instead, so that no collection inside it
frees memory that was live before it (which lowers ``end``, and ``peak - end`` then
passes for the op's workspace).

``own_only=True`` (one op's workspace, passes.workspace; a head's forward,
passes.lm_heads: blocks that free nothing they did not allocate) counts on CPU only what
the block allocates itself, by address: a free of memory allocated before it is not
counted. PyTorch's CPU allocator reports a free with the size it recorded for that
address while some profiler was recording, and that record outlives a block freed with
none recording: a later block at the same address, allocated unrecorded and freed inside a
window, came back with the old block's size (20,000 bytes for a 10,000-byte block), and a
chunked head's measured transient about 2 MB high in one CI process (``end`` too low, so
``peak - end`` too high). Every other block counts every free, as CUDA's counters do: a
chunk of a recurrent chain frees the states it was handed.

Used by the planner's own measurements (passes.chain_policy: one chunk of a recurrent chain;
passes.lm_heads, passes.reversible_stacks, passes.workspace) and by memopt.measure (a whole
training step), whose ``allocation_peak``, ``AllocationTracker``, ``AllocationPeak`` and
``can_track`` are these, for tests, benchmarks and users. (Not to be confused with
memopt.allocator, the static memory-planning solvers, which measure nothing.)
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from ._torch_compat import cpu_allocation_events, profiler_active


@dataclass
class AllocationPeak:
    """Filled in when the ``allocation_peak`` block exits."""

    peak: int = 0
    end: int = 0


#: how many times planning could not measure what it needed (allocations untracked while
#: another profiler records: kernel workspaces, a head's transients); a plan made across
#: one is made again at the first step where they can be (memopt.plan_log.PlanLog)
UNMEASURED = [0]


def note_unmeasured() -> None:
    """Planning used an estimate where it measures (see UNMEASURED)."""
    UNMEASURED[0] += 1


#: what `say_untracked` has said at warning level in this process, by kind
_SAID: set[str] = set()


def say_untracked(kind: str, message: str, *args: object) -> None:
    """Log that planning cannot track allocations (a profiler is recording) and estimates
    what it measures otherwise: at warning level the first time for each `kind` of
    measurement in the process, at debug level after. A step measured with
    memopt.measure.allocation_peak plans every graph of a forward inside it, and a search
    for a minimum plans each many times: an MoE of 8 graphs logged the same warning 458
    times in its first step (found from outside, 2026-11-30)."""
    level = logging.DEBUG if kind in _SAID else logging.WARNING
    _SAID.add(kind)
    logging.getLogger("memopt").log(level, "memopt: cannot track allocations while planning"
                                    + message, *args)


#: bound methods (held weakly) to call once the profiler that kept planning from measuring
#: has stopped: run as the user's `memopt.measure.allocation_peak` closes
_WHEN_TRACKABLE: list[weakref.WeakMethod] = []


def when_trackable(method: Callable[[], None]) -> None:
    """Call the bound `method` once, as the next `memopt.measure.allocation_peak` closes
    (`run_when_trackable`): a plan made while the user measured a step could not measure
    its kernel workspaces, and a user who measures every step never gives memopt another
    call outside the profiler (memopt.backend plans again measured there)."""
    if not any(ref() == method for ref in _WHEN_TRACKABLE):
        _WHEN_TRACKABLE.append(weakref.WeakMethod(method))


def run_when_trackable() -> None:
    """Call what `when_trackable` registered (each once), where no profiler records."""
    if not _WHEN_TRACKABLE or not can_track("cpu"):
        return
    pending = list(_WHEN_TRACKABLE)
    _WHEN_TRACKABLE.clear()
    for ref in pending:
        method = ref()
        if method is not None:
            method()


def can_track(device: torch.device | str) -> bool:
    """False where the counters are unavailable: another profiler is recording on
    CPU (profilers do not nest), or a device that is neither CPU nor CUDA."""
    kind = torch.device(device).type
    if kind == "cuda":
        return True
    return kind == "cpu" and not profiler_active()


class AllocationTracker:
    """`allocation_peak` as two calls, for a window that opens and closes in different
    places (callbacks of a training loop): `start()`, then `stop()` returns the
    AllocationPeak. Raises RuntimeError where `can_track` is False."""

    def __init__(self, device: torch.device | str, collect: bool = True,
                 own_only: bool = False) -> None:
        self.device = torch.device(device)
        self.collect = collect
        self.own_only = own_only
        self._start = 0
        self._prof = None
        self._paused_gc = False
        self._marker: torch.Tensor | None = None

    def start(self) -> None:
        device = self.device
        if not can_track(device):
            raise RuntimeError(f"cannot track allocations on {device} here (a profiler is "
                               f"already recording, or the device is neither CPU nor CUDA)")
        if self.collect:
            gc.collect()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            self._start = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        else:
            from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            with _quiet_stderr():
                self._prof.start()
        if not self.collect and gc.isenabled():
            # The planner's short blocks (one op, one chunk: collect=False) run with the
            # collector paused: an automatic collection inside the block frees memory
            # that was live before it, and `peak - end` then counts those frees as the
            # op's workspace (a 2.5 MB nll_loss_forward "workspace" in one process and
            # none in another: plans that depended on the tests run before them).
            gc.disable()
            self._paused_gc = True

    def mark(self) -> None:
        """On CPU, from here on: `stop()` then gives the peak and the end over what is live
        at the mark, not at the start. A profiler started inside a backward records nothing
        (the autograd engine runs with the thread-local state of the `backward()` call), so
        a window inside one starts before it and is marked where it begins
        (memopt.eager_tail). The mark is a 1-byte tensor held until `stop()`: the last
        allocation of its address and size among the events."""
        self._marker = torch.empty(1, dtype=torch.uint8, device="cpu")

    def stop(self, released: Mapping[int, int] | None = None) -> AllocationPeak:
        """End the window. ``released`` (CPU, after a `mark`): bytes freed inside it with
        no event, by the address of a 1-byte marker tensor allocated, and held until now,
        where they were freed: blocks allocated before the profiler started, whose frees
        it does not report."""
        if self._paused_gc:
            gc.enable()
            self._paused_gc = False
        seen = AllocationPeak()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            seen.peak = torch.cuda.max_memory_allocated(self.device) - self._start
            seen.end = torch.cuda.memory_allocated(self.device) - self._start
            return seen
        prof, self._prof = self._prof, None
        with _quiet_stderr():
            prof.stop()
        own_only = self.own_only  # (the module docstring)
        live, mine = 0, {}
        events = cpu_allocation_events(prof)
        marker, self._marker = self._marker, None
        if marker is not None:  # from the mark on
            at = marker.data_ptr()
            events = events[max(i for i, (_, n, a) in enumerate(events) if a == at and n > 0):]
            own_only = False
        last = {a: i for i, (_, n, a) in enumerate(events) if n == 1 and a in (released or {})}
        for i, (_, nbytes, address) in enumerate(events):
            if last.get(address) == i:
                live -= released[address]
            if nbytes > 0:
                mine[address] = nbytes
                live += nbytes
            elif address in mine:
                live -= mine.pop(address)
            elif not own_only:
                live += nbytes
            seen.peak = max(seen.peak, live)
        seen.end = live
        return seen


@contextmanager
def allocation_peak(device: torch.device | str, collect: bool = True, own_only: bool = False
                    ) -> Iterator[AllocationPeak]:
    """Track the block's allocations on ``device`` (see the module docstring).
    Raises RuntimeError where ``can_track`` is False."""
    tracker = AllocationTracker(device, collect, own_only)
    tracker.start()
    seen = AllocationPeak()
    try:
        yield seen
    finally:
        result = tracker.stop()
        seen.peak, seen.end = result.peak, result.end


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


def maybe_allocation_peak(device: torch.device | str, tracked: bool, own_only: bool = False):
    """``allocation_peak(device, collect=False, own_only)`` when ``tracked``, else a block
    whose AllocationPeak stays at zero (the caller checked ``can_track`` and warned)."""
    return allocation_peak(device, collect=False, own_only=own_only) if tracked \
        else nullcontext(AllocationPeak())
