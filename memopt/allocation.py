"""How many bytes PyTorch's allocator hands out while a block of code runs.

    with allocation_peak(device) as seen:
        run_something()
    seen.peak   # the most bytes live at once during the block, over those live at its start
    seen.end    # bytes live at its end, over those live at its start

This is the public name of memopt.passes.allocation, where the implementation lives
(the planner itself measures kernel workspaces and recurrent chunks with it; see that
module for how CUDA's counters and, on CPU, the profiler's allocation events are read).
"""

from memopt.passes.allocation import (AllocationPeak, AllocationTracker, allocation_peak,
                                      can_track, maybe_allocation_peak)

__all__ = ["AllocationPeak", "AllocationTracker", "allocation_peak", "can_track",
           "maybe_allocation_peak"]
